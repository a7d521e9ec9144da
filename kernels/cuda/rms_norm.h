#pragma once

// CUDA-free header for the RMSNorm launcher.
#include <cstdint>
#include <string>

namespace epd::kernels::cuda {

// Host-pointer convenience launcher: copies in, runs one block per row, copies out.
// x, y: [rows, dim] fp32 host memory; w: [dim]. Returns false and sets *error on any CUDA error.
bool RmsNormF32Host(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps,
                    std::string* error);

}  // namespace epd::kernels::cuda
