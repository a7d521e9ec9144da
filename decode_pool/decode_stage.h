#pragma once

// The decode stage (DESIGN.md §3, §9): token generation on a sequence state handed over by
// prefill. Compute only (decode_server.cc streams the tokens). A step advances a batch of
// sequences with one batched DecodeStep call (continuous batching: the server adds and removes
// sequences between steps).
//
// DSpark off: each step feeds every sequence its last sampled token (1 position) and samples one
// token. DSpark on (docs/dspark.md, "Decode loop"): each step drafts per sequence from its last
// token (Model::Draft), chooses k per sequence (KPolicy from the confidences and the live batch
// size, or a fixed k), checkpoints, runs ONE DecodeStep over [last, k drafts] for all sequences
// (ragged k), verifies (greedy: longest agreeing prefix; T > 0: speculative rejection sampling
// with the request's Rng), rolls the rejected positions back and emits the accepted drafts plus
// the target's token (>= 1 per step), stopping at a stop id or max_tokens (never past it).
// Greedy output is token-for-token identical in both modes.
//
// Thread-safety: Step may be called from any thread; calls are serialized by an internal mutex.
// A DecodeSequence is owned by one request and touched only through this stage.
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "decode_pool/dspark/k_policy.h"
#include "grammar/grammar.h"
#include "decode_pool/dspark/verifier.h"
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"

namespace epd::decode_pool {

struct DecodeSequence {
  std::unique_ptr<model::SequenceState> state;
  std::unique_ptr<model::Sampler> sampler;
  std::vector<int32_t> output;  // tokens generated so far (EOS/stop ids excluded)
  // Per output token when params.top_logprobs > 0 (raw logits of the row that produced it).
  std::vector<model::Logprobs> logprobs;
  int32_t pending = -1;  // last sampled token, not yet fed to the model
  bool done = false;
  std::string finish_reason;  // "stop" | "length" | "error" once done
  // Why this sequence failed in a step (then done, finish_reason "error"): only it fails, the
  // other sequences of the batch go on (DecodeStage::Step).
  absl::Status error;
  int64_t drafted = 0;        // DSpark drafts verified for this sequence (sum of k)
  int64_t accepted = 0;       // of which accepted
  // Constrained decoding (grammar/): the output so far against the request's
  // grammar; null when the request has no constraint.
  std::unique_ptr<grammar::Matcher> grammar;
  int64_t mask_ns = 0;  // time spent computing this sequence's token masks
  int64_t masks = 0;    // masks computed (one per sampled position; k + 1 per DSpark step)
};

struct DecodeStageOptions {
  bool dspark = false;  // draft + verify every step. Default: off (the worker passes --dspark)
  int fixed_k = -1;     // >= 0: that many drafts every step (0: verify nothing); -1: KPolicy
  // The policy's step-time model t(b, k) (relative units are fine: only ratios matter). Default:
  // a memory-bound accelerator step where a verify row costs 2% of the step and the draft pass 5%
  // (docs/dspark.md); on the CPU backend a verify row costs ~half a step (measured there).
  StepTimeModel time_model{.base_s = 1.0, .per_token_s = 0.02, .draft_s = 0.05};
  int max_k = 5;  // <= the DSpark block size
  // Online calibration of the confidence head for greedy requests under the policy (fixed_k <
  // 0): per draft position j, a_j is scaled by (accepted_j + 1) / (predicted_j + 1) observed so
  // far. After `backoff_after` consecutive steps whose greedy sequences all chose k = 0, the
  // draft pass is skipped for `backoff_steps` steps, then one probe step verifies >= 1 draft.
  bool calibrate = true;
  int backoff_after = 8;
  int backoff_steps = 32;
  // The vocabulary for constrained decoding (token bytes); null: constrained requests are
  // refused (FailedPrecondition).
  std::shared_ptr<const grammar::TokenMasker> masker;
  // The decode worker's KV pool capacity in bytes (--kv-pool-bytes; decode_server.cc admits and
  // preempts by it). <= 0: model::DefaultKvPoolCapacity (90 % of a device's free memory after
  // the weights, a quarter of the host's physical memory on the CPU) split kv_pool_share ways.
  int64_t kv_pool_bytes = 0;
  // How many decode workers share this worker's memory (--kv-pool-share, >= 1): `epd serve`
  // passes the number on the same GPU, or on the host for the CPU, so that their default pools
  // add up to one worker's default rather than each taking it all.
  int kv_pool_share = 1;
  // A greedy sequence with no grammar and no logprobs takes its tokens from the backend's Argmax
  // (model::LogitsOut::kArgmax), after its penalties applied there (Backend::PenalizeLogits):
  // its logits rows stay in backend memory, and a step downloads 4 bytes per row instead of
  // vocab x 4 (517 KB at the release vocabulary). The tokens are the host Sampler's (the same
  // penalty arithmetic, kernels/penalty.h, and the same first-largest rule).
  // false: every sequence downloads its logits (the comparison baseline). Default: true
  bool greedy_on_backend = true;
  // A T > 0 sequence with no grammar and no logprobs, in a step that verifies no drafts of it,
  // takes its token from the backend's draw (model::LogitsOut::kSample, Backend::SampleLogits)
  // with the uniform its Sampler's Rng gives: the same token as the host Sampler (the shared
  // arithmetic of kernels/sampling_math.h), and its logits rows stay in backend memory. A
  // verification of T > 0 drafts (rejection sampling) still downloads its rows.
  // false: such sequences download their logits. Default: true
  bool sample_on_backend = true;
};

// What one Step did (DSpark counters are 0 with DSpark off).
struct DecodeStepStats {
  int sequences = 0;     // live sequences stepped
  int64_t drafted = 0;   // draft tokens verified (sum of the per-sequence k)
  int64_t accepted = 0;  // draft tokens accepted (<= drafted)
  int64_t emitted = 0;   // tokens appended to outputs
  std::vector<int> k;    // per live sequence: its k this step (DSpark on only)
  std::vector<int> accepted_k;  // per live sequence, parallel to k: drafts it accepted (<= k)
  int draft_passes = 0;  // Model::Draft calls (sequences whose draft pass was not skipped)
};

// The calibration state (docs/dspark.md, "Decode loop").
struct AcceptanceCalibration {
  std::vector<double> predicted;  // [max_k] sum of sigmoid(c_j) over drafts tested at position j
  std::vector<double> accepted;   // [max_k] drafts accepted at position j
  double Factor(int j) const { return (accepted[j] + 1.0) / (predicted[j] + 1.0); }
};

class DecodeStage {
 public:
  explicit DecodeStage(const model::Model& model, DecodeStageOptions options = {});

  // A sequence from prefill's hand-off: the state at N and the last prompt position's logits.
  // Samples the first token. The model's EOS id is added to the stop ids.
  // `grammar` (optional) constrains every sampled token (a per-position token mask; with DSpark
  // each verified row is masked, so a masked draft is rejected and the output stays lossless).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeSequence>> Start(
      const std::vector<model::StateSegment>& state, std::span<const float> logits,
      model::SamplingParams params, std::span<const int32_t> prompt,
      std::shared_ptr<const grammar::Grammar> grammar = nullptr);
  // The same from a state already deserialized (an n > 1 fork: a copy of one received state,
  // sharing its KV pool blocks copy-on-write).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeSequence>> StartWithState(
      std::unique_ptr<model::SequenceState> state, std::span<const float> logits,
      model::SamplingParams params, std::span<const int32_t> prompt,
      std::shared_ptr<const grammar::Grammar> grammar = nullptr);
  // A sequence from the prompt alone (no encoder/prefill in the chain): runs Model::Prefill.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeSequence>> StartFromPrompt(
      std::span<const int32_t> prompt, model::SamplingParams params,
      std::shared_ptr<const grammar::Grammar> grammar = nullptr);

  // Advances every sequence of `batch` that is not done (one batched DecodeStep): one token each
  // with DSpark off, 1..k+1 with DSpark on. `stats` (optional) receives what the step did.
  // A sequence that fails on its own (a bad token, a state the model refuses, its draft or
  // rollback) is marked done with `error` set and drops out; the others advance as if it had not
  // been in the batch. A returned error (none today but an internal inconsistency) means no
  // sequence of the batch may be used further (the caller fails them).
  [[nodiscard]] absl::Status Step(std::span<DecodeSequence* const> batch,
                                  DecodeStepStats* stats = nullptr);

  const DecodeStageOptions& options() const { return options_; }
  // A copy (takes the compute mutex).
  AcceptanceCalibration calibration();

 private:
  absl::StatusOr<std::unique_ptr<DecodeSequence>> Begin(
      model::SamplingParams params, std::span<const int32_t> prompt,
      std::shared_ptr<const grammar::Grammar> grammar) const;
  // The logits with every token the grammar does not allow at this position set to -inf, for a
  // position `ahead` tokens after the sequence's output (the matcher is already there).
  void MaskLogits(DecodeSequence& seq, const grammar::Matcher& m, int64_t ahead,
                  std::span<float> logits) const;
  // Samples from `logits`; marks the sequence done on a stop token or at max_tokens.
  void Offer(DecodeSequence& seq, std::span<const float> logits) const;
  // Whether a step of `seq` brings back only its rows' tokens (and logprobs, when asked): their
  // argmax (greedy_on_backend), its draw or its verdict on T > 0 drafts (sample_on_backend). Not
  // with a grammar, whose mask is applied on the host.
  bool TokensOnly(const DecodeSequence& seq) const;
  // What a step of `rows` rows (the last token, then the proposal's drafts, if any) asks of
  // `seq`'s logits; its penalties go to `penalties`, a draw's uniforms (taken from seq's Rng now)
  // to `sample` and a T > 0 proposal's drafts and distributions to `verify`, all of which must
  // outlive the step.
  model::LogitsRequest LogitsFor(const DecodeSequence& seq, const DraftProposal* proposal,
                                 int64_t rows, model::LogitPenalties& penalties,
                                 model::SampleRequest& sample,
                                 model::DraftVerification& verify) const;
  // Appends an already chosen token (for logprobs: its row's raw logits, or `logprobs` computed
  // on the backend for this token); returns false once the sequence is done (stop id: not
  // appended; max_tokens reached: appended, then done).
  bool Emit(DecodeSequence& seq, int32_t token, std::span<const float> logits,
            const model::Logprobs* logprobs = nullptr) const;
  // Ends `seq` with `why` (done, finish_reason "error"); the rest of the batch goes on.
  void Fail(DecodeSequence& seq, absl::Status why) const;
  absl::Status StepPlain(std::span<DecodeSequence* const> live, DecodeStepStats& stats);
  absl::Status StepDSpark(std::span<DecodeSequence* const> live, DecodeStepStats& stats);
  // StepDSpark's steps, in the order it runs them (decode_stage.cc).
  struct DSparkBatch;
  struct DSparkRound {
    bool backoff = false;  // no draft pass for the calibrated greedy sequences this step
    bool probe = false;    // this step verifies >= 1 draft for them
  };
  DSparkRound BeginDSparkRound();
  void DraftDSpark(DecodeSequence& s, int b, const DSparkRound& round, DSparkBatch& batch,
                   DecodeStepStats& st);
  void ChooseCalibratedK(DraftProposal& prop, int b, bool probe, DSparkBatch& batch);
  void FinishDSpark(size_t i, DSparkBatch& batch, model::ForwardResult& res, absl::Status& failed,
                    DecodeStepStats& st);
  absl::Status CheckDSparkResult(const DraftProposal& p, const model::LogitsRequest& out,
                                 const model::ForwardResult& res) const;
  std::vector<float> MaskDrafts(DecodeSequence& s, const DraftProposal& p,
                                const std::vector<float>& logits) const;
  absl::StatusOr<VerifyOutcome> VerifyDSpark(DecodeSequence& s, const DSparkBatch& batch, size_t i,
                                             const model::ForwardResult& res,
                                             const std::vector<float>& masked);
  void RecordCalibration(const DraftProposal& p, const VerifyOutcome& o);
  void EmitAccepted(DecodeSequence& s, const DraftProposal& p, const VerifyOutcome& o,
                    const model::ForwardResult& res, bool tokens_only, DecodeStepStats& st) const;
  void EndDSparkRound(const DSparkRound& round, const DSparkBatch& batch);

  const model::Model& model_;
  DecodeStageOptions options_;
  KPolicy policy_;
  Drafter drafter_;  // Propose/Verify per sequence around the batched DecodeStep
  std::mutex compute_mu_;
  // Guarded by compute_mu_.
  AcceptanceCalibration calibration_;
  int idle_steps_ = 0;    // consecutive steps whose calibrated greedy sequences all chose k = 0
  int backoff_left_ = 0;  // steps left without a draft pass for them
  bool probe_ = false;    // this step verifies >= 1 draft for them
};

}  // namespace epd::decode_pool
