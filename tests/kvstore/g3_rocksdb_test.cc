// G3 RocksDB tier against a real RocksDB in a temp dir: persistence across reopen, TTL from the
// stored write time (FakeClock) on read, sweep and compaction, capacity eviction, and corruption
// of stored bytes (raw overwrite and on-disk SST byte flips) reported as a counted miss.
#include "kvstore/g3_rocksdb.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "rocksdb/db.h"
#include "tests/kvstore/test_util.h"
#include "tests/testing/subprocess.h"

namespace epd::kvstore {
namespace {

using testing::Bytes;
using testing::Key;
using testing::MetricValue;
using testing::Payload;

constexpr int64_t kHour = 3'600'000;
constexpr size_t kValue = 64 * 890;  // one official-config block

class G3Test : public ::testing::Test {
 protected:
  void Open(uint64_t capacity = 1ull << 30) {
    store_.reset();
    G3Config c;
    c.path = dir_.File("g3");
    c.capacity_bytes = capacity;
    auto s = G3RocksStore::Open(c, clock_, metrics_);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
  }
  double Metric(const std::string& name, const std::map<std::string, std::string>& l) {
    return MetricValue(registry_, name, l);
  }

  epd::testing::TempDir dir_;
  common::FakeClock clock_;
  prometheus::Registry registry_;
  KvMetrics metrics_{registry_};
  std::unique_ptr<G3RocksStore> store_;
};

TEST_F(G3Test, PutGetAndReopenServeIdenticalBytes) {
  Open();
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(store_->Put(Key(i), Bytes(Payload(i, kValue))).ok());
  EXPECT_EQ(store_->Get(Key(999)).miss, MissReason::kAbsent);
  Open();  // close (no explicit flush: the WAL carries the data) and reopen
  EXPECT_EQ(store_->stats().entries, 20u);
  EXPECT_EQ(store_->stats().bytes, 20u * kValue);
  for (int i = 0; i < 20; ++i) {
    auto r = store_->Get(Key(i));
    ASSERT_EQ(r.miss, MissReason::kNone) << i;
    EXPECT_EQ(r.value, Payload(i, kValue)) << i;
  }
  EXPECT_TRUE(store_->Lookup(Key(3)));
  EXPECT_FALSE(store_->Lookup(Key(300)));
  EXPECT_EQ(Metric("epd_kv_hits_total", {{"tier", "g3"}}), 21);
}

TEST_F(G3Test, GlobalBlocksExpireAfterTheirTtlEvenAcrossRestarts) {
  Open();
  ASSERT_TRUE(store_->Put(Key(1), Bytes(Payload(1, 100))).ok());
  clock_.AdvanceMs(72 * kHour - 1);
  ASSERT_EQ(store_->Get(Key(1)).miss, MissReason::kNone);
  Open();  // the write time lives in the value header, not in process memory
  clock_.AdvanceMs(1);
  EXPECT_FALSE(store_->Contains(Key(1)));
  EXPECT_EQ(store_->Get(Key(1)).miss, MissReason::kExpired);
  EXPECT_EQ(Metric("epd_kv_ttl_expiries_total", {{"tier", "g3"}}), 1);
  EXPECT_EQ(Metric("epd_kv_misses_total", {{"tier", "g3"}, {"reason", "expired"}}), 1);
  EXPECT_EQ(store_->stats().entries, 0u);
}

TEST_F(G3Test, SweepDeletesExpiredValuesAndCompactionFilterDropsThem) {
  Open();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(store_->Put(Key(i), Bytes(Payload(i, 100))).ok());
  clock_.AdvanceMs(10 * kHour);
  for (int i = 5; i < 8; ++i) ASSERT_TRUE(store_->Put(Key(i), Bytes(Payload(i, 100))).ok());
  ASSERT_TRUE(store_->Flush().ok());
  clock_.AdvanceMs(62 * kHour);  // keys 0-4 are 72 h old, 5-7 are 62 h old
  // Compaction alone (no sweep) removes the expired values from RocksDB.
  rocksdb::DB* db = store_->RawDbForTesting();
  ASSERT_TRUE(db->CompactRange(rocksdb::CompactRangeOptions(), store_->ValueCfForTesting(), nullptr,
                               nullptr)
                  .ok());
  std::string raw;
  const auto k0 = Key(0);
  const auto k5 = Key(5);
  EXPECT_TRUE(db->Get(rocksdb::ReadOptions(), store_->ValueCfForTesting(),
                      rocksdb::Slice(reinterpret_cast<const char*>(k0.data()), 16), &raw)
                  .IsNotFound());
  EXPECT_TRUE(db->Get(rocksdb::ReadOptions(), store_->ValueCfForTesting(),
                      rocksdb::Slice(reinterpret_cast<const char*>(k5.data()), 16), &raw)
                  .ok());
  const auto swept = store_->Sweep();
  EXPECT_EQ(swept.expired, 5u);
  EXPECT_EQ(store_->stats().entries, 3u);
  Open();
  EXPECT_EQ(store_->stats().entries, 3u);
  EXPECT_EQ(store_->Get(Key(6)).value, Payload(6, 100));
}

TEST_F(G3Test, CapacityEvictsOldestWrittenFirst) {
  Open(/*capacity=*/10 * 1000);
  for (int i = 0; i < 15; ++i) {
    ASSERT_TRUE(store_->Put(Key(i), Bytes(Payload(i, 1000))).ok());
    clock_.AdvanceMs(1);
  }
  EXPECT_EQ(store_->stats().entries, 10u);
  EXPECT_LE(store_->stats().bytes, 10u * 1000);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(store_->Get(Key(i)).miss, MissReason::kAbsent) << i;
  for (int i = 5; i < 15; ++i) EXPECT_EQ(store_->Get(Key(i)).value, Payload(i, 1000)) << i;
  EXPECT_EQ(Metric("epd_kv_evictions_total", {{"tier", "g3"}}), 5);
  EXPECT_EQ(store_->Put(Key(99), Bytes(Payload(1, 10001))).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(G3Test, OverwrittenValueBytesFailTheChecksumAndAreNeverServed) {
  Open();
  ASSERT_TRUE(store_->Put(Key(1), Bytes(Payload(1, kValue))).ok());
  ASSERT_TRUE(store_->Put(Key(2), Bytes(Payload(2, kValue))).ok());
  rocksdb::DB* db = store_->RawDbForTesting();
  for (int i : {1, 2}) {
    const auto k = Key(i);
    const rocksdb::Slice ks(reinterpret_cast<const char*>(k.data()), 16);
    std::string raw;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), store_->ValueCfForTesting(), ks, &raw).ok());
    ASSERT_EQ(raw.size(), kG3HeaderBytes + kValue);
    if (i == 1) raw[kG3HeaderBytes + 1234] ^= 0x01;  // one payload bit
    if (i == 2) raw[4] = 9;                          // unknown header version
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), store_->ValueCfForTesting(), ks, raw).ok());
  }
  EXPECT_EQ(store_->Get(Key(1)).miss, MissReason::kChecksum);
  EXPECT_EQ(store_->Get(Key(2)).miss, MissReason::kChecksum);
  EXPECT_EQ(Metric("epd_kv_checksum_failures_total", {{"tier", "g3"}}), 2);
  EXPECT_FALSE(store_->Contains(Key(1)));  // dropped, so a re-put can heal it
  ASSERT_TRUE(store_->Put(Key(1), Bytes(Payload(1, kValue))).ok());
  EXPECT_EQ(store_->Get(Key(1)).value, Payload(1, kValue));
}

TEST_F(G3Test, BytesFlippedInTheSstFileOnDiskAreAMissNotServed) {
  Open();
  const std::string victim = Payload(7, kValue);
  ASSERT_TRUE(store_->Put(Key(7), Bytes(victim)).ok());
  ASSERT_TRUE(store_->Put(Key(8), Bytes(Payload(8, kValue))).ok());
  ASSERT_TRUE(store_->Flush().ok());
  store_.reset();  // close the DB
  // Find the value's bytes in an SST file (values are stored uncompressed) and flip one.
  int flipped = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_.File("g3"))) {
    if (e.path().extension() != ".sst") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t at = bytes.find(victim.substr(0, 256));
    if (at == std::string::npos) continue;
    f.seekp(static_cast<std::streamoff>(at + kValue / 2));
    const char c = static_cast<char>(bytes[at + kValue / 2] ^ 0x20);
    f.write(&c, 1);
    ++flipped;
  }
  ASSERT_EQ(flipped, 1);
  Open();
  auto r = store_->Get(Key(7));
  EXPECT_EQ(r.miss, MissReason::kChecksum);
  EXPECT_TRUE(r.value.empty());
  EXPECT_EQ(Metric("epd_kv_checksum_failures_total", {{"tier", "g3"}}), 1);
  EXPECT_EQ(Metric("epd_kv_misses_total", {{"tier", "g3"}, {"reason", "checksum"}}), 1);
}

}  // namespace
}  // namespace epd::kvstore
