#include "model/kv_pool.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "common/memory_limit.h"
#include "common/status_macros.h"
#include "kernels/format.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;

// A block's digest: XXH3-64 of its bytes (Backend::DigestBlocks computes the same on a device).
uint64_t Digest(const uint8_t* data, int64_t bytes) {
  return XXH3_64bits(data, static_cast<size_t>(bytes));
}

// The block's place in the chain: the pool's seed, its stream, its predecessor's hash and its
// content digest. (In-process only: absl's hash is seeded per process.)
uint64_t BlockHash(uint64_t seed, uint64_t stream, uint64_t prev, uint64_t digest) {
  return absl::HashOf(seed, stream, prev, digest);
}

}  // namespace

void AbortUnlessOk(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "kv pool: %s: %s\n", what, std::string(s.message()).c_str());
  std::abort();
}

int64_t DefaultKvPoolCapacity(const kernels::Backend& backend, int64_t reserve_bytes) {
  if (backend.memory_kind() == kernels::MemoryKind::kDevice) {
    // What the device has free once the weights are in, less the activations' scratch cache and
    // a tenth of the rest (the runtime's context, per-call buffers, the page tables).
    const int64_t free = backend.free_memory_bytes();
    if (free > 0) return std::max<int64_t>(1, (free - reserve_bytes) / 10 * 9);
  }
  // A quarter of the memory this process may use (the cgroup's limit, if lower than the host's).
  const int64_t usable = common::UsableMemoryBytes();
  if (usable <= 0) return int64_t{8} << 30;
  return usable / 4;
}

// ---------------------------------------------------------------- KvPool

KvPool::KvPool(int64_t capacity_bytes, uint64_t seed, kernels::Backend* backend, int64_t slab_bytes)
    : seed_(seed),
      backend_(backend),
      slab_bytes_(std::max<int64_t>(1, slab_bytes)),
      capacity_(std::max<int64_t>(0, capacity_bytes)) {
  if (backend_ == nullptr) {
    own_backend_ = kernels::MakeCpuBackend();
    backend_ = own_backend_.get();
  }
  host_memory_ = backend_->memory_kind() == kernels::MemoryKind::kHost;
}

kernels::Buffer& KvPool::BufferOf(int32_t id, int64_t* offset) const {
  std::lock_guard<std::mutex> l(mu_);
  const Slot& s = slots_[id];
  // A referenced block's slab stays (Trim frees only slabs with no block): the reference is
  // good after the lock goes.
  auto& rec = const_cast<SlabRec&>(slabs_.at(s.slab));
  *offset = s.mem - rec.buffer.as<uint8_t>();
  return rec.buffer;
}

absl::Status KvPool::Write(const Block& b, int64_t offset, const void* src, int64_t bytes) {
  if (bytes <= 0) return absl::OkStatus();
  if (host_memory_) {
    std::memcpy(b.data + offset, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  int64_t at = 0;
  kernels::Buffer& buf = BufferOf(b.id, &at);
  return backend_->Upload(src, bytes, buf, at + offset);
}

absl::Status KvPool::Read(const Block& b, int64_t offset, int64_t bytes, void* dst) const {
  if (bytes <= 0) return absl::OkStatus();
  if (host_memory_) {
    std::memcpy(dst, b.data + offset, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  int64_t at = 0;
  const kernels::Buffer& buf = BufferOf(b.id, &at);
  return backend_->Download(buf, at + offset, bytes, dst);
}

absl::Status KvPool::ReadBlocks(std::span<const BlockRange> reads, uint8_t* dst) {
  if (host_memory_) {
    for (const BlockRange& r : reads) {
      std::memcpy(dst, r.block.data + r.offset, static_cast<size_t>(r.bytes));
      dst += r.bytes;
    }
    return absl::OkStatus();
  }
  if (reads.size() == 1) return Read(reads[0].block, reads[0].offset, reads[0].bytes, dst);
  return StagedBlocks(reads, nullptr, dst);
}

absl::Status KvPool::WriteBlocks(std::span<const BlockRange> writes, const uint8_t* src) {
  if (host_memory_) {
    for (const BlockRange& w : writes) {
      std::memcpy(w.block.data + w.offset, src, static_cast<size_t>(w.bytes));
      src += w.bytes;
    }
    return absl::OkStatus();
  }
  if (writes.size() == 1) return Write(writes[0].block, writes[0].offset, src, writes[0].bytes);
  return StagedBlocks(writes, src, nullptr);
}

absl::Status KvPool::StagedBlocks(std::span<const BlockRange> ranges, const uint8_t* src,
                                  uint8_t* dst) {
  const bool write = src != nullptr;
  int64_t total = 0;
  for (const BlockRange& r : ranges) total += r.bytes;
  if (total <= 0) return absl::OkStatus();
  std::lock_guard<std::mutex> l(staging_mu_);
  const int64_t cap = std::min(total, kMaxStagingBytes);
  if (staging_.bytes() < cap) {
    ASSIGN_OR_RETURN(staging_, backend_->Allocate(std::max(
                                   cap, std::min(2 * staging_.bytes(), kMaxStagingBytes))));
  }
  uint8_t* const staging = staging_.as<uint8_t>();
  // One fill: the pieces' block addresses, staging addresses and lengths, moved in one
  // CopyBlocks (tables_: the destinations [m], the sources [m], the lengths [m]).
  std::vector<uint64_t> blocks, at, lens;
  auto flush = [&](int64_t fill) -> absl::Status {
    if (fill == 0) return absl::OkStatus();
    if (write) RETURN_IF_ERROR(backend_->Upload(src, fill, staging_));
    const auto m = static_cast<int64_t>(blocks.size());
    std::vector<uint64_t> args;
    args.reserve(static_cast<size_t>(3 * m));
    const std::vector<uint64_t>& to = write ? blocks : at;
    const std::vector<uint64_t>& from = write ? at : blocks;
    args.insert(args.end(), to.begin(), to.end());
    args.insert(args.end(), from.begin(), from.end());
    args.insert(args.end(), lens.begin(), lens.end());
    {
      std::lock_guard<std::mutex> t(tables_mu_);
      ASSIGN_OR_RETURN(uint64_t * base, UploadTablesLocked(args, 3 * m * 8));
      RETURN_IF_ERROR(backend_->CopyBlocks(reinterpret_cast<uint8_t* const*>(base),
                                           reinterpret_cast<const uint8_t* const*>(base + m),
                                           reinterpret_cast<const int64_t*>(base + 2 * m), m));
    }
    if (write) {
      src += fill;
    } else {
      RETURN_IF_ERROR(backend_->Download(staging_, 0, fill, dst));
      dst += fill;
    }
    blocks.clear();
    at.clear();
    lens.clear();
    return absl::OkStatus();
  };
  int64_t fill = 0;
  for (const BlockRange& r : ranges) {
    for (int64_t done = 0; done < r.bytes;) {
      const int64_t take = std::min(r.bytes - done, staging_.bytes() - fill);
      blocks.push_back(reinterpret_cast<uintptr_t>(r.block.data + r.offset + done));
      at.push_back(reinterpret_cast<uintptr_t>(staging + fill));
      lens.push_back(static_cast<uint64_t>(take));
      fill += take;
      done += take;
      if (fill == staging_.bytes()) {
        RETURN_IF_ERROR(flush(fill));
        fill = 0;
      }
    }
  }
  return flush(fill);
}

absl::StatusOr<uint64_t*> KvPool::UploadTablesLocked(std::span<const uint64_t> args,
                                                     int64_t bytes) {
  if (tables_.bytes() < bytes) {
    ASSIGN_OR_RETURN(tables_, backend_->Allocate(std::max(bytes, 2 * tables_.bytes())));
  }
  RETURN_IF_ERROR(
      backend_->Upload(args.data(), static_cast<int64_t>(args.size() * sizeof(uint64_t)), tables_));
  return tables_.as<uint64_t>();
}

absl::Status KvPool::DigestBlocks(std::span<const BlockRange> blocks, uint64_t* out) {
  if (blocks.empty()) return absl::OkStatus();
  if (host_memory_) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      out[i] = Digest(blocks[i].block.data + blocks[i].offset, blocks[i].bytes);
    }
    return absl::OkStatus();
  }
  // tables_: the block addresses [n], their lengths [n], the digests [n].
  const auto n = static_cast<int64_t>(blocks.size());
  std::vector<uint64_t> args(static_cast<size_t>(2 * n));
  for (int64_t i = 0; i < n; ++i) {
    args[i] = reinterpret_cast<uintptr_t>(blocks[i].block.data + blocks[i].offset);
    args[n + i] = static_cast<uint64_t>(blocks[i].bytes);
  }
  std::lock_guard<std::mutex> l(tables_mu_);
  ASSIGN_OR_RETURN(uint64_t * base, UploadTablesLocked(args, 3 * n * 8));
  RETURN_IF_ERROR(backend_->DigestBlocks(reinterpret_cast<const uint8_t* const*>(base),
                                         reinterpret_cast<const int64_t*>(base + n), n,
                                         base + 2 * n));
  return backend_->Download(tables_, 2 * n * 8, n * 8, out);
}

absl::Status KvPool::BlocksEqual(std::span<const BlockPair> pairs, bool* equal) {
  if (pairs.empty()) return absl::OkStatus();
  if (host_memory_) {
    for (size_t i = 0; i < pairs.size(); ++i) {
      equal[i] =
          std::memcmp(pairs[i].a.data, pairs[i].b.data, static_cast<size_t>(pairs[i].bytes)) == 0;
    }
    return absl::OkStatus();
  }
  // tables_: a's addresses [n], b's [n], the lengths [n], the answers (int32) [n].
  const auto n = static_cast<int64_t>(pairs.size());
  std::vector<uint64_t> args(static_cast<size_t>(3 * n));
  for (int64_t i = 0; i < n; ++i) {
    args[i] = reinterpret_cast<uintptr_t>(pairs[i].a.data);
    args[n + i] = reinterpret_cast<uintptr_t>(pairs[i].b.data);
    args[2 * n + i] = static_cast<uint64_t>(pairs[i].bytes);
  }
  std::vector<int32_t> got(static_cast<size_t>(n));
  {
    std::lock_guard<std::mutex> l(tables_mu_);
    ASSIGN_OR_RETURN(uint64_t * base, UploadTablesLocked(args, 3 * n * 8 + n * 4));
    RETURN_IF_ERROR(backend_->BlocksEqual(reinterpret_cast<const uint8_t* const*>(base),
                                          reinterpret_cast<const uint8_t* const*>(base + n),
                                          reinterpret_cast<const int64_t*>(base + 2 * n), n,
                                          reinterpret_cast<int32_t*>(base + 3 * n)));
    RETURN_IF_ERROR(backend_->Download(tables_, 3 * n * 8, n * 4, got.data()));
  }
  for (int64_t i = 0; i < n; ++i) equal[i] = got[i] != 0;
  return absl::OkStatus();
}

absl::Status KvPool::CopyBlock(const Block& dst, const Block& src, int64_t bytes) {
  if (host_memory_) {
    std::memcpy(dst.data, src.data, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  return backend_->Copy(dst.data, src.data, bytes);
}

absl::StatusOr<kernels::Buffer> KvPool::Staged(const void* host, int64_t bytes) {
  ASSIGN_OR_RETURN(kernels::Buffer buf, backend_->Allocate(bytes));
  RETURN_IF_ERROR(backend_->Upload(host, bytes, buf));
  return buf;
}

absl::StatusOr<const void*> KvPool::Zeros(int64_t bytes) {
  std::lock_guard<std::mutex> l(mu_);
  if (zeros_.bytes() < bytes) {
    const std::vector<uint8_t> zero(static_cast<size_t>(bytes), 0);
    ASSIGN_OR_RETURN(zeros_, Staged(zero.data(), bytes));
  }
  return static_cast<const void*>(zeros_.data());
}

KvPool::~KvPool() {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& [id, rec] : slabs_) {
    for (auto& [lid, fn] : listeners_) fn(SlabOf(id, rec), false);
  }
}

KvPool::Slab KvPool::SlabOf(int64_t id, const SlabRec& r) const {
  return {id, static_cast<uint8_t*>(const_cast<void*>(r.buffer.data())), r.buffer.bytes(),
          r.slot_bytes, r.buffer.kind()};
}

absl::Status KvPool::NewSlabLocked(int64_t slot_bytes) {
  int64_t n = std::max<int64_t>(1, slab_bytes_ / slot_bytes);
  // With a capacity a slab is at most 1/kSlabsPerCapacity of it (at least one slot): the slabs'
  // partly filled tails, one per block size, stay small against the capacity.
  if (capacity_ > 0) {
    n = std::min(n, std::max<int64_t>(1, capacity_ / kSlabsPerCapacity / slot_bytes));
  }
  n = std::min<int64_t>(n, std::numeric_limits<int32_t>::max() - slots_.size());
  if (n <= 0) return absl::ResourceExhaustedError("kv pool: out of block ids");
  if (capacity_ > 0 && stats_.slab_bytes + n * slot_bytes > capacity_) {
    TrimLocked(slot_bytes);  // slots of other sizes, wholly free, make room
  }
  absl::StatusOr<kernels::Buffer> buf = backend_->Allocate(n * slot_bytes);
  if (!buf.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv pool: slab of ", n * slot_bytes, " bytes: ", buf.status().message()));
  }
  const int64_t sid = next_slab_id_++;
  SlabRec& rec = slabs_[sid];
  rec.buffer = std::move(*buf);
  rec.slot_bytes = slot_bytes;
  rec.first_id = static_cast<int32_t>(slots_.size());
  rec.slots = static_cast<int32_t>(n);
  std::vector<int32_t>& fl = free_ids_[slot_bytes];
  uint8_t* base = rec.buffer.as<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    Slot& s = slots_.emplace_back();
    s.mem = base + i * slot_bytes;
    s.bytes = slot_bytes;
    s.slab = sid;
  }
  for (int64_t i = n - 1; i >= 0; --i) fl.push_back(rec.first_id + static_cast<int32_t>(i));
  stats_.slab_bytes += rec.buffer.bytes();
  ++stats_.slabs;
  stats_.free_slots += n;
  for (auto& [lid, fn] : listeners_) fn(SlabOf(sid, rec), true);
  return absl::OkStatus();
}

int64_t KvPool::TrimLocked(int64_t except_slot_bytes) {
  int64_t freed = 0;
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    SlabRec& rec = it->second;
    if (rec.in_use > 0 || rec.slot_bytes == except_slot_bytes) {
      ++it;
      continue;
    }
    for (auto& [lid, fn] : listeners_) fn(SlabOf(it->first, rec), false);
    std::vector<int32_t>& fl = free_ids_[rec.slot_bytes];
    const int32_t lo = rec.first_id, hi = rec.first_id + rec.slots;
    std::erase_if(fl, [&](int32_t id) { return id >= lo && id < hi; });
    for (int32_t id = lo; id < hi; ++id) slots_[id].mem = nullptr;
    freed += rec.buffer.bytes();
    stats_.slab_bytes -= rec.buffer.bytes();
    --stats_.slabs;
    stats_.free_slots -= rec.slots;
    it = slabs_.erase(it);  // the Buffer goes back to the backend
  }
  return freed;
}

int64_t KvPool::Trim() {
  std::lock_guard<std::mutex> l(mu_);
  return TrimLocked(-1);
}

void KvPool::ForEachSlab(const std::function<void(const Slab&)>& fn) const {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& [id, rec] : slabs_) fn(SlabOf(id, rec));
}

int KvPool::AddSlabListener(SlabListener fn) {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& [id, rec] : slabs_) fn(SlabOf(id, rec), true);
  const int lid = next_listener_++;
  listeners_.emplace(lid, std::move(fn));
  return lid;
}

void KvPool::RemoveSlabListener(int id) {
  std::lock_guard<std::mutex> l(mu_);
  listeners_.erase(id);
}

KvPool::Slab KvPool::FindSlab(const void* p, int64_t bytes) const {
  std::lock_guard<std::mutex> l(mu_);
  // Addresses compared as integers: `p` may be any memory, not only the pool's.
  const auto q = reinterpret_cast<uintptr_t>(p);
  for (const auto& [id, rec] : slabs_) {
    const auto b = reinterpret_cast<uintptr_t>(rec.buffer.data());
    if (q >= b && q + static_cast<uint64_t>(bytes) <= b + static_cast<uint64_t>(rec.buffer.bytes()))
      return SlabOf(id, rec);
  }
  return {};
}

absl::Status KvPool::Allocate(int64_t bytes, Block* out) {
  std::lock_guard<std::mutex> l(mu_);
  if (bytes <= 0) return absl::InvalidArgumentError("kv pool: block of <= 0 bytes");
  if (capacity_ > 0) {
    while (stats_.used_bytes + stats_.cached_bytes + bytes > capacity_) {
      if (!EvictOneLocked()) {
        ++stats_.alloc_failures;
        return absl::ResourceExhaustedError(
            absl::StrCat("kv pool: full (", stats_.used_bytes, " of ", capacity_,
                         " bytes in use, block of ", bytes, " bytes)"));
      }
    }
  }
  auto fl = free_ids_.find(bytes);
  if (fl == free_ids_.end() || fl->second.empty()) {
    if (absl::Status st = NewSlabLocked(bytes); !st.ok()) {
      ++stats_.alloc_failures;
      return st;
    }
    fl = free_ids_.find(bytes);
  }
  const int32_t id = fl->second.back();
  fl->second.pop_back();
  Slot& s = slots_[id];
  s.refs = 1;
  s.in_use = true;
  s.sealed = false;
  s.cached = false;
  ++slabs_[s.slab].in_use;
  --stats_.free_slots;
  stats_.used_bytes += bytes;
  ++stats_.used_blocks;
  *out = {id, s.mem};
  return absl::OkStatus();
}

void KvPool::Ref(int32_t id) {
  std::lock_guard<std::mutex> l(mu_);
  RefLocked(id);
}

void KvPool::RefLocked(int32_t id) {
  Slot& s = slots_[id];
  if (s.cached) {  // a cached block comes back into use
    lru_.erase(s.lru);
    s.cached = false;
    stats_.cached_bytes -= s.bytes;
    --stats_.cached_blocks;
    stats_.used_bytes += s.bytes;
    ++stats_.used_blocks;
  }
  ++s.refs;
}

void KvPool::Unref(int32_t id) {
  std::lock_guard<std::mutex> l(mu_);
  UnrefLocked(id);
}

void KvPool::UnrefLocked(int32_t id) {
  Slot& s = slots_[id];
  if (s.refs <= 0) {  // a bookkeeping bug: continuing would free memory still in use
    std::fprintf(stderr, "kv pool: unref of free block %d\n", id);
    std::abort();
  }
  if (--s.refs > 0) return;
  stats_.used_bytes -= s.bytes;
  --stats_.used_blocks;
  if (s.sealed) {  // keep the content for a later sequence with the same prefix
    s.cached = true;
    s.lru = lru_.insert(lru_.end(), id);
    stats_.cached_bytes += s.bytes;
    ++stats_.cached_blocks;
    TrimCacheLocked();
    return;
  }
  FreeLocked(id);
}

void KvPool::TrimCacheLocked() {
  if (capacity_ > 0) {
    while (stats_.used_bytes + stats_.cached_bytes > capacity_ && EvictOneLocked()) {
    }
  } else {
    while (stats_.cached_bytes > kUnboundedCacheBytes && EvictOneLocked()) {
    }
  }
}

void KvPool::FreeLocked(int32_t id) {
  Slot& s = slots_[id];  // the slot goes back to its size's free list; the slab stays
  s.in_use = false;
  s.refs = 0;
  --slabs_[s.slab].in_use;
  ++stats_.free_slots;
  free_ids_[s.bytes].push_back(id);
}

bool KvPool::EvictOneLocked() {
  if (lru_.empty()) return false;
  const int32_t id = lru_.front();
  lru_.pop_front();
  Slot& s = slots_[id];
  s.cached = false;
  auto it = by_hash_.find(s.hash);
  if (it != by_hash_.end() && it->second == id) by_hash_.erase(it);
  s.sealed = false;
  stats_.cached_bytes -= s.bytes;
  --stats_.cached_blocks;
  ++stats_.evictions;
  FreeLocked(id);
  return true;
}

int KvPool::refs(int32_t id) const {
  std::lock_guard<std::mutex> l(mu_);
  return slots_[id].refs;
}

bool KvPool::sealed(int32_t id) const {
  std::lock_guard<std::mutex> l(mu_);
  return slots_[id].sealed;
}

std::vector<int32_t> KvPool::RefRegistered(std::span<const uint64_t> hashes,
                                           std::span<const int32_t> mine) {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<int32_t> ids(hashes.size(), -1);
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto it = by_hash_.find(hashes[i]);
    if (it == by_hash_.end() || it->second == mine[i]) continue;
    if (slots_[it->second].bytes != slots_[mine[i]].bytes) continue;  // cannot be equal
    ids[i] = it->second;
    RefLocked(it->second);
  }
  return ids;
}

KvPool::Block KvPool::BlockOf(int32_t id) const {
  std::lock_guard<std::mutex> l(mu_);
  return Block{id, slots_[id].mem};
}

KvPool::Block KvPool::Seal(Block b, uint64_t hash, Known known) {
  std::lock_guard<std::mutex> l(mu_);
  Slot& mine = slots_[b.id];
  auto it = by_hash_.find(hash);
  if (it != by_hash_.end() && it->second != b.id) {
    Slot& other = slots_[it->second];
    // Equal bytes: as the caller compared them (SealPending, on the backend: a device pool's
    // only way), or in place on a host pool. Else (a hash collision, or not compared) ours
    // stays unshared.
    const bool equal = other.bytes == mine.bytes &&
                       (known.id == it->second
                            ? known.equal
                            : host_memory_ && std::memcmp(other.mem, mine.mem,
                                                          static_cast<size_t>(mine.bytes)) == 0);
    if (equal) {
      const Block shared{it->second, other.mem};
      ++stats_.shared_hits;
      RefLocked(shared.id);
      UnrefLocked(b.id);
      return shared;
    }
    return b;  // a hash collision with different bytes (or not compared): ours stays unshared
  }
  mine.sealed = true;
  mine.hash = hash;
  by_hash_[hash] = b.id;
  return b;
}

absl::Status KvPool::MakeWritable(Block& b, int64_t bytes,
                                  const std::function<absl::Status(const Block&)>& init,
                                  bool* replaced) {
  if (replaced != nullptr) *replaced = false;
  if (b.id >= 0 && TryExclusive(b.id)) return absl::OkStatus();
  Block nb;
  RETURN_IF_ERROR(Allocate(bytes, &nb));
  absl::Status s = b.id >= 0 ? CopyBlock(nb, b, bytes) : init ? init(nb) : absl::OkStatus();
  if (!s.ok()) {
    Unref(nb.id);
    return s;
  }
  if (b.id >= 0) Unref(b.id);
  b = nb;
  if (replaced != nullptr) *replaced = true;
  return absl::OkStatus();
}

bool KvPool::TryExclusive(int32_t id) {
  std::lock_guard<std::mutex> l(mu_);
  Slot& s = slots_[id];
  if (s.refs > 1) return false;
  if (!s.sealed) return true;
  auto it = by_hash_.find(s.hash);
  if (it != by_hash_.end() && it->second == id) by_hash_.erase(it);
  s.sealed = false;
  return true;
}

void KvPool::SetCapacity(int64_t bytes) {
  std::lock_guard<std::mutex> l(mu_);
  capacity_ = std::max<int64_t>(0, bytes);
  TrimCacheLocked();
}

int64_t KvPool::capacity_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return capacity_;
}

int64_t KvPool::available_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  if (capacity_ == 0) return std::numeric_limits<int64_t>::max();
  return std::max<int64_t>(0, capacity_ - stats_.used_bytes);
}

KvPool::Stats KvPool::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  Stats s = stats_;
  s.capacity_bytes = capacity_;
  return s;
}

// ---------------------------------------------------------------- KvRows

kernels::RowCodec KvRowCodec(KvRowFormat format) {
  switch (format) {
    case KvRowFormat::kPackedKv:
      return kernels::RowCodec::kKvEntry;
    case KvRowFormat::kPackedKey:
      return kernels::RowCodec::kIndexKey;
    case KvRowFormat::kF32:
      break;
  }
  return kernels::RowCodec::kF32;
}

int64_t KvRowBytes(KvRowFormat format, int64_t dim) {
  return kernels::RowCodecBytes(KvRowCodec(format), dim);
}

KvRows::KvRows(std::shared_ptr<KvPool> pool, KvRowFormat format, int64_t dim, int ratio,
               uint64_t stream)
    : pool_(std::move(pool)),
      format_(format),
      dim_(dim),
      rows_per_block_(std::max<int64_t>(1, kKvBlockTokens / std::max(1, ratio))),
      row_bytes_(KvRowBytes(format, dim)),
      stream_(stream) {}

KvRows::KvRows(const KvRows& o)
    : pool_(o.pool_),
      format_(o.format_),
      dim_(o.dim_),
      rows_per_block_(o.rows_per_block_),
      row_bytes_(o.row_bytes_),
      stream_(o.stream_),
      rows_(o.rows_),
      blocks_(o.blocks_),
      hashes_(o.hashes_),
      pending_(o.pending_) {
  for (const KvPool::Block& b : blocks_) pool_->Ref(b.id);
}

KvRows& KvRows::operator=(const KvRows& o) {
  if (this == &o) return *this;
  KvRows copy(o);
  *this = std::move(copy);
  return *this;
}

KvRows::KvRows(KvRows&& o) noexcept { *this = std::move(o); }

KvRows& KvRows::operator=(KvRows&& o) noexcept {
  if (this == &o) return *this;
  ReleaseAll();
  pool_ = std::move(o.pool_);
  format_ = o.format_;
  dim_ = o.dim_;
  rows_per_block_ = o.rows_per_block_;
  row_bytes_ = o.row_bytes_;
  stream_ = o.stream_;
  rows_ = std::exchange(o.rows_, 0);
  blocks_ = std::move(o.blocks_);
  hashes_ = std::move(o.hashes_);
  pending_ = std::move(o.pending_);
  pages_ = std::move(o.pages_);
  table_ = std::move(o.table_);
  table_valid_ = std::exchange(o.table_valid_, 0);
  o.blocks_.clear();
  o.hashes_.clear();
  o.pending_.clear();
  o.pages_.clear();
  return *this;
}

KvRows::~KvRows() { ReleaseAll(); }

void KvRows::ReleaseAll() {
  for (const KvPool::Block& b : blocks_) pool_->Unref(b.id);
  blocks_.clear();
  hashes_.clear();
  pending_.clear();
  table_valid_ = 0;
  rows_ = 0;
}

absl::Status KvRows::Writable(size_t b) {
  const int64_t bytes = rows_per_block_ * row_bytes_;
  if (b == blocks_.size()) {
    if (pool_ == nullptr) return absl::FailedPreconditionError("kv rows: no pool");
    KvPool::Block nb;
    RETURN_IF_ERROR(pool_->MakeWritable(nb, bytes, nullptr));
    blocks_.push_back(nb);
    hashes_.push_back(0);
    return absl::OkStatus();
  }
  bool replaced = false;  // shared: copied on write
  RETURN_IF_ERROR(pool_->MakeWritable(blocks_[b], bytes, nullptr, &replaced));
  if (replaced) Invalidate(b);
  hashes_[b] = 0;
  return absl::OkStatus();
}

void KvRows::SealHostBlock(size_t b) {
  const int64_t bytes = rows_per_block_ * row_bytes_;
  hashes_[b] = BlockHash(pool_->seed(), stream_, PrevHash(b), Digest(blocks_[b].data, bytes));
  const KvPool::Block sealed = pool_->Seal(blocks_[b], hashes_[b]);
  if (sealed.id != blocks_[b].id) {
    blocks_[b] = sealed;
    Invalidate(b);
  }
}

absl::Status SealPending(std::span<KvRows* const> streams) {
  std::vector<KvPool::BlockRange> pending;
  KvPool* pool = nullptr;
  for (KvRows* s : streams) {
    if (s == nullptr || s->pending_.empty()) continue;
    if (pool != nullptr && s->pool_.get() != pool)
      return absl::InvalidArgumentError("kv rows: SealPending over streams of two pools");
    pool = s->pool_.get();
    for (size_t b : s->pending_) {
      pending.push_back({s->blocks_[b], s->rows_per_block_ * s->row_bytes_});
    }
  }
  if (pending.empty()) return absl::OkStatus();
  // 1. The pending blocks' digests (computed where the blocks are; one Download), and their
  // hashes in each stream's order (a block's hash chains its predecessor's, sealed before or
  // pending ahead of it).
  std::vector<uint64_t> digests(pending.size());
  RETURN_IF_ERROR(pool->DigestBlocks(pending, digests.data()));
  std::vector<uint64_t> hashes;
  std::vector<int32_t> ids;
  size_t i = 0;
  for (KvRows* s : streams) {
    if (s == nullptr) continue;
    for (size_t b : s->pending_) {
      s->hashes_[b] = BlockHash(s->pool_->seed(), s->stream_, s->PrevHash(b), digests[i]);
      hashes.push_back(s->hashes_[b]);
      ids.push_back(s->blocks_[b].id);
      ++i;
    }
  }
  // 2. What each block will be compared with at its seal: the block already registered under
  // its hash (a shared prefix; held until the seals are done), or else an earlier block of this
  // call with the same hash and size, which its own seal registers first (several streams of one
  // call under the same stream id). All compared on the backend in one BlocksEqual.
  const std::vector<int32_t> found = pool->RefRegistered(hashes, ids);
  std::vector<KvPool::Known> known(pending.size());
  std::vector<KvPool::BlockPair> pairs;
  std::vector<size_t> pair_of;
  absl::flat_hash_map<uint64_t, size_t> first_with;  // hash -> the first pending block with it
  for (size_t k = 0; k < pending.size(); ++k) {
    auto [it, inserted] = first_with.try_emplace(hashes[k], k);
    KvPool::Block theirs;
    if (found[k] >= 0) {
      theirs = pool->BlockOf(found[k]);
    } else if (!inserted && found[it->second] < 0 &&
               pending[it->second].bytes == pending[k].bytes) {
      theirs = pending[it->second].block;
    } else {
      continue;
    }
    known[k].id = theirs.id;
    pairs.push_back({pending[k].block, theirs, pending[k].bytes});
    pair_of.push_back(k);
  }
  absl::Status st = absl::OkStatus();
  if (!pairs.empty()) {
    auto equal = std::make_unique<bool[]>(pairs.size());
    st = pool->BlocksEqual(pairs, equal.get());
    for (size_t p = 0; st.ok() && p < pairs.size(); ++p) known[pair_of[p]].equal = equal[p];
  }
  // 3. Each block sealed (or swapped for the identical registered one). After a failed
  // comparison none is shared: a block whose hash another holds stays unsealed (Seal), the
  // others are registered; the failure (a device error) is the caller's.
  i = 0;
  for (KvRows* s : streams) {
    if (s == nullptr) continue;
    for (size_t b : s->pending_) {
      KvPool::Known k = known[i];
      if (!st.ok()) k = KvPool::Known{};
      const KvPool::Block sealed = pool->Seal(s->blocks_[b], s->hashes_[b], k);
      if (sealed.id != s->blocks_[b].id) {
        s->blocks_[b] = sealed;
        s->Invalidate(b);
      }
      ++i;
    }
    s->pending_.clear();
  }
  for (int32_t id : found) {
    if (id >= 0) pool->Unref(id);
  }
  return st;
}

absl::StatusOr<uint8_t* const*> KvRows::Pages() const {
  if (pages_.size() != blocks_.size()) pages_.resize(blocks_.size());
  for (size_t b = table_valid_; b < blocks_.size(); ++b) pages_[b] = blocks_[b].data;
  if (pool_->host_memory()) {
    table_valid_ = blocks_.size();
    return pages_.data();
  }
  kernels::Backend& be = pool_->backend();
  const auto need = static_cast<int64_t>(std::max<size_t>(1, blocks_.size()) * sizeof(uint8_t*));
  if (table_.bytes() < need) {  // grows by doubling; the new table is uploaded whole
    ASSIGN_OR_RETURN(table_, be.Allocate(std::max(need, 2 * table_.bytes())));
    table_valid_ = 0;  // pages_ is whole (above): all of it goes up
  }
  if (table_valid_ < blocks_.size()) {
    const auto from = static_cast<int64_t>(table_valid_ * sizeof(uint8_t*));
    RETURN_IF_ERROR(be.Upload(
        pages_.data() + table_valid_,
        static_cast<int64_t>((blocks_.size() - table_valid_) * sizeof(uint8_t*)), table_, from));
    table_valid_ = blocks_.size();
  }
  return static_cast<uint8_t* const*>(table_.data());
}

absl::Status KvRows::Reserve(int64_t n) {
  if (n <= 0) return absl::OkStatus();
  const int64_t start = rows_;
  // Every block the rows touch, allocated or made exclusive: a failure reserves nothing.
  const auto first_block = static_cast<size_t>(rows_ / rows_per_block_);
  const auto last_block = static_cast<size_t>((rows_ + n - 1) / rows_per_block_);
  for (size_t b = first_block; b <= last_block; ++b) {
    if (absl::Status s = Writable(b); !s.ok()) {
      Truncate(start);
      return s;
    }
  }
  return absl::OkStatus();
}

void KvRows::Commit(int64_t n) {
  if (n <= 0) return;
  const auto first_block = static_cast<size_t>(rows_ / rows_per_block_);
  const auto last_block = static_cast<size_t>((rows_ + n - 1) / rows_per_block_);
  rows_ += n;
  for (size_t b = first_block; b <= last_block; ++b) {
    if (static_cast<int64_t>(b + 1) * rows_per_block_ > rows_) break;
    if (!pool_->host_memory()) {  // sealed by SealPending, with the call's other blocks
      pending_.push_back(b);
      continue;
    }
    SealHostBlock(b);
  }
}

absl::Status KvRows::AppendFrom(const float* x, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  RETURN_IF_ERROR(Reserve(n));
  absl::StatusOr<uint8_t* const*> pages = Pages();
  absl::Status st = pages.status();
  if (st.ok()) {
    st = pool_->backend().PackRows(KvRowCodec(format_), x, n, dim_, *pages, rows_per_block_,
                                   nullptr, rows_);
  }
  if (!st.ok()) {
    Truncate(rows_);
    return st;
  }
  Commit(n);
  return absl::OkStatus();
}

absl::Status KvRows::Append(const float* x, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  if (pool_ != nullptr && !pool_->host_memory()) {  // staged into the backend's memory
    ASSIGN_OR_RETURN(kernels::Buffer buf, pool_->Staged(x, n * dim_ * 4));
    RETURN_IF_ERROR(AppendFrom(buf.as<float>(), n));
    KvRows* self[] = {this};
    return SealPending(self);  // a host surface's call: its blocks sealed when it returns
  }
  return AppendFrom(x, n);
}

absl::Status KvRows::AppendPacked(const uint8_t* bytes, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  const int64_t start = rows_;
  RETURN_IF_ERROR(Reserve(n));  // every block the rows touch, writable (nothing on a failure)
  // The rows' pieces of each block, written in one KvPool::WriteBlocks (on a device pool one
  // Upload and one CopyBlocks per staging fill).
  std::vector<KvPool::BlockRange> writes;
  for (int64_t r = rows_; r < rows_ + n;) {
    const int64_t slot = r % rows_per_block_;
    const int64_t take = std::min(rows_ + n - r, rows_per_block_ - slot);
    writes.push_back(
        {blocks_[static_cast<size_t>(r / rows_per_block_)], take * row_bytes_, slot * row_bytes_});
    r += take;
  }
  if (absl::Status s = pool_->WriteBlocks(writes, bytes); !s.ok()) {
    Truncate(start);
    return s;
  }
  Commit(n);  // a host pool's full blocks sealed here; a device pool's below
  if (!pool_->host_memory() && !pending_.empty()) {
    // Digested and compared on the backend: nothing of the blocks comes down, and a block equal
    // to a registered one (a prefix read back from the store) is compared there too.
    KvRows* self[] = {this};
    if (absl::Status s = SealPending(self); !s.ok()) {
      Truncate(start);
      return s;
    }
  }
  return absl::OkStatus();
}

void KvRows::Truncate(int64_t n) {
  n = std::clamp<int64_t>(n, 0, rows_);
  const size_t keep = static_cast<size_t>((n + rows_per_block_ - 1) / rows_per_block_);
  while (blocks_.size() > keep) {
    pool_->Unref(blocks_.back().id);
    blocks_.pop_back();
    hashes_.pop_back();
  }
  // A pending block no longer full (or gone) is not sealed.
  const auto full = static_cast<size_t>(n / rows_per_block_);
  std::erase_if(pending_, [&](size_t b) { return b >= full; });
  Invalidate(blocks_.size());
  rows_ = n;
}

absl::Status KvRows::UnpackTo(int64_t first, int64_t n, float* out) const {
  if (n <= 0) return absl::OkStatus();
  // Rows inside the blocks held (a block's rows past rows() are its unwritten tail).
  const int64_t held = static_cast<int64_t>(blocks_.size()) * rows_per_block_;
  if (first < 0 || first + n > held) {
    return absl::OutOfRangeError(
        absl::StrCat("kv rows: rows ", first, "..", first + n, " of ", held, " in the blocks"));
  }
  ASSIGN_OR_RETURN(uint8_t* const* pages, Pages());
  return pool_->backend().UnpackRows(KvRowCodec(format_), pages, rows_per_block_, dim_, nullptr,
                                     first, n, out);
}

absl::Status KvRows::GatherTo(const int32_t* idx, int64_t n, float* out, int64_t offset) const {
  if (n <= 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(uint8_t* const* pages, Pages());
  return pool_->backend().UnpackRows(KvRowCodec(format_), pages, rows_per_block_, dim_, idx, offset,
                                     n, out);
}

void KvRows::Unpack(int64_t first, int64_t n, float* out) const {
  if (n <= 0) return;
  if (pool_->host_memory()) return AbortUnlessOk(UnpackTo(first, n, out), "unpack");
  kernels::Backend& be = pool_->backend();
  absl::StatusOr<kernels::Buffer> buf = be.Allocate(n * dim_ * 4);
  AbortUnlessOk(buf.status(), "unpack");
  AbortUnlessOk(UnpackTo(first, n, buf->as<float>()), "unpack");
  AbortUnlessOk(be.Download(*buf, 0, n * dim_ * 4, out), "unpack");
}

void KvRows::Gather(const int32_t* idx, int64_t n, float* out) const {
  if (n <= 0) return;
  if (pool_->host_memory()) return AbortUnlessOk(GatherTo(idx, n, out), "gather");
  kernels::Backend& be = pool_->backend();
  absl::StatusOr<kernels::Buffer> ids = pool_->Staged(idx, n * 4);
  absl::StatusOr<kernels::Buffer> buf = be.Allocate(n * dim_ * 4);
  AbortUnlessOk(ids.status(), "gather");
  AbortUnlessOk(buf.status(), "gather");
  AbortUnlessOk(GatherTo(ids->as<int32_t>(), n, buf->as<float>()), "gather");
  AbortUnlessOk(be.Download(*buf, 0, n * dim_ * 4, out), "gather");
}

absl::Status KvRows::CopyPacked(int64_t first, int64_t n, std::vector<uint8_t>& out,
                                KvRowFormat packed_format) const {
  if (n <= 0) return absl::OkStatus();
  if (format_ != KvRowFormat::kF32) {  // the blocks' bytes as they are, in one read
    std::vector<KvPool::BlockRange> reads;
    for (int64_t r = first; r < first + n;) {
      const int64_t slot = r % rows_per_block_;
      const int64_t take = std::min(first + n - r, rows_per_block_ - slot);
      reads.push_back({blocks_[static_cast<size_t>(r / rows_per_block_)], take * row_bytes_,
                       slot * row_bytes_});
      r += take;
    }
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(n * row_bytes_));
    return pool_->ReadBlocks(reads, out.data() + at);
  }
  const int64_t pb = KvRowBytes(packed_format, dim_);
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(n * pb));
  std::vector<float> rows(static_cast<size_t>(n * dim_));
  Unpack(first, n, rows.data());
  for (int64_t r = 0; r < n; ++r) {
    kf::PackRow(KvRowCodec(packed_format), rows.data() + r * dim_, dim_, out.data() + at + r * pb);
  }
  return absl::OkStatus();
}

void KvRows::resize(size_t floats) {
  const int64_t n = dim_ > 0 ? static_cast<int64_t>(floats) / dim_ : 0;
  if (n <= rows_) {
    Truncate(n);
    return;
  }
  std::vector<float> zeros((n - rows_) * dim_, 0.f);
  if (absl::Status s = Append(zeros.data(), n - rows_); !s.ok()) {
    std::fprintf(stderr, "kv rows: resize: %s\n", std::string(s.message()).c_str());
    std::abort();
  }
}

std::vector<float> KvRows::ToVector() const {
  std::vector<float> v(size());
  if (rows_ > 0) Unpack(0, rows_, v.data());
  return v;
}

KvRows::operator std::span<const float>() const {
  view_ = ToVector();
  return view_;
}

// ---------------------------------------------------------------- SwaRing

SwaRing::SwaRing(std::shared_ptr<KvPool> pool, int64_t window, int64_t dim)
    : pool_(std::move(pool)),
      window_(window),
      dim_(dim),
      slot_bytes_(kf::PackedSwaSlotBytes(dim)) {}

SwaRing::SwaRing(const SwaRing& o)
    : pool_(o.pool_),
      window_(o.window_),
      dim_(o.dim_),
      slot_bytes_(o.slot_bytes_),
      block_(o.block_) {
  if (allocated()) pool_->Ref(block_.id);
}

SwaRing& SwaRing::operator=(const SwaRing& o) {
  if (this == &o) return *this;
  SwaRing copy(o);
  *this = std::move(copy);
  return *this;
}

SwaRing::SwaRing(SwaRing&& o) noexcept { *this = std::move(o); }

SwaRing& SwaRing::operator=(SwaRing&& o) noexcept {
  if (this == &o) return *this;
  Release();
  pool_ = std::move(o.pool_);
  window_ = o.window_;
  dim_ = o.dim_;
  slot_bytes_ = o.slot_bytes_;
  block_ = std::exchange(o.block_, KvPool::Block{});
  table_ = std::move(o.table_);
  table_ok_ = std::exchange(o.table_ok_, false);
  return *this;
}

SwaRing::~SwaRing() { Release(); }

void SwaRing::Release() {
  if (allocated()) pool_->Unref(block_.id);
  block_ = KvPool::Block{};
  table_ok_ = false;
}

void SwaRing::FillZero(uint8_t* slots, int64_t n) const {
  // PackSwaSlot of a zero row: E4M3 zeros and each 32-block's scale code for an all-zero block
  // (the same for every block), so a ring never written serializes as the float ring did.
  static const uint8_t zero_scale = [] {
    float z[32] = {};
    uint8_t b[33];
    kf::PackSwaSlot(z, 32, b);
    return b[32];
  }();
  for (int64_t s = 0; s < n; ++s) {
    uint8_t* p = slots + s * slot_bytes_;
    std::memset(p, 0, static_cast<size_t>(dim_));
    std::memset(p + dim_, zero_scale, static_cast<size_t>(slot_bytes_ - dim_));
  }
}

absl::Status SwaRing::Writable() {
  if (pool_ == nullptr) return absl::FailedPreconditionError("swa ring: no pool");
  // The first write allocates the block with packed zero slots; a shared one is copied.
  bool replaced = false;
  RETURN_IF_ERROR(pool_->MakeWritable(
      block_, ring_bytes(),
      [&](const KvPool::Block& nb) {
        std::vector<uint8_t> zero(static_cast<size_t>(ring_bytes()));
        FillZero(zero.data(), window_);
        return pool_->Write(nb, 0, zero.data(), ring_bytes());
      },
      &replaced));
  if (replaced) table_ok_ = false;
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> SwaRing::WritableBlock() {
  RETURN_IF_ERROR(Writable());
  return block_.data;
}

absl::StatusOr<uint8_t* const*> SwaRing::Page() const {
  page_ = block_.data;
  if (pool_->host_memory()) return &page_;
  if (!table_ok_) {
    kernels::Backend& be = pool_->backend();
    if (table_.empty()) {
      ASSIGN_OR_RETURN(table_, be.Allocate(static_cast<int64_t>(sizeof(uint8_t*))));
    }
    RETURN_IF_ERROR(be.Upload(&page_, static_cast<int64_t>(sizeof(uint8_t*)), table_));
    table_ok_ = true;
  }
  return static_cast<uint8_t* const*>(table_.data());
}

absl::Status SwaRing::WriteSlot(int64_t slot, const float* x) {
  RETURN_IF_ERROR(Writable());
  std::vector<uint8_t> packed(static_cast<size_t>(slot_bytes_));
  kf::PackSwaSlot(x, dim_, packed.data());
  return pool_->Write(block_, slot * slot_bytes_, packed.data(), slot_bytes_);
}

absl::Status SwaRing::WritePositions(int64_t first_pos, int64_t n, const float* x) {
  if (n <= 0) return absl::OkStatus();
  if (pool_ == nullptr) return absl::FailedPreconditionError("swa ring: no pool");
  if (pool_->host_memory()) return WritePositionsFrom(first_pos, n, x);
  // Staged into the backend's memory: only the rows that land (the last `window`).
  const int64_t i0 = std::max<int64_t>(0, n - window_);
  ASSIGN_OR_RETURN(kernels::Buffer buf, pool_->Staged(x + i0 * dim_, (n - i0) * dim_ * 4));
  return WritePositionsFrom(first_pos + i0, n - i0, buf.as<float>());
}

absl::Status SwaRing::WritePositionsFrom(int64_t first_pos, int64_t n, const float* x) {
  if (n <= 0) return absl::OkStatus();
  RETURN_IF_ERROR(Writable());
  ASSIGN_OR_RETURN(uint8_t* const* page, Page());
  // The last `window` rows, in at most two runs of consecutive slots (the ring wraps once).
  const int64_t i0 = std::max<int64_t>(0, n - window_);
  const int64_t s0 = (first_pos + i0) % window_;
  const int64_t run = std::min(n - i0, window_ - s0);
  kernels::Backend& be = pool_->backend();
  const kernels::RowCodec codec = kernels::RowCodec::kSwaSlot;
  RETURN_IF_ERROR(be.PackRows(codec, x + i0 * dim_, run, dim_, page, window_, nullptr, s0));
  if (i0 + run < n) {
    RETURN_IF_ERROR(
        be.PackRows(codec, x + (i0 + run) * dim_, n - i0 - run, dim_, page, window_, nullptr, 0));
  }
  return absl::OkStatus();
}

absl::Status SwaRing::WriteSlotPacked(int64_t slot, const uint8_t* bytes) {
  RETURN_IF_ERROR(Writable());
  return pool_->Write(block_, slot * slot_bytes_, bytes, slot_bytes_);
}

absl::Status SwaRing::CopySlotsTo(int64_t slot, int64_t n, uint8_t* dst) const {
  if (!allocated()) return absl::FailedPreconditionError("swa ring: no block to copy slots from");
  if (slot < 0 || slot >= window_ || n < 0 || n > window_)
    return absl::InvalidArgumentError("swa ring: slots outside the window");
  const int64_t run = std::min(n, window_ - slot);
  kernels::Backend& be = pool_->backend();
  if (run > 0) RETURN_IF_ERROR(be.Copy(dst, block_.data + slot * slot_bytes_, run * slot_bytes_));
  if (run < n)
    RETURN_IF_ERROR(be.Copy(dst + run * slot_bytes_, block_.data, (n - run) * slot_bytes_));
  return absl::OkStatus();
}

absl::Status SwaRing::WriteSlotsFrom(int64_t slot, int64_t n, const uint8_t* src) {
  if (slot < 0 || slot >= window_ || n < 0 || n > window_)
    return absl::InvalidArgumentError("swa ring: slots outside the window");
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Writable());
  const int64_t run = std::min(n, window_ - slot);
  kernels::Backend& be = pool_->backend();
  RETURN_IF_ERROR(be.Copy(block_.data + slot * slot_bytes_, src, run * slot_bytes_));
  if (run < n)
    RETURN_IF_ERROR(be.Copy(block_.data, src + run * slot_bytes_, (n - run) * slot_bytes_));
  return absl::OkStatus();
}

absl::Status SwaRing::WritePacked(const uint8_t* bytes) {
  RETURN_IF_ERROR(Writable());
  return pool_->Write(block_, 0, bytes, ring_bytes());
}

void SwaRing::Clear() { Release(); }

void SwaRing::ReadSlot(int64_t slot, float* out) const {
  if (!allocated()) {
    std::fill_n(out, dim_, 0.f);
    return;
  }
  std::vector<uint8_t> packed(static_cast<size_t>(slot_bytes_));
  AbortUnlessOk(pool_->Read(block_, slot * slot_bytes_, slot_bytes_, packed.data()), "read slot");
  kf::UnpackSwaSlot(packed.data(), dim_, out);
}

void SwaRing::ReadWindow(float* out) const {
  if (!allocated()) {
    std::fill_n(out, window_ * dim_, 0.f);
    return;
  }
  const uint8_t* bytes = block_.data;
  std::vector<uint8_t> copy;
  if (!pool_->host_memory()) {
    copy.resize(static_cast<size_t>(ring_bytes()));
    AbortUnlessOk(pool_->Read(block_, 0, ring_bytes(), copy.data()), "read window");
    bytes = copy.data();
  }
  for (int64_t w = 0; w < window_; ++w)
    kf::UnpackSwaSlot(bytes + w * slot_bytes_, dim_, out + w * dim_);
}

absl::Status SwaRing::ReadWindowTo(float* out) const {
  if (!allocated()) {  // never written: zeros
    if (pool_ == nullptr) return absl::FailedPreconditionError("swa ring: no pool");
    ASSIGN_OR_RETURN(const void* zeros, pool_->Zeros(window_ * dim_ * 4));
    return pool_->backend().Copy(out, zeros, window_ * dim_ * 4);
  }
  ASSIGN_OR_RETURN(uint8_t* const* page, Page());
  return pool_->backend().UnpackRows(kernels::RowCodec::kSwaSlot, page, window_, dim_, nullptr, 0,
                                     window_, out);
}

absl::Status SwaRing::CopySlotPacked(int64_t slot, std::vector<uint8_t>& out) const {
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(slot_bytes_));
  if (!allocated()) {
    FillZero(out.data() + at, 1);
    return absl::OkStatus();
  }
  return pool_->Read(block_, slot * slot_bytes_, slot_bytes_, out.data() + at);
}

absl::Status SwaRing::CopyPacked(uint8_t* out) const {
  if (!allocated()) {
    FillZero(out, window_);
    return absl::OkStatus();
  }
  return pool_->Read(block_, 0, ring_bytes(), out);
}

std::vector<float> SwaRing::ToVector() const {
  std::vector<float> v(size());
  if (!v.empty()) ReadWindow(v.data());
  return v;
}

SwaRing::operator std::span<const float>() const {
  view_ = ToVector();
  return view_;
}

}  // namespace epd::model
