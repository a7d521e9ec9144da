#include "tests/testing/dspark_target_scorer.h"

#include "absl/strings/str_cat.h"

namespace epd::testing {

SequentialTargetScorer::SequentialTargetScorer(const model::Model& model)
    : model_(model), journal_(model.config()) {}

absl::StatusOr<std::vector<float>> SequentialTargetScorer::Score(model::SequenceState& state,
                                                                 std::span<const int32_t> ids) {
  if (ids.empty()) return absl::InvalidArgumentError("dspark: Score needs at least one token");
  const int64_t V = model_.config().vocab_size;
  std::vector<float> logits;
  logits.reserve(ids.size() * V);
  journal_.Begin(state);
  for (int32_t id : ids) {
    journal_.BeforePosition(state);
    auto r = model_.Decode(state, id);
    if (!r.ok()) {
      // The failed position may have touched its ring slot: journal it as done, then undo all.
      journal_.AfterPosition(state);
      absl::Status rb = journal_.Rollback(state, 0);
      if (!rb.ok()) return rb;
      return r.status();
    }
    journal_.AfterPosition(state);
    logits.insert(logits.end(), r->logits.begin(), r->logits.end());
  }
  return logits;
}

absl::Status SequentialTargetScorer::Commit(model::SequenceState& state, int64_t keep) {
  if (keep < 1) return absl::InvalidArgumentError(absl::StrCat("dspark: commit keeps ", keep));
  return journal_.Rollback(state, keep);
}

absl::StatusOr<std::vector<float>> ExtendTargetScorer::Score(model::SequenceState& state,
                                                             std::span<const int32_t> ids) {
  if (ids.empty()) return absl::InvalidArgumentError("dspark: Score needs at least one token");
  checkpoint_ = model_.Checkpoint(state, static_cast<int64_t>(ids.size()));
  auto r = model_.Extend(state, ids, /*all_logits=*/true);
  if (!r.ok()) {
    open_ = false;
    return r.status();
  }
  ids_.assign(ids.begin(), ids.end());
  step_ = std::move(*r);
  open_ = true;
  return step_.logits;
}

absl::Status ExtendTargetScorer::Commit(model::SequenceState& state, int64_t keep) {
  if (!open_) return absl::FailedPreconditionError("dspark: Commit without a scored step");
  if (keep < 1 || keep > static_cast<int64_t>(ids_.size()))
    return absl::InvalidArgumentError(
        absl::StrCat("dspark: commit keeps ", keep, " of ", ids_.size(), " positions"));
  open_ = false;
  return model_.Rollback(state, checkpoint_, std::span<const int32_t>(ids_).first(keep), step_);
}

}  // namespace epd::testing
