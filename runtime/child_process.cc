#include "runtime/child_process.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <utility>

extern char** environ;

namespace epd::runtime {

ChildProcess::~ChildProcess() { Reset(); }

void ChildProcess::Reset() {
  if (pid_ > 0 && !status_) {
    kill(pid_, SIGKILL);
    int st;
    while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
  status_.reset();
}

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : pid_(std::exchange(o.pid_, -1)),
      status_(std::exchange(o.status_, std::nullopt)),
      log_path_(std::move(o.log_path_)),
      error_(std::move(o.error_)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    Reset();  // the child this object held (if still running) must not be leaked
    pid_ = std::exchange(o.pid_, -1);
    status_ = std::exchange(o.status_, std::nullopt);
    log_path_ = std::move(o.log_path_);
    error_ = std::move(o.error_);
  }
  return *this;
}

ChildProcess ChildProcess::Start(const std::vector<std::string>& argv, const std::string& log_path,
                                 const std::map<std::string, std::string>& extra_env) {
  SpawnOptions options;
  options.extra_env = extra_env;
  return StartWith(argv, log_path, options);
}

ChildProcess ChildProcess::StartWith(const std::vector<std::string>& argv,
                                     const std::string& log_path, const SpawnOptions& options) {
  ChildProcess p;
  p.log_path_ = log_path;
  if (argv.empty()) {
    p.error_ = "empty command line";
    return p;
  }
  // Everything the child needs is built before fork: between fork and exec a multi-threaded
  // parent's child may only make async-signal-safe calls.
  const std::string out = log_path.empty() ? "/dev/null" : log_path;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto key = kv.substr(0, kv.find('='));
    if (!options.extra_env.count(key)) env_store.push_back(kv);
  }
  for (const auto& [k, v] : options.extra_env) env_store.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  // The child reports a failure before exec (errno and the step) on this pipe; exec closes it.
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    p.error_ = std::string("pipe: ") + strerror(errno);
    return p;
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    p.error_ = std::string("fork: ") + strerror(errno);
    close(report[0]);
    close(report[1]);
    return p;
  }
  if (pid == 0) {
    int failure[2] = {0, 0};  // {step, errno}
    auto fail = [&](int step) {
      failure[0] = step;
      failure[1] = errno;
      ssize_t n = write(report[1], failure, sizeof(failure));
      (void)n;
      _exit(127);
    };
    if (options.new_process_group && setpgid(0, 0) != 0) fail(1);
    if (options.parent_death_signal != 0) {
      if (prctl(PR_SET_PDEATHSIG, options.parent_death_signal) != 0) fail(2);
      // The parent may have died between fork and prctl: then no signal will ever come.
      if (getppid() != parent) _exit(128 + options.parent_death_signal);
    }
    // The signal mask survives fork and exec; the program starts with none blocked.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    const int in = open("/dev/null", O_RDONLY);
    const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (in < 0 || fd < 0) fail(3);
    if (dup2(in, 0) < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) fail(4);
    // No other descriptor of the parent (sockets, pipes, RocksDB files) leaks into the child.
    close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    execve(args[0], args.data(), envp.data());
    fail(5);
  }
  close(report[1]);
  int failure[2] = {0, 0};
  ssize_t n;
  while ((n = read(report[0], failure, sizeof(failure))) < 0 && errno == EINTR) {
  }
  close(report[0]);
  if (n == static_cast<ssize_t>(sizeof(failure))) {
    static const char* kSteps[] = {"", "setpgid", "prctl", "open", "dup2", "exec"};
    p.error_ = std::string(kSteps[failure[0] % 6]) + " " + argv[0] + ": " + strerror(failure[1]);
    int st;
    waitpid(pid, &st, 0);
    return p;
  }
  p.pid_ = pid;
  return p;
}

bool ChildProcess::running() {
  if (pid_ <= 0 || status_) return false;
  int st;
  pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r < 0 && errno == ECHILD) {  // reaped elsewhere: it is gone, whatever its status was
    status_ = -1;
    return false;
  }
  if (r == pid_) {
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return false;
  }
  return true;
}

void ChildProcess::Signal(int sig) {
  if (pid_ > 0 && !status_) kill(pid_, sig);
}

std::optional<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (running()) {
    if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status_;
}

int ChildProcess::Stop(std::chrono::milliseconds grace) {
  Signal(SIGTERM);
  if (auto st = Wait(grace)) return *st;
  Signal(SIGKILL);
  return Wait(std::chrono::milliseconds(5000)).value_or(-1);
}

std::string ChildProcess::ReadLog() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::optional<int> WaitForPortFile(const std::string& path, const std::string& key,
                                   std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {  // reads at least once, so a zero timeout means "read it now"
    std::ifstream in(path);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      auto j = nlohmann::json::parse(ss.str(), nullptr, false);
      if (!j.is_discarded() && j.contains(key)) return j[key].get<int>();
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace epd::runtime
