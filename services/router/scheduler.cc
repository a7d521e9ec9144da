#include "services/router/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace epd::services::router {

Scheduler::Scheduler(SchedulerOptions options, Registry& registry, PrefixOracle& oracle,
                     prometheus::Registry& metrics)
    : options_(options),
      registry_(registry),
      oracle_(oracle),
      decisions_(prometheus::BuildCounter()
                     .Name("epd_route_decisions_total")
                     .Help("Requests by the chain of pools that served them (epd, d)")
                     .Register(metrics)) {
  for (const char* route : {"epd", "d"}) decisions_.Add({{"route", route}});
}

absl::StatusOr<Plan> Scheduler::Schedule(const std::vector<int32_t>& prompt_ids) {
  Plan plan;
  plan.fingerprint = registry_.Fingerprint();
  const PrefixHint hint =
      plan.fingerprint.empty() ? PrefixHint{} : oracle_.Lookup(prompt_ids, plan.fingerprint);
  plan.cached_tokens = std::min<int32_t>(hint.cached_tokens, prompt_ids.size());
  auto decode = registry_.Pick(PoolKind::kDecode, hint.workers);
  if (!decode) return absl::UnavailableError("no live decode worker");
  plan.decode = std::move(*decode);
  const int64_t uncached = static_cast<int64_t>(prompt_ids.size()) - plan.cached_tokens;
  if (uncached > options_.direct_decode_max_tokens) {
    plan.encoder = registry_.Pick(PoolKind::kEncoder, hint.workers);
    // Prefill starts from the encoder's hand-off and decode from prefill's: the chain is all
    // three or decode alone. Without a live encoder, or without a live prefill worker (decode
    // cannot start from an encoder's output: it carries no decoder-layer state and no logits), the
    // decode worker computes the whole prompt (route "d").
    if (plan.encoder) plan.prefill = registry_.Pick(PoolKind::kPrefill, hint.workers);
    if (plan.encoder && !plan.prefill) {
      registry_.Release(plan.encoder->id);
      plan.encoder.reset();
    }
  }
  // Only the encoder reuses a stored prefix (the tail rule applies to it); a chain without it
  // computes the whole prompt and the router reports 0 cached (router_core.cc).
  if (plan.encoder && options_.prefix_block_tokens > 0) {
    const int64_t room = static_cast<int64_t>(prompt_ids.size()) - options_.prefix_tail_rows;
    const int64_t cap =
        room <= 0 ? 0 : room / options_.prefix_block_tokens * options_.prefix_block_tokens;
    plan.cached_tokens = static_cast<int32_t>(std::min<int64_t>(plan.cached_tokens, cap));
  }
  plan.route = absl::StrCat(plan.encoder ? "e" : "", plan.prefill ? "p" : "", "d");
  decisions_.Add({{"route", plan.route}}).Increment();
  return plan;
}

void Scheduler::Release(const Plan& plan) {
  registry_.Release(plan.decode.id);
  if (plan.encoder) registry_.Release(plan.encoder->id);
  if (plan.prefill) registry_.Release(plan.prefill->id);
}

}  // namespace epd::services::router
