#include "model/scratch.h"

namespace epd::model {
namespace {

int64_t SizeClass(int64_t bytes) {
  int64_t c = 4096;
  while (c < bytes) c *= 2;
  return c;
}

}  // namespace

absl::StatusOr<kernels::Buffer> ScratchPool::Take(int64_t bytes) {
  const int64_t cls = SizeClass(bytes);
  if (cls > max_cached_) {
    // Never kept (Give frees it): the exact size, not a power of two.
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++allocations_;
    }
    return backend_.Allocate(bytes);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(cls);
    if (it != free_.end() && !it->second.empty()) {
      kernels::Buffer b = std::move(it->second.back());
      it->second.pop_back();
      cached_ -= cls;
      return b;
    }
    ++allocations_;
  }
  return backend_.Allocate(cls);
}

void ScratchPool::Give(kernels::Buffer buffer) {
  const int64_t cls = buffer.bytes();
  if (cls <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (cached_ + cls > max_cached_ || SizeClass(cls) != cls) return;  // freed on return
  cached_ += cls;
  free_[cls].push_back(std::move(buffer));
}

int64_t ScratchPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

int64_t ScratchPool::allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_;
}

}  // namespace epd::model
