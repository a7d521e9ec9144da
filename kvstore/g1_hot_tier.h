#pragma once

// G1HotTier: the kvstore daemon's hot tier (DESIGN §5's G1, in front of G3; kvstore.h), not the
// worker's KV pool (model/kv_pool.h, KvPool: the paged blocks a worker's forward reads and
// writes). It holds published blocks by key for any worker of the node to get; a worker's blocks
// reach it only through the kvstore client. Each block is one arena page holding a packed
// global-KV block or SWA ring (opaque bytes, length <= the page size). Blocks are ref-counted
// (BlockRef) and can be pinned; only published blocks with no refs and no pins sit on the LRU
// list, and only they are evicted. An evicted block is handed to the demote callback (normally
// G3's Put) before its page is reused, so eviction loses nothing that G3 can hold.
//
// Writes are two-phase: Reserve() takes a page that no reader can see, the writer fills it
// (CopyIn, or a DMA/RMA into BlockAddress: the transfer engine's seam), and Commit() publishes
// it atomically. Thread-safe: all methods may be called concurrently.
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvstore/block_arena.h"
#include "kvstore/kv_metrics.h"
#include "kvstore/types.h"

namespace epd::kvstore {

// A value's XXH3-64 and the seed it was computed with.
struct ValueChecksum {
  uint64_t value = 0;
  uint64_t seed = 0;
};

struct G1Config {
  size_t block_bytes = 64 * 890;         // Default: 64 tokens x 890 B/token (official config)
  size_t capacity_bytes = 256ull << 20;  // Default: 256 MiB (capacity / block_bytes pages)
  absl::Status Validate() const;
  uint32_t num_blocks() const { return static_cast<uint32_t>(capacity_bytes / block_bytes); }
};

class G1HotTier {
 public:
  // Called, outside the pool lock, with each evicted block's key and bytes.
  using DemoteFn = std::function<void(const BlockHash& key, std::string bytes)>;

  // `arena` fixes the page size and count; `metrics` must outlive the pool.
  G1HotTier(std::unique_ptr<BlockArena> arena, KvMetrics& metrics, DemoteFn demote = nullptr);
  // Convenience: a host arena sized by `config`.
  static absl::StatusOr<std::unique_ptr<G1HotTier>> CreateHost(const G1Config& config,
                                                               KvMetrics& metrics,
                                                               DemoteFn demote = nullptr);
  ~G1HotTier();
  G1HotTier(const G1HotTier&) = delete;
  G1HotTier& operator=(const G1HotTier&) = delete;

  // A reference to a published block: while it lives the block is never evicted. Move-only.
  class BlockRef {
   public:
    BlockRef() = default;
    BlockRef(BlockRef&& other) noexcept { *this = std::move(other); }
    BlockRef& operator=(BlockRef&& other) noexcept;
    ~BlockRef() { Release(); }
    uint32_t index() const { return index_; }
    size_t length() const { return length_; }
    // The block's address in the arena's memory space (host or device pointer).
    void* address() const;
    void Release();

   private:
    friend class G1HotTier;
    G1HotTier* pool_ = nullptr;
    uint32_t index_ = 0;
    size_t length_ = 0;
  };

  // A reserved, not yet visible page. Destroying it without Commit() frees the page. Move-only.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept { *this = std::move(other); }
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation();
    void* address() const;
    size_t length() const { return length_; }
    uint32_t index() const { return index_; }
    // Publishes the block. If another writer published the same key first, this page is freed
    // and OK is returned (chain-hash keys name identical content).
    absl::Status Commit();

   private:
    friend class G1HotTier;
    G1HotTier* pool_ = nullptr;
    uint32_t index_ = 0;
    size_t length_ = 0;
    BlockHash key_{};
  };

  // Takes a free page (evicting the LRU unreferenced block if needed) for `length` bytes.
  // InvalidArgument if length > block_bytes; ResourceExhausted if every page is referenced,
  // pinned or reserved.
  absl::StatusOr<Reservation> Reserve(const BlockHash& key, size_t length);
  // Reserve + CopyIn + Commit. A key already present is left as is (OK). The block keeps a
  // checksum of `bytes` (ReadInto's): `known` when the caller has one it verified over these very
  // bytes (a G3 hit being promoted), else their XXH3-64 with seed 0, computed once a page is
  // reserved.
  absl::Status Put(const BlockHash& key, std::span<const uint8_t> bytes,
                   std::optional<ValueChecksum> known = std::nullopt);

  // Counted probe (lookups/hits{tier="g1"}). Takes a reference: the block stays until released.
  std::optional<BlockRef> Acquire(const BlockHash& key);
  // Counted get: a copy of the block's bytes, or nullopt (miss counted as "absent").
  std::optional<std::string> Read(const BlockHash& key);
  // Counted get into dest(length) when it returns a buffer (then the result is an empty string),
  // else like Read. nullopt on a miss or a failed copy. `checksum` (optional): set to the block's
  // stored checksum when it has one (blocks written by Put; a block filled through a Reservation
  // has none), else reset. A reader that checks its copy against it checks the page
  // as it was put, end to end, instead of hashing whatever the page holds now.
  std::optional<std::string> ReadInto(const BlockHash& key, const ValueDest& dest, bool* in_dest,
                                      std::optional<ValueChecksum>* checksum = nullptr);
  // Counted probe (lookups/hits{tier="g1"}) without taking a reference or touching the LRU.
  bool Lookup(const BlockHash& key);
  // Uncounted presence check, touches nothing.
  bool Contains(const BlockHash& key) const;
  // Pin/unpin: a pinned block is never evicted. Pins nest. False if the key is absent (or, for
  // Unpin, not pinned).
  bool Pin(const BlockHash& key);
  bool Unpin(const BlockHash& key);
  // Drops an unreferenced, unpinned block without demoting it. False otherwise.
  bool Erase(const BlockHash& key);

  struct Stats {
    uint64_t entries = 0;  // published blocks
    uint64_t bytes = 0;    // payload bytes of published blocks
    uint64_t capacity_bytes = 0;
    uint32_t free_blocks = 0;
    uint32_t evictable_blocks = 0;  // on the LRU list
  };
  Stats stats() const;
  size_t block_bytes() const { return arena_->block_bytes(); }
  BlockArena& arena() { return *arena_; }

 private:
  struct Slot {
    BlockHash key{};
    size_t length = 0;
    int refs = 0;
    int pins = 0;
    bool published = false;
    bool in_use = false;
    std::list<uint32_t>::iterator lru_it;
    bool on_lru = false;
    std::optional<ValueChecksum> checksum;  // written by Put: of the bytes put
  };

  void Unref(uint32_t index);
  void CancelReservation(uint32_t index);
  absl::Status CommitReservation(uint32_t index, const BlockHash& key);
  void UpdateLruLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeSlotLocked(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<BlockArena> arena_;
  KvMetrics::TierMetrics& metrics_;
  KvMetrics& all_metrics_;
  DemoteFn demote_;

  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  std::list<uint32_t> lru_ ABSL_GUARDED_BY(mu_);  // front = most recently used
  absl::flat_hash_map<BlockHash, uint32_t> index_ ABSL_GUARDED_BY(mu_);
  uint64_t published_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace epd::kvstore
