#pragma once

// G3: global KV blocks on SSD in RocksDB, keyed by chain hash (DESIGN §5).
//
// Every stored value is [32-byte header | payload]. The header is versioned and carries the
// write time (from the injected Clock, so TTLs survive restarts and tests use a FakeClock) and an
// xxHash3-64 checksum over header fields + payload. A value whose header or checksum does not
// verify, or that RocksDB itself reports corrupt, is a miss (reason "checksum", counted in
// epd_kv_checksum_failures_total{tier="g3"}), is deleted, and is never served.
//
// Expiry: a value older than ttl_ms (from its last put) is a miss ("expired") on read; Sweep()
// deletes expired values and then the oldest-written values until the payload total fits the
// capacity; a compaction filter also drops expired values whenever RocksDB compacts. Writes go
// through the WAL (optionally fsynced), so a put acknowledged before a crash is served after it.
//
// A small "meta" column family (key -> write time, size) is written in the same atomic batch as
// the value, so Open() rebuilds the in-memory index without reading values. Thread-safe.
#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "kvstore/g3_value.h"
#include "kvstore/kv_metrics.h"
#include "kvstore/types.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
class CompactionFilter;
class Status;
}  // namespace rocksdb

namespace epd::kvstore {

struct G3Config {
  std::string path;                        // RocksDB directory (created if missing)
  int64_t ttl_ms = 72ll * 3600 * 1000;     // Default: 72 hours
  uint64_t capacity_bytes = 100ull << 30;  // Default: 100 GiB of stored values
  bool sync_writes = false;  // Default: off (WAL survives a process crash; on = power loss too)
  uint64_t max_value_bytes = 256ull << 20;  // Default: 256 MiB per value
  // Puts are refused while the filesystem would keep less than this free after the value
  // (statvfs), so RocksDB itself never meets a full disk. Default: 256 MiB.
  uint64_t min_free_bytes = 256ull << 20;
  absl::Status Validate() const;
};

// The value header (kG3HeaderBytes, kG3HeaderVersion) is defined in kvstore/g3_value.h.

class G3RocksStore {
 public:
  // Opens (or creates) the DB and rebuilds the index. `clock` and `metrics` must outlive it. A
  // directory RocksDB reports corrupt is moved aside (renamed `<path>.corrupt-<unix ms>`, kept for
  // inspection) and a fresh store is created in its place: the tier is a cache.
  static absl::StatusOr<std::unique_ptr<G3RocksStore>> Open(const G3Config& config,
                                                            const common::Clock& clock,
                                                            KvMetrics& metrics);
  ~G3RocksStore();
  G3RocksStore(const G3RocksStore&) = delete;
  G3RocksStore& operator=(const G3RocksStore&) = delete;

  // Stores `value` under `key` (replacing it; the TTL restarts). Returns once the WAL has it.
  // A (nearly) full disk: ResourceExhausted, counted (epd_kv_bad_requests_total{reason=
  // "no_space"}), and the store keeps serving gets. Puts are refused before RocksDB sees them
  // while less than min_free_bytes would stay free, and go through again once space returns.
  // Should RocksDB itself still meet a full disk, later puts are refused without touching the
  // database until a DB::Resume (tried at most once a second) succeeds.
  absl::Status Put(const BlockHash& key, std::span<const uint8_t> value);
  // Whether the last write found the disk full (and no resume has succeeded since).
  bool disk_full() const;

  struct GetResult {
    std::string value;                      // the payload on a hit (empty when in_dest)
    MissReason miss = MissReason::kAbsent;  // kNone on a hit
    bool in_dest = false;                   // the payload was copied to dest's buffer instead
    // On a hit: the stored checksum (XXH3-64 seeded by checksum_seed), verified over the bytes
    // returned (dest's copy when in_dest, else `value`).
    uint64_t checksum = 0;
    uint64_t checksum_seed = 0;
  };
  // Counted get (lookups/hits/gets and misses by reason). With `dest`, a hit is copied straight
  // from RocksDB's pinned value into dest(n) when it returns a buffer, and the stored checksum is
  // verified over that copy (one pass checks the disk's bytes and the copy).
  GetResult Get(const BlockHash& key, const ValueDest& dest = nullptr);
  // Counted probe from the index (no value read): present and not expired.
  bool Lookup(const BlockHash& key);
  // Uncounted presence check from the index.
  bool Contains(const BlockHash& key) const;
  absl::Status Delete(const BlockHash& key);

  struct SweepResult {
    uint64_t expired = 0;
    uint64_t evicted = 0;
  };
  // Deletes expired values, then the oldest-written values while over capacity.
  SweepResult Sweep();
  // Flushes memtables to SST files (tests and shutdown).
  absl::Status Flush();

  struct Stats {
    uint64_t entries = 0;
    uint64_t bytes = 0;  // payload bytes of indexed values
    uint64_t capacity_bytes = 0;
  };
  Stats stats() const;
  const G3Config& config() const { return config_; }

  // For tests that corrupt stored bytes: the DB and the value column family.
  rocksdb::DB* RawDbForTesting() { return db_.get(); }
  rocksdb::ColumnFamilyHandle* ValueCfForTesting() { return value_cf_; }

 private:
  struct Meta {
    int64_t write_unix_ms = 0;
    uint64_t bytes = 0;
  };

  G3RocksStore(const G3Config& config, const common::Clock& clock, KvMetrics& metrics);
  absl::Status DeleteKeys(const std::vector<BlockHash>& keys);
  void ForgetLocked(const BlockHash& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets indexed `key` and appends it and its index entry to `keys` / `metas` (the victims a
  // DeleteForgotten deletes). `key` by value: it may be a reference into the index.
  void TakeLocked(BlockHash key, std::vector<BlockHash>& keys, std::vector<Meta>& metas)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets `key` and deletes it from the database; when the delete fails the index entry is put
  // back (index and database keep agreeing: the sweep or a later Get tries again) and the
  // failure is logged and counted (epd_kv_bad_requests_total{reason="internal"}).
  absl::Status DropKey(const BlockHash& key);
  // Deletes forgotten `keys` from the database; when the delete fails the first metas.size() of
  // them (those that were indexed, their entries in `metas`) are indexed again, unless put again
  // meanwhile, and the failure is logged (`what`) and counted as DropKey's. Returns the delete's
  // status.
  absl::Status DeleteForgotten(const std::vector<BlockHash>& keys, const std::vector<Meta>& metas,
                               const char* what) ABSL_LOCKS_EXCLUDED(mu_);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ExpiredAt(int64_t write_ms, int64_t now_ms) const {
    return G3Expired(write_ms, now_ms, config_.ttl_ms);
  }

  // A put that found the disk full: ResourceExhausted; remembers it for ResumeIfFull.
  absl::Status NoteWriteFailure(const rocksdb::Status& s, const char* what);
  // After a full disk: OK once DB::Resume (at most once a second) succeeds, else
  // ResourceExhausted without a write.
  absl::Status ResumeIfFull();
  // ResourceExhausted while the filesystem would keep less than min_free_bytes after `bytes`.
  absl::Status CheckFreeSpace(uint64_t bytes);

  const G3Config config_;
  const common::Clock& clock_;
  KvMetrics::TierMetrics& metrics_;
  KvMetrics& all_metrics_;
  std::unique_ptr<rocksdb::CompactionFilter> value_filter_;
  std::unique_ptr<rocksdb::CompactionFilter> meta_filter_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* value_cf_ = nullptr;  // owned by db_ (default CF)
  rocksdb::ColumnFamilyHandle* meta_cf_ = nullptr;   // owned here, destroyed before db_

  mutable absl::Mutex mu_;
  absl::flat_hash_map<BlockHash, Meta> index_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<int64_t, BlockHash>> by_time_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;

  mutable absl::Mutex full_mu_;
  bool disk_full_ ABSL_GUARDED_BY(full_mu_) = false;
  int64_t last_resume_ms_ ABSL_GUARDED_BY(full_mu_) = 0;
};

}  // namespace epd::kvstore
