#pragma once

// The KV pool's memory registered with the transfer engine's wire (UCX ucp_mem_map) once per
// slab, so a transfer whose buffer lies in the pool (KvTransport::Borrow over a pool block) moves
// without a per-transfer registration or a copy into a staging buffer (docs/memory.md).
//
// The pool tells the registration of every slab it allocates and every slab it gives back
// (KvPool::AddSlabListener); each is registered / deregistered then. A slab the wire refuses is
// counted (failures()) and logged; transfers from it then register their buffer themselves.
// A slab of device memory (a pool on a GPU backend) is not registered: the wire has no CUDA
// transport here, and the hand-off reads device blocks through the pool into host memory
// (counted: device_slabs()).
//
// Thread-safety: thread-safe. Destroy it before the transport.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "transfer/kv_transport.h"
#include "model/kv_pool.h"

namespace epd::worker {

class PoolRegistration {
 public:
  // Registers every slab `pool` holds now and, from now on, every slab it allocates.
  PoolRegistration(std::shared_ptr<model::KvPool> pool, transfer::KvTransport& transport);
  ~PoolRegistration();
  PoolRegistration(const PoolRegistration&) = delete;
  PoolRegistration& operator=(const PoolRegistration&) = delete;

  int64_t registered_slabs() const;
  int64_t failures() const;
  // Device-memory slabs seen and not registered.
  int64_t device_slabs() const;
  // The wire handle of the slab holding [p, p + bytes); 0 when none is registered.
  uint64_t HandleFor(const void* p, int64_t bytes) const;

 private:
  void OnSlab(const model::KvPool::Slab& slab, bool added);

  std::shared_ptr<model::KvPool> pool_;
  transfer::KvTransport& transport_;
  int listener_ = -1;
  mutable std::mutex mu_;
  std::map<int64_t, uint64_t> handles_;  // slab id -> wire handle
  int64_t failures_ = 0;
  int64_t device_slabs_ = 0;
};

}  // namespace epd::worker
