#include "decode_pool/decode_stage.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/sampling_math.h"
#include "model/stages.h"

namespace epd::decode_pool {

DecodeStage::DecodeStage(const model::Model& model, DecodeStageOptions options)
    : model_(model),
      options_(options),
      policy_(options.time_model, KPolicyOptions{.max_k = options.max_k}),
      drafter_(model, &policy_) {
  calibration_.predicted.assign(std::max(0, options_.max_k), 0.0);
  calibration_.accepted.assign(std::max(0, options_.max_k), 0.0);
}

AcceptanceCalibration DecodeStage::calibration() {
  std::lock_guard<std::mutex> lock(compute_mu_);
  return calibration_;
}

absl::StatusOr<std::unique_ptr<DecodeSequence>> DecodeStage::Begin(
    model::SamplingParams params, std::span<const int32_t> prompt,
    std::shared_ptr<const grammar::Grammar> grammar) const {
  auto seq = std::make_unique<DecodeSequence>();
  if (grammar) {
    if (!options_.masker || options_.masker->vocab_size() != model_.config().vocab_size)
      return absl::FailedPreconditionError(
          "decode: constrained decoding needs the model's tokenizer (tokenizer.json)");
    seq->grammar = std::make_unique<grammar::Matcher>(std::move(grammar));
  }
  const int32_t eos = static_cast<int32_t>(model_.config().eos_token_id);
  if (eos >= 0) params.stop_token_ids.push_back(eos);
  seq->sampler =
      std::make_unique<model::Sampler>(std::move(params), model_.config().vocab_size, prompt);
  return seq;
}

void DecodeStage::Fail(DecodeSequence& seq, absl::Status why) const {
  seq.done = true;
  seq.finish_reason = "error";
  seq.error = std::move(why);
}

bool DecodeStage::Emit(DecodeSequence& seq, int32_t tok, std::span<const float> logits,
                       const model::Logprobs* logprobs) const {
  if (seq.done) return false;
  if (seq.sampler->IsStopToken(tok)) {
    seq.done = true;
    seq.finish_reason = "stop";
    return false;
  }
  if (seq.grammar) seq.grammar->Advance(options_.masker->bytes(tok));
  seq.output.push_back(tok);
  if (const int n = seq.sampler->params().top_logprobs; n > 0)
    seq.logprobs.push_back(logprobs != nullptr ? *logprobs
                                               : model::ComputeLogprobs(logits, tok, n));
  seq.pending = tok;
  if (static_cast<int32_t>(seq.output.size()) >= seq.sampler->params().max_tokens) {
    seq.done = true;
    seq.finish_reason = "length";
    return false;
  }
  return true;
}

void DecodeStage::MaskLogits(DecodeSequence& seq, const grammar::Matcher& m, int64_t ahead,
                             std::span<float> logits) const {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t budget = seq.sampler->params().max_tokens -
                         static_cast<int64_t>(seq.output.size()) - ahead - 1;
  std::vector<uint8_t> allowed;
  if (options_.masker->Mask(m, std::max<int64_t>(0, budget), &allowed) == 0 &&
      options_.masker->Mask(m, INT64_MAX, &allowed) == 0) {
    // The budget was too small from the start (max_tokens below the shortest output): the
    // grammar alone decides (the output may then be cut at max_tokens). Nothing at all can
    // continue the output: end it.
    const int32_t eos = options_.masker->eos_id();
    if (eos >= 0) allowed[static_cast<size_t>(eos)] = 1;
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < logits.size(); ++i) {
    if (i >= allowed.size() || !allowed[i]) logits[i] = kNegInf;
  }
  seq.mask_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now() - t0)
                     .count();
  ++seq.masks;
}

bool DecodeStage::TokensOnly(const DecodeSequence& seq) const {
  const model::SamplingParams& p = seq.sampler->params();
  if (seq.grammar) return false;
  return p.greedy() ? options_.greedy_on_backend : options_.sample_on_backend;
}

model::LogitsRequest DecodeStage::LogitsFor(const DecodeSequence& seq,
                                            const DraftProposal* proposal, int64_t rows,
                                            model::LogitPenalties& penalties,
                                            model::SampleRequest& sample,
                                            model::DraftVerification& verify) const {
  const std::span<const int32_t> drafts =
      proposal != nullptr ? std::span<const int32_t>(proposal->drafts) : std::span<const int32_t>();
  if (!TokensOnly(seq)) return model::LogitsOut::kValues;
  const model::SamplingParams& p = seq.sampler->params();
  const model::LogitsOut out = p.greedy()       ? model::LogitsOut::kArgmax
                               : drafts.empty() ? model::LogitsOut::kSample
                                                : model::LogitsOut::kVerify;
  const int top_logprobs = p.top_logprobs > 0 ? p.top_logprobs : -1;  // on the backend too
  if (out == model::LogitsOut::kVerify) {
    verify.q = proposal->q;
    verify.drafts.assign(drafts.begin(), drafts.end());
  }
  if (out != model::LogitsOut::kArgmax) {
    // The uniforms the host's Sample would draw, in its order (one per row).
    sample.params = seq.sampler->DrawParams();
    sample.uniforms.clear();
    for (int64_t r = 0; r < rows; ++r) sample.uniforms.push_back(seq.sampler->rng().NextUniform());
  }
  if (!p.has_penalties()) {
    model::LogitsRequest req(out, nullptr, &sample, &verify);
    req.top_logprobs = top_logprobs;
    return req;
  }
  penalties.repetition = p.repetition_penalty;
  penalties.frequency = p.frequency_penalty;
  penalties.presence = p.presence_penalty;
  penalties.at.clear();
  penalties.counts.clear();
  seq.sampler->PenaltyEntries(drafts, rows, penalties.at, penalties.counts);
  model::LogitsRequest req(out, &penalties, &sample, &verify);
  req.top_logprobs = top_logprobs;
  return req;
}

void DecodeStage::Offer(DecodeSequence& seq, std::span<const float> logits) const {
  int32_t tok;
  if (seq.grammar) {
    std::vector<float> masked(logits.begin(), logits.end());
    MaskLogits(seq, *seq.grammar, 0, masked);
    tok = seq.sampler->Sample(masked);
  } else {
    tok = seq.sampler->Sample(logits);
  }
  if (!seq.sampler->IsStopToken(tok)) seq.sampler->Accept(tok);
  Emit(seq, tok, logits);
}

absl::StatusOr<std::unique_ptr<DecodeSequence>> DecodeStage::Start(
    const std::vector<model::StateSegment>& state, std::span<const float> logits,
    model::SamplingParams params, std::span<const int32_t> prompt,
    std::shared_ptr<const grammar::Grammar> grammar) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (static_cast<int64_t>(logits.size()) != model_.config().vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("decode: first-token logits have ",
                                                   logits.size(), " entries, expected ",
                                                   model_.config().vocab_size));
  auto st = model::DeserializeState(model_, state);
  if (!st.ok()) return st.status();
  return StartWithState(*std::move(st), logits, std::move(params), prompt, std::move(grammar));
}

absl::StatusOr<std::unique_ptr<DecodeSequence>> DecodeStage::StartWithState(
    std::unique_ptr<model::SequenceState> state, std::span<const float> logits,
    model::SamplingParams params, std::span<const int32_t> prompt,
    std::shared_ptr<const grammar::Grammar> grammar) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (static_cast<int64_t>(logits.size()) != model_.config().vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("decode: first-token logits have ",
                                                   logits.size(), " entries, expected ",
                                                   model_.config().vocab_size));
  if (state == nullptr) return absl::InvalidArgumentError("decode: no state");
  auto seq = Begin(std::move(params), prompt, std::move(grammar));
  if (!seq.ok()) return seq.status();
  (*seq)->state = std::move(state);
  Offer(**seq, logits);
  return seq;
}

absl::StatusOr<std::unique_ptr<DecodeSequence>> DecodeStage::StartFromPrompt(
    std::span<const int32_t> prompt, model::SamplingParams params,
    std::shared_ptr<const grammar::Grammar> grammar) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (prompt.empty()) return absl::InvalidArgumentError("decode: empty prompt");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model_.config().vocab_size)
      return absl::InvalidArgumentError(
          absl::StrCat("decode: prompt token ", i, " (", prompt[i], ") is outside the vocabulary"));
  }
  auto begun = Begin(std::move(params), prompt, std::move(grammar));
  if (!begun.ok()) return begun.status();
  std::unique_ptr<DecodeSequence> seq = *std::move(begun);
  seq->state = model_.NewSequence();
  std::lock_guard<std::mutex> lock(compute_mu_);
  // The semantics of the E/P/D chain (bounded decoder replay of window + DSpark block tail rows),
  // so a request's output does not depend on whether the router ran it here alone.
  model::PrefillOptions bounded;
  bounded.decoder_tail_rows = model::DecoderTailRows(model_.config());
  auto res = model_.Prefill(*seq->state, prompt, /*all_logits=*/false, bounded);
  if (!res.ok()) return res.status();
  Offer(*seq, res->logits);
  return seq;
}

absl::Status DecodeStage::Step(std::span<DecodeSequence* const> batch, DecodeStepStats* stats) {
  std::vector<DecodeSequence*> live;
  for (DecodeSequence* s : batch) {
    if (!s->done) live.push_back(s);
  }
  DecodeStepStats local;
  DecodeStepStats& st = stats != nullptr ? *stats : local;
  st = DecodeStepStats{};
  st.sequences = static_cast<int>(live.size());
  if (live.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(compute_mu_);
  return options_.dspark ? StepDSpark(live, st) : StepPlain(live, st);
}

absl::Status DecodeStage::StepPlain(std::span<DecodeSequence* const> live, DecodeStepStats& st) {
  std::vector<model::SequenceState*> states;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<model::LogitsRequest> outs;
  std::vector<model::LogitPenalties> penalties(live.size());
  std::vector<model::SampleRequest> samples(live.size());
  std::vector<model::DraftVerification> verifies(live.size());  // unused: no drafts
  std::vector<uint64_t> drawn_from(live.size());  // each Rng's counter before the step's draws
  for (size_t i = 0; i < live.size(); ++i) {
    DecodeSequence* s = live[i];
    states.push_back(s->state.get());
    tokens.push_back({s->pending});
    drawn_from[i] = s->sampler->rng().counter();
    outs.push_back(LogitsFor(*s, nullptr, 1, penalties[i], samples[i], verifies[i]));
  }
  std::vector<absl::Status> failed;
  auto res = model::DecodeStep(model_, states, tokens, &failed, outs);
  if (!res.ok()) {
    for (size_t i = 0; i < live.size(); ++i) live[i]->sampler->rng().Rewind(drawn_from[i]);
    return res.status();
  }
  const int64_t vocab = model_.config().vocab_size;
  for (size_t i = 0; i < live.size(); ++i) {
    if (!failed[i].ok()) {
      Fail(*live[i], std::move(failed[i]));
      continue;
    }
    const size_t before = live[i]->output.size();
    if (outs[i].out != model::LogitsOut::kValues) {
      // The token of the penalized logits the Sampler would pick (greedy) or draw (T > 0).
      const std::vector<int32_t>& best = (*res)[i].tokens;
      const std::vector<model::Logprobs>& lps = (*res)[i].logprobs;
      if (best.empty() || (outs[i].top_logprobs >= 0 && lps.size() != best.size())) {
        Fail(*live[i], absl::InternalError("decode step returned no token or no logprobs"));
        continue;
      }
      if (!live[i]->sampler->IsStopToken(best.back())) live[i]->sampler->Accept(best.back());
      Emit(*live[i], best.back(), {}, lps.empty() ? nullptr : &lps.back());
    } else {
      const std::vector<float>& l = (*res)[i].logits;
      Offer(*live[i], std::span<const float>(l.data() + l.size() - vocab, vocab));
    }
    st.emitted += static_cast<int64_t>(live[i]->output.size() - before);
  }
  return absl::OkStatus();
}

// What one StepDSpark gathers for its batched DecodeStep, per stepped sequence (the sequences
// whose draft succeeded, in order).
struct DecodeStage::DSparkBatch {
  explicit DSparkBatch(size_t n) : penalties(n), samples(n), verifies(n) { props.reserve(n); }
  std::vector<DraftProposal> props;
  std::vector<model::SequenceState*> states;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<model::StepCheckpoint> checkpoints;
  std::vector<model::LogitsRequest> outs;  // per stepped sequence
  // Their penalties (stable addresses: outs points into it).
  std::vector<model::LogitPenalties> penalties;
  std::vector<model::SampleRequest> samples;
  std::vector<model::DraftVerification> verifies;
  std::vector<uint64_t> drawn_from;      // per stepped sequence: its Rng's counter before the step
  std::vector<DecodeSequence*> stepped;  // the sequences whose draft succeeded, in order
  std::vector<char> calibrated;          // per stepped sequence: k chosen by the calibrated policy
  bool any_calibrated_draft = false, any_calibrated_k = false;
};

absl::Status DecodeStage::StepDSpark(std::span<DecodeSequence* const> live, DecodeStepStats& st) {
  const int b = static_cast<int>(live.size());
  DSparkBatch batch(live.size());
  const DSparkRound round = BeginDSparkRound();
  for (size_t i = 0; i < live.size(); ++i) DraftDSpark(*live[i], b, round, batch, st);
  std::vector<absl::Status> failed;
  auto res = model::DecodeStep(model_, batch.states, batch.tokens, &failed, batch.outs);
  if (!res.ok()) {
    for (size_t i = 0; i < batch.stepped.size(); ++i) {
      batch.stepped[i]->sampler->rng().Rewind(batch.drawn_from[i]);
    }
    return res.status();
  }
  for (size_t i = 0; i < batch.stepped.size(); ++i) {
    FinishDSpark(i, batch, (*res)[i], failed[i], st);
  }
  EndDSparkRound(round, batch);
  return absl::OkStatus();
}

// Calibration + backoff apply to greedy requests under the policy (for T > 0 the k sequence
// must depend on the request alone, see DraftDSpark).
DecodeStage::DSparkRound DecodeStage::BeginDSparkRound() {
  const bool backoff = backoff_left_ > 0;
  if (backoff && --backoff_left_ == 0) probe_ = true;
  const bool probe = probe_ && !backoff;
  if (probe) probe_ = false;
  return DSparkRound{backoff, probe};
}

// Drafts for `s` (k capped by its room, chosen by the calibrated policy for greedy requests),
// checkpoints its state and adds it to `batch`; a failed draft or checkpoint fails `s` alone.
void DecodeStage::DraftDSpark(DecodeSequence& s, int b, const DSparkRound& round,
                              DSparkBatch& batch, DecodeStepStats& st) {
  // A step emits accepted + 1 tokens and the output stops at max_tokens, so more than room - 1
  // drafts could never be emitted: cap k (Emit also truncates, this only saves work).
  const int room = s.sampler->params().max_tokens - static_cast<int>(s.output.size());
  const int cap = std::max(0, std::min(options_.max_k, room - 1));
  int k = options_.fixed_k;
  const bool calib =
      options_.calibrate && k < 0 && s.sampler->params().greedy() && options_.max_k > 0;
  if (calib) k = round.backoff || !policy_.WorthDrafting(b) ? 0 : cap;  // draft all, choose below
  if (cap == 0) k = 0;
  // T > 0: k changes how the seeded Rng is consumed, so the policy sees batch 1 (k then
  // depends on the request alone and a seed reproduces its output whatever else is running).
  const int policy_batch = s.sampler->params().greedy() ? b : 1;
  auto prop = drafter_.Propose(*s.state, s.pending, *s.sampler, k, policy_batch);
  if (!prop.ok()) {
    Fail(s, absl::Status(prop.status().code(),
                         absl::StrCat("dspark draft: ", prop.status().message())));
    return;
  }
  if (!prop->confidence.empty()) ++st.draft_passes;
  if (calib && !prop->confidence.empty()) ChooseCalibratedK(*prop, b, round.probe, batch);
  if (prop->k > cap) {  // the policy chose more than the sequence can emit
    prop->k = cap;
    prop->drafts.resize(cap);  // (a T > 0 proposal's q keeps rows it no longer uses)
  }
  std::vector<int32_t> ids = {s.pending};
  ids.insert(ids.end(), prop->drafts.begin(), prop->drafts.end());
  model::StepCheckpoint ck = prop->k > 0
                                 ? model_.Checkpoint(*s.state, static_cast<int64_t>(ids.size()))
                                 : model::StepCheckpoint{};
  if (!ck.status.ok()) {
    Fail(s,
         absl::Status(ck.status.code(), absl::StrCat("dspark checkpoint: ", ck.status.message())));
    return;
  }
  batch.checkpoints.push_back(std::move(ck));
  batch.stepped.push_back(&s);
  batch.drawn_from.push_back(s.sampler->rng().counter());
  const size_t n = batch.stepped.size() - 1;
  batch.outs.push_back(
      LogitsFor(s, &*prop, prop->k + 1, batch.penalties[n], batch.samples[n], batch.verifies[n]));
  batch.calibrated.push_back(calib);
  batch.states.push_back(s.state.get());
  batch.tokens.push_back(std::move(ids));
  batch.props.push_back(std::move(*prop));
}

// The calibrated policy's k for a greedy proposal (at least 1 on a probe step).
void DecodeStage::ChooseCalibratedK(DraftProposal& prop, int b, bool probe, DSparkBatch& batch) {
  // Greedy drafts are a prefix-consistent chain: any k <= the drafted count is valid.
  std::vector<float> conf(
      prop.confidence.begin(),
      prop.confidence.begin() + std::min<size_t>(prop.confidence.size(), options_.max_k));
  for (size_t j = 0; j < conf.size(); ++j) {
    const double a =
        std::clamp(AcceptanceEstimate(conf[j]) * calibration_.Factor(j), 1e-6, 1 - 1e-6);
    conf[j] = static_cast<float>(std::log(a / (1 - a)));
  }
  const int chosen = policy_.Choose(conf, b);
  batch.any_calibrated_draft = true;
  batch.any_calibrated_k |= chosen > 0 && prop.k > 0;
  prop.k = std::min(probe ? std::max(chosen, 1) : chosen, prop.k);
  prop.drafts.resize(prop.k);
}

// Stepped sequence i after the batched DecodeStep: checks its rows, verifies its drafts, rolls
// its state back to the accepted ones, updates the calibration and emits.
void DecodeStage::FinishDSpark(size_t i, DSparkBatch& batch, model::ForwardResult& res,
                               absl::Status& failed, DecodeStepStats& st) {
  DecodeSequence& s = *batch.stepped[i];
  if (!failed.ok()) {
    Fail(s, std::move(failed));
    return;
  }
  const DraftProposal& p = batch.props[i];
  const std::vector<float>& logits = res.logits;
  const bool tokens_only = batch.outs[i].out != model::LogitsOut::kValues;
  if (absl::Status bad = CheckDSparkResult(p, batch.outs[i], res); !bad.ok()) {
    Fail(s, std::move(bad));
    return;
  }
  std::vector<float> masked;
  if (s.grammar) masked = MaskDrafts(s, p, logits);
  auto o = VerifyDSpark(s, batch, i, res, masked);
  if (!o.ok()) {
    Fail(s, o.status());
    return;
  }
  if (p.k > 0) {
    const std::span<const int32_t> keep =
        std::span<const int32_t>(batch.tokens[i]).first(static_cast<size_t>(o->accepted) + 1);
    if (absl::Status r = model_.Rollback(*s.state, batch.checkpoints[i], keep, res); !r.ok()) {
      Fail(s, absl::Status(r.code(), absl::StrCat("dspark rollback: ", r.message())));
      return;
    }
  }
  if (batch.calibrated[i] && p.k > 0) RecordCalibration(p, *o);
  EmitAccepted(s, p, *o, res, tokens_only, st);
}

// Whether the step returned the rows (or the verdict) asked for `p`.
absl::Status DecodeStage::CheckDSparkResult(const DraftProposal& p, const model::LogitsRequest& out,
                                            const model::ForwardResult& res) const {
  const int64_t V = model_.config().vocab_size;
  const std::vector<float>& logits = res.logits;
  const bool tokens_only = out.out != model::LogitsOut::kValues;
  const bool verified = out.out == model::LogitsOut::kVerify;
  const int64_t got = tokens_only ? static_cast<int64_t>(res.tokens.size())
                                  : static_cast<int64_t>(logits.size()) / V;
  const std::vector<model::Logprobs>& lps = res.logprobs;
  // A verification's result is its verdict, 2 ids, with every row's logprobs when asked.
  if (got != (verified ? 2 : p.k + 1) ||
      (!tokens_only && static_cast<int64_t>(logits.size()) != got * V) ||
      (out.top_logprobs >= 0 && static_cast<int64_t>(lps.size()) != p.k + 1)) {
    return absl::InternalError(
        absl::StrCat("decode step returned ", got, " logit rows for ", p.k + 1, " positions"));
  }
  if (verified &&
      (res.tokens[0] < 0 || res.tokens[0] > p.k || res.tokens[1] < 0 || res.tokens[1] >= V)) {
    return absl::InternalError(absl::StrCat("decode step returned the verdict {", res.tokens[0],
                                            ", ", res.tokens[1], "} for ", p.k, " drafts"));
  }
  return absl::OkStatus();
}

// Constrained: row j is masked by the grammar after drafts 0..j-1; the rows after the first
// draft the grammar refuses are left as they are (verification rejects that draft: its
// masked probability is 0), so the output equals the unspeculated constrained output.
std::vector<float> DecodeStage::MaskDrafts(DecodeSequence& s, const DraftProposal& p,
                                           const std::vector<float>& logits) const {
  const int64_t V = model_.config().vocab_size;
  std::vector<float> masked = logits;
  grammar::Matcher m = *s.grammar;
  for (int j = 0; j <= p.k; ++j) {
    MaskLogits(s, m, j, std::span<float>(masked.data() + j * V, V));
    if (j == p.k) break;
    const int32_t d = p.drafts[j];
    if (!std::isfinite(masked[static_cast<size_t>(j * V + d)]) ||
        !m.Advance(options_.masker->bytes(d)))
      break;
  }
  return masked;
}

// Tokens only: the rows' argmax is the greedy target of each position (row j penalized as
// after drafts[0, j)); a T > 0 sequence's one row (no drafts) is its draw, which is what
// Verify's rejection sampling takes with k = 0; a T > 0 sequence with drafts gets the
// backend's verdict (Backend::VerifyDrafts), which took UniformsUsed of its k + 1 uniforms.
absl::StatusOr<VerifyOutcome> DecodeStage::VerifyDSpark(DecodeSequence& s, const DSparkBatch& batch,
                                                        size_t i, const model::ForwardResult& res,
                                                        const std::vector<float>& masked) {
  const DraftProposal& p = batch.props[i];
  const bool tokens_only = batch.outs[i].out != model::LogitsOut::kValues;
  const bool verified = batch.outs[i].out == model::LogitsOut::kVerify;
  VerifyOutcome o;
  if (verified) {
    o = VerifyOutcome{res.tokens[0], res.tokens[1]};
    s.sampler->rng().Rewind(
        batch.drawn_from[i] +
        static_cast<uint64_t>(kernels::sampling::UniformsUsed(o.accepted, p.k)));
  } else if (tokens_only) {
    o = VerifyGreedy(res.tokens, std::span<const int32_t>(p.drafts));
  } else {
    auto v = drafter_.Verify(s.grammar ? masked : res.logits, p, *s.sampler);
    if (!v.ok()) return v.status();
    o = *v;
  }
  return o;
}

// Position j was tested iff drafts 1..j-1 were accepted.
void DecodeStage::RecordCalibration(const DraftProposal& p, const VerifyOutcome& o) {
  for (int j = 0; j < std::min(p.k, o.accepted + 1); ++j) {
    calibration_.predicted[j] += AcceptanceEstimate(p.confidence[j]);
    calibration_.accepted[j] += j < o.accepted ? 1.0 : 0.0;
  }
}

// Counts the step and emits the accepted drafts, then the verdict's token.
void DecodeStage::EmitAccepted(DecodeSequence& s, const DraftProposal& p, const VerifyOutcome& o,
                               const model::ForwardResult& res, bool tokens_only,
                               DecodeStepStats& st) const {
  const int64_t V = model_.config().vocab_size;
  const std::vector<float>& logits = res.logits;
  const std::vector<model::Logprobs>& lps = res.logprobs;
  st.k.push_back(p.k);
  st.accepted_k.push_back(o.accepted);
  st.drafted += p.k;
  st.accepted += o.accepted;
  s.drafted += p.k;
  s.accepted += o.accepted;
  const size_t before = s.output.size();
  for (int j = 0; j <= o.accepted; ++j) {
    const int32_t t = j < o.accepted ? p.drafts[j] : o.token;
    if (!s.sampler->IsStopToken(t)) s.sampler->Accept(t);
    const std::span<const float> row =
        tokens_only ? std::span<const float>() : std::span<const float>(logits.data() + j * V, V);
    // Row j's backend logprobs are of its own token, the one emitted here (a greedy row's
    // argmax, which an accepted draft equals; a draw's token with k = 0; a verified row's
    // draft, or the verdict's token at its row).
    const model::Logprobs* lp = lps.empty() ? nullptr : &lps[static_cast<size_t>(j)];
    if (lp != nullptr && lp->chosen.token != t) {
      Fail(s, absl::InternalError(absl::StrCat("decode step: row ", j, "'s logprobs are of token ",
                                               lp->chosen.token, ", not of ", t)));
      break;
    }
    if (!Emit(s, t, row, lp)) break;
  }
  st.emitted += static_cast<int64_t>(s.output.size() - before);
}

// A probe whose calibrated choice is still k = 0 goes straight back to the backoff.
void DecodeStage::EndDSparkRound(const DSparkRound& round, const DSparkBatch& batch) {
  if (batch.any_calibrated_k) {
    idle_steps_ = 0;
  } else if (batch.any_calibrated_draft &&
             (round.probe || ++idle_steps_ >= options_.backoff_after)) {
    idle_steps_ = 0;
    backoff_left_ = std::max(1, options_.backoff_steps);
  }
}

}  // namespace epd::decode_pool
