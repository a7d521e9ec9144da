#pragma once

// The decode stage (DESIGN.md §3): token generation on a sequence state handed over by prefill.
// Compute only (decode_server.cc streams the tokens). A step advances a batch of sequences by one
// token each with one batched DecodeStep call (continuous batching: the server adds and removes
// sequences between steps).
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
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"

namespace epd::decode_pool {

struct DecodeSequence {
  std::unique_ptr<model::SequenceState> state;
  std::unique_ptr<model::Sampler> sampler;
  std::vector<int32_t> output;  // tokens generated so far (EOS/stop ids excluded)
  int32_t pending = -1;         // last sampled token, not yet fed to the model
  bool done = false;
  std::string finish_reason;  // "stop" | "length" once done
};

class DecodeStage {
 public:
  explicit DecodeStage(const model::Model& model) : model_(model) {}

  // A sequence from prefill's hand-off: the state at N and the last prompt position's logits.
  // Samples the first token. The model's EOS id is added to the stop ids.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeSequence>> Start(
      const std::vector<model::StateSegment>& state, std::span<const float> logits,
      model::SamplingParams params, std::span<const int32_t> prompt);
  // A sequence from the prompt alone (no encoder/prefill in the chain): runs Model::Prefill.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeSequence>> StartFromPrompt(
      std::span<const int32_t> prompt, model::SamplingParams params);

  // One token for every sequence of `batch` that is not done (one batched DecodeStep).
  [[nodiscard]] absl::Status Step(std::span<DecodeSequence* const> batch);

 private:
  std::unique_ptr<DecodeSequence> Begin(model::SamplingParams params,
                                        std::span<const int32_t> prompt) const;
  // Samples from `logits`; marks the sequence done on a stop token or at max_tokens.
  void Offer(DecodeSequence& seq, std::span<const float> logits) const;

  const model::Model& model_;
  std::mutex compute_mu_;
};

}  // namespace epd::decode_pool
