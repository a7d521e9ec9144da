// The router's per-pool replica recommendation (services/router/replica_planner.h): the pure rule,
// and the planner reading the router's own registry (the series Registry and RouterCore export).
#include "services/router/replica_planner.h"

#include <gtest/gtest.h>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace epd::services::router {
namespace {

double Gauge(prometheus::Registry& reg, const std::string& name, const std::string& pool) {
  for (const auto& f : reg.Collect()) {
    if (f.name != name) continue;
    for (const auto& m : f.metric)
      for (const auto& l : m.label)
        if (l.name == "pool" && l.value == pool) return m.gauge.value;
  }
  return -1;
}

TEST(RecommendReplicasTest, QueueDepthAgainstTheTargetPerWorker) {
  PlannerOptions o;
  o.target_queue = {2, 2, 8};
  EXPECT_EQ(RecommendReplicas(PoolKind::kDecode, {.workers = 1, .queue_depth = 0}, o), 1);
  EXPECT_EQ(RecommendReplicas(PoolKind::kDecode, {.workers = 1, .queue_depth = 8}, o), 1);
  EXPECT_EQ(RecommendReplicas(PoolKind::kDecode, {.workers = 1, .queue_depth = 9}, o), 2);
  EXPECT_EQ(RecommendReplicas(PoolKind::kDecode, {.workers = 3, .queue_depth = 24}, o), 3);
  EXPECT_EQ(RecommendReplicas(PoolKind::kEncoder, {.workers = 1, .queue_depth = 5}, o), 3);
  // No workers and no load: still one (a pool never goes to zero).
  EXPECT_EQ(RecommendReplicas(PoolKind::kPrefill, {}, o), 1);
  o.max_replicas = 4;
  EXPECT_EQ(RecommendReplicas(PoolKind::kEncoder, {.workers = 1, .queue_depth = 100}, o), 4);
}

TEST(RecommendReplicasTest, LatencyAgainstItsTarget) {
  PlannerOptions o;
  o.target_ttft_ms = 500;
  o.target_itl_ms = 50;
  // TTFT twice the target with 2 prefill workers: 4.
  EXPECT_EQ(
      RecommendReplicas(PoolKind::kPrefill, {.workers = 2, .mean_latency_s = 1.0}, o), 4);
  // ITL at 0.4x its target on 3 workers: 2 would do.
  EXPECT_EQ(RecommendReplicas(PoolKind::kDecode,
                              {.workers = 3, .queue_depth = 1, .mean_latency_s = 0.02}, o),
            2);
  // ITL 1.5x the target with 2 decode workers: 3.
  EXPECT_EQ(
      RecommendReplicas(PoolKind::kDecode, {.workers = 2, .mean_latency_s = 0.075}, o), 3);
  // No samples this interval: no latency signal.
  EXPECT_EQ(RecommendReplicas(PoolKind::kDecode, {.workers = 5, .mean_latency_s = -1}, o), 1);
  o.target_itl_ms = 0;  // off
  EXPECT_EQ(RecommendReplicas(PoolKind::kDecode, {.workers = 2, .mean_latency_s = 9}, o), 1);
}

TEST(PlannerOptionsTest, RefusesBadTargets) {
  PlannerOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.target_queue[2] = 0;
  EXPECT_FALSE(o.Validate().ok());
  o = PlannerOptions{};
  o.target_itl_ms = -1;
  EXPECT_FALSE(o.Validate().ok());
  o = PlannerOptions{};
  o.max_replicas = 0;
  EXPECT_FALSE(o.Validate().ok());
}

TEST(ReplicaPlannerTest, ReadsTheRoutersSeriesAndExportsOneGaugePerPool) {
  prometheus::Registry reg;
  auto& workers = prometheus::BuildGauge().Name("epd_router_workers").Register(reg);
  auto& queue = prometheus::BuildGauge().Name("epd_router_queue_depth").Register(reg);
  const prometheus::Histogram::BucketBoundaries b = {0.01, 0.1, 1, 10};
  auto& ttft = prometheus::BuildHistogram().Name("epd_ttft_seconds").Register(reg).Add({}, b);
  auto& itl = prometheus::BuildHistogram().Name("epd_itl_seconds").Register(reg).Add({}, b);
  for (const char* p : {"encoder", "prefill", "decode"}) workers.Add({{"pool", p}}).Set(1);
  queue.Add({{"pool", "encoder"}}).Set(0);
  queue.Add({{"pool", "prefill"}}).Set(0);
  queue.Add({{"pool", "decode"}}).Set(20);

  PlannerOptions o;
  o.target_queue = {2, 2, 8};
  o.target_ttft_ms = 100;
  o.target_itl_ms = 10;
  ReplicaPlanner planner(o, reg);
  EXPECT_EQ(Gauge(reg, "epd_router_recommended_replicas", "decode"), 1);  // before any update
  for (int i = 0; i < 4; ++i) ttft.Observe(0.3);  // mean 300 ms against 100
  itl.Observe(0.005);
  planner.Update();
  EXPECT_EQ(planner.recommended(PoolKind::kDecode), 3);  // ceil(20 / 8); ITL under target
  EXPECT_EQ(planner.recommended(PoolKind::kPrefill), 3);  // ceil(1 * 300 / 100)
  EXPECT_EQ(planner.recommended(PoolKind::kEncoder), 3);
  EXPECT_EQ(Gauge(reg, "epd_router_recommended_replicas", "decode"), 3);
  EXPECT_EQ(Gauge(reg, "epd_router_recommended_replicas", "prefill"), 3);

  // The next interval: fast first tokens, slow decode steps; the means are of the new samples.
  ttft.Observe(0.05);
  for (int i = 0; i < 10; ++i) itl.Observe(0.04);  // 40 ms against 10 ms, 1 worker
  queue.Add({{"pool", "decode"}}).Set(0);
  planner.Update();
  EXPECT_EQ(planner.recommended(PoolKind::kPrefill), 1);
  EXPECT_EQ(planner.recommended(PoolKind::kDecode), 4);
  // An interval with no requests: back to the queue rule.
  planner.Update();
  EXPECT_EQ(planner.recommended(PoolKind::kDecode), 1);
  EXPECT_EQ(Gauge(reg, "epd_router_recommended_replicas", "decode"), 1);
}

}  // namespace
}  // namespace epd::services::router
