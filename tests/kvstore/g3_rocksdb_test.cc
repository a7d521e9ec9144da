// G3 RocksDB tier against a real RocksDB in a temp dir: persistence across reopen, TTL from the
// stored write time (FakeClock) on read, sweep and compaction, capacity eviction, and corruption
// of stored bytes (raw overwrite and on-disk SST byte flips) reported as a counted miss; a corrupt
// directory moved aside, and a full disk (a size-limited tmpfs, when the test may mount one) that
// refuses puts, keeps serving gets and recovers when space returns.
#include "kvstore/g3_rocksdb.h"

#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

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


// A directory RocksDB reports corrupt (its MANIFEST overwritten) is moved aside, kept, and the
// store starts empty and works: the tier is a cache, so a damaged disk costs hits, not service.
TEST_F(G3Test, ACorruptDirectoryIsMovedAsideAndTheStoreStartsEmpty) {
  Open();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(store_->Put(Key(i), Bytes(Payload(i, kValue))).ok());
  store_.reset();
  int manifests = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_.File("g3"))) {
    if (e.path().filename().string().rfind("MANIFEST-", 0) != 0) continue;
    std::ofstream(e.path(), std::ios::binary | std::ios::trunc) << std::string(4096, '\x5a');
    ++manifests;
  }
  ASSERT_GT(manifests, 0);
  Open();
  EXPECT_EQ(store_->stats().entries, 0u);
  int aside = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_.path())) {
    aside += e.path().filename().string().rfind("g3.corrupt-", 0) == 0;
  }
  EXPECT_EQ(aside, 1);
  ASSERT_TRUE(store_->Put(Key(7), Bytes(Payload(7, kValue))).ok());
  EXPECT_EQ(store_->Get(Key(7)).value, Payload(7, kValue));
}

// A nearly full disk (a 24 MiB tmpfs, 16 MiB of it taken by a filler file, 2 MiB kept in reserve):
// puts are refused with ResourceExhausted and counted before RocksDB meets the full disk, every
// stored value is still served, and once the filler is deleted puts go through again. Needs
// CAP_SYS_ADMIN for the mount (skipped otherwise).
TEST_F(G3Test, AFullDiskRefusesPutsServesGetsAndRecoversWhenSpaceReturns) {
  const std::string mnt = dir_.File("small");
  std::filesystem::create_directories(mnt);
  if (mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=24m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  }
  struct Unmount {
    std::string at;
    ~Unmount() { umount2(at.c_str(), MNT_DETACH); }
  } unmount{mnt};
  const std::string filler = mnt + "/filler";
  std::ofstream(filler, std::ios::binary) << std::string(16u << 20, 'f');
  G3Config c;
  c.path = mnt + "/g3";
  c.min_free_bytes = 2u << 20;
  auto opened = G3RocksStore::Open(c, clock_, metrics_);
  ASSERT_TRUE(opened.ok()) << opened.status();
  store_ = std::move(*opened);
  constexpr size_t kBig = 1u << 20;
  int stored = 0;
  absl::Status refused;
  for (int i = 0; i < 64 && refused.ok(); ++i) {
    refused = store_->Put(Key(i), Bytes(Payload(i, kBig)));
    stored += refused.ok();
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("full"), std::string_view::npos) << refused;
  ASSERT_GT(stored, 0);
  EXPECT_TRUE(store_->disk_full());
  EXPECT_GE(Metric("epd_kv_bad_requests_total", {{"reason", "no_space"}}), 1);
  // Gets are served while puts are refused.
  for (int i = 0; i < stored; ++i) {
    auto r = store_->Get(Key(i));
    ASSERT_EQ(r.miss, MissReason::kNone) << i;
    EXPECT_TRUE(r.value == Payload(i, kBig)) << i;  // (not EXPECT_EQ: no megabyte dumps)
  }
  EXPECT_EQ(store_->Put(Key(100), Bytes(Payload(100, kBig))).code(),
            absl::StatusCode::kResourceExhausted);
  // Space returns: puts go through again.
  std::filesystem::remove(filler);
  absl::Status again;
  for (int i = 0; i < 150; ++i) {
    again = store_->Put(Key(100), Bytes(Payload(100, kBig)));
    if (again.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_FALSE(store_->disk_full());
  EXPECT_TRUE(store_->Get(Key(100)).value == Payload(100, kBig));
  EXPECT_TRUE(store_->Get(Key(0)).value == Payload(0, kBig));
  store_.reset();  // closed before the tmpfs goes
}

}  // namespace
}  // namespace epd::kvstore
