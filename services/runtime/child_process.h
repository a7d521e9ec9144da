#pragma once

// Child processes for the `epd serve` launcher and for tests: spawn with arguments, send output to
// a log file, signal, reap. A child still running when its ChildProcess is destroyed gets SIGKILL.
// Not thread-safe: one owner thread per ChildProcess.
#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace epd::services {

class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess();
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // argv[0] is the program path. stdout and stderr go to `log_path` (or /dev/null if empty).
  static ChildProcess Start(const std::vector<std::string>& argv, const std::string& log_path = "",
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

// Polls `path` until it holds a JSON object with key `key` (written by --port-file); returns its
// integer value, or nullopt after `timeout`.
std::optional<int> WaitForPortFile(const std::string& path, const std::string& key,
                                   std::chrono::milliseconds timeout);

}  // namespace epd::services
