#include "kvstore/g1_hot_tier.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/hash.h"

namespace epd::kvstore {

absl::Status G1Config::Validate() const {
  if (block_bytes == 0) return absl::InvalidArgumentError("G1 block_bytes must be > 0");
  if (capacity_bytes < block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("G1 capacity_bytes (", capacity_bytes,
                                                   ") must hold at least one block of ",
                                                   block_bytes, " bytes"));
  }
  if (capacity_bytes / block_bytes > 0xffffffffull) {
    return absl::InvalidArgumentError("G1 capacity_bytes / block_bytes exceeds 2^32 blocks");
  }
  return absl::OkStatus();
}

G1HotTier::G1HotTier(std::unique_ptr<BlockArena> arena, KvMetrics& metrics, DemoteFn demote)
    : arena_(std::move(arena)),
      metrics_(metrics.tier(Tier::kG1)),
      all_metrics_(metrics),
      demote_(std::move(demote)) {
  absl::MutexLock lock(&mu_);
  const uint32_t n = arena_->num_blocks();
  slots_.resize(n);
  free_.reserve(n);
  for (uint32_t i = n; i > 0; --i) free_.push_back(i - 1);
  UpdateGaugesLocked();
}

G1HotTier::~G1HotTier() = default;

absl::StatusOr<std::unique_ptr<G1HotTier>> G1HotTier::CreateHost(const G1Config& config,
                                                                 KvMetrics& metrics,
                                                                 DemoteFn demote) {
  if (auto s = config.Validate(); !s.ok()) return s;
  auto arena = MakeHostArena(config.block_bytes, config.num_blocks());
  if (!arena.ok()) return arena.status();
  return std::make_unique<G1HotTier>(std::move(*arena), metrics, std::move(demote));
}

// ---- BlockRef / Reservation ----

G1HotTier::BlockRef& G1HotTier::BlockRef::operator=(BlockRef&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    index_ = other.index_;
    length_ = other.length_;
  }
  return *this;
}

void* G1HotTier::BlockRef::address() const {
  return pool_ == nullptr ? nullptr : pool_->arena_->BlockAddress(index_);
}

void G1HotTier::BlockRef::Release() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->Unref(index_);
}

G1HotTier::Reservation& G1HotTier::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) pool_->CancelReservation(index_);
    pool_ = std::exchange(other.pool_, nullptr);
    index_ = other.index_;
    length_ = other.length_;
    key_ = other.key_;
  }
  return *this;
}

G1HotTier::Reservation::~Reservation() {
  if (pool_ != nullptr) pool_->CancelReservation(index_);
}

void* G1HotTier::Reservation::address() const {
  return pool_ == nullptr ? nullptr : pool_->arena_->BlockAddress(index_);
}

absl::Status G1HotTier::Reservation::Commit() {
  if (pool_ == nullptr) return absl::FailedPreconditionError("G1 reservation already consumed");
  return std::exchange(pool_, nullptr)->CommitReservation(index_, key_);
}

// ---- pool ----

absl::StatusOr<G1HotTier::Reservation> G1HotTier::Reserve(const BlockHash& key, size_t length) {
  if (length > arena_->block_bytes()) {
    all_metrics_.CountBadRequest("value_size");
    return absl::InvalidArgumentError(absl::StrCat("G1 value of ", length,
                                                   " bytes exceeds the block size of ",
                                                   arena_->block_bytes(), " bytes"));
  }
  std::vector<std::pair<BlockHash, std::string>> evicted;
  Reservation r;
  {
    absl::MutexLock lock(&mu_);
    if (free_.empty()) {
      if (lru_.empty()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "G1 full: all ", slots_.size(), " blocks are referenced, pinned or being written"));
      }
      const uint32_t victim = lru_.back();
      Slot& s = slots_[victim];
      if (demote_) {
        std::string bytes(s.length, '\0');
        auto copied = arena_->CopyOut(
            victim, std::span<uint8_t>(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()));
        if (copied.ok()) evicted.emplace_back(s.key, std::move(bytes));
      }
      index_.erase(s.key);
      FreeSlotLocked(victim);
      metrics_.evictions->Increment();
    }
    const uint32_t idx = free_.back();
    free_.pop_back();
    Slot& s = slots_[idx];
    s.in_use = true;
    s.published = false;
    s.checksum.reset();
    s.length = length;
    s.key = key;
    r.pool_ = this;
    r.index_ = idx;
    r.length_ = length;
    r.key_ = key;
    UpdateGaugesLocked();
  }
  for (auto& [k, bytes] : evicted) {
    metrics_.demotions->Increment();
    demote_(k, std::move(bytes));
  }
  return r;
}

absl::Status G1HotTier::CommitReservation(uint32_t index, const BlockHash& key) {
  absl::MutexLock lock(&mu_);
  if (index_.contains(key)) {
    FreeSlotLocked(index);  // a concurrent writer won; its content is the same by construction
    UpdateGaugesLocked();
    return absl::OkStatus();
  }
  Slot& s = slots_[index];
  s.published = true;
  index_[key] = index;
  published_bytes_ += s.length;
  metrics_.puts->Increment();
  metrics_.put_bytes->Increment(static_cast<double>(s.length));
  UpdateLruLocked(index);
  UpdateGaugesLocked();
  return absl::OkStatus();
}

void G1HotTier::CancelReservation(uint32_t index) {
  absl::MutexLock lock(&mu_);
  FreeSlotLocked(index);
  UpdateGaugesLocked();
}

absl::Status G1HotTier::Put(const BlockHash& key, std::span<const uint8_t> bytes,
                            std::optional<ValueChecksum> known) {
  if (Contains(key)) return absl::OkStatus();
  auto r = Reserve(key, bytes.size());
  if (!r.ok()) return r.status();
  if (auto s = arena_->CopyIn(r->index(), bytes); !s.ok()) return s;
  const ValueChecksum checksum = known ? *known : ValueChecksum{common::Xxh3_64(bytes), 0};
  {
    absl::MutexLock lock(&mu_);  // the page is reserved: nobody else sees it yet
    slots_[r->index()].checksum = checksum;
  }
  return r->Commit();
}

std::optional<G1HotTier::BlockRef> G1HotTier::Acquire(const BlockHash& key) {
  absl::MutexLock lock(&mu_);
  metrics_.lookups->Increment();
  auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  metrics_.hits->Increment();
  Slot& s = slots_[it->second];
  ++s.refs;
  UpdateLruLocked(it->second);
  UpdateGaugesLocked();
  BlockRef ref;
  ref.pool_ = this;
  ref.index_ = it->second;
  ref.length_ = s.length;
  return ref;
}

std::optional<std::string> G1HotTier::ReadInto(const BlockHash& key, const ValueDest& dest,
                                               bool* in_dest,
                                               std::optional<ValueChecksum>* checksum) {
  *in_dest = false;
  if (checksum != nullptr) checksum->reset();
  if (!dest) return Read(key);
  metrics_.gets->Increment();
  auto ref = Acquire(key);
  if (!ref.has_value()) {
    all_metrics_.CountMiss(Tier::kG1, MissReason::kAbsent);
    return std::nullopt;
  }
  if (checksum != nullptr) {
    absl::MutexLock lock(&mu_);  // the reference keeps the page (and its checksum) in place
    *checksum = slots_[ref->index()].checksum;
  }
  uint8_t* out = dest(ref->length());
  if (out == nullptr) {
    std::string copy(ref->length(), '\0');
    auto s = arena_->CopyOut(
        ref->index(), std::span<uint8_t>(reinterpret_cast<uint8_t*>(copy.data()), copy.size()));
    if (!s.ok()) return std::nullopt;
    metrics_.get_bytes->Increment(static_cast<double>(copy.size()));
    return copy;
  }
  auto s = arena_->CopyOut(ref->index(), std::span<uint8_t>(out, ref->length()));
  if (!s.ok()) return std::nullopt;
  metrics_.get_bytes->Increment(static_cast<double>(ref->length()));
  *in_dest = true;
  return std::string();
}

std::optional<std::string> G1HotTier::Read(const BlockHash& key) {
  metrics_.gets->Increment();
  auto ref = Acquire(key);
  if (!ref.has_value()) {
    all_metrics_.CountMiss(Tier::kG1, MissReason::kAbsent);
    return std::nullopt;
  }
  std::string out(ref->length(), '\0');
  auto s = arena_->CopyOut(ref->index(),
                           std::span<uint8_t>(reinterpret_cast<uint8_t*>(out.data()), out.size()));
  if (!s.ok()) return std::nullopt;
  metrics_.get_bytes->Increment(static_cast<double>(out.size()));
  return out;
}

bool G1HotTier::Lookup(const BlockHash& key) {
  metrics_.lookups->Increment();
  const bool hit = Contains(key);
  if (hit) metrics_.hits->Increment();
  return hit;
}

bool G1HotTier::Contains(const BlockHash& key) const {
  absl::MutexLock lock(&mu_);
  return index_.contains(key);
}

bool G1HotTier::Pin(const BlockHash& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  ++slots_[it->second].pins;
  UpdateLruLocked(it->second);
  UpdateGaugesLocked();
  return true;
}

bool G1HotTier::Unpin(const BlockHash& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end() || slots_[it->second].pins == 0) return false;
  --slots_[it->second].pins;
  UpdateLruLocked(it->second);
  UpdateGaugesLocked();
  return true;
}

bool G1HotTier::Erase(const BlockHash& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  const uint32_t idx = it->second;
  if (slots_[idx].refs > 0 || slots_[idx].pins > 0) return false;
  index_.erase(it);
  FreeSlotLocked(idx);
  UpdateGaugesLocked();
  return true;
}

void G1HotTier::Unref(uint32_t index) {
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[index];
  if (s.refs > 0) --s.refs;
  UpdateLruLocked(index);
  UpdateGaugesLocked();
}

G1HotTier::Stats G1HotTier::stats() const {
  absl::MutexLock lock(&mu_);
  Stats st;
  st.entries = index_.size();
  st.bytes = published_bytes_;
  st.capacity_bytes = static_cast<uint64_t>(slots_.size()) * arena_->block_bytes();
  st.free_blocks = static_cast<uint32_t>(free_.size());
  st.evictable_blocks = static_cast<uint32_t>(lru_.size());
  return st;
}

void G1HotTier::UpdateLruLocked(uint32_t index) {
  Slot& s = slots_[index];
  if (s.on_lru) {
    lru_.erase(s.lru_it);
    s.on_lru = false;
  }
  if (s.in_use && s.published && s.refs == 0 && s.pins == 0) {
    lru_.push_front(index);
    s.lru_it = lru_.begin();
    s.on_lru = true;
  }
}

void G1HotTier::FreeSlotLocked(uint32_t index) {
  Slot& s = slots_[index];
  if (s.on_lru) lru_.erase(s.lru_it);
  if (s.published) published_bytes_ -= s.length;
  s = Slot{};
  free_.push_back(index);
}

void G1HotTier::UpdateGaugesLocked() {
  metrics_.bytes->Set(static_cast<double>(published_bytes_));
  metrics_.entries->Set(static_cast<double>(index_.size()));
  metrics_.capacity_bytes->Set(static_cast<double>(slots_.size() * arena_->block_bytes()));
}

}  // namespace epd::kvstore
