#pragma once

// CPU reference ops (deterministic, row-independent). See kernels/backend.h for the tensor
// conventions. Pure functions; thread-safe.

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/rope.h"

namespace epd::kernels::cpu {

void LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y);
void LinearBf16(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in, float* y);
void LinearF32(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in, float* y);
void RmsNormBf16(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y);
void Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs, const float* cos,
          const float* sin, bool inverse);
// The reference's sparse attention (MODEL.md §3 step 8; the exact operation order is in ops.cc):
// scores are fp32 dots summed in index order, each 64-entry chunk's probabilities are summed in
// torch's order (TorchChunkSum) before they join the denominator.
void SparseAttention(const SparseAttentionArgs& a);
// torch 1.13's CPU fp32 exp (Sleef expf u10 with FMA), bit for bit.
float TorchExp(float d);
void TorchExpN(const float* x, float* y, int64_t n);  // y[i] = TorchExp(x[i]) (AVX2+FMA lanes)
// torch 1.13's CPU fp32 `sum(-1)` of n contiguous floats (AVX2 build), bit for bit.
float TorchSum(const float* x, int64_t n);
float TorchChunkSum(const float* x, int64_t n);  // TorchSum of one attention chunk
// torch's fp32 `x.square().mean(-1)` (the reference's RMSNorm and mHC statistic).
float TorchMeanSquare(const float* x, int64_t n);

// Indexer scores of one query row against keys [n, dim] (MODEL.md §3 step 6): for each key t,
// score[t] = bf16(sum over heads h in order of bf16(max(bf16(q_h . k_t), 0) * w[h])), each dot
// an fp32 sum in index order. q [heads, dim], w [heads], score [n].
void IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                   int64_t dim, float* score);

// SIMD paths (x86-64 AVX2 without FMA; TorchExpN's lanes fuse where Sleef does, with FMA) perform
// the same fp32 operations in the same order as the scalar code (lanes are independent sums,
// products are rounded before they are added), so every result is bit-identical. One switch
// decides which code runs: a call takes the SIMD paths where the CPU has them unless the calling
// thread is inside a ScopedScalarKernels(true) (other threads are unaffected). The tests' CPU
// backend with simd = false (tests/testing/test_cpu_backend.h) holds one around each of its ops;
// tests comparing the two paths hold one around their direct calls of these functions.
bool SimdEnabled();  // whether the calling thread's calls take the SIMD paths
// Forces the scalar code on this thread while alive (when `scalar`); restores the previous
// setting.
class ScopedScalarKernels {
 public:
  explicit ScopedScalarKernels(bool scalar);
  ~ScopedScalarKernels();
  ScopedScalarKernels(const ScopedScalarKernels&) = delete;
  ScopedScalarKernels& operator=(const ScopedScalarKernels&) = delete;

 private:
  bool active_;
  bool prev_;
};

// RoPE tables live in kernels/rope.h (host constants shared by every backend).
using ::epd::kernels::RopeCosSin;
using ::epd::kernels::RopeFrequencies;

// Stable top-k: the k largest values, descending; equal values -> lower index first.
// Returns the indices (size min(k, n)).
std::vector<int32_t> StableTopK(const float* v, int64_t n, int64_t k);

// mHC mixes (MODEL.md §3): h [hc, dim] bf16; fn [(2+hc)*hc, hc*dim] fp32; scale [3]; base
// [(2+hc)*hc]. Outputs pre [hc], post [hc], comb [hc, hc] (comb[j*hc+k]: source j -> dest k).
void HcMixes(const float* h, int hc, int64_t dim, const float* fn, const float* scale,
             const float* base, int sinkhorn_iters, float hc_eps, float norm_eps, float* pre,
             float* post, float* comb, bool torch_vector_exp = true);
// y[d] = bf16(sum_j pre[j] * h[j, d]).
void HcPre(const float* h, int hc, int64_t dim, const float* pre, float* y);
// out[k, d] = bf16(post[k] * y[d] + sum_j comb[j, k] * res[j, d]). out may alias res.
void HcPost(const float* y, const float* res, int hc, int64_t dim, const float* post,
            const float* comb, float* out);

}  // namespace epd::kernels::cpu
