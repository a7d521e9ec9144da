#pragma once

// The paged, packed KV pool of a worker (issue 11; DESIGN.md §5's G1 tier inside the worker): the
// worker's KV pool, not the kvstore's G1 tier (kvstore/g1_hot_tier.h, G1HotTier: the daemon's hot
// tier of published blocks by key, which a worker reaches only through the kvstore client).
//
// A KvPool hands out fixed-size blocks of bytes. Each global-KV stream of a sequence (the
// compressed entries `kv.<L>` and the index keys `keys.<L>` of KV source L) is a KvRows: a block
// table into the pool, one block per kKvBlockTokens (64, the store's block) tokens of the stream,
// holding that many tokens' rows (64 / ratio) in their packed MODEL.md §4 formats (288 B per
// entry, 68 B per key at the released sizes), so a worker holds exactly the bytes `epd
// kv-layout` accounts per token. Each SWA ring of a sequence is a SwaRing: one pool block of
// window packed slots (below).
//
// Sharing: blocks are reference-counted. Copying a KvRows shares its blocks (a copied
// SequenceState, a snapshot, an n > 1 fork); a write into a shared block copies it first
// (copy-on-write). A block that fills up is sealed under a content hash chain (the model's
// config seed, the stream, the previous block's hash, the XXH3-64 digest of the block's bytes,
// which a device pool computes on the device); when a block with the
// same hash and the same bytes is already in the pool (in use by another sequence, or cached),
// the sequence takes that one and its own copy is freed, so sequences with a common prefix hold
// its blocks once. The hash is over content rather than tokens because a token prefix does not
// determine the KV (prefill vs decode steps publish different index keys; bounded replay depends
// on the prompt length): equal bytes are the only safe criterion. A sealed block whose last
// reference goes stays cached (LRU) and is evicted only when an allocation needs the room.
//
// Capacity: bytes in use + cached <= capacity (0 = unbounded; the cache then keeps at most
// kUnboundedCacheBytes). An allocation that does not fit after evicting every cached block fails
// with ResourceExhausted (the decode worker preempts).
//
// Memory: the blocks live in slabs, large buffers from `Backend::Allocate` (host memory on the
// CPU backend) carved into fixed-size slots, one slot size per block size (a model has a few:
// one per stream kind and ratio). A slab is allocated when a block of its size finds no free
// slot; a freed block's slot goes back to its size's free list (reused last-in first-out), and
// the slab stays: the pool's memory only grows, up to its high-water, and goes back to the
// backend only on Trim() (slabs none of whose slots holds a block) or with the pool. Slab memory
// = the blocks' bytes (used + cached, bounded by the capacity) + the free slots (each size's
// high-water minus what it holds now). With a capacity a slab is at most 1/kSlabsPerCapacity of
// it, and when a new slab would take the slab memory past the capacity the pool first gives back
// wholly free slabs of the other sizes (slots of one size cannot serve another). The slabs can
// be registered with a transport (UCX) once: ForEachSlab / AddSlabListener.
//
// Thread-safety: KvPool is thread-safe. A KvRows is used by one thread at a time (as the
// SequenceState holding it); different KvRows may share blocks across threads (shared blocks are
// never written).

#include <algorithm>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace epd::model {

inline constexpr int64_t kKvBlockTokens = 64;
inline constexpr int64_t kUnboundedCacheBytes = int64_t{64} << 20;
inline constexpr int64_t kDefaultSlabBytes = int64_t{4} << 20;
// With a capacity, a slab holds at most capacity / kSlabsPerCapacity bytes of slots.
inline constexpr int64_t kSlabsPerCapacity = 16;

class KvPool {
 public:
  struct Stats {
    int64_t capacity_bytes = 0;  // 0 = unbounded
    int64_t used_bytes = 0;      // blocks referenced by some sequence
    int64_t cached_bytes = 0;    // sealed blocks nobody references (evictable)
    int64_t used_blocks = 0;
    int64_t cached_blocks = 0;
    int64_t shared_hits = 0;  // seals that found an identical block (memory saved)
    int64_t evictions = 0;
    int64_t alloc_failures = 0;
    int64_t slab_bytes = 0;  // memory taken from the backend (the slabs)
    int64_t slabs = 0;
    int64_t free_slots = 0;  // slots of the slabs that hold no block
  };
  // One slab: `bytes` of backend memory at `data`, slots of `slot_bytes` each.
  struct Slab {
    int64_t id = -1;
    uint8_t* data = nullptr;
    int64_t bytes = 0;
    int64_t slot_bytes = 0;
    kernels::MemoryKind kind = kernels::MemoryKind::kHost;
  };
  // Told of every slab: added = true when it is allocated (and, on AddSlabListener, for every
  // slab already there), false just before it goes back to the backend. Called with the pool's
  // lock held: it must not call into the pool.
  using SlabListener = std::function<void(const Slab& slab, bool added)>;
  struct Block {
    int32_t id = -1;
    uint8_t* data = nullptr;
  };

  // `seed` enters every content hash (a config fingerprint: blocks of different models never
  // match). `backend` gives the slabs and runs the ops on the blocks (nullptr: a CPU backend the
  // pool owns): with a device backend the blocks are device memory, which the model reads and
  // writes with the backend's PackRows / UnpackRows, and host code through Write / Read (the
  // backend's Upload / Download). It must outlive the pool; its Allocate, Upload, Download,
  // Copy, CopyBlocks, DigestBlocks and BlocksEqual are called from whichever thread uses the pool
  // (backend.h allows them from other threads).
  // `slab_bytes`: the size of a slab (rounded down to whole slots, at least one; with a capacity,
  // at most capacity / kSlabsPerCapacity).
  explicit KvPool(int64_t capacity_bytes = 0, uint64_t seed = 0,
                  kernels::Backend* backend = nullptr, int64_t slab_bytes = kDefaultSlabBytes);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  // A block of `bytes` with one reference. ResourceExhausted when it does not fit.
  [[nodiscard]] absl::Status Allocate(int64_t bytes, Block* out);
  void Ref(int32_t id);
  void Unref(int32_t id);
  int refs(int32_t id) const;
  // Registers a full block under `hash`; returns the block the caller should hold from now on
  // (an identical block already present, with the caller's reference moved to it, or `b`).
  // An identical block is one whose bytes are equal: as the caller compared them (`theirs`, when
  // it names the block registered under `hash`: SealPending, which compares on the backend, a
  // device pool's only way), else compared in place on a host pool. A hash collision, or a block
  // nobody compared, stays unshared (and unsealed).
  struct Known {
    int32_t id = -1;
    bool equal = false;  // b's bytes equal block id's
  };
  Block Seal(Block b, uint64_t hash, Known theirs);
  Block Seal(Block b, uint64_t hash) { return Seal(b, hash, Known{}); }
  // For each hashes[i]: the block registered under it, other than mine[i], with a reference
  // taken for the caller (who compares with it, then Unrefs it), or -1 (SealPending: the blocks
  // a batch of seals will compare against, in one BlocksEqual).
  std::vector<int32_t> RefRegistered(std::span<const uint64_t> hashes,
                                     std::span<const int32_t> mine);
  // The block of id `id` (its data pointer) while the caller holds a reference.
  Block BlockOf(int32_t id) const;
  // True when the caller holds the only reference; the block is then unsealed (its hash
  // forgotten, so nobody can start sharing it) and the caller may write it. False: shared.
  bool TryExclusive(int32_t id);
  // Makes `b`, a block of `bytes` the caller holds (id < 0: none yet), one the caller alone holds
  // and may write: b itself when it is the only reference (TryExclusive); else a copy of it with
  // the caller's reference moved to the copy (copy-on-write); or, for none, a new block that
  // `init` fills (nullptr: left as allocated). *replaced (optional) says whether b changed.
  // ResourceExhausted when the pool is full, or init's error: b is unchanged then.
  [[nodiscard]] absl::Status MakeWritable(Block& b, int64_t bytes,
                                          const std::function<absl::Status(const Block&)>& init,
                                          bool* replaced = nullptr);
  bool sealed(int32_t id) const;

  // The backend whose memory holds the blocks, and whether that is host memory.
  kernels::Backend& backend() const { return *backend_; }
  bool host_memory() const { return host_memory_; }
  // Host bytes into / out of block b at `offset` (memcpy on a host pool, else Upload /
  // Download). The caller holds a reference to b.
  [[nodiscard]] absl::Status Write(const Block& b, int64_t offset, const void* src, int64_t bytes);
  [[nodiscard]] absl::Status Read(const Block& b, int64_t offset, int64_t bytes, void* dst) const;
  // A range of a block: `bytes` from `offset`.
  struct BlockRange {
    Block block;
    int64_t bytes = 0;
    int64_t offset = 0;
  };
  // Several ranges into dst, one after the other (sum of the bytes): on a device pool, one
  // backend CopyBlocks into a staging buffer the pool keeps and one Download per
  // kMaxStagingBytes (one range: a plain Read), so a stream of n blocks read for a hand-off waits
  // for the device once and queues one copy, not n (the host bounce of a transfer wire without a
  // CUDA transport). The caller holds the blocks.
  [[nodiscard]] absl::Status ReadBlocks(std::span<const BlockRange> reads, uint8_t* dst);
  // The reverse: src's bytes, one range after the other, into the ranges (a received hand-off's
  // blocks): on a device pool one Upload into the staging buffer and one CopyBlocks out of it per
  // kMaxStagingBytes, not an Upload per block. The caller holds the blocks, writable.
  [[nodiscard]] absl::Status WriteBlocks(std::span<const BlockRange> writes, const uint8_t* src);
  static constexpr int64_t kMaxStagingBytes = int64_t{16} << 20;
  // out[i] = XXH3-64 of block i's range (the content digest a seal hashes; offset 0): on a
  // device pool the backend's DigestBlocks, so only the 8 bytes of each come down (one Upload of
  // the addresses and lengths, 16 bytes a block, and one Download for all the blocks).
  [[nodiscard]] absl::Status DigestBlocks(std::span<const BlockRange> blocks, uint64_t* out);
  // equal[i] = whether the first `bytes` of pairs[i].a and pairs[i].b are equal (the backend's
  // BlocksEqual on a device pool: one Upload of 24 bytes a pair, one Download of 4).
  struct BlockPair {
    Block a, b;
    int64_t bytes = 0;
  };
  [[nodiscard]] absl::Status BlocksEqual(std::span<const BlockPair> pairs, bool* equal);
  // dst's first `bytes` = src's (the backend's Copy on a device pool).
  [[nodiscard]] absl::Status CopyBlock(const Block& dst, const Block& src, int64_t bytes);
  // A backend buffer holding a copy of `bytes` host bytes (a host surface's input, staged).
  absl::StatusOr<kernels::Buffer> Staged(const void* host, int64_t bytes);
  // At least `bytes` zero bytes in the backend's memory (kept by the pool, never written).
  absl::StatusOr<const void*> Zeros(int64_t bytes);

  void SetCapacity(int64_t bytes);
  int64_t capacity_bytes() const;
  // Bytes an allocation may still take (capacity - used; cached blocks are evictable). INT64_MAX
  // when unbounded.
  int64_t available_bytes() const;
  Stats stats() const;
  uint64_t seed() const { return seed_; }

  // Gives every slab back to the backend that holds no block (cached blocks are kept: they are
  // blocks). Returns the bytes given back.
  int64_t Trim();
  // The slabs now, in allocation order.
  void ForEachSlab(const std::function<void(const Slab&)>& fn) const;
  // Calls `fn(slab, true)` for each slab now, then on every slab allocated or freed later, until
  // RemoveSlabListener(returned id).
  int AddSlabListener(SlabListener fn);
  void RemoveSlabListener(int id);
  // The slab holding [p, p + bytes); id -1 when no slab of the pool holds all of it.
  Slab FindSlab(const void* p, int64_t bytes) const;

 private:
  struct Slot {
    uint8_t* mem = nullptr;  // nullptr: its slab was given back (the id is not reused)
    int64_t bytes = 0;       // the slot size
    int64_t slab = -1;       // id of its slab
    int refs = 0;
    bool in_use = false;  // holds a block (used or cached)
    bool sealed = false;
    uint64_t hash = 0;
    bool cached = false;
    std::list<int32_t>::iterator lru;
  };
  struct SlabRec {
    kernels::Buffer buffer;
    int64_t slot_bytes = 0;
    int32_t first_id = 0;  // its slots are ids [first_id, first_id + slots)
    int32_t slots = 0;
    int32_t in_use = 0;
  };
  bool EvictOneLocked();
  void TrimCacheLocked();
  void RefLocked(int32_t id);
  void UnrefLocked(int32_t id);
  void FreeLocked(int32_t id);
  absl::Status NewSlabLocked(int64_t slot_bytes);
  int64_t TrimLocked(int64_t except_slot_bytes);
  Slab SlabOf(int64_t id, const SlabRec& r) const;
  // The slab buffer holding block `id` and the block's offset in it.
  kernels::Buffer& BufferOf(int32_t id, int64_t* offset) const;
  // ReadBlocks (into dst) / WriteBlocks (from src; dst null) on a device pool: the ranges
  // through the staging buffer, one fill at a time (a range longer than what is left of a fill
  // is split).
  absl::Status StagedBlocks(std::span<const BlockRange> ranges, const uint8_t* src, uint8_t* dst);

  const uint64_t seed_;
  std::unique_ptr<kernels::Backend> own_backend_;
  kernels::Backend* backend_ = nullptr;
  bool host_memory_ = true;
  const int64_t slab_bytes_;
  mutable std::mutex mu_;
  int64_t capacity_ = 0;
  std::vector<Slot> slots_;
  // Free slots per slot size.
  absl::flat_hash_map<int64_t, std::vector<int32_t>> free_ids_;
  std::map<int64_t, SlabRec> slabs_;  // by slab id (allocation order)
  int64_t next_slab_id_ = 0;
  std::map<int, SlabListener> listeners_;
  int next_listener_ = 0;
  absl::flat_hash_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> lru_;  // cached blocks, oldest first
  Stats stats_;
  kernels::Buffer zeros_;  // Zeros()
  std::mutex staging_mu_;  // ReadBlocks' and WriteBlocks' staging buffer
  kernels::Buffer staging_;  // grows by doubling, to at most kMaxStagingBytes
  // DigestBlocks', BlocksEqual's and CopyBlocks' tables (addresses, lengths, answers): apart
  // from the staging buffer, so a decode step's seal does not wait behind a hand-off's read
  // (taken after staging_mu_ where both are).
  std::mutex tables_mu_;
  kernels::Buffer tables_;  // grows by doubling
  // Under tables_mu_: tables_ of at least `bytes`, with `args` uploaded at its start.
  absl::StatusOr<uint64_t*> UploadTablesLocked(std::span<const uint64_t> args, int64_t bytes);
};

// A worker's KV pool capacity when none is configured (docs/memory.md): on a device backend 90 %
// of its free memory (measured once the weights are in) less `reserve_bytes` (the activations'
// scratch cache); on the host, or a device that cannot say, a quarter of the host's physical
// memory. At least 1 (0 would mean unbounded).
int64_t DefaultKvPoolCapacity(const kernels::Backend& backend, int64_t reserve_bytes);

// Row codecs of a KvRows.
enum class KvRowFormat {
  kPackedKv,   // compressed entry: E2M1 + E4M3 per 16 (kernels/format.h PackKvEntry)
  kPackedKey,  // index key: E2M1 + UE8M0 per 32 (PackIndexKey)
  kF32,        // fp32 rows (ModelOptions::unquantized_kv, a benchmark switch)
};

// One paged stream of rows. Value semantics: a copy shares the blocks (copy-on-write).
// The vector-like members (size() in floats, resize to fewer floats, comparison, a float view)
// keep the code and tests written against the former std::vector<float> working; the model reads
// through Unpack/Gather.
class KvRows {
 public:
  KvRows() = default;
  // `stream` identifies the stream within a sequence (enters the content hash); `ratio` the
  // tokens per row (rows per block = kKvBlockTokens / ratio).
  KvRows(std::shared_ptr<KvPool> pool, KvRowFormat format, int64_t dim, int ratio, uint64_t stream);
  KvRows(const KvRows& o);
  KvRows& operator=(const KvRows& o);
  KvRows(KvRows&& o) noexcept;
  KvRows& operator=(KvRows&& o) noexcept;
  ~KvRows();

  int64_t rows() const { return rows_; }
  int64_t dim() const { return dim_; }
  int64_t rows_per_block() const { return rows_per_block_; }
  int64_t row_bytes() const { return row_bytes_; }
  KvRowFormat format() const { return format_; }
  // Bytes this stream's blocks hold (shared blocks counted in full).
  int64_t held_bytes() const {
    return static_cast<int64_t>(blocks_.size()) * rows_per_block_ * row_bytes_;
  }
  std::span<const KvPool::Block> blocks() const { return blocks_; }

  // Appends rows [n, dim] in host memory (values the format holds exactly: FP4
  // quantize-dequantized for the packed formats). ResourceExhausted when the pool is full
  // (nothing is appended then). The blocks it fills are sealed when it returns.
  [[nodiscard]] absl::Status Append(const float* x, int64_t n);
  // The same from rows in the pool backend's memory (the model's path: one PackRows). The blocks
  // it fills are sealed at once on a host pool; on a device pool they wait for SealPending (the
  // model calls it once a forward has written every stream of a sequence), so that sealing
  // reads them in one Download rather than one wait for the device per block.
  [[nodiscard]] absl::Status AppendFrom(const float* x, int64_t n);
  // AppendFrom in two steps, so that one PackRows writes the rows of many streams (a batched
  // decode step): Reserve makes every block rows [rows(), rows() + n) touch allocated and
  // exclusive (ResourceExhausted when the pool is full: nothing reserved), the caller writes the
  // rows into blocks() (as the backend's PackRows), and Commit(n) appends them. Truncate(rows())
  // gives back a reservation not committed.
  [[nodiscard]] absl::Status Reserve(int64_t n);
  void Commit(int64_t n);
  // Full blocks waiting to be sealed (a device pool's AppendFrom).
  bool has_pending_seals() const { return !pending_.empty(); }
  // Appends rows given in the packed format (row_bytes() each; fp32 bytes for kF32).
  [[nodiscard]] absl::Status AppendPacked(const uint8_t* bytes, int64_t n);
  // Keeps the first n rows (n <= rows()); blocks past them are released.
  void Truncate(int64_t n);
  // rows [first, first+n) as floats into the pool backend's memory (one UnpackRows).
  [[nodiscard]] absl::Status UnpackTo(int64_t first, int64_t n, float* out) const;
  // rows idx[0..n) + offset (idx in the backend's memory) as floats into the backend's memory;
  // a negative row leaves its output row as it is (a top-k's -1).
  [[nodiscard]] absl::Status GatherTo(const int32_t* idx, int64_t n, float* out,
                                      int64_t offset = 0) const;
  // The same into host memory (tests, tools; staged through the backend on a device pool, which
  // aborts on a backend failure).
  void Unpack(int64_t first, int64_t n, float* out) const;
  void Gather(const int32_t* idx, int64_t n, float* out) const;
  // The page table of the blocks (rows_per_block() rows a page), in the backend's memory (host:
  // a host array), for the backend's paged ops; valid until the stream changes.
  absl::StatusOr<uint8_t* const*> Pages() const;
  // rows [first, first+n) in the packed format, appended to `out` (no re-pack: the bytes the
  // blocks hold, in one KvPool::ReadBlocks, one Download on a device pool; kF32 rows are packed
  // with `packed_format`).
  [[nodiscard]] absl::Status CopyPacked(int64_t first, int64_t n, std::vector<uint8_t>& out,
                                        KvRowFormat packed_format) const;

  // ---- std::vector<float>-like surface (floats = rows * dim) ----
  size_t size() const { return static_cast<size_t>(rows_ * dim_); }
  bool empty() const { return rows_ == 0; }
  // Shrinks to `floats` / dim rows (growing appends zero rows; aborts if the pool is full).
  void resize(size_t floats);
  std::vector<float> ToVector() const;
  operator std::span<const float>() const;  // NOLINT: unpacked copy, kept until the next call
  friend bool operator==(const KvRows& a, const KvRows& b) { return a.ToVector() == b.ToVector(); }

 private:
  // Makes block `b` (index in blocks_) exclusively ours and unsealed, allocating it if b ==
  // blocks_.size().
  absl::Status Writable(size_t b);
  uint64_t PrevHash(size_t b) const { return b == 0 ? 0 : hashes_[b - 1]; }
  // Seals block b of a host pool (its bytes in place). A device pool's blocks are sealed by
  // SealPending.
  void SealHostBlock(size_t b);
  void ReleaseAll();
  friend absl::Status SealPending(std::span<KvRows* const> streams);
  // Block b changed (replaced or gone): the backend's page table is stale from b on.
  void Invalidate(size_t b) const { table_valid_ = std::min(table_valid_, b); }

  std::shared_ptr<KvPool> pool_;
  KvRowFormat format_ = KvRowFormat::kF32;
  int64_t dim_ = 0;
  int64_t rows_per_block_ = 1;
  int64_t row_bytes_ = 0;
  uint64_t stream_ = 0;
  int64_t rows_ = 0;
  std::vector<KvPool::Block> blocks_;
  std::vector<uint64_t> hashes_;  // per block: content hash chain (valid when sealed)
  std::vector<size_t> pending_;   // full blocks to seal, ascending (device pool, AppendFrom)
  mutable std::vector<float> view_;
  // Pages(): the block addresses, and on a device pool their copy in device memory, whose first
  // table_valid_ entries are current.
  mutable std::vector<uint8_t*> pages_;
  mutable kernels::Buffer table_;
  mutable size_t table_valid_ = 0;
};

// Seals the pending full blocks of `streams` (KvRows::AppendFrom on a device pool), all of one
// pool, without bringing their bytes to the host: their content digests come down in one
// KvPool::DigestBlocks (8 bytes a block), each block's hash is chained in its stream's order,
// and a block whose hash is already registered (or taken by an earlier block of the same call) is
// compared with that block on the backend (one KvPool::BlocksEqual for all of them) before it is
// shared. Nothing pending: no backend call.
[[nodiscard]] absl::Status SealPending(std::span<KvRows* const> streams);

// A read of pool memory whose caller cannot return a status (host-facing test/tool surfaces,
// and the state serializers that return plain values): a failure there is a failed device read,
// which leaves a CUDA context unusable, so the process ends with the message (a supervised
// worker is restarted).
void AbortUnlessOk(const absl::Status& s, const char* what);

// The backend row codec of `format`.
kernels::RowCodec KvRowCodec(KvRowFormat format);
// Packed bytes per row of `format` at `dim`.
int64_t KvRowBytes(KvRowFormat format, int64_t dim);

// One sliding-window ring of a sequence (a layer's last `window` KV rows, slot = position %
// window) in one pool block of window x the packed SWA slot (MODEL.md §4: E4M3 + UE8M0 per 32,
// kernels/format.h PackSwaSlot; 528 B at head_dim 512), the hand-off's format: serializing a ring
// copies its block as it is. The values written are FP8-window quantize-dequantized (bf16), which
// the slot format holds exactly: ReadSlot gives back the floats WriteSlot was given, bit for bit.
//
// Value semantics: a copy shares the block (refcounted); the first write on either side copies it
// (copy-on-write, as KvRows). The block is not allocated before the first write: a ring never
// written reads zeros (and serializes as packed zero slots) and holds no pool bytes. Ring blocks
// are never sealed (nothing shares them by content). The values are the same with
// ModelOptions::unquantized_kv (that switch leaves the window's FP8 rounding in place).
class SwaRing {
 public:
  SwaRing() = default;
  SwaRing(std::shared_ptr<KvPool> pool, int64_t window, int64_t dim);
  SwaRing(const SwaRing& o);
  SwaRing& operator=(const SwaRing& o);
  SwaRing(SwaRing&& o) noexcept;
  SwaRing& operator=(SwaRing&& o) noexcept;
  ~SwaRing();

  int64_t window() const { return window_; }
  int64_t dim() const { return dim_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t ring_bytes() const { return window_ * slot_bytes_; }
  bool allocated() const { return block_.id >= 0; }
  // Whether the ring holds its block alone: WritableBlock then takes nothing from the pool.
  bool exclusive() const { return allocated() && pool_->refs(block_.id) == 1; }
  // Pool bytes this ring holds (a shared block counted in full; 0 before the first write).
  int64_t held_bytes() const { return allocated() ? ring_bytes() : 0; }
  const KvPool::Block& block() const { return block_; }

  // Packs `x` [dim] into `slot` (copying a shared block first, allocating the block on the
  // first write). ResourceExhausted when the pool is full (the ring is unchanged then).
  [[nodiscard]] absl::Status WriteSlot(int64_t slot, const float* x);
  // Rows x[0..n) [n, dim] of positions first_pos.. into their slots (position % window).
  [[nodiscard]] absl::Status WritePositions(int64_t first_pos, int64_t n, const float* x);
  // The same from rows in the pool backend's memory (the model's path: PackRows).
  [[nodiscard]] absl::Status WritePositionsFrom(int64_t first_pos, int64_t n, const float* x);
  // The ring's block made writable (allocated with zero slots on the first write, a shared one
  // copied): its address in the pool backend's memory, one page of window() kSwaSlot rows. For a
  // caller that packs and unpacks many rings' rows in one backend call (Model::StepAttention);
  // valid until the ring is next written through another call or released.
  [[nodiscard]] absl::StatusOr<uint8_t*> WritableBlock();
  // The pool's backend (null without a pool).
  kernels::Backend* backend() const { return pool_ != nullptr ? &pool_->backend() : nullptr; }
  // Slot bytes as they are (slot_bytes()).
  [[nodiscard]] absl::Status WriteSlotPacked(int64_t slot, const uint8_t* bytes);
  // The whole ring, ring_bytes() packed bytes.
  [[nodiscard]] absl::Status WritePacked(const uint8_t* bytes);
  // Zeros in every slot.
  void Clear();
  // Into host memory (a device pool's bytes are downloaded; it aborts on a backend failure).
  void ReadSlot(int64_t slot, float* out) const;
  // Every slot in slot order, [window, dim].
  void ReadWindow(float* out) const;
  // Every slot in slot order into the pool backend's memory (the model's path: UnpackRows).
  [[nodiscard]] absl::Status ReadWindowTo(float* out) const;
  // `slot`'s packed bytes appended to `out`.
  [[nodiscard]] absl::Status CopySlotPacked(int64_t slot, std::vector<uint8_t>& out) const;
  // The ring's ring_bytes() packed bytes (the block as it is, or packed zero slots).
  [[nodiscard]] absl::Status CopyPacked(uint8_t* out) const;
  // The packed bytes of the n slots from `slot` on (wrapping) into `dst`, memory of the pool's
  // backend, with backend Copies (no host round trip): at most two. The ring must be allocated.
  [[nodiscard]] absl::Status CopySlotsTo(int64_t slot, int64_t n, uint8_t* dst) const;
  // The reverse: n packed slots from `src` (the pool backend's memory) into slots `slot`..
  // (wrapping), copying a shared block first.
  [[nodiscard]] absl::Status WriteSlotsFrom(int64_t slot, int64_t n, const uint8_t* src);

  // ---- std::vector<float>-like surface (tests; floats = window * dim) ----
  size_t size() const { return static_cast<size_t>(window_ * dim_); }
  std::vector<float> ToVector() const;
  operator std::span<const float>() const;  // NOLINT: unpacked copy, kept until the next call
  friend bool operator==(const SwaRing& a, const SwaRing& b) {
    return a.ToVector() == b.ToVector();
  }

 private:
  absl::Status Writable();
  void Release();
  void FillZero(uint8_t* slots, int64_t n) const;
  // The ring's one-entry page table in the backend's memory.
  absl::StatusOr<uint8_t* const*> Page() const;

  std::shared_ptr<KvPool> pool_;
  int64_t window_ = 0;
  int64_t dim_ = 0;
  int64_t slot_bytes_ = 0;
  KvPool::Block block_;
  mutable std::vector<float> view_;
  mutable uint8_t* page_ = nullptr;  // Page(): block_.data, and its copy in device memory
  mutable kernels::Buffer table_;
  mutable bool table_ok_ = false;
};

}  // namespace epd::model
