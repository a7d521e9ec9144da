// The composed KvStore (in process, real RocksDB): longest-prefix lookup over whole blocks,
// G1 eviction demoting to G3, pins surviving pressure, SWA presence, tier routing, bad input.
#include <gtest/gtest.h>

#include <numeric>

#include "common/hash.h"
#include "kvstore/kvstore.h"
#include "tests/kvstore/test_util.h"
#include "tests/testing/subprocess.h"

namespace epd::kvstore {
namespace {

using testing::Bytes;
using testing::MetricValue;
using testing::Payload;

constexpr size_t kBlock = 4096;

class KvStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvStoreConfig c;
    c.data_dir = dir_.File("data");
    c.g1.block_bytes = kBlock;
    c.g1.capacity_bytes = 4 * kBlock;
    c.g2.capacity_bytes = 1 << 20;
    c.g2.ttl_ms = 60'000;
    c.g1_write_through = false;
    auto s = KvStore::Open(c, clock_, registry_);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
  }
  std::vector<BlockHash> Chain(int blocks, int salt = 0) {
    std::vector<int32_t> tokens(blocks * 64);
    std::iota(tokens.begin(), tokens.end(), salt);
    return ChainHashes(tokens, 64, "fp");
  }

  epd::testing::TempDir dir_;
  common::FakeClock clock_;
  prometheus::Registry registry_;
  std::unique_ptr<KvStore> store_;
};

TEST_F(KvStoreTest, LookupReturnsTheLongestCachedPrefixAndWhereItLives) {
  const auto chain = Chain(6);
  ASSERT_TRUE(store_->Put(Tier::kG1, AsBytes(chain[0]), Bytes(Payload(0, 100))).ok());
  ASSERT_TRUE(store_->Put(Tier::kG3, AsBytes(chain[1]), Bytes(Payload(1, 100))).ok());
  ASSERT_TRUE(store_->Put(Tier::kG3, AsBytes(chain[2]), Bytes(Payload(2, 100))).ok());
  // chain[3] missing; chain[4] present must not count (prefix semantics).
  ASSERT_TRUE(store_->Put(Tier::kG3, AsBytes(chain[4]), Bytes(Payload(4, 100))).ok());
  ASSERT_TRUE(store_->Put(Tier::kG2, AsBytes(chain[2]), Bytes(Payload(9, 100))).ok());
  auto r = store_->Lookup(chain);
  EXPECT_EQ(r.cached_blocks, 3);
  EXPECT_EQ(r.tiers, (std::vector<Tier>{Tier::kG1, Tier::kG3, Tier::kG3}));
  EXPECT_TRUE(r.swa_snapshot_present);
  clock_.AdvanceMs(60'000);
  EXPECT_FALSE(store_->Lookup(chain).swa_snapshot_present);  // expired snapshot
  EXPECT_EQ(store_->Lookup(Chain(3, 1)).cached_blocks, 0);   // other tokens: nothing
  EXPECT_GE(MetricValue(registry_, "epd_kv_lookups_total", {{"tier", "g3"}}), 3);
}

TEST_F(KvStoreTest, G1EvictionDemotesToG3AndPinnedBlocksStay) {
  const auto chain = Chain(10);
  ASSERT_TRUE(store_->Put(Tier::kG1, AsBytes(chain[0]), Bytes(Payload(0, kBlock))).ok());
  auto pinned = store_->Pin(AsBytes(chain[0]), true);
  ASSERT_TRUE(pinned.ok() && *pinned);
  for (int i = 1; i < 10; ++i) {
    ASSERT_TRUE(store_->Put(Tier::kG1, AsBytes(chain[i]), Bytes(Payload(i, kBlock))).ok());
  }
  EXPECT_TRUE(store_->g1()->Contains(chain[0]));  // pinned: never evicted
  for (int i = 1; i < 10; ++i) {
    auto g = store_->Get(Tier::kAuto, AsBytes(chain[i]));
    ASSERT_TRUE(g.ok());
    ASSERT_TRUE(g->found) << i;
    EXPECT_EQ(g->value, Payload(i, kBlock)) << i;
  }
  // The first blocks were evicted from G1 and demoted, so G3 holds them.
  EXPECT_TRUE(store_->g3().Contains(chain[1]));
  EXPECT_FALSE(store_->g3().Contains(chain[0]));
  EXPECT_GE(MetricValue(registry_, "epd_kv_demotions_total", {{"tier", "g1"}}), 6);
  auto unpinned = store_->Pin(AsBytes(chain[0]), false);
  ASSERT_TRUE(unpinned.ok() && *unpinned);
}

TEST_F(KvStoreTest, PinLoadsABlockHeldOnlyInG3) {
  const auto chain = Chain(1);
  ASSERT_TRUE(store_->Put(Tier::kG3, AsBytes(chain[0]), Bytes(Payload(0, 100))).ok());
  EXPECT_FALSE(store_->g1()->Contains(chain[0]));
  auto pinned = store_->Pin(AsBytes(chain[0]), true);
  ASSERT_TRUE(pinned.ok() && *pinned);
  EXPECT_TRUE(store_->g1()->Contains(chain[0]));
  auto missing = store_->Pin(AsBytes(Chain(1, 5)[0]), true);
  ASSERT_TRUE(missing.ok());
  EXPECT_FALSE(*missing);
}

TEST_F(KvStoreTest, ExpiredSwaSnapshotIsAMissWithReasonExpired) {
  ASSERT_TRUE(store_->Put(Tier::kG2, "snap", Bytes(Payload(1, 500))).ok());
  clock_.AdvanceMs(60'000);
  auto g = store_->Get(Tier::kG2, "snap");
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(g->found);
  EXPECT_EQ(g->miss, MissReason::kExpired);
  EXPECT_EQ(MissReasonName(g->miss), "expired");
}

TEST_F(KvStoreTest, MalformedKeysAreRejectedByNameAndCounted) {
  auto s = store_->Put(Tier::kG3, "not-a-hash", Bytes(Payload(1, 10)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("16 bytes"), std::string::npos) << s;
  EXPECT_FALSE(store_->Get(Tier::kAuto, "xx").ok());
  EXPECT_EQ(MetricValue(registry_, "epd_kv_bad_requests_total", {{"reason", "key_size"}}), 2);
}

// Get with a ValueDest copies a hit straight into the caller's buffer (G1 page, G3 pinned value,
// G2 snapshot) with the same accounting; a dest that declines gets the bytes as a string.
TEST_F(KvStoreTest, GetIntoADestinationCopiesTheHitStraightIntoTheCallersBuffer) {
  const auto keys = Chain(2);
  const std::string a = Payload(1, kBlock), b = Payload(2, kBlock - 5);
  ASSERT_TRUE(store_->Put(Tier::kG1, AsBytes(keys[0]), Bytes(a)).ok());
  ASSERT_TRUE(store_->Put(Tier::kG3, AsBytes(keys[1]), Bytes(b)).ok());
  ASSERT_TRUE(store_->Put(Tier::kG2, "snap", Bytes(b)).ok());
  std::string buffer(kBlock, '\0');
  size_t asked = 0;
  ValueDest dest = [&](size_t n) {
    asked = n;
    return reinterpret_cast<uint8_t*>(buffer.data());
  };
  struct Case {
    Tier tier;
    std::string key;
    const std::string* want;
    Tier served;
  };
  for (const Case& c : {Case{Tier::kAuto, std::string(AsBytes(keys[0])), &a, Tier::kG1},
                        Case{Tier::kG3, std::string(AsBytes(keys[1])), &b, Tier::kG3},
                        Case{Tier::kG2, "snap", &b, Tier::kG2}}) {
    asked = 0;
    auto r = store_->Get(c.tier, c.key, dest);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->found);
    EXPECT_TRUE(r->in_dest);
    EXPECT_TRUE(r->value.empty());
    EXPECT_EQ(r->tier, c.served);
    ASSERT_EQ(asked, c.want->size());
    EXPECT_TRUE(buffer.compare(0, asked, *c.want) == 0);
  }
  auto declined = store_->Get(Tier::kG3, AsBytes(keys[1]), [](size_t) { return nullptr; });
  ASSERT_TRUE(declined.ok());
  EXPECT_FALSE(declined->in_dest);
  EXPECT_TRUE(declined->value == b);
  auto miss = store_->Get(Tier::kG3, AsBytes(Chain(1, 99)[0]), dest);
  ASSERT_TRUE(miss.ok());
  EXPECT_FALSE(miss->found);
  EXPECT_FALSE(miss->in_dest);
  EXPECT_EQ(MetricValue(registry_, "epd_kv_hits_total", {{"tier", "g3"}}), 2);
}

// Every hit into a destination comes with a checksum the reader can check its copy against: G3's
// stored (seeded) one, verified over the copy; after a G3 hit promotes the block into G1, the G1
// hit carries that same checksum (the promotion hashes nothing again); a block put into G1 carries
// the XXH3-64 of the bytes put (seed 0).
TEST_F(KvStoreTest, HitsIntoADestinationCarryAChecksumOfTheBytesStored) {
  const auto keys = Chain(2);
  const std::string a = Payload(3, kBlock - 7), b = Payload(4, kBlock);
  ASSERT_TRUE(store_->Put(Tier::kG3, AsBytes(keys[0]), Bytes(a)).ok());
  ASSERT_TRUE(store_->Put(Tier::kG1, AsBytes(keys[1]), Bytes(b)).ok());
  std::string buffer(kBlock, '\0');
  ValueDest dest = [&](size_t) { return reinterpret_cast<uint8_t*>(buffer.data()); };
  auto check = [&](std::string_view key, const std::string& want, Tier served) {
    auto r = store_->Get(Tier::kAuto, key, dest);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->found && r->in_dest);
    EXPECT_EQ(r->tier, served);
    ASSERT_TRUE(r->has_checksum);
    EXPECT_EQ(common::Xxh3_64(Bytes(want), r->checksum_seed), r->checksum);
    EXPECT_EQ(buffer.compare(0, want.size(), want), 0);
  };
  ASSERT_FALSE(store_->g1()->Contains(keys[0]));
  check(AsBytes(keys[0]), a, Tier::kG3);  // and promoted
  ASSERT_TRUE(store_->g1()->Contains(keys[0]));
  auto g3 = store_->Get(Tier::kG3, AsBytes(keys[0]), dest);
  ASSERT_TRUE(g3.ok() && g3->has_checksum);
  EXPECT_NE(g3->checksum_seed, 0u);  // G3's seed comes from the value's header
  auto g1 = store_->Get(Tier::kAuto, AsBytes(keys[0]), dest);
  ASSERT_TRUE(g1.ok());
  EXPECT_EQ(g1->tier, Tier::kG1);
  EXPECT_EQ(g1->checksum, g3->checksum);
  EXPECT_EQ(g1->checksum_seed, g3->checksum_seed);
  check(AsBytes(keys[0]), a, Tier::kG1);
  check(AsBytes(keys[1]), b, Tier::kG1);
}

}  // namespace
}  // namespace epd::kvstore
