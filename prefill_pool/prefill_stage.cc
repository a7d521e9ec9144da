#include "prefill_pool/prefill_stage.h"

#include "absl/strings/str_cat.h"

namespace epd::prefill_pool {

absl::StatusOr<PrefillResult> PrefillStage::Run(const std::vector<model::StateSegment>& segments,
                                                const model::EncoderOutput& enc) {
  std::lock_guard<std::mutex> lock(compute_mu_);
  auto state = model::DeserializeState(model_, segments);
  if (!state.ok()) return state.status();
  if (enc.tail.rows <= 0 || enc.tail_start + enc.tail.rows != (*state)->pos)
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill: encoder tail [", enc.tail_start, ", ", enc.tail_start + enc.tail.rows,
        ") does not end at the state position ", (*state)->pos));
  auto res = model::DecoderReplay(model_, **state, enc);
  if (!res.ok()) return res.status();
  PrefillResult r;
  r.state = model::SerializeState(model_.config(), **state);
  const int64_t vocab = model_.config().vocab_size;
  r.logits.assign(res->logits.end() - vocab, res->logits.end());
  r.replayed_rows = enc.tail.rows;
  return r;
}

}  // namespace epd::prefill_pool
