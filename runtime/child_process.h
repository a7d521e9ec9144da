#pragma once

// Child processes for the `epd serve` launcher and for tests: spawn with arguments, send output to
// a log file, signal, reap. A child still running when its ChildProcess is destroyed (or assigned
// over) gets SIGKILL and is reaped. Not thread-safe: one owner thread per ChildProcess.
#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace epd::runtime {

struct SpawnOptions {
  // Added to (or replacing) the parent's environment.
  std::map<std::string, std::string> extra_env;
  // When non-zero, the kernel sends this signal to the child when the thread that started it
  // exits (prctl PR_SET_PDEATHSIG), so the child never outlives a parent that is SIGKILLed. Start
  // such children from a thread that lives as long as they should (e.g. main). Default: 0 (none).
  int parent_death_signal = 0;
  // When true the child leads a new process group (its pid), so a signal to the parent's group
  // does not reach it. Default: false (the child shares the parent's group: a terminal's Ctrl-C or
  // a service manager's group SIGTERM reaches it too).
  bool new_process_group = false;
};

class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess();
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // argv[0] is the program path. stdout and stderr go to `log_path` (appended; /dev/null if
  // empty), stdin is /dev/null, and no other descriptor of the parent is inherited. pid() <= 0
  // when the program could not be started (error() says why).
  static ChildProcess Start(const std::vector<std::string>& argv, const std::string& log_path = "",
                            const std::map<std::string, std::string>& extra_env = {});
  // The same with the full set of options.
  static ChildProcess StartWith(const std::vector<std::string>& argv, const std::string& log_path,
                                const SpawnOptions& options);

  pid_t pid() const { return pid_; }
  // Why Start failed (empty when it did not).
  const std::string& error() const { return error_; }
  bool running();
  // The exit status once reaped (exit code, or 128+signal); nullopt while running.
  std::optional<int> exit_status() const { return status_; }
  void Signal(int sig);
  // Waits for exit up to `timeout`; returns the exit status (or 128+signal), nullopt on timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  // SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit status.
  int Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(10000));
  const std::string& log_path() const { return log_path_; }
  std::string ReadLog() const;

 private:
  // SIGKILLs and reaps a child that is still running; leaves this object empty.
  void Reset();

  pid_t pid_ = -1;
  std::optional<int> status_;
  std::string log_path_;
  std::string error_;
};

// Polls `path` until it holds a JSON object with key `key` (written by --port-file); returns its
// integer value, or nullopt after `timeout`.
std::optional<int> WaitForPortFile(const std::string& path, const std::string& key,
                                   std::chrono::milliseconds timeout);

}  // namespace epd::runtime
