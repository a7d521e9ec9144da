#include "kvstore/g2_swa_pool.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/memory_limit.h"

namespace epd::kvstore {

uint64_t DefaultSwaCapacityBytes() {
  // A tenth of the memory this process may use (the cgroup's limit, if lower than the host's).
  const int64_t usable = common::UsableMemoryBytes();
  if (usable <= 0) return 1ull << 30;  // 1 GiB when the OS will not say
  return static_cast<uint64_t>(usable) / 10;
}

absl::Status G2Config::Validate() const {
  if (ttl_ms <= 0) return absl::InvalidArgumentError("G2 ttl must be > 0");
  if (capacity_bytes == 0) return absl::InvalidArgumentError("G2 capacity_bytes must be > 0");
  if (max_key_bytes == 0) return absl::InvalidArgumentError("G2 max_key_bytes must be > 0");
  return absl::OkStatus();
}

G2SwaPool::G2SwaPool(const G2Config& config, const common::Clock& clock, KvMetrics& metrics)
    : config_(config), clock_(clock), metrics_(metrics.tier(Tier::kG2)), all_metrics_(metrics) {
  absl::MutexLock lock(&mu_);
  UpdateGaugesLocked();
}

G2SwaPool::PendingPut& G2SwaPool::PendingPut::operator=(PendingPut&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) pool_->ReleaseReservation(value_->size());
    pool_ = std::exchange(other.pool_, nullptr);
    key_ = std::move(other.key_);
    value_ = std::move(other.value_);
  }
  return *this;
}

G2SwaPool::PendingPut::~PendingPut() {
  if (pool_ != nullptr) pool_->ReleaseReservation(value_->size());
}

absl::Status G2SwaPool::PendingPut::Commit() {
  if (pool_ == nullptr) return absl::FailedPreconditionError("G2 put already committed");
  return std::exchange(pool_, nullptr)->CommitPending(std::move(key_), std::move(value_));
}

absl::StatusOr<G2SwaPool::PendingPut> G2SwaPool::BeginPut(std::string_view key, size_t bytes) {
  if (key.empty() || key.size() > config_.max_key_bytes) {
    all_metrics_.CountBadRequest("key_size");
    return absl::InvalidArgumentError(
        absl::StrCat("SWA key must be 1..", config_.max_key_bytes, " bytes, got ", key.size()));
  }
  if (bytes > config_.capacity_bytes) {
    all_metrics_.CountBadRequest("value_size");
    return absl::InvalidArgumentError(absl::StrCat("SWA snapshot of ", bytes,
                                                   " bytes exceeds the pool capacity of ",
                                                   config_.capacity_bytes, " bytes"));
  }
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(clock_.NowUnixMs());
    // LRU eviction until the new value fits next to what is published and reserved.
    while (bytes_ + reserved_ + bytes > config_.capacity_bytes && !lru_.empty()) {
      RemoveLocked(entries_.find(lru_.back()));
      metrics_.evictions->Increment();
    }
    if (bytes_ + reserved_ + bytes > config_.capacity_bytes) {
      all_metrics_.CountBadRequest("capacity");
      return absl::ResourceExhaustedError(absl::StrCat(
          "SWA pool: ", reserved_, " bytes are held by puts in progress; no room for ", bytes));
    }
    reserved_ += bytes;
    UpdateGaugesLocked();
  }
  PendingPut p;
  p.pool_ = this;
  p.key_ = std::string(key);
  p.value_ = std::make_shared<std::string>(bytes, '\0');
  return p;
}

absl::Status G2SwaPool::Put(std::string_view key, std::span<const uint8_t> value) {
  auto p = BeginPut(key, value.size());
  if (!p.ok()) return p.status();
  if (!value.empty()) std::memcpy(p->data(), value.data(), value.size());
  return p->Commit();
}

absl::Status G2SwaPool::CommitPending(std::string key, std::shared_ptr<std::string> value) {
  const size_t size = value->size();
  absl::MutexLock lock(&mu_);
  reserved_ -= size;
  tombstones_.erase(key);
  if (auto it = entries_.find(absl::string_view(key.data(), key.size())); it != entries_.end())
    RemoveLocked(it);
  lru_.push_front(key);
  Entry e;
  e.value = std::move(value);
  e.expires_unix_ms = clock_.NowUnixMs() + config_.ttl_ms;
  e.lru_it = lru_.begin();
  entries_.emplace(std::move(key), std::move(e));
  bytes_ += size;
  metrics_.puts->Increment();
  metrics_.put_bytes->Increment(static_cast<double>(size));
  UpdateGaugesLocked();
  return absl::OkStatus();
}

void G2SwaPool::ReleaseReservation(size_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_ -= bytes;
  UpdateGaugesLocked();
}

G2SwaPool::GetResult G2SwaPool::Get(std::string_view key) {
  GetResult r;
  absl::MutexLock lock(&mu_);
  metrics_.gets->Increment();
  metrics_.lookups->Increment();
  const absl::string_view k(key.data(), key.size());
  auto it = entries_.find(k);
  if (it == entries_.end()) {
    auto t = tombstones_.find(k);
    r.miss = t == tombstones_.end() ? MissReason::kAbsent : MissReason::kExpired;
    if (t != tombstones_.end()) tombstones_.erase(t);
  } else if (clock_.NowUnixMs() >= it->second.expires_unix_ms) {
    RemoveLocked(it);
    metrics_.ttl_expiries->Increment();
    UpdateGaugesLocked();
    r.miss = MissReason::kExpired;
  } else {
    // Recency for LRU only; the expiry time is left as it is.
    lru_.splice(lru_.begin(), lru_, it->second.lru_it);
    r.value = it->second.value;
    r.miss = MissReason::kNone;
    metrics_.hits->Increment();
    metrics_.get_bytes->Increment(static_cast<double>(r.value->size()));
  }
  all_metrics_.CountMiss(Tier::kG2, r.miss);
  return r;
}

bool G2SwaPool::Contains(std::string_view key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(absl::string_view(key.data(), key.size()));
  return it != entries_.end() && clock_.NowUnixMs() < it->second.expires_unix_ms;
}

size_t G2SwaPool::ExpireNow() {
  absl::MutexLock lock(&mu_);
  const size_t n = ExpireLocked(clock_.NowUnixMs());
  UpdateGaugesLocked();
  return n;
}

size_t G2SwaPool::ExpireLocked(int64_t now_ms) {
  size_t n = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (now_ms >= it->second.expires_unix_ms) {
      if (tombstones_.size() >= kMaxTombstones) tombstones_.clear();
      tombstones_[it->first] = it->second.expires_unix_ms;
      RemoveLocked(it);
      ++n;
    }
    it = next;
  }
  if (n > 0) metrics_.ttl_expiries->Increment(static_cast<double>(n));
  for (auto t = tombstones_.begin(); t != tombstones_.end();) {
    auto next = std::next(t);
    if (now_ms - t->second >= config_.ttl_ms) tombstones_.erase(t);
    t = next;
  }
  return n;
}

void G2SwaPool::RemoveLocked(absl::flat_hash_map<std::string, Entry>::iterator it) {
  bytes_ -= it->second.value->size();
  lru_.erase(it->second.lru_it);
  entries_.erase(it);
}

G2SwaPool::Stats G2SwaPool::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{entries_.size(), bytes_, reserved_, config_.capacity_bytes};
}

void G2SwaPool::UpdateGaugesLocked() {
  metrics_.bytes->Set(static_cast<double>(bytes_));
  metrics_.entries->Set(static_cast<double>(entries_.size()));
  metrics_.capacity_bytes->Set(static_cast<double>(config_.capacity_bytes));
}

}  // namespace epd::kvstore
