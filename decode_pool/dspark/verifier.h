#pragma once

// DSpark speculative decoding, the draft and verify halves (docs/dspark.md): draft with the DSpark
// head, verify against the target's rows for the last accepted token plus k drafts, accept the
// longest agreeing prefix (greedy) or use standard speculative rejection sampling (T > 0), always
// emit at least one target token. The target pass and the rollback of rejected positions are
// DecodeStage's (one batched DecodeStep + Model::Checkpoint/Rollback); tests/testing/
// dspark_reference.h holds the one-sequence reference loop the tests compare it with.
//
// Invariant: with greedy sampling the emitted tokens equal those of plain decoding (k = 0),
// token for token, and the state after each step equals the plain run's byte for byte.
//
// Thread-safety: a Drafter is used by one thread at a time (the model's backend is
// single-threaded); the free functions are reentrant.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_pool/dspark/k_policy.h"
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"

namespace epd::decode_pool {

struct VerifyOutcome {
  int accepted = 0;   // drafts accepted (prefix length)
  int32_t token = 0;  // the target token emitted after them
};

// Greedy verification: target_tokens [k+1] are the target's greedy tokens per row (row i follows
// drafts[0..i)), drafts [k].
VerifyOutcome VerifyGreedy(std::span<const int32_t> target_tokens, std::span<const int32_t> drafts);

// Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023). p: [k+1, V] target
// distributions per row, q: [k, V] the draft distributions drafts[i] was drawn from. Accept draft
// x with probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)); if all k are
// accepted draw a bonus token from p[k]. The emitted tokens are distributed exactly as sampling
// from p autoregressively. Uses one uniform per tested draft plus one for the final draw
// (kernels/sampling_math.h, VerifyDrafts: the backend's arithmetic).
VerifyOutcome VerifyRejection(std::span<const float> p, std::span<const float> q,
                              std::span<const int32_t> drafts, int64_t vocab, model::Rng& rng);

// A step's draft: the k draft tokens and, for T > 0, the distributions they were drawn from.
struct DraftProposal {
  int k = 0;                    // drafts (0: no draft pass, or the policy chose 0)
  std::vector<int32_t> drafts;  // [k]
  // T > 0 with k > 0: [>= k, V] draft distributions in the model's backend memory
  // (model::DraftResult::q: what a LogitsOut::kVerify step takes); null when greedy.
  std::shared_ptr<kernels::Buffer> q;
  std::vector<float> confidence;  // raw DSpark confidences (empty: no draft pass)
};

// The draft and verify halves of a DSpark step for one sequence (docs/dspark.md, "Decode loop").
// DecodeStage calls Propose per sequence, runs ONE batched DecodeStep over [last, drafts...] for
// all of them, then Verify per sequence. Borrows model and policy (must outlive it).
class Drafter {
 public:
  // `policy` may be null: then only explicit k values are used.
  explicit Drafter(const model::Model& model, const KPolicy* policy = nullptr)
      : model_(model), policy_(policy) {}

  // The draft for a sequence at state.pos whose last sampled token `last` is not yet in the
  // state. k < 0: draft, then let the policy choose k from the confidences and `batch`; k = 0: no
  // draft pass; k > 0: that many drafts (capped at the block size). The chain runs on the
  // model's backend with the request's penalties as of now (Model::Draft): greedy, each
  // position's argmax; T > 0, each position's draw with one of the sampler's uniforms (k of them
  // are consumed) and its distribution kept in backend memory. Does not change `state`
  // (Model::Draft stores no KV).
  [[nodiscard]] absl::StatusOr<DraftProposal> Propose(model::SequenceState& state, int32_t last,
                                                      model::Sampler& sampler, int k,
                                                      int batch = 1) const;
  // The verify half on host rows: `logits` [k+1, V] are the target's rows for [last, drafts...]
  // (row i = the distribution of the token after drafts[0..i)). Greedy: longest agreeing prefix;
  // T > 0: rejection sampling with the sampler's Rng (the drafts' distributions come down from
  // the backend), the arithmetic of Backend::VerifyDrafts. Does not touch the sampler's history.
  [[nodiscard]] absl::StatusOr<VerifyOutcome> Verify(std::span<const float> logits,
                                                     const DraftProposal& proposal,
                                                     model::Sampler& sampler) const;

 private:
  const model::Model& model_;
  const KPolicy* policy_;
};

// The config switch: a decode worker whose fingerprint says DSpark on must receive DSpark state
// in the hand-off (the DSpark stages' window rings and main_hidden), and one with DSpark off must
// receive none. Returns FailedPrecondition naming the mismatch.
[[nodiscard]] absl::Status CheckDSparkHandoff(bool worker_dspark, bool handoff_has_dspark_state);
// The decode side of the switch when the hand-off was refused by the transfer engine: the
// engine compares the offer's manifest header field `dspark` with the receiver's (on/off) before
// any byte moves. When `receive_error`'s message names that field, returns the
// CheckDSparkHandoff error (plus the engine's message) and sets *mismatch; else returns
// `receive_error` unchanged.
[[nodiscard]] absl::Status DSparkHandoffReceiveError(bool worker_dspark,
                                                     const absl::Status& receive_error,
                                                     bool* mismatch);
// Whether serialized state segments (model/sequence_state.h) carry DSpark state: "swa.<L>" for a
// DSpark stage L >= n_layers, or "main_hidden".
bool HandoffHasDSparkState(const model::ModelConfig& config,
                           const std::vector<model::StateSegment>& segments);

}  // namespace epd::decode_pool
