#pragma once

// Helpers shared by the kernels/cuda .cu files: launch shapes, scratch layouts (host side) and
// device arithmetic.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/codec.h"

namespace epd::kernels::cuda {

constexpr int kThreads = 256;

inline unsigned GridFor(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// A launcher's scratch memory is laid out in pieces of kAlign bytes.
constexpr size_t kAlign = 256;
inline size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Lays out a scratch buffer: each Take returns the offset of the next aligned piece.
struct ScratchCursor {
  size_t at = 0;
  size_t Take(size_t bytes) {
    const size_t here = at;
    at += AlignUp(bytes);
    return here;
  }
};

// fp32 transcendental functions: evaluated in double and rounded once to fp32, i.e. the
// correctly rounded fp32 result in all but vanishingly rare cases. glibc's expf/log1pf/cosf/sinf
// (the CPU reference) are within 0.51-0.56 ulp, so the two agree except where glibc itself misses
// the correctly rounded value (docs/cuda.md: the ops that use these carry a 1-ulp-per-step
// tolerance in the parity suite).
__device__ __forceinline__ float ExpF(float x) {
  return static_cast<float>(exp(static_cast<double>(x)));
}
__device__ __forceinline__ float Log1pF(float x) {
  return static_cast<float>(log1p(static_cast<double>(x)));
}
__device__ __forceinline__ float CosF(float x) {
  return static_cast<float>(cos(static_cast<double>(x)));
}
__device__ __forceinline__ float SinF(float x) {
  return static_cast<float>(sin(static_cast<double>(x)));
}

// The dot of one quantization block (n <= 32) as the reference sums it and ops.cc QuantOutputs
// does: fp32, in K order from +0 (every product exact, every addition rounded).
__device__ __forceinline__ float BlockDot(const float* a, const float* b, int n) {
  float d = 0.f;
  for (int i = 0; i < n; ++i) d += a[i] * b[i];
  return d;
}

}  // namespace epd::kernels::cuda
