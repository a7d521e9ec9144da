#include "services/router/watch_pool.h"

#include <utility>

namespace epd::services::router {

WatchPool::WatchPool(Options options) : options_(options) {}

WatchPool::~WatchPool() {
  std::map<int, std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;  // no thread is made from here on
    threads.swap(threads_);
    exited_.clear();
  }
  // Each thread runs what is queued before it sees stop_.
  for (auto& [id, t] : threads) t.join();
}

void WatchPool::JoinExitedLocked() {
  // An exited thread no longer takes mu_, so joining it here cannot deadlock.
  for (int id : exited_) {
    auto it = threads_.find(id);
    if (it == threads_.end()) continue;  // the destructor took it
    it->second.join();
    threads_.erase(it);
  }
  exited_.clear();
}

void WatchPool::Run(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  JoinExitedLocked();
  queue_.push_back(std::move(task));
  if (static_cast<size_t>(idle_) < queue_.size() && live_ < options_.max_threads && !stop_) {
    const int id = next_id_++;
    ++live_;
    ++idle_;  // counted free from now, so the next Run does not make another one for this task
    threads_.emplace(id, std::thread([this, id] { Loop(id); }));
  }
}

void WatchPool::Loop(int id) {
  mu_.Lock();
  // The thread is counted in idle_ whenever it holds mu_ here.
  for (;;) {
    if (!queue_.empty()) {
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      --idle_;
      mu_.Unlock();
      task();
      task = nullptr;  // its captures go before the lock is taken again
      mu_.Lock();
      ++idle_;
      continue;
    }
    if (stop_) break;
    const bool woke =
        mu_.AwaitWithTimeout(absl::Condition(this, &WatchPool::ReadyLocked), options_.idle);
    if (!woke && live_ > options_.keep_threads) break;
  }
  --idle_;
  --live_;
  exited_.push_back(id);
  mu_.Unlock();
}

bool WatchPool::ReadyLocked() const { return !queue_.empty() || stop_; }

int WatchPool::threads() const {
  absl::MutexLock lock(&mu_);
  return live_;
}

int WatchPool::idle_threads() const {
  absl::MutexLock lock(&mu_);
  return idle_;
}

int WatchPool::threads_started() const {
  absl::MutexLock lock(&mu_);
  return next_id_;
}

}  // namespace epd::services::router
