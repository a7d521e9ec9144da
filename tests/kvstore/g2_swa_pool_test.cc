// G2 SWA pool: TTL from the put (FakeClock, no sleeps) reported as "expired", reads never extend
// the TTL, expired entries go before LRU victims, two-phase puts, capacity accounting.
#include "kvstore/g2_swa_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "tests/kvstore/test_util.h"

namespace epd::kvstore {
namespace {

using testing::Bytes;
using testing::MetricValue;
using testing::Payload;

constexpr int64_t kMinute = 60'000;

struct Fixture {
  explicit Fixture(uint64_t capacity, int64_t ttl_ms = 5 * kMinute) {
    G2Config c;
    c.capacity_bytes = capacity;
    c.ttl_ms = ttl_ms;
    pool = std::make_unique<G2SwaPool>(c, clock, metrics);
  }
  common::FakeClock clock;
  prometheus::Registry registry;
  KvMetrics metrics{registry};
  std::unique_ptr<G2SwaPool> pool;
};

TEST(G2SwaPoolTest, DefaultCapacityIsAboutATenthOfHostMemory) {
  const uint64_t c = DefaultSwaCapacityBytes();
  EXPECT_GT(c, 0u);
  EXPECT_EQ(G2Config{}.capacity_bytes, c);
  EXPECT_EQ(G2Config{}.ttl_ms, 10 * kMinute);
}

TEST(G2SwaPoolTest, SnapshotExpiresAfterItsTtlAndIsReportedExpired) {
  Fixture f(1 << 20);
  ASSERT_TRUE(f.pool->Put("s1", Bytes(Payload(1, 1000))).ok());
  f.clock.AdvanceMs(5 * kMinute - 1);
  auto hit = f.pool->Get("s1");
  ASSERT_NE(hit.value, nullptr);
  EXPECT_EQ(*hit.value, Payload(1, 1000));
  EXPECT_TRUE(f.pool->Contains("s1"));
  f.clock.AdvanceMs(1);
  EXPECT_FALSE(f.pool->Contains("s1"));
  auto miss = f.pool->Get("s1");
  EXPECT_EQ(miss.value, nullptr);
  EXPECT_EQ(miss.miss, MissReason::kExpired);
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_ttl_expiries_total", {{"tier", "g2"}}), 1);
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_misses_total", {{"tier", "g2"}, {"reason", "expired"}}),
            1);
  EXPECT_EQ(f.pool->Get("s1").miss, MissReason::kAbsent);  // dropped on the expired read
  EXPECT_EQ(f.pool->stats().bytes, 0u);
}

TEST(G2SwaPoolTest, ReadsNeverExtendTheTtlButAPutRestartsIt) {
  Fixture f(1 << 20);
  ASSERT_TRUE(f.pool->Put("s", Bytes(Payload(1, 10))).ok());
  for (int i = 0; i < 4; ++i) {
    f.clock.AdvanceMs(kMinute);
    ASSERT_NE(f.pool->Get("s").value, nullptr);
  }
  f.clock.AdvanceMs(kMinute);  // 5 minutes after the put, despite the reads
  EXPECT_EQ(f.pool->Get("s").miss, MissReason::kExpired);
  ASSERT_TRUE(f.pool->Put("s", Bytes(Payload(2, 10))).ok());
  f.clock.AdvanceMs(4 * kMinute);
  ASSERT_TRUE(f.pool->Put("s", Bytes(Payload(3, 10))).ok());  // re-put restarts the TTL
  f.clock.AdvanceMs(4 * kMinute);
  auto r = f.pool->Get("s");
  ASSERT_NE(r.value, nullptr);
  EXPECT_EQ(*r.value, Payload(3, 10));
}

TEST(G2SwaPoolTest, CapacityEvictsExpiredFirstThenLeastRecentlyUsed) {
  Fixture f(4000);
  ASSERT_TRUE(f.pool->Put("old", Bytes(Payload(0, 1000))).ok());
  f.clock.AdvanceMs(3 * kMinute);
  ASSERT_TRUE(f.pool->Put("a", Bytes(Payload(1, 1000))).ok());
  ASSERT_TRUE(f.pool->Put("b", Bytes(Payload(2, 1000))).ok());
  ASSERT_TRUE(f.pool->Put("c", Bytes(Payload(3, 1000))).ok());
  // "old" is the LRU entry, but touch it so that "a" is least recently used instead.
  ASSERT_NE(f.pool->Get("old").value, nullptr);
  f.clock.AdvanceMs(2 * kMinute);  // now "old" has expired, a/b/c have not
  ASSERT_TRUE(f.pool->Put("d", Bytes(Payload(4, 1000))).ok());
  EXPECT_FALSE(f.pool->Contains("old"));  // expired: dropped first
  EXPECT_TRUE(f.pool->Contains("a"));     // so no LRU victim was needed
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_evictions_total", {{"tier", "g2"}}), 0);
  // A reader takes "b", then c, d and a are used: LRU order (oldest first) is b, c, d, a.
  const auto held_b = f.pool->Get("b").value;
  ASSERT_NE(held_b, nullptr);
  for (const char* k : {"c", "d", "a"}) ASSERT_NE(f.pool->Get(k).value, nullptr);
  ASSERT_TRUE(f.pool->Put("e", Bytes(Payload(5, 1500))).ok());
  EXPECT_FALSE(f.pool->Contains("b"));
  EXPECT_FALSE(f.pool->Contains("c"));
  EXPECT_TRUE(f.pool->Contains("d"));
  EXPECT_TRUE(f.pool->Contains("a"));
  EXPECT_TRUE(f.pool->Contains("e"));
  EXPECT_EQ(*held_b, Payload(2, 1000));  // the evicted value a reader holds stays whole
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_evictions_total", {{"tier", "g2"}}), 2);
  EXPECT_LE(f.pool->stats().bytes, 4000u);
}

TEST(G2SwaPoolTest, TwoPhasePutIsInvisibleUntilCommitAndHoldsItsCapacity) {
  Fixture f(3000);
  ASSERT_TRUE(f.pool->Put("k", Bytes(Payload(1, 1000))).ok());
  auto pending = f.pool->BeginPut("k", 1000);
  ASSERT_TRUE(pending.ok());
  std::memset(pending->data(), 0x5a, 500);  // half written
  auto mid = f.pool->Get("k");
  ASSERT_NE(mid.value, nullptr);
  EXPECT_EQ(*mid.value, Payload(1, 1000));  // readers still see the old, whole value
  // Reservations count against capacity: 2000 more bytes fit only by evicting the published
  // copy of "k" (LRU), and after that nothing evictable is left for another 1000.
  auto p2 = f.pool->BeginPut("x", 2000);
  ASSERT_TRUE(p2.ok());
  EXPECT_FALSE(f.pool->Contains("k"));
  auto p3 = f.pool->BeginPut("y", 1000);
  EXPECT_EQ(p3.status().code(), absl::StatusCode::kResourceExhausted);
  std::memset(pending->data() + 500, 0x5a, 500);
  ASSERT_TRUE(pending->Commit().ok());
  auto after = f.pool->Get("k");
  ASSERT_NE(after.value, nullptr);
  EXPECT_EQ(*after.value, std::string(1000, '\x5a'));
  { auto abandoned = std::move(*p2); }  // dropped without Commit: nothing published
  EXPECT_FALSE(f.pool->Contains("x"));
  EXPECT_EQ(f.pool->stats().reserved_bytes, 0u);
}

TEST(G2SwaPoolTest, RejectsBadKeysAndOversizedValuesWithCounts) {
  Fixture f(100);
  EXPECT_EQ(f.pool->Put("", Bytes(Payload(1, 1))).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.pool->Put("k", Bytes(Payload(1, 101))).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_bad_requests_total", {}), 2);
}

TEST(G2SwaPoolTest, ExpireNowSweepsAndCounts) {
  Fixture f(1 << 20, kMinute);
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(f.pool->Put(std::to_string(i), Bytes(Payload(i, 10))).ok());
  f.clock.AdvanceMs(kMinute / 2);
  ASSERT_TRUE(f.pool->Put("late", Bytes(Payload(9, 10))).ok());
  f.clock.AdvanceMs(kMinute / 2);
  EXPECT_EQ(f.pool->ExpireNow(), 5u);
  EXPECT_TRUE(f.pool->Contains("late"));
  // A get after the sweep still says why: "expired", once; a re-put clears that.
  EXPECT_EQ(f.pool->Get("0").miss, MissReason::kExpired);
  EXPECT_EQ(f.pool->Get("0").miss, MissReason::kAbsent);
  ASSERT_TRUE(f.pool->Put("1", Bytes(Payload(1, 10))).ok());
  EXPECT_NE(f.pool->Get("1").value, nullptr);
  EXPECT_EQ(f.pool->Get("never").miss, MissReason::kAbsent);
  EXPECT_EQ(MetricValue(f.registry, "epd_kv_ttl_expiries_total", {{"tier", "g2"}}), 5);
}

TEST(G2SwaPoolTest, ConcurrentPutsAndGetsNeverMixValues) {
  Fixture f(64 * 2048);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        const int k = (i + t * 13) % 100;
        (void)f.pool->Put(std::to_string(k), Bytes(Payload(k, 1000 + k)));
        auto r = f.pool->Get(std::to_string((k + 1) % 100));
        if (r.value != nullptr && *r.value != Payload((k + 1) % 100, 1000 + (k + 1) % 100)) ++bad;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_LE(f.pool->stats().bytes, 64u * 2048);
}

}  // namespace
}  // namespace epd::kvstore
