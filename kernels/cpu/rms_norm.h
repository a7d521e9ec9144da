#pragma once

#include <cstdint>
#include <span>

namespace epd::kernels::cpu {

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w, all in fp32.
// x, y: [rows, dim]; w: [dim]. y may alias x. Rows are independent (batch-invariant).
void RmsNormF32(std::span<const float> x, std::span<const float> w, std::span<float> y,
                int64_t rows, int64_t dim, float eps);

}  // namespace epd::kernels::cpu
