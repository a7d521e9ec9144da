// Sampling ops of CudaBackend: Argmax, PenalizeLogits, SampleLogits, VerifyDrafts, TopLogprobs.
// Each mirrors its host reference (cpu_backend.cc Argmax, kernels/penalty.h, and
// kernels/sampling_math.h's FilteredProbs, DrawIndex, VerifyDrafts and logprobs): the same token
// ids, and the sums the host takes in double taken in double in the same order. SampleLogits'
// top-k / top-p sort is topk.cu's (sort_rows.h).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/sort_rows.h"
#include "kernels/penalty.h"
#include "kernels/sampling_math.h"

namespace epd::kernels::cuda {
namespace {

using codec::IsNan;

// The block's first entry of the row xr [n] in the strict order `before(v, i, w, j)` ((v, i)
// before (w, j)), past the entries `skip(v, i)` names: each thread scans a strided part, then the
// threads' candidates combine in a tree through bv / bi (kThreads each, shared memory), which does
// not depend on the order. Every thread of the block calls it; on return bv[0] / bi[0] hold the
// entry (bi[0] = -1: none).
template <typename Skip, typename Before>
__device__ __forceinline__ void BlockFirst(const float* xr, int64_t n, Skip skip, Before before,
                                           float* bv, int64_t* bi) {
  float v = 0.f;
  int64_t idx = -1;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float xi = xr[i];
    if (skip(xi, i)) continue;
    if (idx < 0 || before(xi, i, v, idx)) {
      v = xi;
      idx = i;
    }
  }
  bv[threadIdx.x] = v;
  bi[threadIdx.x] = idx;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = bv[threadIdx.x + s];
      const int64_t oi = bi[threadIdx.x + s];
      if (oi >= 0 && (bi[threadIdx.x] < 0 || before(ov, oi, bv[threadIdx.x], bi[threadIdx.x]))) {
        bv[threadIdx.x] = ov;
        bi[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
}

// cpu_backend.cc Argmax (std::max_element: the first index of the largest value; a NaN is never
// taken after the first element, and a NaN first element stays the answer). One block per row:
// BlockFirst over the non-NaN values in the order (larger value, then lower index); in a thread's
// own scan the indices ascend, so a later value is taken only when larger, as max_element does.
__global__ void ArgmaxKernel(const float* x, int64_t n, int32_t* out) {
  __shared__ float bv[kThreads];
  __shared__ int64_t bi[kThreads];
  const float* xr = x + blockIdx.x * n;
  BlockFirst(
      xr, n, [](float v, int64_t) { return IsNan(v); },
      [](float v, int64_t i, float w, int64_t j) { return w < v || (!(v < w) && i < j); }, bv, bi);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = (IsNan(xr[0]) || bi[0] < 0) ? 0 : static_cast<int32_t>(bi[0]);
  }
}

// Backend::PenalizeLogits: one thread per entry (the entries are distinct, so no two threads
// write one logit); kernels/penalty.h is the host Sampler's arithmetic. An entry outside the
// logits is skipped (the CPU backend refuses the call).
__global__ void PenalizeLogitsKernel(float* x, int64_t total, const int64_t* at,
                                     const int32_t* counts, int64_t entries, float repetition,
                                     float frequency, float presence) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= entries) return;
  const int64_t a = at[i];
  if (a < 0 || a >= total) return;
  x[a] = Penalized(x[a], counts[i], repetition, frequency, presence);
}


// ---- SampleLogits: kernels/sampling_math.h (FilteredProbs, then DrawIndex), step by step ----
// A blocked sum's block b of row r is one thread's sequential double sum (the host's order);
// BlockPrefixKernel adds a row's block sums in order; a first-hit search runs block by block and
// takes the lowest block with a hit. No atomics: the same token whatever the launch.
using sampling::kSumBlock;

// Row maxima of x [rows, n], one block per row (a max is exact in any order; NaN never taken,
// as the host's `l > mx`).
__global__ void RowMaxKernel(const float* x, int64_t n, float* mx) {
  __shared__ float part[kThreads];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * n;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (xr[i] > m) m = xr[i];
  }
  part[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && part[threadIdx.x + s] > part[threadIdx.x])
      part[threadIdx.x] = part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) mx[blockIdx.x] = part[0];
}

__device__ __forceinline__ int64_t BlockEnd(int64_t b, int64_t lim) {
  return (b + 1) * kSumBlock < lim ? (b + 1) * kSumBlock : lim;
}

// Step 1: the weights (into probs) and their block sums T [rows, nb].
__global__ void WeightBlockSumsKernel(const float* x, int64_t rows, int64_t n, int64_t nb,
                                      const float* mx, float inv_t, float* probs, double* T) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * nb) return;
  const int64_t r = t / nb, b = t % nb;
  double s = 0;
  for (int64_t i = b * kSumBlock; i < BlockEnd(b, n); ++i) {
    const float e = sampling::Weight(x[r * n + i], mx[r], inv_t);
    probs[r * n + i] = e;
    s += e;
  }
  T[t] = s;
}

// The sorted position j's index of row r (SortSampleKeys' keys: descending, ties lower first).
__device__ __forceinline__ int64_t SortedIndex(const uint64_t* sorted, int64_t r, int64_t n,
                                               int64_t j) {
  return static_cast<int64_t>(sorted[r * n + j] & 0xffffffffu);
}

// Block sums T [rows, nb] of probs: in index order (sorted null), else over the sorted positions
// j < lim; positive_only sums max(p, 0) (DrawIndex's terms).
__global__ void BlockSumsKernel(const float* probs, int64_t rows, int64_t n, int64_t nb,
                                const uint64_t* sorted, int64_t lim, bool positive_only,
                                double* T) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * nb) return;
  const int64_t r = t / nb, b = t % nb;
  double s = 0;
  for (int64_t j = b * kSumBlock; j < BlockEnd(b, lim); ++j) {
    const float v = probs[r * n + (sorted != nullptr ? SortedIndex(sorted, r, n, j) : j)];
    s += positive_only && !(v > 0.f) ? 0.0 : static_cast<double>(v);
  }
  T[t] = s;
}

// P [rows, nb + 1]: P[0] = 0, P[b + 1] = P[b] + T[b] (the blocked sum is P[nb]).
__global__ void BlockPrefixKernel(const double* T, int64_t rows, int64_t nb, double* P) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  double acc = 0;
  P[r * (nb + 1)] = 0;
  for (int64_t b = 0; b < nb; ++b) {
    acc += T[r * nb + b];
    P[r * (nb + 1) + b + 1] = acc;
  }
}

// probs = fp32(p / the row's blocked sum).
__global__ void NormalizeKernel(float* probs, int64_t rows, int64_t n, int64_t nb,
                                const double* P) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n;
  probs[i] = static_cast<float>(static_cast<double>(probs[i]) / P[r * (nb + 1) + nb]);
}

// Top-p: in block b of row r's sorted positions j < k, the first whose prefix / kept >= top_p
// (kept = the blocked sum of the first k), or -1: hit [rows, nb].
__global__ void TopPFindKernel(const float* probs, const uint64_t* sorted, int64_t rows, int64_t n,
                               int64_t nb, int64_t k, const double* P, double top_p,
                               int64_t* hit) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * nb) return;
  const int64_t r = t / nb, b = t % nb;
  const double kept = P[r * (nb + 1) + nb];
  double acc = P[r * (nb + 1) + b];
  hit[t] = -1;
  for (int64_t j = b * kSumBlock; j < BlockEnd(b, k); ++j) {
    acc += static_cast<double>(probs[r * n + SortedIndex(sorted, r, n, j)]);
    if (acc / kept >= top_p) {
      hit[t] = j;
      return;
    }
  }
}

// keep[r] = the row's first hit + 1, else k.
__global__ void KeepKernel(const int64_t* hit, int64_t rows, int64_t nb, int64_t k,
                           int64_t* keep) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  keep[r] = k;
  for (int64_t b = 0; b < nb; ++b) {
    if (hit[r * nb + b] >= 0) {
      keep[r] = hit[r * nb + b] + 1;
      return;
    }
  }
}

// Sorted positions j >= keep[r] (keep null: >= k) get probability 0.
__global__ void DropTailKernel(float* probs, const uint64_t* sorted, int64_t rows, int64_t n,
                               const int64_t* keep, int64_t k) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, j = i % n;
  if (j >= (keep != nullptr ? keep[r] : k)) probs[r * n + SortedIndex(sorted, r, n, j)] = 0.f;
}

// Min-p: p < fp32(min_p * the row's max) -> 0.
__global__ void MinPKernel(float* probs, int64_t rows, int64_t n, const float* pmax, float min_p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * n) return;
  const float cut = min_p * pmax[i / n];
  if (probs[i] < cut) probs[i] = 0.f;
}

// DrawIndex in block b of row r: the first i with p_i > 0 and u * total < prefix_i (hit), and
// the block's last i with p_i > 0 (last), each -1 when none.
__global__ void DrawFindKernel(const float* probs, int64_t rows, int64_t n, int64_t nb,
                               const double* P, const double* u, int64_t* hit, int64_t* last) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * nb) return;
  const int64_t r = t / nb, b = t % nb;
  const double target = u[r] * P[r * (nb + 1) + nb];
  double acc = P[r * (nb + 1) + b];
  int64_t h = -1, l = -1;
  for (int64_t i = b * kSumBlock; i < BlockEnd(b, n); ++i) {
    const float p = probs[r * n + i];
    acc += p > 0.f ? static_cast<double>(p) : 0.0;
    if (p > 0.f) {
      l = i;
      if (h < 0 && target < acc) h = i;
    }
  }
  hit[t] = h;
  last[t] = l;
}

// out[r] = the row's first hit, else its last positive index, else 0.
__global__ void DrawPickKernel(const int64_t* hit, const int64_t* last, int64_t rows, int64_t nb,
                               int32_t* out) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  int64_t pick = -1, fallback = -1;
  for (int64_t b = 0; b < nb && pick < 0; ++b) {
    pick = hit[r * nb + b];
    if (last[r * nb + b] >= 0) fallback = last[r * nb + b];
  }
  out[r] = static_cast<int32_t>(pick >= 0 ? pick : fallback >= 0 ? fallback : 0);
}

// The scratch of blocked sums and draws over `rows` rows of nb blocks: block sums T f64 [rows, nb],
// their prefixes P f64 [rows, nb + 1], the draw's hit / last i64 [rows, nb].
struct DrawScratch {
  double* T = nullptr;
  double* P = nullptr;
  int64_t* hit = nullptr;
  int64_t* last = nullptr;
};
// Where a DrawScratch lies in a launcher's scratch (taken from its cursor in this order).
struct DrawLayout {
  size_t T = 0, P = 0, hit = 0, last = 0;
  DrawLayout() = default;
  DrawLayout(ScratchCursor& c, int64_t rows, int64_t nb) {
    const size_t rb = static_cast<size_t>(rows * nb);
    T = c.Take(rb * 8);
    P = c.Take((rb + static_cast<size_t>(rows)) * 8);
    hit = c.Take(rb * 8);
    last = c.Take(rb * 8);
  }
  DrawScratch At(uint8_t* base) const {
    return {reinterpret_cast<double*>(base + T), reinterpret_cast<double*>(base + P),
            reinterpret_cast<int64_t*>(base + hit), reinterpret_cast<int64_t*>(base + last)};
  }
};

// Each row's blocked sum of probs [rows, n] (in `sorted` order when given, over the first `lim`
// positions; positive entries only when asked): block sums s.T, their prefixes s.P.
void LaunchBlockedSums(const float* probs, int64_t rows, int64_t n, int64_t nb,
                       const uint64_t* sorted, int64_t lim, bool positive_only,
                       const DrawScratch& s, cudaStream_t stream) {
  BlockSumsKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(probs, rows, n, nb, sorted, lim,
                                                               positive_only, s.T);
  BlockPrefixKernel<<<GridFor(rows), kThreads, 0, stream>>>(s.T, rows, nb, s.P);
}

// sampling::DrawIndex of each row of probs [rows, n] with u [rows] into out [rows]: the
// positive entries' blocked sums, then the inverse CDF.
void LaunchDraw(const float* probs, int64_t rows, int64_t n, int64_t nb, const double* u,
                const DrawScratch& s, int32_t* out, cudaStream_t stream) {
  LaunchBlockedSums(probs, rows, n, nb, nullptr, n, true, s, stream);
  DrawFindKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(probs, rows, n, nb, s.P, u, s.hit,
                                                              s.last);
  DrawPickKernel<<<GridFor(rows), kThreads, 0, stream>>>(s.hit, s.last, rows, nb, out);
}

// ---- VerifyDrafts: kernels/sampling_math.h (VerifyDrafts), step by step ----
// The tests (one thread, in order, as the host): *row = the row of the final draw (the first
// rejected draft, else k), out[0] = the drafts accepted, *uf = the final draw's uniform. A draft
// outside [0, n) is rejected (the CPU backend refuses it).
__global__ void AcceptDraftsKernel(const float* p, const float* q, const int32_t* drafts, int64_t k,
                                   int64_t n, const double* u, int32_t* out, int64_t* row,
                                   double* uf) {
  int64_t i = 0;
  for (; i < k; ++i) {
    const int32_t x = drafts[i];
    if (x < 0 || x >= n || !sampling::AcceptDraft(p[i * n + x], q[i * n + x], u[i])) break;
  }
  out[0] = static_cast<int32_t>(i);
  *row = i;
  *uf = u[i < k ? i + 1 : k];
}

// The final draw's distribution d [n]: max(0, p_r - q_r) after a rejection at row r, else p_k.
__global__ void ResidualKernel(const float* p, const float* q, int64_t k, int64_t n,
                               const int64_t* row, float* d) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t r = *row;
  d[i] = r < k ? fmaxf(0.f, p[r * n + i] - q[r * n + i]) : p[k * n + i];
}

// A residual without mass (P[nb], the blocked sum of its positive entries, is 0) is p_r.
__global__ void ResidualFallbackKernel(const float* p, int64_t k, int64_t n, const int64_t* row,
                                       const double* P, int64_t nb, float* d) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t r = *row;
  if (r < k && !(P[nb] > 0.0)) d[i] = p[r * n + i];
}

// Each row's token for its logprobs after the verdict out = {accepted, token}: the token at the
// verdict's row (and at row k), the row's draft elsewhere.
__global__ void ChosenTokensKernel(const int32_t* drafts, int64_t k, const int32_t* out,
                                   int32_t* chosen) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r > k) return;
  chosen[r] = r != out[0] && r < k ? drafts[r] : out[1];
}

// Backend::TopLogprobs' last step (sampling_math.cc LogSumExp and TopIndices), one block per row
// after RowMaxKernel, WeightBlockSumsKernel (T = 1) and BlockPrefixKernel: lse = mx + log(P[nb]),
// the chosen token's logprob, then the top entries one at a time. Entry j is the TopBefore-first
// entry after entry j - 1 (a strict total order, so no list of taken entries is kept), found by
// BlockFirst. No atomics.
__global__ void LogprobsKernel(const float* x, int64_t n, int64_t nb, const float* mx,
                               const double* P, const int32_t* chosen, int64_t top,
                               float* chosen_lp, int32_t* top_ids, float* top_lp) {
  __shared__ float bv[kThreads];
  __shared__ int64_t bi[kThreads];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * n;
  const double lse = static_cast<double>(mx[r]) + log(P[r * (nb + 1) + nb]);
  if (threadIdx.x == 0) {
    const int32_t c = chosen[r];
    chosen_lp[r] = c >= 0 && c < n ? sampling::Logprob(xr[c], lse) : NAN;
  }
  float pv = 0.f;
  int64_t pi = -1;  // the previous entry (none yet)
  for (int64_t j = 0; j < top; ++j) {
    BlockFirst(
        xr, n, [&](float v, int64_t i) { return pi >= 0 && !sampling::TopBefore(pv, pi, v, i); },
        [](float v, int64_t i, float w, int64_t k) { return sampling::TopBefore(v, i, w, k); }, bv,
        bi);
    pv = bv[0];
    pi = bi[0];
    if (threadIdx.x == 0) {
      top_ids[r * top + j] = pi < 0 ? 0 : static_cast<int32_t>(pi);
      top_lp[r * top + j] = pi < 0 ? NAN : sampling::Logprob(pv, lse);
    }
    __syncthreads();  // every thread read bv[0] and bi[0] before the next entry's writes
  }
}

// Scratch layout of TopLogprobs over [rows, n]: the weights f32 [rows, n] (unused after their
// block sums), T f64 [rows, nb], P f64 [rows, nb + 1], mx f32 [rows].
struct LogprobsLayout {
  int64_t nb = 0;
  size_t probs = 0, T = 0, P = 0, mx = 0, total = 0;
  LogprobsLayout(int64_t rows, int64_t n) : nb(sampling::SumBlocks(n)) {
    const size_t r = static_cast<size_t>(rows), rb = static_cast<size_t>(rows * nb);
    ScratchCursor c;
    probs = c.Take(static_cast<size_t>(rows * n) * 4);
    T = c.Take(rb * 8);
    P = c.Take((rb + r) * 8);
    mx = c.Take(r * 4);
    total = c.at;
  }
};

// Scratch layout of SampleLogits over [rows, n]: probs f32 [rows, n], the draw's (DrawLayout of
// rows), keep i64 [rows], mx f32 [rows]; with a sort, keys in / out u64 [rows, n], segment offsets
// int [rows + 1] and CUB's temporary storage.
struct SampleLayout {
  int64_t nb = 0;
  DrawLayout draw;
  size_t probs = 0, keep = 0, mx = 0, keys_in = 0, keys_out = 0, off = 0, temp = 0, temp_bytes = 0,
         total = 0;
  SampleLayout(int64_t rows, int64_t n, bool sort) : nb(sampling::SumBlocks(n)) {
    const size_t rn = static_cast<size_t>(rows * n), r = static_cast<size_t>(rows);
    ScratchCursor c;
    probs = c.Take(rn * 4);
    draw = DrawLayout(c, rows, nb);
    keep = c.Take(r * 8);
    mx = c.Take(r * 4);
    if (sort) {
      keys_in = c.Take(rn * 8);
      keys_out = c.Take(rn * 8);
      off = c.Take((r + 1) * 4);
      temp_bytes = AlignUp(SortTopKRowsTempBytes(rows, n));
      temp = c.Take(temp_bytes);
    }
    total = c.at;
  }
};
}  // namespace

cudaError_t Argmax(const float* x, int64_t rows, int64_t n, int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  ArgmaxKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, n, out);
  return cudaGetLastError();
}

cudaError_t PenalizeLogits(float* x, int64_t total, const int64_t* at, const int32_t* counts,
                           int64_t entries, float repetition, float frequency, float presence,
                           cudaStream_t stream) {
  if (entries <= 0) return cudaSuccess;
  PenalizeLogitsKernel<<<GridFor(entries), kThreads, 0, stream>>>(x, total, at, counts, entries,
                                                                 repetition, frequency, presence);
  return cudaGetLastError();
}

size_t TopLogprobsScratchBytes(int64_t rows, int64_t n) { return LogprobsLayout(rows, n).total; }

cudaError_t TopLogprobs(const float* x, int64_t rows, int64_t n, const int32_t* chosen, int64_t top,
                        float* chosen_lp, int32_t* top_ids, float* top_lp, void* scratch,
                        size_t scratch_bytes, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  const LogprobsLayout l(rows, n);
  if (scratch_bytes < l.total) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(scratch);
  auto* probs = reinterpret_cast<float*>(base + l.probs);
  auto* T = reinterpret_cast<double*>(base + l.T);
  auto* P = reinterpret_cast<double*>(base + l.P);
  auto* mx = reinterpret_cast<float*>(base + l.mx);
  const unsigned row_grid = static_cast<unsigned>(rows);
  RowMaxKernel<<<row_grid, kThreads, 0, stream>>>(x, n, mx);
  WeightBlockSumsKernel<<<GridFor(rows * l.nb), kThreads, 0, stream>>>(x, rows, n, l.nb, mx, 1.f,
                                                                       probs, T);
  BlockPrefixKernel<<<GridFor(rows), kThreads, 0, stream>>>(T, rows, l.nb, P);
  LogprobsKernel<<<row_grid, kThreads, 0, stream>>>(x, n, l.nb, mx, P, chosen, top, chosen_lp,
                                                    top_ids, top_lp);
  return cudaGetLastError();
}

size_t SampleLogitsScratchBytes(int64_t rows, int64_t n, bool sort) {
  return SampleLayout(rows, n, sort).total;
}

cudaError_t SampleLogits(const float* x, int64_t rows, int64_t n, float temperature, int top_k,
                         float top_p, float min_p, const double* u, int32_t* out, float* probs_out,
                         void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  const bool use_k = top_k > 0 && top_k < n, use_p = top_p < 1.f;
  const SampleLayout l(rows, n, use_k || use_p);
  if (scratch_bytes < l.total) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(scratch);
  // The distribution is built in place in probs: the caller's buffer when it wants it.
  auto* probs = probs_out != nullptr ? probs_out : reinterpret_cast<float*>(base + l.probs);
  const DrawScratch s = l.draw.At(base);
  auto* keep = reinterpret_cast<int64_t*>(base + l.keep);
  auto* mx = reinterpret_cast<float*>(base + l.mx);
  const int64_t nb = l.nb;
  const unsigned row_grid = static_cast<unsigned>(rows);
  // Blocked sum of probs (order, lim, positive_only) into P.
  auto blocked = [&](const uint64_t* sorted, int64_t lim, bool positive_only) {
    LaunchBlockedSums(probs, rows, n, nb, sorted, lim, positive_only, s, stream);
  };
  // 1. Softmax of x / T.
  RowMaxKernel<<<row_grid, kThreads, 0, stream>>>(x, n, mx);
  WeightBlockSumsKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(x, rows, n, nb, mx,
                                                                     1.f / temperature, probs, s.T);
  BlockPrefixKernel<<<GridFor(rows), kThreads, 0, stream>>>(s.T, rows, nb, s.P);
  NormalizeKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(probs, rows, n, nb, s.P);
  // 2. Top-k, then top-p over the top-k's mass.
  if (use_k || use_p) {
    const int64_t k = use_k ? top_k : n;
    auto* keys_out = reinterpret_cast<uint64_t*>(base + l.keys_out);
    const cudaError_t rc = SortTopKRows(
        probs, rows, n, nullptr, 0, reinterpret_cast<uint64_t*>(base + l.keys_in), keys_out,
        reinterpret_cast<int*>(base + l.off), base + l.temp, l.temp_bytes, stream);
    if (rc != cudaSuccess) return rc;
    if (use_p) {
      blocked(keys_out, k, false);
      TopPFindKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(
          probs, keys_out, rows, n, nb, k, s.P, static_cast<double>(top_p), s.hit);
      KeepKernel<<<GridFor(rows), kThreads, 0, stream>>>(s.hit, rows, nb, k, keep);
    }
    DropTailKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(probs, keys_out, rows, n,
                                                               use_p ? keep : nullptr, k);
  }
  // 3. Min-p.
  if (min_p > 0.f) {
    RowMaxKernel<<<row_grid, kThreads, 0, stream>>>(probs, n, mx);
    MinPKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(probs, rows, n, mx, min_p);
  }
  // 4. Renormalized; then the inverse CDF.
  blocked(nullptr, n, false);
  NormalizeKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(probs, rows, n, nb, s.P);
  LaunchDraw(probs, rows, n, nb, u, s, out, stream);
  return cudaGetLastError();
}

// Scratch layout of VerifyDrafts over n: d f32 [n], the draw's (DrawLayout of one row), row i64,
// uf f64.
struct VerifyLayout {
  int64_t nb = 0;
  DrawLayout draw;
  size_t d = 0, row = 0, uf = 0, total = 0;
  explicit VerifyLayout(int64_t n) : nb(sampling::SumBlocks(n)) {
    ScratchCursor c;
    d = c.Take(static_cast<size_t>(n) * 4);
    draw = DrawLayout(c, 1, nb);
    row = c.Take(8);
    uf = c.Take(8);
    total = c.at;
  }
};

size_t VerifyDraftsScratchBytes(int64_t n) { return VerifyLayout(n).total; }

cudaError_t VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k,
                         int64_t n, const double* u, int32_t* out, int32_t* chosen, void* scratch,
                         size_t scratch_bytes, cudaStream_t stream) {
  if (n <= 0 || k < 0) return cudaErrorInvalidValue;
  const VerifyLayout l(n);
  if (scratch_bytes < l.total) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(scratch);
  auto* d = reinterpret_cast<float*>(base + l.d);
  const DrawScratch s = l.draw.At(base);
  auto* row = reinterpret_cast<int64_t*>(base + l.row);
  auto* uf = reinterpret_cast<double*>(base + l.uf);
  const int64_t nb = l.nb;
  AcceptDraftsKernel<<<1, 1, 0, stream>>>(p, q, drafts, k, n, u, out, row, uf);
  ResidualKernel<<<GridFor(n), kThreads, 0, stream>>>(p, q, k, n, row, d);
  LaunchBlockedSums(d, 1, n, nb, nullptr, n, true, s, stream);  // the residual's mass
  ResidualFallbackKernel<<<GridFor(n), kThreads, 0, stream>>>(p, k, n, row, s.P, nb, d);
  // DrawIndex of d with uf (its sums again: d may have fallen back to p_r).
  LaunchDraw(d, 1, n, nb, uf, s, out + 1, stream);
  if (chosen != nullptr) {
    ChosenTokensKernel<<<GridFor(k + 1), kThreads, 0, stream>>>(drafts, k, out, chosen);
  }
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
