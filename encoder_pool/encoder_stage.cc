#include "encoder_pool/encoder_stage.h"

#include "absl/strings/str_cat.h"

namespace epd::encoder_pool {

EncoderStage::EncoderStage(const model::Model& model, int64_t tail_rows)
    : model_(model), tail_rows_(tail_rows > 0 ? tail_rows : DefaultTailRows(model.config())) {}

int64_t EncoderStage::DefaultTailRows(const model::ModelConfig& c) {
  return c.window_size + std::max(0, c.dspark_block_size);
}

absl::StatusOr<EncoderResult> EncoderStage::Run(std::span<const int32_t> prompt) {
  if (prompt.empty()) return absl::InvalidArgumentError("encoder: empty prompt");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model_.config().vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("encoder: prompt token ", i, " (", prompt[i],
                                                     ") is outside the vocabulary"));
  }
  std::lock_guard<std::mutex> lock(compute_mu_);
  auto state = model_.NewSequence();
  auto out = model::EncoderPass(model_, *state, prompt, tail_rows_);
  if (!out.ok()) return out.status();
  EncoderResult r;
  r.state = model::SerializeState(model_.config(), *state);
  r.output = std::move(*out);
  return r;
}

}  // namespace epd::encoder_pool
