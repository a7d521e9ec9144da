#pragma once

// Test helpers for real processes: temp dirs, ports, HTTP probes, binary paths.
#include <sys/types.h>

#include "runtime/child_process.h"

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace epd::testing {

// Subprocess is the production ChildProcess (runtime/child_process.h).
using Subprocess = epd::runtime::ChildProcess;
using epd::runtime::WaitForPortFile;

// Directory of built binaries (EPD_BINARY_DIR, set by ctest), e.g. BinaryPath("epd-router").
std::string BinaryPath(const std::string& name);
// The repository root (EPD_SOURCE_DIR).
std::string SourcePath(const std::string& relative);

// A fresh temporary directory, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A port that was free a moment ago on 127.0.0.1, below the kernel's ephemeral range (for
// programs that cannot take port 0 and publish what they bound). -1 when none was found.
int PickFreePort();

// Minimal HTTP GET against 127.0.0.1; returns the body, nullopt on connection failure.
std::optional<std::string> HttpGet(int port, const std::string& path, int* status = nullptr);

// Runs a shell command, returns its exit status and appends its stdout to *out.
int RunCommand(const std::string& cmd, std::string* out = nullptr);

// One line per thread of a live process (from /proc: name, state, kernel wait channel, system
// call): for the failure message of a test whose process did not exit when it should have.
std::string DescribeThreads(pid_t pid);

}  // namespace epd::testing
