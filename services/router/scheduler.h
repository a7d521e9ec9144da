#pragma once

// Picks the workers of one request: a decode worker always, an encoder and a prefill worker when
// those pools have live workers (the flow is in docs/router.md). Counts each decision in
// epd_route_decisions_total{route}.
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/registry.h"
#include "services/router/prefix_oracle.h"
#include "services/router/registry.h"

namespace epd::services::router {

struct SchedulerOptions {
  // Uncached prompt tokens at or below which the decode worker runs the request alone instead
  // of a hand-off chain. Default: 0 (always use every pool that has live workers).
  int direct_decode_max_tokens = 0;
  // Prefix-hint cap (docs/workers.md "tail rule"): the decoder replays the last tail rows, whose
  // residuals only the encoder computes, so the hint is cut to the largest multiple of
  // prefix_block_tokens <= N - prefix_tail_rows. Default: 64 tokens a block, 133 tail rows
  // (window 128 + DSpark block 5; router_main derives it from --model's config).
  int prefix_block_tokens = 64;
  int prefix_tail_rows = 133;
};

struct Plan {
  std::optional<WorkerInfo> encoder;
  std::optional<WorkerInfo> prefill;
  WorkerInfo decode;
  int32_t cached_tokens = 0;  // the prefix hint (capped by the tail rule when an encoder runs)
  std::string fingerprint;
  std::string route;  // "epd" | "d" (the chain is all three pools or decode alone)
};

// Thread-safe.
class Scheduler {
 public:
  Scheduler(SchedulerOptions options, Registry& registry, PrefixOracle& oracle,
            prometheus::Registry& metrics);
  // Unavailable when no decode worker is live.
  absl::StatusOr<Plan> Schedule(const std::vector<int32_t>& prompt_ids);
  // Returns the plan's workers' load accounting (call once per successful Schedule).
  void Release(const Plan& plan);

 private:
  SchedulerOptions options_;
  Registry& registry_;
  PrefixOracle& oracle_;
  prometheus::Family<prometheus::Counter>& decisions_;
};

}  // namespace epd::services::router
