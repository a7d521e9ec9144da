#pragma once

// CPU reference ops (deterministic, row-independent). See kernels/backend.h for the tensor
// conventions. Pure functions; thread-safe.

#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace epd::kernels::cpu {

void LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y);
void LinearBf16(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y);
void LinearF32(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y);
void RmsNormBf16(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y);
void Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs, const float* cos,
          const float* sin, bool inverse);
void SparseAttention(const SparseAttentionArgs& a);

// Indexer scores of one query row against keys [n, dim] (MODEL.md §3 step 6): for each key t,
// score[t] = bf16(sum over heads h in order of bf16(max(bf16(q_h . k_t), 0) * w[h])), each dot
// an fp32 sum in index order. q [heads, dim], w [heads], score [n].
void IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                   int64_t dim, float* score);

// SIMD paths (x86-64 AVX2, no FMA) perform the same fp32 operations in the same order as the
// scalar code (lanes are independent sums, products are rounded before they are added), so every
// result is bit-identical; they are used when the CPU has AVX2. SetSimdEnabled(false) forces the
// scalar code (tests compare the two). Process-wide; set it before using the ops.
void SetSimdEnabled(bool on);
bool SimdEnabled();

// RoPE frequencies (MODEL.md §3 step 4): freq_i = fp32(1/theta^(2i/rope_dim)), optionally with
// YaRN (factor, original length, beta_fast/slow). Returns rope_dim/2 frequencies.
std::vector<float> RopeFrequencies(int rope_dim, double theta, bool yarn, double factor,
                                   double original_seq_len, double beta_fast, double beta_slow);
// cos/sin [n_pairs] at an integer position: angle = fp32(pos * freq_i).
void RopeCosSin(const std::vector<float>& freqs, int64_t pos, float* cos, float* sin);

// Stable top-k: the k largest values, descending; equal values -> lower index first.
// Returns the indices (size min(k, n)).
std::vector<int32_t> StableTopK(const float* v, int64_t n, int64_t k);

// mHC mixes (MODEL.md §3): h [hc, dim] bf16; fn [(2+hc)*hc, hc*dim] fp32; scale [3]; base
// [(2+hc)*hc]. Outputs pre [hc], post [hc], comb [hc, hc] (comb[j*hc+k]: source j -> dest k).
void HcMixes(const float* h, int hc, int64_t dim, const float* fn, const float* scale,
             const float* base, int sinkhorn_iters, float hc_eps, float norm_eps, float* pre,
             float* post, float* comb);
// y[d] = bf16(sum_j pre[j] * h[j, d]).
void HcPre(const float* h, int hc, int64_t dim, const float* pre, float* y);
// out[k, d] = bf16(post[k] * y[d] + sum_j comb[j, k] * res[j, d]). out may alias res.
void HcPost(const float* y, const float* res, int hc, int64_t dim, const float* post,
            const float* comb, float* out);

}  // namespace epd::kernels::cpu
