#include "runtime/worker/pool_registration.h"

#include <string>
#include <utility>

#include "spdlog/spdlog.h"

namespace epd::worker {

PoolRegistration::PoolRegistration(std::shared_ptr<model::KvPool> pool,
                                   transfer::KvTransport& transport)
    : pool_(std::move(pool)), transport_(transport) {
  listener_ = pool_->AddSlabListener(
      [this](const model::KvPool::Slab& slab, bool added) { OnSlab(slab, added); });
}

PoolRegistration::~PoolRegistration() {
  pool_->RemoveSlabListener(listener_);  // no OnSlab runs after this returns
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, handle] : handles_) transport_.DeregisterMemory(handle);
  handles_.clear();
}

// Runs under the pool's lock (KvPool::SlabListener): only the transport is called.
void PoolRegistration::OnSlab(const model::KvPool::Slab& slab, bool added) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!added) {
    auto it = handles_.find(slab.id);
    if (it == handles_.end()) return;
    transport_.DeregisterMemory(it->second);
    handles_.erase(it);
    return;
  }
  if (slab.kind != kernels::MemoryKind::kHost) {
    // Device memory: the wire here has no CUDA transport, so the hand-off reads the blocks
    // through the pool (KvRows::CopyPacked: a download into host memory) and sends that.
    ++device_slabs_;
    return;
  }
  absl::StatusOr<uint64_t> h =
      transport_.RegisterMemory(slab.data, static_cast<uint64_t>(slab.bytes));
  if (!h.ok()) {
    ++failures_;
    spdlog::warn("kv pool: slab {} ({} bytes) not registered with the transfer wire: {}", slab.id,
                 slab.bytes, std::string(h.status().message()));
    return;
  }
  handles_[slab.id] = *h;
}

int64_t PoolRegistration::registered_slabs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(handles_.size());
}

int64_t PoolRegistration::device_slabs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return device_slabs_;
}

int64_t PoolRegistration::failures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failures_;
}

uint64_t PoolRegistration::HandleFor(const void* p, int64_t bytes) const {
  const model::KvPool::Slab slab = pool_->FindSlab(p, bytes);
  if (slab.id < 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(slab.id);
  return it == handles_.end() ? 0 : it->second;
}

}  // namespace epd::worker
