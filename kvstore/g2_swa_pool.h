#pragma once

// G2: the host-DRAM pool of encoder SWA snapshots (DESIGN §5). Each entry has a TTL counted from
// its put (reads never extend it) and the pool has a byte capacity: a put first drops expired
// entries, then evicts least-recently-used ones until the new value fits. Losing an entry only
// costs an encoder replay of the rings, so nothing here is persisted.
//
// Puts are two-phase: BeginPut() reserves capacity and hands out a private buffer; Commit()
// publishes it with one pointer swap, so a reader sees the old value, the new value or nothing,
// never a half-written one. Values are immutable once published and shared with readers
// (shared_ptr<const std::string>), so a get never copies under the lock.
// Thread-safe: all methods may be called concurrently.
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "kvstore/kv_metrics.h"
#include "kvstore/types.h"

namespace epd::kvstore {

// ~10% of this machine's physical memory (the G2 default capacity).
uint64_t DefaultSwaCapacityBytes();

struct G2Config {
  int64_t ttl_ms = 10 * 60 * 1000;                      // Default: 10 minutes
  uint64_t capacity_bytes = DefaultSwaCapacityBytes();  // Default: ~10% of host memory
  size_t max_key_bytes = 256;  // Default: 256 (keys are chain hashes, 16 B)
  absl::Status Validate() const;
};

class G2SwaPool {
 public:
  // `clock` and `metrics` must outlive the pool.
  G2SwaPool(const G2Config& config, const common::Clock& clock, KvMetrics& metrics);
  G2SwaPool(const G2SwaPool&) = delete;
  G2SwaPool& operator=(const G2SwaPool&) = delete;

  // A reserved, invisible value. Fill data()[0, size()) then Commit(). Destroying it without
  // Commit() releases the reservation and publishes nothing. Move-only.
  class PendingPut {
   public:
    PendingPut() = default;
    PendingPut(PendingPut&& other) noexcept { *this = std::move(other); }
    PendingPut& operator=(PendingPut&& other) noexcept;
    ~PendingPut();
    uint8_t* data() { return reinterpret_cast<uint8_t*>(value_->data()); }
    size_t size() const { return value_ ? value_->size() : 0; }
    // Publishes the value (replacing any previous value of the key, whose TTL restarts).
    absl::Status Commit();

   private:
    friend class G2SwaPool;
    G2SwaPool* pool_ = nullptr;
    std::string key_;
    std::shared_ptr<std::string> value_;
  };

  // Reserves `bytes` of capacity. InvalidArgument for a bad key or a value larger than the whole
  // capacity; ResourceExhausted when pending reservations hold the rest.
  absl::StatusOr<PendingPut> BeginPut(std::string_view key, size_t bytes);
  // BeginPut + copy + Commit.
  absl::Status Put(std::string_view key, std::span<const uint8_t> value);

  struct GetResult {
    std::shared_ptr<const std::string> value;  // null on a miss
    MissReason miss = MissReason::kAbsent;     // kNone on a hit
  };
  // Counted get. An entry past its TTL is dropped and reported kExpired (count ttl_expiries);
  // so is one that a sweep dropped for its TTL within the last TTL period (bounded memory).
  // A hit marks the entry recently used for LRU but never extends its TTL.
  GetResult Get(std::string_view key);
  // Uncounted check for a live (unexpired) entry; touches nothing.
  bool Contains(std::string_view key) const;
  // Drops every expired entry; returns how many.
  size_t ExpireNow();

  struct Stats {
    uint64_t entries = 0;
    uint64_t bytes = 0;           // published payload bytes
    uint64_t reserved_bytes = 0;  // held by pending puts
    uint64_t capacity_bytes = 0;
  };
  Stats stats() const;
  const G2Config& config() const { return config_; }

 private:
  struct Entry {
    std::shared_ptr<const std::string> value;
    int64_t expires_unix_ms = 0;
    std::list<std::string>::iterator lru_it;  // into lru_
  };

  absl::Status CommitPending(std::string key, std::shared_ptr<std::string> value);
  void ReleaseReservation(size_t bytes);
  void RemoveLocked(absl::flat_hash_map<std::string, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t ExpireLocked(int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const G2Config config_;
  const common::Clock& clock_;
  KvMetrics::TierMetrics& metrics_;
  KvMetrics& all_metrics_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // front = most recently used
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  // Keys the sweep expired -> their expiry time, so a later get still says "expired". Dropped one
  // TTL after expiry; cleared wholesale beyond kMaxTombstones.
  absl::flat_hash_map<std::string, int64_t> tombstones_ ABSL_GUARDED_BY(mu_);
  static constexpr size_t kMaxTombstones = 1 << 16;
};

}  // namespace epd::kvstore
