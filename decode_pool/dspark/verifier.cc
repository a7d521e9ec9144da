#include "decode_pool/dspark/verifier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/sampling_math.h"
#include "transfer/transfer_error.h"

namespace epd::decode_pool {

using model::Sampler;
using model::SequenceState;

VerifyOutcome VerifyGreedy(std::span<const int32_t> target_tokens,
                           std::span<const int32_t> drafts) {
  VerifyOutcome o;
  while (o.accepted < static_cast<int>(drafts.size()) &&
         target_tokens[o.accepted] == drafts[o.accepted]) {
    ++o.accepted;
  }
  o.token = target_tokens[o.accepted];
  return o;
}

VerifyOutcome VerifyRejection(std::span<const float> p, std::span<const float> q,
                              std::span<const int32_t> drafts, int64_t V, model::Rng& rng) {
  const auto k = static_cast<int64_t>(drafts.size());
  // The k + 1 uniforms VerifyDrafts may take, in order; those it did not take are given back.
  const uint64_t start = rng.counter();
  std::vector<double> u(static_cast<size_t>(k + 1));
  for (double& x : u) x = rng.NextUniform();
  std::vector<float> residual;
  const kernels::sampling::DraftVerdict v =
      kernels::sampling::VerifyDrafts(p.data(), q.data(), drafts.data(), k, V, u.data(), residual);
  rng.Rewind(start + static_cast<uint64_t>(kernels::sampling::UniformsUsed(v.accepted, k)));
  return VerifyOutcome{v.accepted, v.token};
}

absl::StatusOr<DraftProposal> Drafter::Propose(SequenceState& state, int32_t last,
                                               Sampler& sampler, int k, int batch) const {
  const model::ModelConfig& c = model_.config();
  const bool greedy = sampler.params().greedy();
  const bool can_draft = c.n_mtp_layers > 0 && model_.weights().dspark != nullptr;
  if (!can_draft) k = 0;
  if (k < 0 && (policy_ == nullptr || !policy_->WorthDrafting(batch))) k = 0;

  DraftProposal p;
  if (k == 0) return p;
  // The chain runs on the backend with the request's penalties as of now (the chain's own
  // drafts not counted: a greedy chain's drafts only change what is verified, never the output;
  // a drawn chain's distributions are those its drafts were drawn from, which is all rejection
  // sampling needs): only ids and confidences come down.
  model::LogitPenalties penalties;
  const bool penalize = sampler.params().has_penalties();
  if (penalize) {
    penalties.repetition = sampler.params().repetition_penalty;
    penalties.frequency = sampler.params().frequency_penalty;
    penalties.presence = sampler.params().presence_penalty;
    sampler.PenaltyEntries({}, 1, penalties.at, penalties.counts);
  }
  // T > 0: one uniform per block position, drawn now; those after the k drafts are given back.
  model::SampleRequest sample;
  const uint64_t counter = sampler.rng().counter();
  if (!greedy) {
    sample.params = sampler.DrawParams();
    for (int64_t i = 0; i < c.dspark_block_size; ++i)
      sample.uniforms.push_back(sampler.rng().NextUniform());
  }
  auto draft =
      model_.Draft(state, last, {}, greedy ? model::LogitsOut::kArgmax : model::LogitsOut::kSample,
                   penalize ? &penalties : nullptr, greedy ? nullptr : &sample);
  if (!draft.ok()) {
    sampler.rng().Rewind(counter);
    return draft.status();
  }
  p.confidence = draft->confidence;
  if (k < 0) k = policy_->Choose(draft->confidence, batch);
  k = std::min<int>(k, c.dspark_block_size);
  p.k = k;
  p.drafts.assign(draft->ids.begin() + 1, draft->ids.begin() + 1 + k);
  if (!greedy) {
    sampler.rng().Rewind(counter + static_cast<uint64_t>(k));
    if (k > 0) p.q = std::move(draft->q);
  }
  return p;
}

absl::StatusOr<VerifyOutcome> Drafter::Verify(std::span<const float> logits,
                                              const DraftProposal& prop, Sampler& sampler) const {
  const int64_t V = model_.config().vocab_size;
  const int k = prop.k;
  const std::span<const int32_t> dspan(prop.drafts);
  if (sampler.params().greedy()) {
    std::vector<int32_t> target(k + 1);
    for (int i = 0; i <= k; ++i) {
      target[i] =
          sampler.Greedy(std::span<const float>(logits.data() + i * V, V), dspan.subspan(0, i));
      if (i < k && target[i] != prop.drafts[i]) {
        target.resize(i + 1);
        break;
      }
    }
    return VerifyGreedy(target, dspan.subspan(0, target.size() - 1));
  }
  std::vector<float> p(static_cast<size_t>(k + 1) * V), pi, q(static_cast<size_t>(k) * V);
  for (int i = 0; i <= k; ++i) {
    sampler.Probabilities(std::span<const float>(logits.data() + i * V, V), dspan.subspan(0, i),
                          pi);
    std::copy(pi.begin(), pi.end(), p.begin() + static_cast<int64_t>(i) * V);
  }
  if (k > 0) {
    const int64_t bytes = k * V * static_cast<int64_t>(sizeof(float));
    absl::Status st = prop.q == nullptr || prop.q->bytes() < bytes
                          ? absl::InternalError("the drafts' distributions are missing")
                          : model_.backend().Download(*prop.q, 0, bytes, q.data());
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat("dspark verify: ", st.message()));
  }
  return VerifyRejection(p, q, prop.drafts, V, sampler.rng());
}

absl::Status CheckDSparkHandoff(bool worker_dspark, bool handoff_has_dspark_state) {
  if (worker_dspark && !handoff_has_dspark_state) {
    return absl::FailedPreconditionError(
        "dspark: this decode worker runs DSpark (fingerprint dspark=on) but the hand-off carries "
        "no DSpark state (draft rings / main_hidden); the prefill side runs with DSpark off");
  }
  if (!worker_dspark && handoff_has_dspark_state) {
    return absl::FailedPreconditionError(
        "dspark: the hand-off carries DSpark state (draft rings / main_hidden) but this decode "
        "worker runs with DSpark off (fingerprint dspark=off)");
  }
  return absl::OkStatus();
}

absl::Status DSparkHandoffReceiveError(bool worker_dspark, const absl::Status& receive_error,
                                       bool* mismatch) {
  *mismatch = false;
  const std::optional<transfer::TransferErrorInfo> info = transfer::TransferErrorOf(receive_error);
  if (!info.has_value() || info->field != "dspark") return receive_error;
  *mismatch = true;
  const absl::Status c = CheckDSparkHandoff(worker_dspark, !worker_dspark);
  return absl::FailedPreconditionError(
      absl::StrCat(c.message(), " [", receive_error.message(), "]"));
}

bool HandoffHasDSparkState(const model::ModelConfig& config,
                           const std::vector<model::StateSegment>& segments) {
  for (const model::StateSegment& s : segments) {
    if (s.name == "main_hidden") return true;
    for (int L = config.n_layers; L < config.total_layers(); ++L) {
      if (s.name == absl::StrCat("swa.", L)) return true;
    }
  }
  return false;
}

}  // namespace epd::decode_pool
