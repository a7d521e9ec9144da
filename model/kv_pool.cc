#include "model/kv_pool.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "kernels/format.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;

uint64_t BlockHash(uint64_t seed, uint64_t stream, uint64_t prev, const uint8_t* data,
                   int64_t bytes) {
  return absl::Hash<std::tuple<uint64_t, uint64_t, uint64_t, std::string_view>>{}(std::make_tuple(
      seed, stream, prev, std::string_view(reinterpret_cast<const char*>(data), bytes)));
}

}  // namespace

// ---------------------------------------------------------------- KvPool

KvPool::KvPool(int64_t capacity_bytes, uint64_t seed, kernels::Backend* backend,
               int64_t slab_bytes)
    : seed_(seed),
      backend_(backend),
      slab_bytes_(std::max<int64_t>(1, slab_bytes)),
      capacity_(std::max<int64_t>(0, capacity_bytes)) {
  if (backend_ == nullptr || backend_->memory_kind() != kernels::MemoryKind::kHost) {
    own_backend_ = kernels::MakeCpuBackend();
    backend_ = own_backend_.get();
  }
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

KvPool::Block KvPool::Seal(Block b, uint64_t hash) {
  std::lock_guard<std::mutex> l(mu_);
  Slot& mine = slots_[b.id];
  auto it = by_hash_.find(hash);
  if (it != by_hash_.end() && it->second != b.id) {
    Slot& other = slots_[it->second];
    if (other.bytes == mine.bytes &&
        std::memcmp(other.mem, mine.mem, static_cast<size_t>(mine.bytes)) == 0) {
      const Block shared{it->second, other.mem};
      ++stats_.shared_hits;
      RefLocked(shared.id);
      UnrefLocked(b.id);
      return shared;
    }
    return b;  // a hash collision with different bytes: keep ours unshared
  }
  mine.sealed = true;
  mine.hash = hash;
  by_hash_[hash] = b.id;
  return b;
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

int64_t KvRowBytes(KvRowFormat format, int64_t dim) {
  switch (format) {
    case KvRowFormat::kPackedKv:
      return kf::PackedKvEntryBytes(dim);
    case KvRowFormat::kPackedKey:
      return kf::PackedIndexKeyBytes(dim);
    case KvRowFormat::kF32:
      return dim * 4;
  }
  return dim * 4;
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
      hashes_(o.hashes_) {
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
  o.blocks_.clear();
  o.hashes_.clear();
  return *this;
}

KvRows::~KvRows() { ReleaseAll(); }

void KvRows::ReleaseAll() {
  for (const KvPool::Block& b : blocks_) pool_->Unref(b.id);
  blocks_.clear();
  hashes_.clear();
  rows_ = 0;
}

absl::Status KvRows::Writable(size_t b) {
  if (b == blocks_.size()) {
    if (pool_ == nullptr) return absl::FailedPreconditionError("kv rows: no pool");
    KvPool::Block nb;
    if (absl::Status s = pool_->Allocate(rows_per_block_ * row_bytes_, &nb); !s.ok()) return s;
    blocks_.push_back(nb);
    hashes_.push_back(0);
    return absl::OkStatus();
  }
  KvPool::Block& cur = blocks_[b];
  if (!pool_->TryExclusive(cur.id)) {  // shared: copy on write
    KvPool::Block nb;
    if (absl::Status s = pool_->Allocate(rows_per_block_ * row_bytes_, &nb); !s.ok()) return s;
    std::memcpy(nb.data, cur.data, static_cast<size_t>(rows_per_block_ * row_bytes_));
    pool_->Unref(cur.id);
    cur = nb;
  }
  hashes_[b] = 0;
  return absl::OkStatus();
}

void KvRows::SealBlock(size_t b) {
  hashes_[b] =
      BlockHash(pool_->seed(), stream_, PrevHash(b), blocks_[b].data, rows_per_block_ * row_bytes_);
  blocks_[b] = pool_->Seal(blocks_[b], hashes_[b]);
}

absl::Status KvRows::Append(const float* x, int64_t n) {
  const int64_t start = rows_;
  for (int64_t i = 0; i < n;) {
    const size_t b = static_cast<size_t>(rows_ / rows_per_block_);
    if (absl::Status s = Writable(b); !s.ok()) {
      Truncate(start);
      return s;
    }
    const int64_t slot = rows_ % rows_per_block_;
    const int64_t take = std::min(n - i, rows_per_block_ - slot);
    uint8_t* dst = blocks_[b].data + slot * row_bytes_;
    for (int64_t j = 0; j < take; ++j) {
      const float* row = x + (i + j) * dim_;
      uint8_t* d = dst + j * row_bytes_;
      switch (format_) {
        case KvRowFormat::kPackedKv:
          kf::PackKvEntry(row, dim_, d);
          break;
        case KvRowFormat::kPackedKey:
          kf::PackIndexKey(row, dim_, d);
          break;
        case KvRowFormat::kF32:
          std::memcpy(d, row, static_cast<size_t>(row_bytes_));
          break;
      }
    }
    rows_ += take;
    i += take;
    if (slot + take == rows_per_block_) SealBlock(b);
  }
  return absl::OkStatus();
}

absl::Status KvRows::AppendPacked(const uint8_t* bytes, int64_t n) {
  const int64_t start = rows_;
  for (int64_t i = 0; i < n;) {
    const size_t b = static_cast<size_t>(rows_ / rows_per_block_);
    if (absl::Status s = Writable(b); !s.ok()) {
      Truncate(start);
      return s;
    }
    const int64_t slot = rows_ % rows_per_block_;
    const int64_t take = std::min(n - i, rows_per_block_ - slot);
    std::memcpy(blocks_[b].data + slot * row_bytes_, bytes + i * row_bytes_,
                static_cast<size_t>(take * row_bytes_));
    rows_ += take;
    i += take;
    if (slot + take == rows_per_block_) SealBlock(b);
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
  rows_ = n;
}

void KvRows::Unpack(int64_t first, int64_t n, float* out) const {
  for (int64_t r = first; r < first + n;) {
    const int64_t slot = r % rows_per_block_;
    const int64_t take = std::min(first + n - r, rows_per_block_ - slot);
    const uint8_t* src = blocks_[r / rows_per_block_].data + slot * row_bytes_;
    float* o = out + (r - first) * dim_;
    switch (format_) {
      case KvRowFormat::kPackedKv:
        for (int64_t j = 0; j < take; ++j)
          kf::UnpackKvEntry(src + j * row_bytes_, dim_, o + j * dim_);
        break;
      case KvRowFormat::kPackedKey:
        for (int64_t j = 0; j < take; ++j)
          kf::UnpackIndexKey(src + j * row_bytes_, dim_, o + j * dim_);
        break;
      case KvRowFormat::kF32:
        std::memcpy(o, src, static_cast<size_t>(take * row_bytes_));
        break;
    }
    r += take;
  }
}

void KvRows::Gather(const int32_t* idx, int64_t n, float* out) const {
  for (int64_t i = 0; i < n; ++i) Unpack(idx[i], 1, out + i * dim_);
}

void KvRows::CopyPacked(int64_t first, int64_t n, std::vector<uint8_t>& out,
                        KvRowFormat packed_format) const {
  if (format_ != KvRowFormat::kF32) {
    for (int64_t r = first; r < first + n;) {
      const int64_t slot = r % rows_per_block_;
      const int64_t take = std::min(first + n - r, rows_per_block_ - slot);
      const uint8_t* src = blocks_[r / rows_per_block_].data + slot * row_bytes_;
      out.insert(out.end(), src, src + take * row_bytes_);
      r += take;
    }
    return;
  }
  const int64_t pb = KvRowBytes(packed_format, dim_);
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(n * pb));
  std::vector<float> row(dim_);
  for (int64_t r = 0; r < n; ++r) {
    Unpack(first + r, 1, row.data());
    if (packed_format == KvRowFormat::kPackedKv) {
      kf::PackKvEntry(row.data(), dim_, out.data() + at + r * pb);
    } else if (packed_format == KvRowFormat::kPackedKey) {
      kf::PackIndexKey(row.data(), dim_, out.data() + at + r * pb);
    } else {
      std::memcpy(out.data() + at + r * pb, row.data(), static_cast<size_t>(pb));
    }
  }
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
  return *this;
}

SwaRing::~SwaRing() { Release(); }

void SwaRing::Release() {
  if (allocated()) pool_->Unref(block_.id);
  block_ = KvPool::Block{};
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
  if (!allocated()) {
    KvPool::Block nb;
    if (absl::Status s = pool_->Allocate(ring_bytes(), &nb); !s.ok()) return s;
    FillZero(nb.data, window_);
    block_ = nb;
    return absl::OkStatus();
  }
  if (!pool_->TryExclusive(block_.id)) {  // shared: copy on write
    KvPool::Block nb;
    if (absl::Status s = pool_->Allocate(ring_bytes(), &nb); !s.ok()) return s;
    std::memcpy(nb.data, block_.data, static_cast<size_t>(ring_bytes()));
    pool_->Unref(block_.id);
    block_ = nb;
  }
  return absl::OkStatus();
}

absl::Status SwaRing::WriteSlot(int64_t slot, const float* x) {
  if (absl::Status s = Writable(); !s.ok()) return s;
  kf::PackSwaSlot(x, dim_, block_.data + slot * slot_bytes_);
  return absl::OkStatus();
}

absl::Status SwaRing::WritePositions(int64_t first_pos, int64_t n, const float* x) {
  if (n <= 0) return absl::OkStatus();
  if (absl::Status s = Writable(); !s.ok()) return s;
  for (int64_t i = std::max<int64_t>(0, n - window_); i < n; ++i)
    kf::PackSwaSlot(x + i * dim_, dim_, block_.data + ((first_pos + i) % window_) * slot_bytes_);
  return absl::OkStatus();
}

absl::Status SwaRing::WriteSlotPacked(int64_t slot, const uint8_t* bytes) {
  if (absl::Status s = Writable(); !s.ok()) return s;
  std::memcpy(block_.data + slot * slot_bytes_, bytes, static_cast<size_t>(slot_bytes_));
  return absl::OkStatus();
}

absl::Status SwaRing::WritePacked(const uint8_t* bytes) {
  if (absl::Status s = Writable(); !s.ok()) return s;
  std::memcpy(block_.data, bytes, static_cast<size_t>(ring_bytes()));
  return absl::OkStatus();
}

void SwaRing::Clear() { Release(); }

void SwaRing::ReadSlot(int64_t slot, float* out) const {
  if (!allocated()) {
    std::fill_n(out, dim_, 0.f);
    return;
  }
  kf::UnpackSwaSlot(block_.data + slot * slot_bytes_, dim_, out);
}

void SwaRing::ReadWindow(float* out) const {
  if (!allocated()) {
    std::fill_n(out, window_ * dim_, 0.f);
    return;
  }
  for (int64_t w = 0; w < window_; ++w)
    kf::UnpackSwaSlot(block_.data + w * slot_bytes_, dim_, out + w * dim_);
}

void SwaRing::CopySlotPacked(int64_t slot, std::vector<uint8_t>& out) const {
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(slot_bytes_));
  if (allocated()) {
    std::memcpy(out.data() + at, block_.data + slot * slot_bytes_,
                static_cast<size_t>(slot_bytes_));
  } else {
    FillZero(out.data() + at, 1);
  }
}

void SwaRing::CopyPacked(uint8_t* out) const {
  if (allocated()) {
    std::memcpy(out, block_.data, static_cast<size_t>(ring_bytes()));
  } else {
    FillZero(out, window_);
  }
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
