#pragma once

// The prefill stage (DESIGN.md §3): decoder bounded replay, layers [split, n_layers) on the
// encoder's tail rows (+ the DSpark rings when the model has DSpark). Compute only.
//
// Thread-safety: Run may be called from any thread; calls are serialized by an internal mutex.
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model.h"
#include "model/sequence_state.h"
#include "model/stages.h"

namespace epd::prefill_pool {

struct PrefillResult {
  std::vector<model::StateSegment> state;  // the whole sequence state at N (with main_hidden)
  std::vector<float> logits;               // fp32 [vocab] of the last prompt position
  int64_t replayed_rows = 0;               // tail rows run through the decoder layers
};

class PrefillStage {
 public:
  explicit PrefillStage(const model::Model& model) : model_(model) {}

  // `state`: the encoder's state at N; `enc`: its output tail. Errors name the bad segment.
  [[nodiscard]] absl::StatusOr<PrefillResult> Run(const std::vector<model::StateSegment>& state,
                                                  const model::EncoderOutput& enc);

 private:
  const model::Model& model_;
  std::mutex compute_mu_;
};

}  // namespace epd::prefill_pool
