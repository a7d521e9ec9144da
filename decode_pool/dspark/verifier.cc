#include "decode_pool/dspark/verifier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvstore/transfer/transfer_error.h"

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
  const int k = static_cast<int>(drafts.size());
  VerifyOutcome o;
  for (int i = 0; i < k; ++i) {
    const float* pi = p.data() + i * V;
    const float* qi = q.data() + i * V;
    const int32_t x = drafts[i];
    const double px = pi[x], qx = qi[x];
    const double u = rng.NextUniform();
    // Accept with min(1, p/q); q(x) = 0 cannot be drawn, treat it as accept iff p(x) > 0.
    const bool accept = qx > 0 ? u * qx < px : px > 0;
    if (accept) {
      ++o.accepted;
      continue;
    }
    std::vector<float> residual(V);
    double total = 0;
    for (int64_t v = 0; v < V; ++v) {
      residual[v] = std::max(0.f, pi[v] - qi[v]);
      total += residual[v];
    }
    // p == q exactly leaves no residual mass (and then rejection has probability 0): fall back
    // to p for numerical safety.
    const std::span<const float> dist =
        total > 0 ? std::span<const float>(residual) : std::span<const float>(pi, V);
    o.token = model::SampleFromProbs(dist, rng.NextUniform());
    return o;
  }
  o.token = model::SampleFromProbs(std::span<const float>(p.data() + k * V, V), rng.NextUniform());
  return o;
}

absl::StatusOr<DraftProposal> Drafter::Propose(SequenceState& state, int32_t last,
                                               Sampler& sampler, int k, int batch) const {
  const model::ModelConfig& c = model_.config();
  const int64_t V = c.vocab_size;
  const bool greedy = sampler.params().greedy();
  const bool can_draft = c.n_mtp_layers > 0 && model_.weights().dspark != nullptr;
  if (!can_draft) k = 0;
  if (k < 0 && (policy_ == nullptr || !policy_->WorthDrafting(batch))) k = 0;

  DraftProposal p;
  if (k == 0) return p;
  // A greedy chain is the draft's own ids, chained on the backend with the request's penalties
  // as of now (the chain's own drafts not counted: they only change what is verified, never the
  // output): its logits stay there.
  model::LogitPenalties penalties;
  if (greedy && sampler.params().has_penalties()) {
    penalties.repetition = sampler.params().repetition_penalty;
    penalties.frequency = sampler.params().frequency_penalty;
    penalties.presence = sampler.params().presence_penalty;
    sampler.PenaltyEntries({}, 1, penalties.at, penalties.counts);
  }
  auto draft =
      model_.Draft(state, last, {}, greedy ? model::LogitsOut::kArgmax : model::LogitsOut::kValues,
                   greedy && sampler.params().has_penalties() ? &penalties : nullptr);
  if (!draft.ok()) return draft.status();
  p.confidence = draft->confidence;
  if (k < 0) k = policy_->Choose(draft->confidence, batch);
  k = std::min<int>(k, c.dspark_block_size);
  p.k = k;
  if (greedy) {
    p.drafts.assign(draft->ids.begin() + 1, draft->ids.begin() + 1 + k);
    return p;
  }
  // T > 0: re-chain the Markov head with our own draws: logits_i depend on the chain token x_i
  // only through bias(x_i); the returned logits carry bias(ids[i]) of the greedy chain.
  std::vector<float> li(V), b_old, b_new, qi;
  p.q.resize(static_cast<size_t>(k) * V);
  for (int i = 0; i < k; ++i) {
    const float* base = draft->logits.data() + i * V;
    std::copy_n(base, V, li.data());
    if (i > 0 && p.drafts[i - 1] != draft->ids[i]) {
      if (absl::Status st = model_.MarkovBias(draft->ids[i], b_old); !st.ok()) return st;
      if (absl::Status st = model_.MarkovBias(p.drafts[i - 1], b_new); !st.ok()) return st;
      for (int64_t v = 0; v < V; ++v) li[v] = li[v] - b_old[v] + b_new[v];
    }
    sampler.Probabilities(li, p.drafts, qi);
    std::copy(qi.begin(), qi.end(), p.q.begin() + static_cast<int64_t>(i) * V);
    p.drafts.push_back(model::SampleFromProbs(qi, sampler.rng().NextUniform()));
  }
  return p;
}

VerifyOutcome Drafter::Verify(std::span<const float> logits, const DraftProposal& prop,
                              Sampler& sampler) const {
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
  std::vector<float> p(static_cast<size_t>(k + 1) * V), pi;
  for (int i = 0; i <= k; ++i) {
    sampler.Probabilities(std::span<const float>(logits.data() + i * V, V), dspan.subspan(0, i),
                          pi);
    std::copy(pi.begin(), pi.end(), p.begin() + static_cast<int64_t>(i) * V);
  }
  return VerifyRejection(p, prop.q, prop.drafts, V, sampler.rng());
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
