#include "services/runtime/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

extern char** environ;

namespace epd::services {

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !status_) {
    kill(pid_, SIGKILL);
    int st;
    waitpid(pid_, &st, 0);
  }
}

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : pid_(o.pid_), status_(o.status_), log_path_(std::move(o.log_path_)) {
  o.pid_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    this->~ChildProcess();
    pid_ = o.pid_;
    status_ = o.status_;
    log_path_ = std::move(o.log_path_);
    o.pid_ = -1;
  }
  return *this;
}

ChildProcess ChildProcess::Start(const std::vector<std::string>& argv, const std::string& log_path,
                             const std::map<std::string, std::string>& extra_env) {
  ChildProcess p;
  p.log_path_ = log_path;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string out = log_path.empty() ? "/dev/null" : log_path;
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto key = kv.substr(0, kv.find('='));
    if (!extra_env.count(key)) env_store.push_back(kv);
  }
  for (const auto& [k, v] : extra_env) env_store.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), envp.data()) == 0) {
    p.pid_ = pid;
  }
  posix_spawn_file_actions_destroy(&actions);
  return p;
}

bool ChildProcess::running() {
  if (pid_ <= 0 || status_) return false;
  int st;
  pid_t r = waitpid(pid_, &st, WNOHANG);
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

}  // namespace epd::services
