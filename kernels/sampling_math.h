#pragma once

// The arithmetic of a T > 0 draw (model/sampling.h; docs/dspark.md, "Sampling"), one definition
// shared by the host Sampler (model/sampling.cc), the CPU backend's SampleLogits and its CUDA
// kernels (kernels/cuda/sample.cu), so a seeded request draws the same token wherever its logits
// are. A GPU cannot run a 129K-term sequential sum fast, so every sum here is *blocked*, an order
// a GPU runs in parallel and a CPU runs as easily:
//
//   BlockedSum(v[0, n)) = ((0 + T_0) + T_1) + ... + T_{nb-1},  nb = ceil(n / kSumBlock),
//   T_b = ((0 + v[b*kSumBlock]) + v[b*kSumBlock + 1]) + ...   (the block's terms in order),
//
// all in double. A running sum ("the mass up to i", for top-p and the inverse CDF) is the
// blocked prefix P_b + v[b*kSumBlock] + ... + v[i] (in order, from P_b = the sum of the block sums
// before i's block); the first index whose prefix passes a threshold is the answer, so blocks can
// be searched at once and the lowest hit taken.
//
// The distribution of a draw from penalized logits l [n] at temperature T (FilteredProbs):
//   1. mx = max l; e_i = TorchExp(fp32((l_i - mx) * fp32(1 / T))) (kernels/torch_math.h: one exp
//      with the same bits on the host and the device); p_i = fp32(e_i / BlockedSum(e));
//   2. top-k / top-p over the order of p descending, ties to the lower index (the project's top-k
//      rule): positions >= k are dropped; with top-p, kept = BlockedSum of the first k sorted
//      probabilities and the first position j whose blocked prefix / kept >= top_p is the last
//      one kept (all k when none);
//   3. min-p: p_i < fp32(min_p * max p) dropped;
//   4. p_i = fp32(p_i / BlockedSum(p)).
// The draw with u in [0, 1) (DrawIndex): target = u * BlockedSum(p+) (p+ = max(p, 0)), the first
// i with p_i > 0 and target < prefix_i; none (rounding at the top end): the last i with p_i > 0,
// else 0.
//
// Speculative verification of k drafts (DSpark at T > 0; Leviathan et al. 2023, Chen et al.
// 2023), VerifyDrafts: p [k+1, n] the target's distributions (FilteredProbs of its penalized rows
// for [last, drafts...]), q [k, n] the distributions the drafts were drawn from, uniforms u [k+1]
// taken in order. Draft i (x) is accepted when q(x) > 0 ? u_i * q(x) < p(x) : p(x) > 0 (in
// double); at the first rejected one (row r) the token is DrawIndex(max(0, p_r - q_r), u_{r+1}),
// or DrawIndex(p_r, u_{r+1}) when that residual has no mass (p_r == q_r); with all k accepted it is
// DrawIndex(p_k, u_k). UniformsUsed of them are consumed (the host Rng rewinds the rest).
//
// Logprobs (model::ComputeLogprobs, Backend::TopLogprobs) are the log-softmax of the raw logits
// l [n] (T = 1, no penalties or filters): lse = mx + log(BlockedSum(Weight(l_i, mx, 1))) in double
// (mx = max l), token t's logprob fp32(l_t - lse) (Logprob); the top entries are the largest l,
// descending, ties to the lower index (TopBefore).
//
// NaN logits have no defined draw (neither here nor in the reference).

#include <cstdint>
#include <vector>

#include "kernels/codec.h"
#include "kernels/torch_math.h"

namespace epd::kernels {

// A T > 0 draw's filters (model::SamplingParams' fields of the same names). Validated by the
// callers: temperature > 0 and finite, top_k >= 0, top_p in (0, 1], min_p in [0, 1].
struct SampleParams {
  float temperature = 1.f;
  int32_t top_k = 0;  // 0 = off
  float top_p = 1.f;  // 1 = off
  float min_p = 0.f;  // 0 = off
};

namespace sampling {

// Terms per block of a blocked sum.
inline constexpr int64_t kSumBlock = 256;

inline int64_t SumBlocks(int64_t n) { return (n + kSumBlock - 1) / kSumBlock; }

// Step 1's unnormalized weight of a logit.
EPD_HD float Weight(float l, float mx, float inv_t) { return torch_math::TorchExp((l - mx) * inv_t); }

// A logprob from a raw logit and its row's log-sum-exp.
EPD_HD float Logprob(float l, double lse) {
  return static_cast<float>(static_cast<double>(l) - lse);
}

// Whether entry (va, a) comes before (vb, b) in the top-logprobs order.
EPD_HD bool TopBefore(float va, int64_t a, float vb, int64_t b) {
  return va > vb || (va == vb && a < b);
}

// VerifyDrafts' test of a draft x with target and draft probabilities p(x), q(x).
EPD_HD bool AcceptDraft(float px, float qx, double u) {
  return qx > 0.f ? u * static_cast<double>(qx) < static_cast<double>(px) : px > 0.f;
}

// The uniforms VerifyDrafts consumed for `accepted` of k drafts (the tests made, then the draw).
EPD_HD int64_t UniformsUsed(int64_t accepted, int64_t k) {
  return (accepted < k ? accepted + 1 : k) + 1;
}

// Why `p` cannot be a draw's filters (empty when it can).
inline const char* ParamsProblem(const SampleParams& p) {
  if (!(p.temperature > 0.f) || p.temperature == INFINITY) return "temperature must be > 0";
  if (p.top_k < 0) return "top_k must be >= 0";
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) return "top_p must be in (0, 1]";
  if (!(p.min_p >= 0.f && p.min_p <= 1.f)) return "min_p must be in [0, 1]";
  return nullptr;
}

// ---- The host's definitions (the CUDA kernels mirror them step by step) ----

// BlockedSum of term(i), i < n (term returns a double).
template <typename Term>
double BlockedSum(int64_t n, Term term) {
  double total = 0;
  for (int64_t b = 0; b * kSumBlock < n; ++b) {
    double t = 0;
    const int64_t end = (b + 1) * kSumBlock < n ? (b + 1) * kSumBlock : n;
    for (int64_t i = b * kSumBlock; i < end; ++i) t += term(i);
    total += t;
  }
  return total;
}

// The first i < n with hit(i, prefix_i) (prefix_i the blocked prefix of term), or -1.
template <typename Term, typename Hit>
int64_t FirstPrefixHit(int64_t n, Term term, Hit hit) {
  double before = 0;  // P_b
  for (int64_t b = 0; b * kSumBlock < n; ++b) {
    double acc = before, t = 0;
    const int64_t end = (b + 1) * kSumBlock < n ? (b + 1) * kSumBlock : n;
    for (int64_t i = b * kSumBlock; i < end; ++i) {
      const double v = term(i);
      acc += v;
      t += v;
      if (hit(i, acc)) return i;
    }
    before += t;
  }
  return -1;
}

// The distribution a draw from penalized logits l [n] uses, into probs [n] (steps 1-4 above).
// `order` is scratch (the sorted indices, when top-k or top-p is on).
void FilteredProbs(const float* l, int64_t n, const SampleParams& p, float* probs,
                   std::vector<int32_t>& order);

// The index a draw with u in [0, 1) takes from probs [n] (non-negative, any positive sum).
int32_t DrawIndex(const float* probs, int64_t n, double u);

// The verdict on k drafts (the arithmetic above): the drafts accepted and the token after them.
// `residual` is scratch.
struct DraftVerdict {
  int32_t accepted = 0;
  int32_t token = 0;
};
DraftVerdict VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k,
                          int64_t n, const double* u, std::vector<float>& residual);

// The log-sum-exp of raw logits l [n] (the logprobs' arithmetic above).
double LogSumExp(const float* l, int64_t n);

// The `top` entries of l [n] in the TopBefore order, into ids [top] (top <= n). `order` is scratch.
void TopIndices(const float* l, int64_t n, int64_t top, int32_t* ids, std::vector<int32_t>& order);

}  // namespace sampling
}  // namespace epd::kernels
