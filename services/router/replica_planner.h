#pragma once

// Per-pool recommended replica counts from the observed load (docs/router.md "Autoscaling
// signals"), in the spirit of NVIDIA Dynamo's planner, for operators without an HPA (or for an
// HPA that follows the router through the External metric in deploy/k8s):
//   queue:   ceil(queue_depth / target_queue_per_worker[pool])
//   latency: encoder and prefill: ceil(workers * mean TTFT / target TTFT)  (TTFT is their cost)
//            decode:              ceil(workers * mean ITL / target ITL)
//   recommended = clamp(max(1, queue, latency), 1, max_replicas)
// The planner reads only the router's own Prometheus registry (epd_router_workers{pool},
// epd_queue_depth{pool}, the epd_ttft_seconds and epd_itl_seconds histograms; the means are over
// the last planning interval) and exports epd_router_recommended_replicas{pool}.
// Thread-safety: Update() from one thread; recommended() from any.
#include <array>
#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "services/router/registry.h"

namespace epd::services::router {

struct PlannerOptions {
  // Jobs per worker a pool should run at most (encoder, prefill, decode). Default: 2, 2, 8.
  std::array<double, kNumPools> target_queue = {2, 2, 8};
  double target_ttft_ms = 0;  // 0 = no TTFT target. Default: off
  double target_itl_ms = 0;   // 0 = no ITL target. Default: off
  int max_replicas = 64;      // Default: 64
  int interval_ms = 5000;     // how often the router updates the gauges. Default: 5 s
  absl::Status Validate() const;
};

// What the planner saw of one pool.
struct PoolObservation {
  int workers = 0;           // live registered workers
  double queue_depth = 0;    // jobs running or queued on them (their heartbeats, summed)
  double mean_latency_s = -1;  // mean TTFT (encoder/prefill) or ITL (decode); < 0: no samples
};

// The recommendation for one pool (pure; see the header comment for the rule).
int RecommendReplicas(PoolKind pool, const PoolObservation& seen, const PlannerOptions& options);

class ReplicaPlanner {
 public:
  // `metrics` is the router's registry: read on Update(), and where the gauge is registered.
  ReplicaPlanner(PlannerOptions options, prometheus::Registry& metrics);
  // Reads the registry, recomputes every pool, sets the gauges.
  void Update();
  int recommended(PoolKind pool) const { return recommended_[static_cast<int>(pool)].load(); }
  const PlannerOptions& options() const { return options_; }

 private:
  PlannerOptions options_;
  prometheus::Registry& metrics_;
  std::array<prometheus::Gauge*, kNumPools> gauges_{};
  std::array<std::atomic<int>, kNumPools> recommended_{};
  // Histogram totals at the previous Update (count, sum) for TTFT and ITL.
  double ttft_count_ = 0, ttft_sum_ = 0, itl_count_ = 0, itl_sum_ = 0;
};

}  // namespace epd::services::router
