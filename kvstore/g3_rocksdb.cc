#include "kvstore/g3_rocksdb.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <sys/statvfs.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "common/little_endian.h"
#include "rocksdb/compaction_filter.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/sst_file_manager.h"
#include "rocksdb/table.h"
#include "rocksdb/write_batch.h"

namespace epd::kvstore {
namespace {

constexpr char kMetaCf[] = "meta";

using common::LoadLe;
using common::StoreLe;

std::string EncodeMeta(int64_t write_ms, uint64_t bytes) {
  std::string m(16, '\0');
  StoreLe<int64_t>(reinterpret_cast<uint8_t*>(m.data()), write_ms);
  StoreLe<uint64_t>(reinterpret_cast<uint8_t*>(m.data()) + 8, bytes);
  return m;
}

// Drops values whose write time is older than the TTL when RocksDB compacts. Malformed values
// are kept so that a read reports (and counts) them.
class TtlFilter final : public rocksdb::CompactionFilter {
 public:
  TtlFilter(const common::Clock& clock, int64_t ttl_ms, bool meta)
      : clock_(clock), ttl_ms_(ttl_ms), meta_(meta) {}
  bool Filter(int, const rocksdb::Slice&, const rocksdb::Slice& value, std::string*,
              bool*) const override {
    int64_t write_ms = 0;
    if (meta_) {
      if (value.size() != 16) return false;
      write_ms = LoadLe<int64_t>(reinterpret_cast<const uint8_t*>(value.data()));
    } else if (!G3HeaderWriteMs(std::span<const uint8_t>(
                                    reinterpret_cast<const uint8_t*>(value.data()), value.size()),
                                &write_ms)) {
      return false;
    }
    return G3Expired(write_ms, clock_.NowUnixMs(), ttl_ms_);
  }
  const char* Name() const override { return meta_ ? "epd.g3.ttl.meta" : "epd.g3.ttl.value"; }

 private:
  const common::Clock& clock_;
  int64_t ttl_ms_;
  bool meta_;
};

// Wall-clock (steady) milliseconds: the resume throttle follows real time, not the store's
// (possibly fake) TTL clock.
int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("G3 RocksDB ", std::string(what), ": ", s.ToString()));
}

}  // namespace

absl::Status G3Config::Validate() const {
  if (path.empty()) return absl::InvalidArgumentError("G3 path is empty");
  if (ttl_ms <= 0) return absl::InvalidArgumentError("G3 ttl must be > 0");
  if (capacity_bytes == 0) return absl::InvalidArgumentError("G3 capacity_bytes must be > 0");
  return absl::OkStatus();
}

G3RocksStore::G3RocksStore(const G3Config& config, const common::Clock& clock, KvMetrics& metrics)
    : config_(config), clock_(clock), metrics_(metrics.tier(Tier::kG3)), all_metrics_(metrics) {}

G3RocksStore::~G3RocksStore() {
  if (db_ != nullptr) {
    if (meta_cf_ != nullptr) db_->DestroyColumnFamilyHandle(meta_cf_);
    db_->Close();
  }
}

absl::StatusOr<std::unique_ptr<G3RocksStore>> G3RocksStore::Open(const G3Config& config,
                                                                 const common::Clock& clock,
                                                                 KvMetrics& metrics) {
  if (auto s = config.Validate(); !s.ok()) return s;
  std::unique_ptr<G3RocksStore> store(new G3RocksStore(config, clock, metrics));
  store->value_filter_ = std::make_unique<TtlFilter>(clock, config.ttl_ms, false);
  store->meta_filter_ = std::make_unique<TtlFilter>(clock, config.ttl_ms, true);

  rocksdb::DBOptions db_options;
  // The SstFileManager tracks the DB's disk use and lets RocksDB recover by itself from a full
  // disk once space returns (Put also resumes it: ResumeIfFull).
  db_options.sst_file_manager.reset(rocksdb::NewSstFileManager(rocksdb::Env::Default()));
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.IncreaseParallelism(2);
  rocksdb::ColumnFamilyOptions value_options;
  value_options.compression = rocksdb::kNoCompression;  // FP4/FP8 KV does not compress
  value_options.compaction_filter = store->value_filter_.get();
  value_options.write_buffer_size = 64ull << 20;
  rocksdb::ColumnFamilyOptions meta_options;
  meta_options.compaction_filter = store->meta_filter_.get();
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs{
      {rocksdb::kDefaultColumnFamilyName, value_options}, {kMetaCf, meta_options}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status opened = rocksdb::DB::Open(db_options, config.path, cfs, &handles, &raw);
  if (opened.IsCorruption()) {
    // A cache: move the broken directory aside (kept for inspection) and start empty.
    const std::string aside = absl::StrCat(config.path, ".corrupt-", clock.NowUnixMs());
    std::error_code ec;
    std::filesystem::rename(config.path, aside, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("G3 RocksDB open ", config.path, ": ",
                                              opened.ToString(), "; moving it aside to ", aside,
                                              " failed: ", ec.message()));
    }
    spdlog::error("G3: {} is corrupt ({}); moved it aside to {} and created an empty store",
                  config.path, opened.ToString(), aside);
    handles.clear();
    opened = rocksdb::DB::Open(db_options, config.path, cfs, &handles, &raw);
  }
  if (auto s = FromRocks(opened, absl::StrCat("open ", config.path)); !s.ok()) return s;
  store->db_.reset(raw);
  // The default CF handle from Open must be destroyed like any other; keep the DB's own.
  store->value_cf_ = raw->DefaultColumnFamily();
  raw->DestroyColumnFamilyHandle(handles[0]);
  store->meta_cf_ = handles[1];

  // Rebuild the index from the meta column family.
  {
    absl::MutexLock lock(&store->mu_);
    std::unique_ptr<rocksdb::Iterator> it(
        raw->NewIterator(rocksdb::ReadOptions(), store->meta_cf_));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->key().size() != kBlockHashBytes || it->value().size() != 16) continue;
      BlockHash key;
      std::memcpy(key.data(), it->key().data(), key.size());
      const auto* v = reinterpret_cast<const uint8_t*>(it->value().data());
      Meta m{LoadLe<int64_t>(v), LoadLe<uint64_t>(v + 8)};
      store->index_[key] = m;
      store->by_time_.emplace(m.write_unix_ms, key);
      store->bytes_ += m.bytes;
    }
    if (auto s = FromRocks(it->status(), "index scan"); !s.ok()) return s;
    store->UpdateGaugesLocked();
  }
  spdlog::info("G3: opened {} with {} blocks ({} bytes)", config.path, store->stats().entries,
               store->stats().bytes);
  return store;
}

absl::Status G3RocksStore::Put(const BlockHash& key, std::span<const uint8_t> value) {
  if (value.size() > config_.max_value_bytes || value.size() > config_.capacity_bytes) {
    all_metrics_.CountBadRequest("value_size");
    return absl::InvalidArgumentError(absl::StrCat(
        "G3 value of ", value.size(), " bytes exceeds the limit of ",
        std::min<uint64_t>(config_.max_value_bytes, config_.capacity_bytes), " bytes"));
  }
  const int64_t now = clock_.NowUnixMs();
  uint8_t header[kG3HeaderBytes];
  EncodeG3Header(header, now, value);
  const rocksdb::Slice parts[2] = {
      rocksdb::Slice(reinterpret_cast<const char*>(header), sizeof(header)),
      rocksdb::Slice(reinterpret_cast<const char*>(value.data()), value.size())};
  const rocksdb::Slice key_slice(reinterpret_cast<const char*>(key.data()), key.size());
  const std::string meta = EncodeMeta(now, value.size());
  rocksdb::WriteBatch batch;
  if (auto s = FromRocks(
          batch.Put(value_cf_, rocksdb::SliceParts(&key_slice, 1), rocksdb::SliceParts(parts, 2)),
          "batch");
      !s.ok()) {
    return s;
  }
  if (auto s = FromRocks(batch.Put(meta_cf_, key_slice, meta), "batch"); !s.ok()) return s;
  rocksdb::WriteOptions wo;
  wo.sync = config_.sync_writes;
  if (auto s = CheckFreeSpace(value.size() + sizeof(header) + meta.size()); !s.ok()) return s;
  if (auto s = ResumeIfFull(); !s.ok()) return s;
  if (const rocksdb::Status w = db_->Write(wo, &batch); !w.ok()) return NoteWriteFailure(w, "put");
  metrics_.puts->Increment();
  metrics_.put_bytes->Increment(static_cast<double>(value.size()));
  std::vector<BlockHash> victims;
  std::vector<Meta> metas;
  {
    absl::MutexLock lock(&mu_);
    ForgetLocked(key);
    index_[key] = Meta{now, value.size()};
    by_time_.emplace(now, key);
    bytes_ += value.size();
    // Over capacity: the oldest-written values go first (the new one is the newest).
    while (bytes_ > config_.capacity_bytes && !by_time_.empty()) {
      const BlockHash victim = by_time_.begin()->second;
      if (victim == key) break;
      TakeLocked(victim, victims, metas);
    }
    UpdateGaugesLocked();
  }
  // The value is stored either way; victims the database keeps stay indexed (not counted as
  // evicted), and the next put or sweep evicts them again.
  if (!victims.empty() && DeleteForgotten(victims, metas, "G3 eviction").ok()) {
    metrics_.evictions->Increment(static_cast<double>(victims.size()));
  }
  return absl::OkStatus();
}

absl::Status G3RocksStore::NoteWriteFailure(const rocksdb::Status& s, const char* what) {
  if (!s.IsNoSpace()) {
    all_metrics_.CountBadRequest("internal");
    return FromRocks(s, what);
  }
  all_metrics_.CountBadRequest("no_space");
  {
    absl::MutexLock lock(&full_mu_);
    if (!disk_full_) {
      spdlog::error("G3: the disk of {} is full ({}); refusing puts, serving gets", config_.path,
                    s.ToString());
    }
    disk_full_ = true;
    last_resume_ms_ = SteadyMs();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "G3 ", what, " refused: the disk of the store is full (", s.ToString(),
      "); gets are still served, puts resume when space returns"));
}

absl::Status G3RocksStore::ResumeIfFull() {
  absl::MutexLock lock(&full_mu_);
  if (!disk_full_) return absl::OkStatus();
  // No write reaches a database stopped by a full disk (RocksDB asserts on a write after a failed
  // WAL append). RocksDB's SstFileManager starts resuming it once space returns; DB::Resume here,
  // at most once a second, says when it is done (Busy while that recovery runs) or does it.
  const int64_t now = SteadyMs();
  if (now - last_resume_ms_ >= 1000) {
    last_resume_ms_ = now;
    if (db_->Resume().ok()) {
      disk_full_ = false;
      spdlog::info("G3: {} accepts puts again (space returned)", config_.path);
      return absl::OkStatus();
    }
  }
  all_metrics_.CountBadRequest("no_space");
  return absl::ResourceExhaustedError(
      "G3 put refused: the disk of the store is full; gets are still served");
}

absl::Status G3RocksStore::CheckFreeSpace(uint64_t bytes) {
  struct statvfs fs {};
  if (statvfs(config_.path.c_str(), &fs) != 0) return absl::OkStatus();  // unknown: let RocksDB try
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  const bool low = free_bytes < config_.min_free_bytes + bytes;
  absl::MutexLock lock(&full_mu_);
  if (!low) {
    if (disk_full_ && db_->Resume().ok()) {
      disk_full_ = false;
      spdlog::info("G3: {} accepts puts again ({} bytes free)", config_.path, free_bytes);
    }
    return absl::OkStatus();
  }
  if (!disk_full_) {
    spdlog::error("G3: the disk of {} is nearly full ({} bytes free, {} kept in reserve); refusing "
                  "puts, serving gets",
                  config_.path, free_bytes, config_.min_free_bytes);
  }
  disk_full_ = true;
  last_resume_ms_ = SteadyMs();
  all_metrics_.CountBadRequest("no_space");
  return absl::ResourceExhaustedError(absl::StrCat(
      "G3 put refused: the disk of the store is nearly full (", free_bytes, " bytes free, ",
      config_.min_free_bytes, " kept in reserve); gets are still served"));
}

bool G3RocksStore::disk_full() const {
  absl::MutexLock lock(&full_mu_);
  return disk_full_;
}

G3RocksStore::GetResult G3RocksStore::Get(const BlockHash& key, const ValueDest& dest) {
  GetResult r;
  metrics_.gets->Increment();
  metrics_.lookups->Increment();
  const rocksdb::Slice key_slice(reinterpret_cast<const char*>(key.data()), key.size());
  rocksdb::PinnableSlice stored;
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  const rocksdb::Status s = db_->Get(ro, value_cf_, key_slice, &stored);
  bool drop = false;
  if (s.IsNotFound()) {
    r.miss = MissReason::kAbsent;
    absl::MutexLock lock(&mu_);
    if (index_.contains(key)) {  // dropped by the compaction filter; forget it too
      ForgetLocked(key);
      UpdateGaugesLocked();
    }
  } else if (s.IsCorruption()) {
    spdlog::warn("G3: RocksDB reports block {} corrupt: {}", common::ToHex(key), s.ToString());
    r.miss = MissReason::kChecksum;
    drop = true;
  } else if (!s.ok()) {
    spdlog::warn("G3: get failed: {}", s.ToString());
    all_metrics_.CountBadRequest("internal");
    r.miss = MissReason::kAbsent;
  } else {
    const std::span<const uint8_t> stored_bytes(reinterpret_cast<const uint8_t*>(stored.data()),
                                                stored.size());
    // Into dest: the checksum is verified over the copy below instead of the stored bytes.
    auto decoded = DecodeG3Value(stored_bytes, /*verify_checksum=*/!dest);
    const bool expired = decoded.ok() && ExpiredAt(decoded->write_ms, clock_.NowUnixMs());
    uint8_t* out = nullptr;
    if (decoded.ok() && dest) {
      std::span<const uint8_t> checked = decoded->payload;
      out = expired ? nullptr : dest(checked.size());
      if (out != nullptr) {
        if (!checked.empty()) std::memcpy(out, checked.data(), checked.size());
        checked = std::span<const uint8_t>(out, checked.size());
      }
      if (common::Xxh3_64(checked, decoded->seed) != decoded->checksum) {
        decoded = absl::DataLossError("G3 value: checksum mismatch");
        out = nullptr;
      }
    }
    if (!decoded.ok()) {
      spdlog::warn("G3: block {} dropped: {}", common::ToHex(key),
                   std::string(decoded.status().message()));
      r.miss = MissReason::kChecksum;
      drop = true;
    } else if (expired) {
      r.miss = MissReason::kExpired;
      metrics_.ttl_expiries->Increment();
      drop = true;
    } else {
      const auto payload = decoded->payload;
      r.checksum = decoded->checksum;  // verified above over the bytes returned
      r.checksum_seed = decoded->seed;
      if (out != nullptr) {
        r.in_dest = true;
      } else {
        r.value.assign(reinterpret_cast<const char*>(payload.data()), payload.size());
      }
      r.miss = MissReason::kNone;
      metrics_.hits->Increment();
      metrics_.get_bytes->Increment(static_cast<double>(payload.size()));
    }
  }
  if (r.miss == MissReason::kChecksum) metrics_.checksum_failures->Increment();
  all_metrics_.CountMiss(Tier::kG3, r.miss);
  if (drop) (void)DropKey(key);  // a failure is logged, counted and retried later
  return r;
}

bool G3RocksStore::Lookup(const BlockHash& key) {
  metrics_.lookups->Increment();
  const bool hit = Contains(key);
  if (hit) metrics_.hits->Increment();
  return hit;
}

bool G3RocksStore::Contains(const BlockHash& key) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  return it != index_.end() && !ExpiredAt(it->second.write_unix_ms, clock_.NowUnixMs());
}

absl::Status G3RocksStore::Delete(const BlockHash& key) { return DropKey(key); }

absl::Status G3RocksStore::DropKey(const BlockHash& key) {
  std::vector<Meta> had;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = index_.find(key); it != index_.end()) had.push_back(it->second);
    ForgetLocked(key);
    UpdateGaugesLocked();
  }
  return DeleteForgotten({key}, had, "G3 delete");  // not indexed: nothing to put back
}

absl::Status G3RocksStore::DeleteForgotten(const std::vector<BlockHash>& keys,
                                           const std::vector<Meta>& metas, const char* what) {
  absl::Status s = DeleteKeys(keys);
  if (s.ok()) return s;
  spdlog::warn("{}: {} block(s) could not be deleted ({}); they stay indexed", what, keys.size(),
               std::string(s.message()));
  all_metrics_.CountBadRequest("internal");
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < metas.size(); ++i) {
    if (index_.contains(keys[i])) continue;  // put again meanwhile
    index_[keys[i]] = metas[i];
    by_time_.emplace(metas[i].write_unix_ms, keys[i]);
    bytes_ += metas[i].bytes;
  }
  UpdateGaugesLocked();
  return s;
}

absl::Status G3RocksStore::DeleteKeys(const std::vector<BlockHash>& keys) {
  rocksdb::WriteBatch batch;
  for (const BlockHash& k : keys) {
    const rocksdb::Slice ks(reinterpret_cast<const char*>(k.data()), k.size());
    if (auto s = FromRocks(batch.Delete(value_cf_, ks), "batch"); !s.ok()) return s;
    if (auto s = FromRocks(batch.Delete(meta_cf_, ks), "batch"); !s.ok()) return s;
  }
  return FromRocks(db_->Write(rocksdb::WriteOptions(), &batch), "delete");
}

G3RocksStore::SweepResult G3RocksStore::Sweep() {
  SweepResult r;
  std::vector<BlockHash> victims;
  std::vector<Meta> metas;
  {
    absl::MutexLock lock(&mu_);
    const int64_t now = clock_.NowUnixMs();
    auto take = [&] { TakeLocked(by_time_.begin()->second, victims, metas); };
    while (!by_time_.empty() && ExpiredAt(by_time_.begin()->first, now)) {
      take();
      ++r.expired;
    }
    while (bytes_ > config_.capacity_bytes && !by_time_.empty()) {
      take();
      ++r.evicted;
    }
    UpdateGaugesLocked();
  }
  // Still in the database after a failed delete: indexed again (neither expired nor evicted), so
  // the next sweep tries again.
  if (!victims.empty() && !DeleteForgotten(victims, metas, "G3 sweep").ok()) r = SweepResult{};
  if (r.expired > 0) metrics_.ttl_expiries->Increment(static_cast<double>(r.expired));
  if (r.evicted > 0) metrics_.evictions->Increment(static_cast<double>(r.evicted));
  return r;
}

absl::Status G3RocksStore::Flush() {
  rocksdb::FlushOptions fo;
  fo.wait = true;
  if (auto s = FromRocks(db_->Flush(fo, value_cf_), "flush"); !s.ok()) return s;
  return FromRocks(db_->Flush(fo, meta_cf_), "flush");
}

G3RocksStore::Stats G3RocksStore::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{index_.size(), bytes_, config_.capacity_bytes};
}

void G3RocksStore::TakeLocked(BlockHash key, std::vector<BlockHash>& keys,
                              std::vector<Meta>& metas) {
  metas.push_back(index_.at(key));
  ForgetLocked(key);
  keys.push_back(key);
}

void G3RocksStore::ForgetLocked(const BlockHash& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  by_time_.erase({it->second.write_unix_ms, key});
  bytes_ -= it->second.bytes;
  index_.erase(it);
}

void G3RocksStore::UpdateGaugesLocked() {
  metrics_.bytes->Set(static_cast<double>(bytes_));
  metrics_.entries->Set(static_cast<double>(index_.size()));
  metrics_.capacity_bytes->Set(static_cast<double>(config_.capacity_bytes));
}

}  // namespace epd::kvstore
