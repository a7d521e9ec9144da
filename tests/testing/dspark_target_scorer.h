#pragma once

// Test reference (not in any worker): the target pass of DSpark verification for ONE sequence,
// behind an interface with two implementations (sequential Decode calls + StepJournal, and one
// Extend call + Model::Checkpoint). The shipping decode path verifies drafts inside one batched
// DecodeStep (decode_pool/decode_stage.cc); the DSpark tests and dspark_bench compare it with these.
//
// Contract: Score(state, ids) runs the target model over ids (ids[0] = the last accepted token,
// then the drafts) at positions state.pos .. state.pos + ids.size() - 1 and returns fp32 logits
// [ids.size(), vocab]; row i is the distribution of the token at position state.pos + i + 1.
// Afterwards the state is as if every id had been decoded. Commit(state, keep) keeps the first
// `keep` positions and restores everything the rest touched (byte-exact), so the state equals
// that of a run that only ever decoded ids[0 .. keep).
//
// Thread-safety: one scorer per thread (it holds per-step journals and uses a Backend).

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tests/testing/dspark_rollback.h"
#include "model/model.h"

namespace epd::testing {

class TargetScorer {
 public:
  virtual ~TargetScorer() = default;
  [[nodiscard]] virtual absl::StatusOr<std::vector<float>> Score(model::SequenceState& state,
                                                                 std::span<const int32_t> ids) = 0;
  [[nodiscard]] virtual absl::Status Commit(model::SequenceState& state, int64_t keep) = 0;
};

// k + 1 sequential Model::Decode calls, journaled by StepJournal. Borrows `model` (must outlive
// the scorer). One open step at a time: Score then Commit.
class SequentialTargetScorer final : public TargetScorer {
 public:
  explicit SequentialTargetScorer(const model::Model& model);
  absl::StatusOr<std::vector<float>> Score(model::SequenceState& state,
                                           std::span<const int32_t> ids) override;
  absl::Status Commit(model::SequenceState& state, int64_t keep) override;
  const StepJournal& journal() const { return journal_; }

 private:
  const model::Model& model_;
  StepJournal journal_;
};

// One Model::Extend call over the k + 1 positions (kDecode mode: bit-identical to sequential
// Decode calls) with Model::Checkpoint / Model::Rollback for the rejected ones. Borrows `model`.
class ExtendTargetScorer final : public TargetScorer {
 public:
  explicit ExtendTargetScorer(const model::Model& model) : model_(model) {}
  absl::StatusOr<std::vector<float>> Score(model::SequenceState& state,
                                           std::span<const int32_t> ids) override;
  absl::Status Commit(model::SequenceState& state, int64_t keep) override;

 private:
  const model::Model& model_;
  bool open_ = false;
  model::StepCheckpoint checkpoint_;
  std::vector<int32_t> ids_;
  model::ForwardResult step_;
};

}  // namespace epd::testing
