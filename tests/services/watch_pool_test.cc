// WatchPool (services/router/watch_pool.h): the router's side-stage watchers reuse a bounded
// set of threads instead of one new thread per stage per request.
#include "services/router/watch_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "absl/synchronization/notification.h"

namespace epd::services::router {
namespace {

void WaitUntil(const std::function<bool()>& pred) {
  while (!pred()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

TEST(WatchPoolTest, SequentialTasksReuseThreads) {
  WatchPool pool;
  for (int i = 0; i < 200; ++i) {
    absl::Notification done;
    pool.Run([&] { done.Notify(); });
    done.WaitForNotification();
    // Until its thread is back from the task, a new task would get a second thread.
    WaitUntil([&] { return pool.idle_threads() == pool.threads(); });
  }
  EXPECT_EQ(pool.threads_started(), 1);  // a thread per task would have made 200
  EXPECT_EQ(pool.threads(), 1);
}

TEST(WatchPoolTest, TasksBeyondTheBoundWaitForAFreeThread) {
  WatchPool pool({.max_threads = 2});
  absl::Notification gate;
  std::atomic<int> blocked{0};
  std::atomic<bool> third_ran{false};
  for (int i = 0; i < 2; ++i) {
    pool.Run([&] {
      ++blocked;
      gate.WaitForNotification();
    });
  }
  absl::Notification third_done;
  pool.Run([&] {
    third_ran = true;
    third_done.Notify();
  });
  WaitUntil([&] { return blocked.load() == 2; });
  EXPECT_EQ(pool.threads_started(), 2);  // no third thread
  EXPECT_FALSE(third_ran.load());        // both threads are held by the gate
  gate.Notify();
  third_done.WaitForNotification();
  EXPECT_TRUE(third_ran.load());
  EXPECT_EQ(pool.threads_started(), 2);
}

TEST(WatchPoolTest, IdleThreadsAboveTheKeptNumberExit) {
  WatchPool pool({.max_threads = 8, .keep_threads = 1, .idle = absl::Milliseconds(20)});
  absl::Notification gate;
  std::atomic<int> running{0};
  for (int i = 0; i < 4; ++i) {
    pool.Run([&] {
      ++running;
      gate.WaitForNotification();
    });
  }
  WaitUntil([&] { return running.load() == 4; });
  EXPECT_EQ(pool.threads(), 4);
  gate.Notify();
  WaitUntil([&] { return pool.threads() == 1; });  // three idle threads exited, one kept
  absl::Notification done;
  pool.Run([&] { done.Notify(); });
  done.WaitForNotification();
  EXPECT_LE(pool.threads(), 2);
}

TEST(WatchPoolTest, DestructionRunsEveryQueuedTask) {
  std::atomic<int> ran{0};
  {
    WatchPool pool({.max_threads = 1});
    absl::Notification gate;
    pool.Run([&] { gate.WaitForNotification(); });
    for (int i = 0; i < 5; ++i) pool.Run([&] { ++ran; });
    gate.Notify();
  }
  EXPECT_EQ(ran.load(), 5);
}

}  // namespace
}  // namespace epd::services::router
