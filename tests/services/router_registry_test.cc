// Registry and scheduler: registration, the fingerprint pairing rule, heartbeat expiry on a fake
// clock, failure marking, least-loaded picks, and the route decisions.
#include <gtest/gtest.h>

#include "common/clock.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "services/router/prefix_oracle.h"
#include "services/router/registry.h"
#include "services/router/scheduler.h"

namespace epd::services::router {
namespace {

WorkerInfo Worker(const std::string& id, PoolKind pool, const std::string& fp = "fp1") {
  WorkerInfo w;
  w.id = id;
  w.pool = pool;
  w.control_address = "127.0.0.1:1";
  w.transfer_address = "t://" + id;
  w.fingerprint = fp;
  w.model = "m";
  return w;
}

std::string Scrape(prometheus::Registry& reg) {
  return prometheus::TextSerializer().Serialize(reg.Collect());
}

class RegistryTest : public ::testing::Test {
 protected:
  RegistryTest() : registry_(Options(), clock_, metrics_) {}
  static RegistryOptions Options() {
    RegistryOptions o;
    o.heartbeat_interval_ms = 100;
    o.heartbeat_miss_limit = 3;
    return o;
  }
  common::FakeClock clock_;
  prometheus::Registry metrics_;
  Registry registry_;
};

TEST_F(RegistryTest, FingerprintMismatchIsRefusedAcrossPoolsAndExplained) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode, "fpA")).ok());
  absl::Status s = registry_.Register(Worker("e0", PoolKind::kEncoder, "fpB"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("fpB"), absl::string_view::npos);
  EXPECT_NE(s.message().find("fpA"), absl::string_view::npos);
  EXPECT_EQ(registry_.Count(PoolKind::kEncoder), 0);
  ASSERT_EQ(registry_.RecentRefusals().size(), 1u);
  EXPECT_NE(registry_.RecentRefusals()[0].find("e0"), std::string::npos);
  EXPECT_NE(
      Scrape(metrics_).find("epd_router_registrations_total{outcome=\"fingerprint_mismatch\"} 1"),
      std::string::npos);
  // Same fingerprint pairs fine; once every fpA worker is gone, a new fingerprint may start.
  EXPECT_TRUE(registry_.Register(Worker("e1", PoolKind::kEncoder, "fpA")).ok());
  registry_.MarkFailed("d0", "test");
  registry_.MarkFailed("e1", "test");
  EXPECT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder, "fpB")).ok());
  EXPECT_EQ(registry_.Fingerprint(), "fpB");
}

TEST_F(RegistryTest, RefusesMissingFields) {
  WorkerInfo w = Worker("d0", PoolKind::kDecode);
  w.control_address.clear();
  EXPECT_EQ(registry_.Register(w).code(), absl::StatusCode::kInvalidArgument);
  w = Worker("d0", PoolKind::kDecode);
  w.fingerprint.clear();
  EXPECT_EQ(registry_.Register(w).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.Count(PoolKind::kDecode), 0);
}

TEST_F(RegistryTest, MissedHeartbeatsExpireAWorkerAndItMustRegisterAgain) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  for (int i = 0; i < 5; ++i) {
    clock_.AdvanceMs(100);
    EXPECT_TRUE(registry_.Heartbeat("d1", "fp1", {}, false));
    EXPECT_EQ(registry_.ExpireStale().size(), i == 3 ? 1u : 0u) << i;
  }
  EXPECT_EQ(registry_.Count(PoolKind::kDecode), 1);
  EXPECT_FALSE(registry_.Heartbeat("d0", "fp1", {}, false));  // forgotten: register again
  EXPECT_NE(Scrape(metrics_).find("epd_router_workers{pool=\"decode\"} 1"), std::string::npos);
  EXPECT_NE(Scrape(metrics_).find("epd_router_worker_expiries_total 1"), std::string::npos);
  // A heartbeat with a changed fingerprint is refused too.
  EXPECT_FALSE(registry_.Heartbeat("d1", "fp2", {}, false));
  EXPECT_EQ(registry_.Count(PoolKind::kDecode), 0);
}

TEST_F(RegistryTest, PicksTheLeastLoadedAndSkipsDraining) {
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_TRUE(registry_.Register(Worker(id, PoolKind::kDecode)).ok());
  }
  registry_.Heartbeat("a", "fp1", {.queue_depth = 5}, false);
  registry_.Heartbeat("b", "fp1", {.running_requests = 1}, false);
  registry_.Heartbeat("c", "fp1", {}, true);  // draining
  auto w = registry_.Pick(PoolKind::kDecode);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->id, "b");
  // b now has 1 running (reported) and 1 in flight from us; still below a's 5.
  EXPECT_EQ(registry_.Pick(PoolKind::kDecode)->id, "b");
  EXPECT_EQ(registry_.Pick(PoolKind::kDecode)->id, "b");
  // Router-side in-flight counts once heartbeats lag: b has 3 in flight now.
  registry_.Heartbeat("a", "fp1", {.queue_depth = 2}, false);
  EXPECT_EQ(registry_.Pick(PoolKind::kDecode)->id, "a");
  EXPECT_FALSE(registry_.Pick(PoolKind::kEncoder).has_value());
  // The queue gauge sums the heartbeats.
  EXPECT_NE(Scrape(metrics_).find("epd_router_queue_depth{pool=\"decode\"} 2"), std::string::npos);
}

TEST_F(RegistryTest, EqualLoadsShareWork) {
  for (const char* id : {"a", "b"}) {
    ASSERT_TRUE(registry_.Register(Worker(id, PoolKind::kDecode)).ok());
  }
  int a = 0;
  for (int i = 0; i < 10; ++i) {
    auto w = registry_.Pick(PoolKind::kDecode);
    a += w->id == "a";
    registry_.Release(w->id);
  }
  EXPECT_EQ(a, 5);
}

class FixedOracle final : public PrefixOracle {
 public:
  PrefixHint Lookup(const std::vector<int32_t>&, const std::string& fp) override {
    last_fp = fp;
    return hint;
  }
  PrefixHint hint;
  std::string last_fp;
};

TEST_F(RegistryTest, SchedulerBuildsTheChainFromLivePoolsAndUsesThePrefixHint) {
  FixedOracle oracle;
  Scheduler sched({.direct_decode_max_tokens = 4}, registry_, oracle, metrics_);
  EXPECT_EQ(sched.Schedule({1, 2, 3}).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  std::vector<int32_t> prompt(10, 7);
  // Prefill needs an encoder's hand-off: with no live encoder, decode computes the whole prompt
  // (a "pd" chain would send prefill a job it must refuse), and the prefill worker is not held.
  auto plan = sched.Schedule(prompt);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->route, "d");
  EXPECT_FALSE(plan->prefill.has_value());
  EXPECT_EQ(plan->fingerprint, "fp1");
  sched.Release(*plan);
  // Decode cannot start from an encoder's output either: an encoder with no live prefill worker
  // is not used (nor held).
  registry_.MarkFailed("p0", "test");
  ASSERT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder)).ok());
  plan = sched.Schedule(prompt);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->route, "d");
  EXPECT_FALSE(plan->encoder.has_value());
  EXPECT_FALSE(plan->prefill.has_value());
  sched.Release(*plan);
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  oracle.hint = {.cached_tokens = 8, .workers = {"d1"}};
  // 2 uncached tokens <= 4: decode alone, on the worker holding the prefix.
  plan = sched.Schedule(prompt);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->route, "d");
  EXPECT_EQ(plan->decode.id, "d1");
  EXPECT_EQ(plan->cached_tokens, 8);
  EXPECT_EQ(oracle.last_fp, "fp1");
  sched.Release(*plan);
  oracle.hint = {};
  plan = sched.Schedule(prompt);
  EXPECT_EQ(plan->route, "epd");
  const std::string text = Scrape(metrics_);
  EXPECT_NE(text.find("epd_route_decisions_total{route=\"epd\"} 1"), std::string::npos);
  EXPECT_NE(text.find("epd_route_decisions_total{route=\"d\"} 3"), std::string::npos);
}

// The tail rule: with an encoder in the chain the prefix hint never reaches into the last
// prefix_tail_rows prompt rows (the decoder replays them from the encoder's residuals), and it
// stays whole blocks.
TEST_F(RegistryTest, SchedulerCapsThePrefixHintToLeaveTheTailToTheEncoder) {
  FixedOracle oracle;
  Scheduler sched({.prefix_block_tokens = 64, .prefix_tail_rows = 133}, registry_, oracle,
                  metrics_);
  ASSERT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder)).ok());
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  struct Case {
    int prompt, hint, want;
  };
  for (const Case c : {Case{600, 256, 256},  // 600 - 133 = 467 >= 256: the hint stands
                       Case{340, 256, 192},  // 340 - 133 = 207 -> 192
                       Case{200, 128, 64},   // 200 - 133 = 67 -> 64
                       Case{180, 128, 0},    // 47 rows of room: no whole block
                       Case{133, 64, 0}}) {  // nothing before the tail
    oracle.hint = {.cached_tokens = c.hint};
    auto plan = sched.Schedule(std::vector<int32_t>(c.prompt, 5));
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->route, "epd");
    EXPECT_EQ(plan->cached_tokens, c.want) << "prompt " << c.prompt << " hint " << c.hint;
    sched.Release(*plan);
  }
}

}  // namespace
}  // namespace epd::services::router
