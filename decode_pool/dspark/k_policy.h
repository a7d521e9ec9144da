#pragma once

// Choice of the verify length k per decode step (docs/dspark.md, "Choosing k").
//
// The confidence head gives one raw logit c_i per draft position; a_i = sigmoid(c_i) estimates
// P(draft i accepted | drafts before it accepted). With k drafts the expected number of tokens a
// step emits is E(k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i (one target token always, plus the
// accepted prefix). Step time is a calibrated linear model t(b, k) in the batch size b and k; the
// policy picks the k in [0, max_k] maximizing b * E(k) / t(b, k) (tokens per second of the whole
// batch; every sequence of the step uses the same k when ChooseForBatch is used).
//
// Thread-safety: immutable after construction; share freely.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace epd::decode_pool {

struct StepTimeSample {
  int batch = 1;
  int k = 0;
  double seconds = 0;
};

// t(b, k) = base_s + per_token_s * b * (k + 1) + draft_s * b * [k > 0]   (seconds)
struct StepTimeModel {
  double base_s = 0;       // fixed per-step cost (launches, scheduling). Default: 0
  double per_token_s = 1;  // per target position verified. Default: 1
  double draft_s = 0;      // per sequence DSpark draft pass. Default: 0
  double Seconds(int batch, int k) const;
  // Least squares over the three terms (needs samples with k = 0 and k > 0 and >= 3 distinct
  // (b, k)); negative coefficients are clamped to 0.
  [[nodiscard]] static absl::StatusOr<StepTimeModel> Fit(std::span<const StepTimeSample> samples);
};

double AcceptanceEstimate(float raw_confidence);  // sigmoid
// E(k) for the given raw confidences (k <= confidences.size()).
double ExpectedEmitted(std::span<const float> raw_confidence, int k);

struct KPolicyOptions {
  int max_k = 5;  // <= the DSpark block size. Default: 5
};

class KPolicy {
 public:
  explicit KPolicy(StepTimeModel time, KPolicyOptions options = {});
  // k for one sequence in a batch of `batch` sequences that all use the same k.
  int Choose(std::span<const float> raw_confidence, int batch) const;
  // One k for a whole batch (each entry a sequence's raw confidences).
  int ChooseForBatch(std::span<const std::vector<float>> raw_confidence) const;
  // False when even certain acceptance of every draft cannot beat k = 0 at this batch size (then
  // a worker skips the draft pass entirely).
  bool WorthDrafting(int batch) const;
  const StepTimeModel& time_model() const { return time_; }

 private:
  StepTimeModel time_;
  KPolicyOptions options_;
};

}  // namespace epd::decode_pool
