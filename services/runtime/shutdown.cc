#include "services/runtime/shutdown.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace epd::services {
namespace {

std::atomic<bool> g_requested{false};
std::mutex g_mu;
std::condition_variable g_cv;
int g_pipe[2] = {-1, -1};

void OnSignal(int) {
  // Async-signal-safe: only write to the self-pipe; a watcher thread wakes the waiters.
  char c = 1;
  if (g_pipe[1] >= 0) {
    ssize_t n = write(g_pipe[1], &c, 1);
    (void)n;
  }
}

}  // namespace

void RequestShutdown() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_requested = true;
  }
  g_cv.notify_all();
}

void InstallShutdownHandlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (pipe(g_pipe) != 0) return;
    std::thread([] {
      char c;
      while (read(g_pipe[0], &c, 1) == 1) RequestShutdown();
    }).detach();
    struct sigaction sa {};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);
  });
}

bool ShutdownRequested() { return g_requested.load(); }

bool WaitForShutdown(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(g_mu);
  g_cv.wait_for(lock, timeout, [] { return g_requested.load(); });
  return g_requested.load();
}

}  // namespace epd::services
