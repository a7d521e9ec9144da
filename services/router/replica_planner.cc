#include "services/router/replica_planner.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace epd::services::router {
namespace {

// The value of `label`="value" on a metric, or "".
std::string Label(const prometheus::ClientMetric& m, const std::string& name) {
  for (const auto& l : m.label) {
    if (l.name == name) return l.value;
  }
  return "";
}

int PoolIndex(const std::string& name) {
  for (int p = 0; p < kNumPools; ++p) {
    if (name == PoolName(static_cast<PoolKind>(p))) return p;
  }
  return -1;
}

}  // namespace

absl::Status PlannerOptions::Validate() const {
  for (int p = 0; p < kNumPools; ++p) {
    if (!(target_queue[p] > 0))
      return absl::InvalidArgumentError(absl::StrCat("target queue per ",
                                                     PoolName(static_cast<PoolKind>(p)),
                                                     " worker must be > 0"));
  }
  if (target_ttft_ms < 0 || target_itl_ms < 0)
    return absl::InvalidArgumentError("latency targets must be >= 0 (0 = off)");
  if (max_replicas < 1) return absl::InvalidArgumentError("max replicas must be >= 1");
  if (interval_ms < 100) return absl::InvalidArgumentError("planner interval must be >= 100 ms");
  return absl::OkStatus();
}

int RecommendReplicas(PoolKind pool, const PoolObservation& seen, const PlannerOptions& o) {
  const int p = static_cast<int>(pool);
  double want = 1;
  want = std::max(want, std::ceil(std::max(0.0, seen.queue_depth) / o.target_queue[p]));
  const double target_ms = pool == PoolKind::kDecode ? o.target_itl_ms : o.target_ttft_ms;
  if (target_ms > 0 && seen.mean_latency_s >= 0 && seen.workers > 0) {
    want = std::max(want, std::ceil(seen.workers * seen.mean_latency_s * 1000.0 / target_ms));
  }
  return static_cast<int>(std::clamp(want, 1.0, static_cast<double>(o.max_replicas)));
}

ReplicaPlanner::ReplicaPlanner(PlannerOptions options, prometheus::Registry& metrics)
    : options_(options), metrics_(metrics) {
  auto& family =
      prometheus::BuildGauge()
          .Name("epd_router_recommended_replicas")
          .Help(
              "Replicas each pool should run for the observed load: queue depth per worker and "
              "TTFT (encoder, prefill) / ITL (decode) against the router's --target-* flags")
          .Register(metrics);
  for (int p = 0; p < kNumPools; ++p) {
    gauges_[p] = &family.Add({{"pool", PoolName(static_cast<PoolKind>(p))}});
    gauges_[p]->Set(1);
    recommended_[p].store(1);
  }
}

void ReplicaPlanner::Update() {
  std::array<PoolObservation, kNumPools> seen{};
  double ttft_count = ttft_count_, ttft_sum = ttft_sum_, itl_count = itl_count_,
         itl_sum = itl_sum_;
  for (const auto& family : metrics_.Collect()) {
    if (family.name == "epd_router_workers" || family.name == "epd_router_queue_depth") {
      for (const auto& m : family.metric) {
        const int p = PoolIndex(Label(m, "pool"));
        if (p < 0) continue;
        if (family.name == "epd_router_workers") {
          seen[p].workers = static_cast<int>(m.gauge.value);
        } else {
          seen[p].queue_depth = m.gauge.value;
        }
      }
    } else if (family.name == "epd_ttft_seconds" || family.name == "epd_itl_seconds") {
      double count = 0, sum = 0;
      for (const auto& m : family.metric) {
        count += static_cast<double>(m.histogram.sample_count);
        sum += m.histogram.sample_sum;
      }
      (family.name == "epd_ttft_seconds" ? ttft_count : itl_count) = count;
      (family.name == "epd_ttft_seconds" ? ttft_sum : itl_sum) = sum;
    }
  }
  // Means over the samples since the last update (none: no latency signal this round).
  const double dttft = ttft_count - ttft_count_, ditl = itl_count - itl_count_;
  const double ttft_mean = dttft > 0 ? (ttft_sum - ttft_sum_) / dttft : -1;
  const double itl_mean = ditl > 0 ? (itl_sum - itl_sum_) / ditl : -1;
  ttft_count_ = ttft_count;
  ttft_sum_ = ttft_sum;
  itl_count_ = itl_count;
  itl_sum_ = itl_sum;
  for (int p = 0; p < kNumPools; ++p) {
    const auto pool = static_cast<PoolKind>(p);
    seen[p].mean_latency_s = pool == PoolKind::kDecode ? itl_mean : ttft_mean;
    const int n = RecommendReplicas(pool, seen[p], options_);
    recommended_[p].store(n);
    gauges_[p]->Set(n);
  }
}

}  // namespace epd::services::router
