#pragma once

// Test reference (not in any worker): DSpark decoding of ONE sequence, step by step, with a
// TargetScorer doing the target pass (tests/testing/dspark_target_scorer.h). The shipping path is
// DecodeStage (decode_pool/decode_stage.h): the same Drafter::Propose / Drafter::Verify around one
// batched DecodeStep for every live sequence. The DSpark tests check the two agree token for
// token and state for state, and dspark_bench measures acceptance with this loop.
//
// Thread-safety: one SpeculativeDecoder per thread.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "decode_pool/dspark/k_policy.h"
#include "decode_pool/dspark/verifier.h"
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"
#include "tests/testing/dspark_target_scorer.h"

namespace epd::testing {

using decode_pool::DraftProposal;
using decode_pool::Drafter;
using decode_pool::KPolicy;
using decode_pool::VerifyOutcome;

struct StepStats {
  int k = 0;                      // drafts verified
  int accepted = 0;               // drafts accepted
  int emitted = 0;                // tokens appended (accepted + 1)
  std::vector<float> confidence;  // raw DSpark confidences of this step's draft (empty: no draft)
  // Per emitted token when params.top_logprobs > 0 (raw target logits of its row).
  std::vector<model::Logprobs> logprobs;
};

// One sequence's decode steps. Borrows model, scorer and policy (must outlive it).
class SpeculativeDecoder {
 public:
  // `policy` may be null: then only explicit k values are used.
  SpeculativeDecoder(const model::Model& model, TargetScorer& scorer,
                     const KPolicy* policy = nullptr)
      : model_(model), scorer_(scorer), drafter_(model, policy) {}

  // One step: Drafter::Propose + scorer.Score + Drafter::Verify + scorer.Commit, for a sequence at
  // state.pos whose last sampled token `last` is not yet in the state. k as in Drafter::Propose.
  // Appends the emitted tokens to `out` and to the sampler's history; the state afterwards holds
  // `last` and the accepted drafts.
  [[nodiscard]] absl::StatusOr<StepStats> Step(model::SequenceState& state, int32_t last,
                                               model::Sampler& sampler, int k,
                                               std::vector<int32_t>& out, int batch = 1);
  const Drafter& drafter() const { return drafter_; }

 private:
  const model::Model& model_;
  TargetScorer& scorer_;
  Drafter drafter_;
};

struct GenerateOptions {
  bool dspark = true;               // Default: on
  int fixed_k = -1;                 // >= 0 forces k every step; -1 = the policy. Default: -1
  const KPolicy* policy = nullptr;  // needed when fixed_k < 0 and dspark is on
  int batch = 1;                    // batch size the policy assumes. Default: 1
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids, stop token excluded
  std::string finish_reason;    // "stop" | "length"
  std::vector<StepStats> steps;
  std::vector<model::Logprobs> logprobs;        // per token when params.top_logprobs > 0
  std::unique_ptr<model::SequenceState> state;  // final state
};

// Prefill + decode loop for one prompt.
[[nodiscard]] absl::StatusOr<GenerationResult> Generate(const model::Model& model,
                                                        TargetScorer& scorer,
                                                        std::span<const int32_t> prompt,
                                                        const model::SamplingParams& params,
                                                        const GenerateOptions& options);

}  // namespace epd::testing
