// G1 hot tier (the kvstore daemon's G1): two-phase writes, LRU eviction of unreferenced blocks
// only, demotion of evicted blocks, pinning, and concurrent use.
#include "kvstore/g1_hot_tier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common/hash.h"
#include "tests/kvstore/test_util.h"

namespace epd::kvstore {
namespace {

using testing::Bytes;
using testing::Key;
using testing::MetricValue;
using testing::Payload;

constexpr size_t kBlock = 1024;

struct Fixture {
  explicit Fixture(uint32_t blocks) {
    G1Config c;
    c.block_bytes = kBlock;
    c.capacity_bytes = kBlock * blocks;
    pool = *G1HotTier::CreateHost(c, metrics, [this](const BlockHash& k, std::string bytes) {
      std::lock_guard<std::mutex> lock(mu);
      demoted[k] = std::move(bytes);
    });
  }
  prometheus::Registry registry;
  KvMetrics metrics{registry};
  std::mutex mu;
  std::map<BlockHash, std::string> demoted;
  std::unique_ptr<G1HotTier> pool;
};

TEST(G1HotTierTest, PutReadRoundTripsAndRejectsOversizedValues) {
  Fixture f(4);
  const std::string v = Payload(1, 700);
  ASSERT_TRUE(f.pool->Put(Key(1), Bytes(v)).ok());
  EXPECT_EQ(f.pool->Read(Key(1)).value(), v);
  EXPECT_FALSE(f.pool->Read(Key(2)).has_value());
  const std::string big = Payload(2, kBlock + 1);
  auto s = f.pool->Put(Key(3), Bytes(big));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_bad_requests_total", {{"reason", "value_size"}}), 1);
  EXPECT_EQ(f.pool->stats().entries, 1u);
  EXPECT_EQ(f.pool->stats().bytes, 700u);
}

// A block written by Put keeps the XXH3-64 of the bytes put, and ReadInto hands it to the reader
// (the daemon passes it to the client, which checks its copy against it): a page that changed
// after the put no longer matches, where a checksum of the copy would have matched it. A block
// filled through a Reservation (a DMA into the page) has no stored checksum.
TEST(G1HotTierTest, PutKeepsTheChecksumOfTheBytesPutAndAChangedPageNoLongerMatchesIt) {
  Fixture f(4);
  const std::string v = Payload(7, 900);
  ASSERT_TRUE(f.pool->Put(Key(1), Bytes(v)).ok());
  std::string copy;
  auto into = [&](size_t n) -> uint8_t* {
    copy.assign(n, '\0');
    return reinterpret_cast<uint8_t*>(copy.data());
  };
  bool in_dest = false;
  std::optional<ValueChecksum> checksum;
  ASSERT_TRUE(f.pool->ReadInto(Key(1), into, &in_dest, &checksum).has_value());
  ASSERT_TRUE(in_dest);
  ASSERT_TRUE(checksum.has_value());
  EXPECT_EQ(checksum->value, common::Xxh3_64(v));
  EXPECT_EQ(checksum->seed, 0u);
  EXPECT_EQ(copy, v);
  {  // a bit flips in the page after the put
    auto ref = f.pool->Acquire(Key(1));
    ASSERT_TRUE(ref.has_value());
    static_cast<uint8_t*>(ref->address())[123] ^= 0x10;
  }
  ASSERT_TRUE(f.pool->ReadInto(Key(1), into, &in_dest, &checksum).has_value());
  ASSERT_TRUE(checksum.has_value());
  EXPECT_NE(common::Xxh3_64(copy), checksum->value);  // the reader's check fails: caught

  auto r = f.pool->Reserve(Key(2), 100);
  ASSERT_TRUE(r.ok());
  std::memset(r->address(), 5, 100);
  ASSERT_TRUE(r->Commit().ok());
  ASSERT_TRUE(f.pool->ReadInto(Key(2), into, &in_dest, &checksum).has_value());
  EXPECT_TRUE(in_dest);
  EXPECT_FALSE(checksum.has_value());
  // Reused for a Put: the page's new block has its own checksum again.
  ASSERT_TRUE(f.pool->Erase(Key(2)));
  const std::string w = Payload(8, 300);
  ASSERT_TRUE(f.pool->Put(Key(3), Bytes(w)).ok());
  ASSERT_TRUE(f.pool->ReadInto(Key(3), into, &in_dest, &checksum).has_value());
  ASSERT_TRUE(checksum.has_value());
  EXPECT_EQ(checksum->value, common::Xxh3_64(w));
  // A checksum the caller already verified over the bytes (a G3 hit's, seeded) is kept as given.
  const std::string x = Payload(9, 500);
  ASSERT_TRUE(f.pool->Put(Key(4), Bytes(x), ValueChecksum{common::Xxh3_64(Bytes(x), 77), 77}).ok());
  ASSERT_TRUE(f.pool->ReadInto(Key(4), into, &in_dest, &checksum).has_value());
  ASSERT_TRUE(checksum.has_value());
  EXPECT_EQ(checksum->seed, 77u);
  EXPECT_EQ(checksum->value, common::Xxh3_64(Bytes(copy), 77));
}

TEST(G1HotTierTest, ReservationIsInvisibleUntilCommitAndFreedIfAbandoned) {
  Fixture f(2);
  {
    auto r = f.pool->Reserve(Key(1), 100);
    ASSERT_TRUE(r.ok());
    std::memset(r->address(), 0xab, 100);
    EXPECT_FALSE(f.pool->Contains(Key(1)));
    EXPECT_FALSE(f.pool->Read(Key(1)).has_value());
    ASSERT_TRUE(r->Commit().ok());
  }
  EXPECT_EQ(f.pool->Read(Key(1)).value(), std::string(100, '\xab'));
  {
    auto r = f.pool->Reserve(Key(2), 10);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(f.pool->stats().free_blocks, 0u);
  }  // abandoned
  EXPECT_EQ(f.pool->stats().free_blocks, 1u);
  EXPECT_FALSE(f.pool->Contains(Key(2)));
}

TEST(G1HotTierTest, EvictsLeastRecentlyUsedAndDemotesIt) {
  Fixture f(3);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pool->Put(Key(i), Bytes(Payload(i, 500))).ok());
  ASSERT_TRUE(f.pool->Read(Key(0)).has_value());  // 0 becomes most recent; 1 is now LRU
  ASSERT_TRUE(f.pool->Put(Key(3), Bytes(Payload(3, 500))).ok());
  EXPECT_FALSE(f.pool->Contains(Key(1)));
  EXPECT_TRUE(f.pool->Contains(Key(0)));
  EXPECT_TRUE(f.pool->Contains(Key(2)));
  ASSERT_EQ(f.demoted.count(Key(1)), 1u);
  EXPECT_EQ(f.demoted[Key(1)], Payload(1, 500));  // the evicted bytes, intact
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_evictions_total", {{"tier", "g1"}}), 1);
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_demotions_total", {{"tier", "g1"}}), 1);
}

TEST(G1HotTierTest, NeverEvictsReferencedOrPinnedBlocks) {
  Fixture f(3);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pool->Put(Key(i), Bytes(Payload(i, 64))).ok());
  auto ref0 = f.pool->Acquire(Key(0));  // oldest, but referenced
  ASSERT_TRUE(ref0.has_value());
  ASSERT_TRUE(f.pool->Pin(Key(1)));  // next oldest, pinned
  // Fill far past capacity: only block 2 and the newcomers may go.
  for (int i = 10; i < 30; ++i) ASSERT_TRUE(f.pool->Put(Key(i), Bytes(Payload(i, 64))).ok());
  EXPECT_TRUE(f.pool->Contains(Key(0)));
  EXPECT_TRUE(f.pool->Contains(Key(1)));
  EXPECT_FALSE(f.pool->Contains(Key(2)));
  EXPECT_EQ(std::string(static_cast<const char*>(ref0->address()), 64), Payload(0, 64));
  // With every page referenced or pinned, a put fails instead of evicting one of them.
  auto ref29 = f.pool->Acquire(Key(29));
  auto full = f.pool->Put(Key(100), Bytes(Payload(100, 64)));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  // Releasing makes the block evictable again.
  ref0.reset();
  ASSERT_TRUE(f.pool->Put(Key(100), Bytes(Payload(100, 64))).ok());
  EXPECT_FALSE(f.pool->Contains(Key(0)));
  EXPECT_TRUE(f.pool->Contains(Key(1)));
  EXPECT_TRUE(f.pool->Unpin(Key(1)));
  EXPECT_FALSE(f.pool->Unpin(Key(1)));
  EXPECT_FALSE(f.pool->Erase(Key(29)));  // still referenced
  ref29.reset();
  EXPECT_TRUE(f.pool->Erase(Key(29)));
}

TEST(G1HotTierTest, ConcurrentWritersAndReadersSeeOnlyWholeValues) {
  Fixture f(16);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 400; ++i) {
        const int k = (i * 7 + t) % 40;
        const std::string v = Payload(k, 256 + k);
        (void)f.pool->Put(Key(k), Bytes(v));
        if (auto got = f.pool->Read(Key((k + 3) % 40)); got.has_value()) {
          const int kk = (k + 3) % 40;
          if (*got != Payload(kk, 256 + kk)) ++bad;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_LE(f.pool->stats().entries, 16u);
}

}  // namespace
}  // namespace epd::kvstore
