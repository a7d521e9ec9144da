#include "runtime/shutdown.h"

#include <errno.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace epd::runtime {
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
      // The handler may run on this very thread: its read() then returns EINTR with the byte
      // still in the pipe, so read again (ending the loop there lost the shutdown for good).
      for (;;) {
        char c;
        const ssize_t n = read(g_pipe[0], &c, 1);
        if (n == 1) {
          RequestShutdown();
        } else if (n < 0 && errno == EINTR) {
          continue;
        } else {
          return;
        }
      }
    }).detach();
    struct sigaction sa {};
    sa.sa_handler = OnSignal;
    // Other threads' blocking calls resume after the handler instead of failing with EINTR.
    sa.sa_flags = SA_RESTART;
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

}  // namespace epd::runtime
