#include "kernels/cpu/rms_norm.h"

#include <cmath>

namespace epd::kernels::cpu {

void RmsNormF32(std::span<const float> x, std::span<const float> w, std::span<float> y,
                int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * dim;
    float* yr = y.data() + r * dim;
    float sum_sq = 0.f;
    for (int64_t i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

}  // namespace epd::kernels::cpu
