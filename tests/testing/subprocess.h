#pragma once

// Starting real processes from tests: spawn with arguments, capture output to a file, wait for a
// port file, signal, reap. Every child is killed (SIGKILL) when its Subprocess is destroyed.
#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace epd::testing {

class Subprocess {
 public:
  Subprocess() = default;
  ~Subprocess();
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // argv[0] is the program path. stdout and stderr go to `log_path` (or /dev/null if empty).
  static Subprocess Start(const std::vector<std::string>& argv, const std::string& log_path = "",
                          const std::map<std::string, std::string>& extra_env = {});

  pid_t pid() const { return pid_; }
  bool running();
  void Signal(int sig);
  // Waits for exit up to `timeout`; returns the exit status (or 128+signal), nullopt on timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  // SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit status.
  int Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(10000));
  const std::string& log_path() const { return log_path_; }
  std::string ReadLog() const;

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
  std::string log_path_;
};

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

// Polls `path` until it holds a JSON object with key `key`; returns its integer value.
std::optional<int> WaitForPortFile(const std::string& path, const std::string& key,
                                   std::chrono::milliseconds timeout);

// A port that was free a moment ago on 127.0.0.1 (for programs that cannot take port 0).
int PickFreePort();

// Minimal HTTP GET against 127.0.0.1; returns the body, nullopt on connection failure.
std::optional<std::string> HttpGet(int port, const std::string& path, int* status = nullptr);

// Runs a shell command, returns its exit status and appends its stdout to *out.
int RunCommand(const std::string& cmd, std::string* out = nullptr);

}  // namespace epd::testing
