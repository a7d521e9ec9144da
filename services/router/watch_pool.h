#pragma once

// A bounded, reused set of threads for the router's blocking stream reads (the side stages'
// watchers, stage_chain.h): a request no longer makes and joins one thread per side stage.
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace epd::services::router {

// Threads are made on demand up to `max_threads` and reused; a thread idle for `idle` exits
// while more than `keep_threads` live. A task given while every thread is busy and the bound is
// reached waits, first in first out, for the next free thread (so a task must not wait for a
// task given after it). Thread-safe.
class WatchPool {
 public:
  struct Options {
    int max_threads = 512;  // Default: two side stages for each of the admission's 256 running
    int keep_threads = 4;   // Default: threads kept when idle
    absl::Duration idle = absl::Seconds(10);  // Default: idle time after which a thread exits
  };
  explicit WatchPool(Options options);
  WatchPool() : WatchPool(Options{}) {}
  // Runs every task already given, then joins every thread.
  ~WatchPool();
  WatchPool(const WatchPool&) = delete;
  WatchPool& operator=(const WatchPool&) = delete;

  void Run(std::function<void()> task);

  int threads() const;          // live threads
  int idle_threads() const;     // live threads not running a task
  int threads_started() const;  // threads made since construction

 private:
  void Loop(int id);
  void JoinExitedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReadyLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::thread> threads_ ABSL_GUARDED_BY(mu_);  // by id
  std::vector<int> exited_ ABSL_GUARDED_BY(mu_);             // returned, not yet joined
  int idle_ ABSL_GUARDED_BY(mu_) = 0;                        // live threads not running a task
  int live_ ABSL_GUARDED_BY(mu_) = 0;
  int next_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace epd::services::router
