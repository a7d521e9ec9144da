#include "tests/testing/dspark_reference.h"

namespace epd::testing {

using model::Sampler;
using model::SequenceState;

absl::StatusOr<StepStats> SpeculativeDecoder::Step(SequenceState& state, int32_t last,
                                                   Sampler& sampler, int k,
                                                   std::vector<int32_t>& out, int batch) {
  const int64_t V = model_.config().vocab_size;
  auto prop = drafter_.Propose(state, last, sampler, k, batch);
  if (!prop.ok()) return prop.status();
  StepStats st;
  st.confidence = prop->confidence;
  const std::vector<int32_t>& drafts = prop->drafts;
  std::vector<int32_t> ids = {last};
  ids.insert(ids.end(), drafts.begin(), drafts.end());
  auto logits = scorer_.Score(state, ids);
  if (!logits.ok()) return logits.status();
  auto verdict = drafter_.Verify(*logits, *prop, sampler);
  if (!verdict.ok()) return verdict.status();
  const VerifyOutcome o = *verdict;
  if (absl::Status s = scorer_.Commit(state, o.accepted + 1); !s.ok()) return s;
  for (int i = 0; i < o.accepted; ++i) {
    out.push_back(drafts[i]);
    sampler.Accept(drafts[i]);
  }
  out.push_back(o.token);
  sampler.Accept(o.token);
  if (const int n = sampler.params().top_logprobs; n > 0) {
    for (int i = 0; i <= o.accepted; ++i) {
      const int32_t t = i < o.accepted ? drafts[i] : o.token;
      st.logprobs.push_back(
          model::ComputeLogprobs(std::span<const float>(logits->data() + i * V, V), t, n));
    }
  }
  st.k = prop->k;
  st.accepted = o.accepted;
  st.emitted = o.accepted + 1;
  return st;
}

absl::StatusOr<GenerationResult> Generate(const model::Model& model, TargetScorer& scorer,
                                          std::span<const int32_t> prompt,
                                          const model::SamplingParams& params,
                                          const GenerateOptions& options) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (options.dspark && options.fixed_k < 0 && options.policy == nullptr)
    return absl::InvalidArgumentError("dspark: Generate with the k policy needs a KPolicy");
  Sampler sampler(params, model.config().vocab_size, prompt);
  GenerationResult res;
  res.state = model.NewSequence();
  auto pre = model.Prefill(*res.state, prompt, /*all_logits=*/false);
  if (!pre.ok()) return pre.status();
  int32_t last = sampler.Sample(pre->logits);
  sampler.Accept(last);
  std::vector<model::Logprobs> pending_lp;
  if (params.top_logprobs > 0)
    pending_lp.push_back(model::ComputeLogprobs(pre->logits, last, params.top_logprobs));
  SpeculativeDecoder decoder(model, scorer, options.policy);
  std::vector<int32_t> pending = {last};
  const int k = !options.dspark ? 0 : options.fixed_k;
  for (;;) {
    for (size_t i = 0; i < pending.size(); ++i) {
      const int32_t t = pending[i];
      if (sampler.IsStopToken(t)) {
        res.finish_reason = "stop";
        return res;
      }
      res.tokens.push_back(t);
      if (i < pending_lp.size()) res.logprobs.push_back(pending_lp[i]);
      if (static_cast<int32_t>(res.tokens.size()) >= params.max_tokens) {
        res.finish_reason = "length";
        return res;
      }
    }
    last = pending.back();
    pending.clear();
    auto st = decoder.Step(*res.state, last, sampler, k, pending, options.batch);
    if (!st.ok()) return st.status();
    pending_lp = std::move(st->logprobs);
    st->logprobs.clear();
    res.steps.push_back(*st);
  }
}

}  // namespace epd::testing
