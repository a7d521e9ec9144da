#pragma once

// The sampling penalties' arithmetic on one logit (OpenAI frequency / presence, HF/vLLM
// repetition; model/sampling.h), shared by the host Sampler (model/sampling.cc), the CPU
// backend's PenalizeLogits and its CUDA kernel (kernels/cuda/sampling.cu): one copy, compiled
// __host__ __device__ under nvcc, so a penalized logit has the same bits wherever it is computed.

#include <cstdint>

#include "kernels/codec.h"

namespace epd::kernels {

// Repetition (a token of the prompt or of the output so far): l > 0 ? l / r : l * r.
EPD_HD float RepetitionPenalized(float l, float repetition) {
  return l > 0.f ? l / repetition : l * repetition;
}

// Frequency and presence (a token generated `count` > 0 times): l - (f * count + p).
EPD_HD float AdditivePenalized(float l, int32_t count, float frequency, float presence) {
  return l - (frequency * static_cast<float>(count) + presence);
}

// Both, in the Sampler's order: repetition when repetition != 1, then the additive penalty when
// count > 0.
EPD_HD float Penalized(float l, int32_t count, float repetition, float frequency, float presence) {
  if (repetition != 1.f) l = RepetitionPenalized(l, repetition);
  if (count > 0) l = AdditivePenalized(l, count, frequency, presence);
  return l;
}

}  // namespace epd::kernels
