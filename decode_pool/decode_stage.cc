#include "decode_pool/decode_stage.h"

#include "absl/strings/str_cat.h"
#include "model/stages.h"

namespace epd::decode_pool {

std::unique_ptr<DecodeSequence> DecodeStage::Begin(model::SamplingParams params,
                                                   std::span<const int32_t> prompt) const {
  auto seq = std::make_unique<DecodeSequence>();
  const int32_t eos = static_cast<int32_t>(model_.config().eos_token_id);
  if (eos >= 0) params.stop_token_ids.push_back(eos);
  seq->sampler =
      std::make_unique<model::Sampler>(std::move(params), model_.config().vocab_size, prompt);
  return seq;
}

void DecodeStage::Offer(DecodeSequence& seq, std::span<const float> logits) const {
  const int32_t tok = seq.sampler->Sample(logits);
  if (seq.sampler->IsStopToken(tok)) {
    seq.done = true;
    seq.finish_reason = "stop";
    return;
  }
  seq.sampler->Accept(tok);
  seq.output.push_back(tok);
  seq.pending = tok;
  if (static_cast<int32_t>(seq.output.size()) >= seq.sampler->params().max_tokens) {
    seq.done = true;
    seq.finish_reason = "length";
  }
}

absl::StatusOr<std::unique_ptr<DecodeSequence>> DecodeStage::Start(
    const std::vector<model::StateSegment>& state, std::span<const float> logits,
    model::SamplingParams params, std::span<const int32_t> prompt) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (static_cast<int64_t>(logits.size()) != model_.config().vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("decode: first-token logits have ",
                                                   logits.size(), " entries, expected ",
                                                   model_.config().vocab_size));
  auto st = model::DeserializeState(model_, state);
  if (!st.ok()) return st.status();
  auto seq = Begin(std::move(params), prompt);
  seq->state = std::move(*st);
  Offer(*seq, logits);
  return seq;
}

absl::StatusOr<std::unique_ptr<DecodeSequence>> DecodeStage::StartFromPrompt(
    std::span<const int32_t> prompt, model::SamplingParams params) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (prompt.empty()) return absl::InvalidArgumentError("decode: empty prompt");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model_.config().vocab_size)
      return absl::InvalidArgumentError(
          absl::StrCat("decode: prompt token ", i, " (", prompt[i], ") is outside the vocabulary"));
  }
  auto seq = Begin(std::move(params), prompt);
  seq->state = model_.NewSequence();
  std::lock_guard<std::mutex> lock(compute_mu_);
  auto res = model_.Prefill(*seq->state, prompt, /*all_logits=*/false);
  if (!res.ok()) return res.status();
  Offer(*seq, res->logits);
  return seq;
}

absl::Status DecodeStage::Step(std::span<DecodeSequence* const> batch) {
  std::vector<DecodeSequence*> live;
  std::vector<model::SequenceState*> states;
  std::vector<std::vector<int32_t>> tokens;
  for (DecodeSequence* s : batch) {
    if (s->done) continue;
    live.push_back(s);
    states.push_back(s->state.get());
    tokens.push_back({s->pending});
  }
  if (live.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(compute_mu_);
  auto res = model::DecodeStep(model_, states, tokens);
  if (!res.ok()) return res.status();
  const int64_t vocab = model_.config().vocab_size;
  for (size_t i = 0; i < live.size(); ++i) {
    const std::vector<float>& l = (*res)[i].logits;
    Offer(*live[i], std::span<const float>(l.data() + l.size() - vocab, vocab));
  }
  return absl::OkStatus();
}

}  // namespace epd::decode_pool
