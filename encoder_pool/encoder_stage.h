#pragma once

// The encoder stage (DESIGN.md §3): layers [0, split) of the prompt plus the split layer's
// compressor and index keys. Compute only: no gRPC, no UCX (encoder_server.cc moves the result).
//
// Thread-safety: Run may be called from any thread; calls share the model's backend and are
// serialized by an internal mutex.
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model.h"
#include "model/sequence_state.h"
#include "model/stages.h"

namespace epd::encoder_pool {

struct EncoderResult {
  std::vector<model::StateSegment> state;  // the sequence state at N (SerializeState)
  model::EncoderOutput output;             // residual entering the split layer, tail rows
};

class EncoderStage {
 public:
  // `model` must outlive the stage. tail_rows <= 0: DefaultTailRows(config).
  explicit EncoderStage(const model::Model& model, int64_t tail_rows = 0);

  // Tail rows the decoder replays: window + DSpark block (128 + 5 in the release).
  static int64_t DefaultTailRows(const model::ModelConfig& config);
  int64_t tail_rows() const { return tail_rows_; }

  // Encodes a whole prompt from position 0. Errors on an empty prompt or ids out of the vocab.
  [[nodiscard]] absl::StatusOr<EncoderResult> Run(std::span<const int32_t> prompt);

 private:
  const model::Model& model_;
  int64_t tail_rows_;
  std::mutex compute_mu_;
};

}  // namespace epd::encoder_pool
