// Selection ops of CudaBackend: stable top-k, candidate selection, index-list selection, MoE
// routing, argmax. Integer results, exact: the same indices as kernels/cpu (ops.cc StableTopK,
// cpu_backend.cc CandidateMask / SelectTopK / MoeRoute / Argmax) for the same inputs.
//
// Stable top-k is a radix sort (CUB, deterministic) of 64-bit keys (descending value, then
// ascending index): key = (~ordered(v) << 32) | index, where ordered() maps fp32 to uint32 in
// value order and -0 to +0 (the reference's comparator treats them as equal). NaN values have no
// defined place in the reference (its comparator is not a strict weak order with NaN) and none
// here.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/penalty.h"
#include "kernels/sampling_math.h"

namespace epd::kernels::cuda {
namespace {

using codec::F32Bits;
using codec::IsNan;

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Lays out a scratch buffer: each Take returns the offset of the next aligned piece.
struct ScratchCursor {
  size_t at = 0;
  size_t Take(size_t bytes) {
    const size_t here = at;
    at += AlignUp(bytes);
    return here;
  }
};

// CUB's temporary storage for a radix sort of n keys of type Key.
template <typename Key>
size_t CubBytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortKeys(nullptr, bytes, static_cast<const Key*>(nullptr),
                                 static_cast<Key*>(nullptr), static_cast<int>(n));
  return bytes;
}
// The same for a segmented sort of `items` keys in `segments` segments (int offsets).
template <typename Key>
size_t CubSegmentedBytes(int64_t items, int64_t segments) {
  size_t bytes = 0;
  cub::DeviceSegmentedRadixSort::SortKeys(
      nullptr, bytes, static_cast<const Key*>(nullptr), static_cast<Key*>(nullptr),
      static_cast<int>(items), static_cast<int>(segments), static_cast<const int*>(nullptr),
      static_cast<const int*>(nullptr));
  return bytes;
}

// Scratch layout of a top-k over n values: keys in/out [n] u64, sorted selection [n] u32 x 2,
// then CUB's temporary storage.
struct TopKLayout {
  size_t keys_in = 0, keys_out = 0, sel_in = 0, sel_out = 0, temp = 0, temp_bytes = 0, total = 0;
  explicit TopKLayout(int64_t n) {
    const size_t k64 = AlignUp(static_cast<size_t>(n) * 8),
                 k32 = AlignUp(static_cast<size_t>(n) * 4);
    keys_out = k64;
    sel_in = 2 * k64;
    sel_out = sel_in + k32;
    temp = sel_out + k32;
    const size_t a = CubBytes<uint64_t>(n), b = CubBytes<uint32_t>(n);
    temp_bytes = AlignUp(a > b ? a : b);
    total = temp + temp_bytes;
  }
};

__device__ __forceinline__ uint64_t TopKKey(float v, int64_t i) {
  uint32_t u = F32Bits(v == 0.f ? 0.f : v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending uint32 order == value order
  return (static_cast<uint64_t>(~u) << 32) | static_cast<uint64_t>(i);
}

// Scratch layout of a top-k of each of `rows` rows of n values keeping k (SelectTopKRows,
// CandidateMaskRows): keys in/out [rows * n] u64, the selection in/out [rows * k] u32, segment
// offsets [rows + 1] int with steps n and k, then CUB's temporary storage.
struct RowsTopKLayout {
  size_t keys_in = 0, keys_out = 0, sel_in = 0, sel_out = 0, off_n = 0, off_k = 0, temp = 0,
         temp_bytes = 0, total = 0;
  RowsTopKLayout(int64_t rows, int64_t n, int64_t k) {
    const size_t k64 = AlignUp(static_cast<size_t>(rows * n) * 8),
                 s32 = AlignUp(static_cast<size_t>(rows * k) * 4),
                 off = AlignUp(static_cast<size_t>(rows + 1) * 4);
    keys_out = k64;
    sel_in = 2 * k64;
    sel_out = sel_in + s32;
    off_n = sel_out + s32;
    off_k = off_n + off;
    temp = off_k + off;
    const size_t a = CubSegmentedBytes<uint64_t>(rows * n, rows),
                 b = CubSegmentedBytes<uint32_t>(rows * k, rows);
    temp_bytes = AlignUp(a > b ? a : b);
    total = temp + temp_bytes;
  }
};

__global__ void SegmentOffsetsKernel(int64_t rows, int64_t step, int* off) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i <= rows) off[i] = static_cast<int>(i * step);
}

// Row r's keys (its own indices t < n), with the row's mask applied as MaskScores does.
__global__ void TopKKeysRowsKernel(const float* v, int64_t rows, int64_t n, const uint8_t* mask,
                                   int64_t mask_cols, uint64_t* keys) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, t = i % n;
  float x = v[i];
  if (mask != nullptr && (t >= mask_cols || !mask[r * mask_cols + t])) x = -INFINITY;
  keys[i] = TopKKey(x, t);
}

__global__ void TopKTakeRowsKernel(const uint64_t* sorted, int64_t rows, int64_t n, int64_t k,
                                   uint32_t* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= rows * k) return;
  out[j] = static_cast<uint32_t>(sorted[(j / k) * n + j % k] & 0xffffffffu);
}

__global__ void SelectOutRowsKernel(const uint32_t* sel, int64_t rows, int64_t k,
                                    const int64_t* visible, int64_t offset, int32_t* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= rows * k) return;
  const int64_t s = sel[j];
  out[j] = s >= visible[j / k] ? -1 : static_cast<int32_t>(s + offset);
}

// Sorts each row's keys of v [rows, n] (masked) into layout.keys_out, row by row.
cudaError_t SortTopKRows(const float* v, int64_t rows, int64_t n, const uint8_t* mask,
                         int64_t mask_cols, uint8_t* scratch, const RowsTopKLayout& l,
                         cudaStream_t stream) {
  auto* keys_in = reinterpret_cast<uint64_t*>(scratch + l.keys_in);
  auto* keys_out = reinterpret_cast<uint64_t*>(scratch + l.keys_out);
  auto* off = reinterpret_cast<int*>(scratch + l.off_n);
  SegmentOffsetsKernel<<<GridFor(rows + 1), kThreads, 0, stream>>>(rows, n, off);
  TopKKeysRowsKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(v, rows, n, mask, mask_cols,
                                                                 keys_in);
  cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  size_t temp_bytes = l.temp_bytes;
  return cub::DeviceSegmentedRadixSort::SortKeys(
      scratch + l.temp, temp_bytes, static_cast<const uint64_t*>(keys_in), keys_out,
      static_cast<int>(rows * n), static_cast<int>(rows), static_cast<const int*>(off),
      static_cast<const int*>(off + 1), 0, 64, stream);
}

__global__ void TopKKeysKernel(const float* v, int64_t n, uint64_t* keys) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) keys[i] = TopKKey(v[i], i);
}

__global__ void TopKTakeKernel(const uint64_t* sorted, int64_t k, int32_t* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < k) out[j] = static_cast<int32_t>(sorted[j] & 0xffffffffu);
}

__global__ void TopKTakeU32Kernel(const uint64_t* sorted, int64_t k, uint32_t* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < k) out[j] = static_cast<uint32_t>(sorted[j] & 0xffffffffu);
}

// Sorts the keys of v [n] into layout.keys_out (ascending = the top-k order).
cudaError_t SortTopK(const float* v, int64_t n, uint8_t* scratch, const TopKLayout& l,
                     cudaStream_t stream) {
  auto* keys_in = reinterpret_cast<uint64_t*>(scratch + l.keys_in);
  auto* keys_out = reinterpret_cast<uint64_t*>(scratch + l.keys_out);
  TopKKeysKernel<<<GridFor(n), kThreads, 0, stream>>>(v, n, keys_in);
  cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  size_t temp_bytes = l.temp_bytes;
  return cub::DeviceRadixSort::SortKeys(scratch + l.temp, temp_bytes,
                                        static_cast<const uint64_t*>(keys_in), keys_out,
                                        static_cast<int>(n), 0, 64, stream);
}

// cpu_backend.cc CandidateMask, step 1: block scores (max over each block; NaN never taken, as
// std::max(running, NaN) keeps the running value), the block holding key visible-1 = +inf.
__global__ void BlockScoresKernel(const float* score, int64_t n, int64_t bs, int64_t visible,
                                  float* bscore, int64_t nb) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nb) return;
  float m = -INFINITY;
  const int64_t end = (b + 1) * bs < n ? (b + 1) * bs : n;
  for (int64_t t = b * bs; t < end; ++t) m = codec::StdMax(m, score[t]);
  if (visible > 0 && (visible - 1) / bs == b) m = INFINITY;
  bscore[b] = m;
}

// CandidateMaskRows, step 1: BlockScoresKernel for block b of row r (thread r * nb + b) over the
// row's cols[r] columns: blocks past them are -inf (CandidateMask of the narrower row has none,
// and an all -inf block is never marked, nor does it displace a kept one).
__global__ void BlockScoresRowsKernel(const float* score, int64_t rows, int64_t n, int64_t bs,
                                      const int64_t* visible, const int64_t* cols, float* bscore,
                                      int64_t nb) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * nb) return;
  const int64_t r = i / nb, b = i % nb;
  const int64_t nr = cols != nullptr ? cols[r] : n;
  const float* sr = score + r * n;
  float m = -INFINITY;
  const int64_t end = (b + 1) * bs < nr ? (b + 1) * bs : nr;
  for (int64_t t = b * bs; t < end; ++t) m = codec::StdMax(m, sr[t]);
  if (b * bs < nr && visible[r] > 0 && (visible[r] - 1) / bs == b) m = INFINITY;
  bscore[i] = m;
}

// Step 2 of row blockIdx.y: MarkBlocksKernel, within the row's cols[r] columns.
__global__ void MarkBlocksRowsKernel(const uint64_t* sorted, int64_t keep, const float* bscore,
                                     int64_t nb, int64_t bs, int64_t n, const int64_t* cols,
                                     uint8_t* mask) {
  const int64_t j = blockIdx.x, r = blockIdx.y;
  if (j >= keep) return;
  const int64_t b = static_cast<int64_t>(sorted[r * nb + j] & 0xffffffffu);
  if (bscore[r * nb + b] == -INFINITY) return;
  const int64_t nr = cols != nullptr ? cols[r] : n;
  const int64_t end = (b + 1) * bs < nr ? (b + 1) * bs : nr;
  for (int64_t t = b * bs + threadIdx.x; t < end; t += blockDim.x) mask[r * n + t] = 1;
}

// Step 2: keys of the kept blocks that are not all -inf -> 1 (mask zeroed before).
__global__ void MarkBlocksKernel(const uint64_t* sorted, int64_t keep, const float* bscore,
                                 int64_t bs, int64_t n, uint8_t* mask) {
  const int64_t j = blockIdx.x;
  if (j >= keep) return;
  const int64_t b = static_cast<int64_t>(sorted[j] & 0xffffffffu);
  if (bscore[b] == -INFINITY) return;
  const int64_t end = (b + 1) * bs < n ? (b + 1) * bs : n;
  for (int64_t t = b * bs + threadIdx.x; t < end; t += blockDim.x) mask[t] = 1;
}

__global__ void SelectOutKernel(const uint32_t* sel, int64_t k, int64_t visible, int64_t offset,
                                int32_t* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= k) return;
  const int64_t s = sel[j];
  out[j] = s >= visible ? -1 : static_cast<int32_t>(s + offset);
}

// cpu_backend.cc MoeRoute, one thread per row. s = sqrt(softplus(z)), biased = s + bias, the
// stable top-k of biased by k passes (each takes the largest unchosen value, ties to the lower
// expert id), weights = s normalised over the chosen in top-k order (k > 1) times route_scale,
// then the experts sorted ascending with their weights.
__global__ void MoeRouteKernel(const float* z, int64_t rows, int E, const float* bias, int K,
                               float route_scale, int32_t* experts, float* weights, int32_t* ranked,
                               float* s_all, float* biased_all, uint8_t* chosen_all,
                               int32_t* sel_all, float* wts_all) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float* s = s_all + r * E;
  float* biased = biased_all + r * E;
  uint8_t* chosen = chosen_all + r * E;
  int32_t* sel = sel_all + r * K;
  float* wts = wts_all + r * K;
  for (int e = 0; e < E; ++e) {
    const float v = z[r * E + e];
    const float sp = v > 20.f ? v : Log1pF(ExpF(v));
    s[e] = sqrtf(sp);
    biased[e] = s[e] + bias[e];
    chosen[e] = 0;
  }
  for (int j = 0; j < K; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      if (chosen[e] || IsNan(biased[e])) continue;
      if (best < 0 || biased[e] > biased[best]) best = e;
    }
    if (best < 0) {  // only NaN left: the lowest unchosen id (the reference leaves this open)
      for (int e = 0; e < E && best < 0; ++e) {
        if (!chosen[e]) best = e;
      }
    }
    chosen[best] = 1;
    sel[j] = best;
  }
  float sum = 0.f;
  for (int j = 0; j < K; ++j) {
    wts[j] = s[sel[j]];
    sum += wts[j];
  }
  for (int j = 0; j < K; ++j) {
    if (K > 1) wts[j] = wts[j] / (sum + 1e-20f);
    wts[j] *= route_scale;
  }
  if (ranked != nullptr) {
    for (int j = 0; j < K; ++j) ranked[r * K + j] = sel[j];
  }
  // Ascending expert id (selection sort; ids are distinct).
  for (int j = 0; j < K; ++j) {
    int m = j;
    for (int i = j + 1; i < K; ++i) {
      if (sel[i] < sel[m]) m = i;
    }
    const int32_t te = sel[j];
    sel[j] = sel[m];
    sel[m] = te;
    const float tw = wts[j];
    wts[j] = wts[m];
    wts[m] = tw;
    experts[r * K + j] = sel[j];
    weights[r * K + j] = wts[j];
  }
}

// cpu_backend.cc Argmax (std::max_element: the first index of the largest value; a NaN is never
// taken after the first element, and a NaN first element stays the answer). One block per row:
// each thread scans a strided part, the partial results combine as (larger value, then lower
// index), which is order-independent.
__global__ void ArgmaxKernel(const float* x, int64_t n, int32_t* out) {
  __shared__ float bv[kThreads];
  __shared__ int64_t bi[kThreads];
  const float* xr = x + blockIdx.x * n;
  float v = 0.f;
  int64_t idx = -1;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float xi = xr[i];
    if (IsNan(xi)) continue;
    if (idx < 0 || v < xi) {
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
      const int64_t mi = bi[threadIdx.x];
      const float mv = bv[threadIdx.x];
      const bool take = oi >= 0 && (mi < 0 || mv < ov || (!(ov < mv) && oi < mi));
      if (take) {
        bv[threadIdx.x] = ov;
        bi[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[blockIdx.x] = (IsNan(xr[0]) || bi[0] < 0) ? 0 : static_cast<int32_t>(bi[0]);
  }
}

// cpu_backend.cc MoeGroup, in three kernels.
// Which of its top_k slots routes row r to expert e (experts ascending per row), or -1.
__device__ __forceinline__ int SlotOf(const int32_t* experts, int64_t r, int top_k, int e) {
  for (int j = 0; j < top_k; ++j) {
    if (experts[r * top_k + j] == e) return j;
  }
  return -1;
}

// One block per expert e: starts[e + 1] = the number of rows routed to e (an integer sum: the
// same whatever the order).
__global__ void MoeCountKernel(const int32_t* experts, int64_t rows, int top_k, int64_t* starts) {
  __shared__ int64_t part[kThreads];
  const int e = blockIdx.x;
  int64_t n = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) n += SlotOf(experts, r, top_k, e) >= 0;
  part[threadIdx.x] = n;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) starts[e + 1] = part[0];
}

// starts[0] = 0, the shared lists hold every row, then the prefix sums over the lists.
__global__ void MoeStartsKernel(int64_t rows, int n_experts, int n_shared, int64_t* starts) {
  starts[0] = 0;
  for (int s = 0; s < n_shared; ++s) starts[n_experts + s + 1] = rows;
  for (int l = 0; l < n_experts + n_shared; ++l) starts[l + 1] += starts[l];
}

// One block per list: the rows of the list, ascending, in tiles of blockDim rows; a row's place
// is the list's start plus the rows of the list before it (a block-wide exclusive count).
__global__ void MoeFillKernel(const int32_t* experts, const float* weights, int64_t rows,
                              int n_experts, int top_k, int n_shared, const int64_t* starts,
                              int64_t* src_rows, int64_t* slot_rows, float* entry_weights) {
  __shared__ int warp_counts[kThreads / 32];
  const int list = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool shared = list >= n_experts;
  const int64_t slots = top_k + n_shared;
  int64_t at = starts[list];
  for (int64_t r0 = 0; r0 < rows; r0 += blockDim.x) {
    const int64_t r = r0 + threadIdx.x;
    int j = -1;
    if (r < rows) j = shared ? top_k + (list - n_experts) : SlotOf(experts, r, top_k, list);
    const unsigned in_list = __ballot_sync(0xffffffffu, j >= 0);
    if (lane == 0) warp_counts[warp] = __popc(in_list);
    __syncthreads();
    int before = __popc(in_list & ((1u << lane) - 1u)), total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
      if (w < warp) before += warp_counts[w];
      total += warp_counts[w];
    }
    if (j >= 0) {
      const int64_t i = at + before;
      src_rows[i] = r;
      slot_rows[i] = r * slots + j;
      if (!shared) entry_weights[i] = weights[r * top_k + j];
    }
    at += total;
    __syncthreads();  // warp_counts is rewritten by the next tile
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

// Each row's blocked sum of probs [rows, n] (in `sorted` order when given, over the first `lim`
// positions; positive entries only when asked): block sums T [rows, nb], their prefix P
// [rows, nb + 1].
void LaunchBlockedSums(const float* probs, int64_t rows, int64_t n, int64_t nb,
                       const uint64_t* sorted, int64_t lim, bool positive_only, double* T,
                       double* P, cudaStream_t stream) {
  BlockSumsKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(probs, rows, n, nb, sorted, lim,
                                                               positive_only, T);
  BlockPrefixKernel<<<GridFor(rows), kThreads, 0, stream>>>(T, rows, nb, P);
}

// sampling::DrawIndex of each row of probs [rows, n] with u [rows] into out [rows]: the
// positive entries' blocked sums, then the inverse CDF (T, P, hit and last are scratch).
void LaunchDraw(const float* probs, int64_t rows, int64_t n, int64_t nb, const double* u, double* T,
                double* P, int64_t* hit, int64_t* last, int32_t* out, cudaStream_t stream) {
  LaunchBlockedSums(probs, rows, n, nb, nullptr, n, true, T, P, stream);
  DrawFindKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(probs, rows, n, nb, P, u, hit, last);
  DrawPickKernel<<<GridFor(rows), kThreads, 0, stream>>>(hit, last, rows, nb, out);
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
// entry after entry j - 1 (a strict total order, so no list of taken entries is kept), found by a
// block reduction whose combine does not depend on the order. No atomics.
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
    float v = 0.f;
    int64_t idx = -1;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float xi = xr[i];
      if (pi >= 0 && !sampling::TopBefore(pv, pi, xi, i)) continue;  // taken already
      if (idx < 0 || sampling::TopBefore(xi, i, v, idx)) {
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
        if (oi >= 0 && (bi[threadIdx.x] < 0 ||
                        sampling::TopBefore(ov, oi, bv[threadIdx.x], bi[threadIdx.x]))) {
          bv[threadIdx.x] = ov;
          bi[threadIdx.x] = oi;
        }
      }
      __syncthreads();
    }
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

// Scratch layout of SampleLogits over [rows, n]: probs f32 [rows, n], T f64 [rows, nb], P f64
// [rows, nb + 1], hit / last i64 [rows, nb], keep i64 [rows], mx f32 [rows]; with a sort, keys
// in / out u64 [rows, n], segment offsets int [rows + 1] and CUB's temporary storage.
struct SampleLayout {
  int64_t nb = 0;
  size_t probs = 0, T = 0, P = 0, hit = 0, last = 0, keep = 0, mx = 0, keys_in = 0, keys_out = 0,
         off = 0, temp = 0, temp_bytes = 0, total = 0;
  SampleLayout(int64_t rows, int64_t n, bool sort) : nb(sampling::SumBlocks(n)) {
    const size_t rn = static_cast<size_t>(rows * n), rb = static_cast<size_t>(rows * nb),
                 r = static_cast<size_t>(rows);
    ScratchCursor c;
    probs = c.Take(rn * 4);
    T = c.Take(rb * 8);
    P = c.Take((rb + r) * 8);
    hit = c.Take(rb * 8);
    last = c.Take(rb * 8);
    keep = c.Take(r * 8);
    mx = c.Take(r * 4);
    if (sort) {
      keys_in = c.Take(rn * 8);
      keys_out = c.Take(rn * 8);
      off = c.Take((r + 1) * 4);
      temp_bytes = AlignUp(CubSegmentedBytes<uint64_t>(rows * n, rows));
      temp = c.Take(temp_bytes);
    }
    total = c.at;
  }
};
}  // namespace

size_t TopKScratchBytes(int64_t n) { return TopKLayout(n).total; }

cudaError_t StableTopK(const float* v, int64_t n, int64_t k, int32_t* out, void* scratch,
                       size_t scratch_bytes, cudaStream_t stream) {
  k = k < n ? k : n;
  if (k <= 0) return cudaSuccess;
  const TopKLayout l(n);
  if (scratch_bytes < l.total) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(scratch);
  cudaError_t rc = SortTopK(v, n, base, l, stream);
  if (rc != cudaSuccess) return rc;
  TopKTakeKernel<<<GridFor(k), kThreads, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(base + l.keys_out), k, out);
  return cudaGetLastError();
}

size_t CandidateMaskScratchBytes(int64_t n, int64_t block) {
  const int64_t nb = (n + block - 1) / block;
  return AlignUp(static_cast<size_t>(nb) * 4) + TopKLayout(nb).total;
}

cudaError_t CandidateMask(const float* score, int64_t n, int64_t block, int64_t visible,
                          int64_t keep_blocks, uint8_t* mask, void* scratch, size_t scratch_bytes,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t nb = (n + block - 1) / block;
  const TopKLayout l(nb);
  const size_t head = AlignUp(static_cast<size_t>(nb) * 4);
  if (scratch_bytes < head + l.total) return cudaErrorInvalidValue;
  auto* bscore = static_cast<float*>(scratch);
  auto* base = static_cast<uint8_t*>(scratch) + head;
  BlockScoresKernel<<<GridFor(nb), kThreads, 0, stream>>>(score, n, block, visible, bscore, nb);
  cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  rc = cudaMemsetAsync(mask, 0, static_cast<size_t>(n), stream);
  if (rc != cudaSuccess) return rc;
  const int64_t keep = keep_blocks < nb ? keep_blocks : nb;
  if (keep <= 0) return cudaSuccess;
  rc = SortTopK(bscore, nb, base, l, stream);
  if (rc != cudaSuccess) return rc;
  MarkBlocksKernel<<<static_cast<unsigned>(keep), 128, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(base + l.keys_out), keep, bscore, block, n, mask);
  return cudaGetLastError();
}

cudaError_t SelectTopK(const float* score, int64_t n, int64_t k, int64_t visible, int64_t offset,
                       int32_t* out, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  if (k <= 0) return cudaSuccess;
  const TopKLayout l(n);
  if (scratch_bytes < l.total) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(scratch);
  cudaError_t rc = SortTopK(score, n, base, l, stream);
  if (rc != cudaSuccess) return rc;
  auto* sel_in = reinterpret_cast<uint32_t*>(base + l.sel_in);
  auto* sel_out = reinterpret_cast<uint32_t*>(base + l.sel_out);
  TopKTakeU32Kernel<<<GridFor(k), kThreads, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(base + l.keys_out), k, sel_in);
  rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  size_t temp_bytes = l.temp_bytes;
  rc = cub::DeviceRadixSort::SortKeys(base + l.temp, temp_bytes,
                                      static_cast<const uint32_t*>(sel_in), sel_out,
                                      static_cast<int>(k), 0, 32, stream);
  if (rc != cudaSuccess) return rc;
  SelectOutKernel<<<GridFor(k), kThreads, 0, stream>>>(sel_out, k, visible, offset, out);
  return cudaGetLastError();
}

size_t CandidateMaskRowsScratchBytes(int64_t rows, int64_t n, int64_t block) {
  const int64_t nb = (n + block - 1) / block;
  return AlignUp(static_cast<size_t>(rows * nb) * 4) + RowsTopKLayout(rows, nb, 0).total;
}

cudaError_t CandidateMaskRows(const float* score, int64_t rows, int64_t n, int64_t block,
                              const int64_t* visible, const int64_t* cols, int64_t keep_blocks,
                              uint8_t* mask, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  const int64_t nb = (n + block - 1) / block;
  const RowsTopKLayout l(rows, nb, 0);
  const size_t head = AlignUp(static_cast<size_t>(rows * nb) * 4);
  if (scratch_bytes < head + l.total) return cudaErrorInvalidValue;
  auto* bscore = static_cast<float*>(scratch);
  auto* base = static_cast<uint8_t*>(scratch) + head;
  BlockScoresRowsKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(score, rows, n, block, visible,
                                                                     cols, bscore, nb);
  cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  rc = cudaMemsetAsync(mask, 0, static_cast<size_t>(rows * n), stream);
  if (rc != cudaSuccess) return rc;
  const int64_t keep = keep_blocks < nb ? keep_blocks : nb;
  if (keep <= 0) return cudaSuccess;
  rc = SortTopKRows(bscore, rows, nb, nullptr, 0, base, l, stream);
  if (rc != cudaSuccess) return rc;
  const dim3 grid(static_cast<unsigned>(keep), static_cast<unsigned>(rows));
  MarkBlocksRowsKernel<<<grid, 128, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(base + l.keys_out), keep, bscore, nb, block, n, cols, mask);
  return cudaGetLastError();
}

size_t SelectTopKRowsScratchBytes(int64_t rows, int64_t n, int64_t k) {
  return RowsTopKLayout(rows, n, k).total;
}

cudaError_t SelectTopKRows(const float* score, int64_t rows, int64_t n, int64_t k,
                           const int64_t* visible, int64_t offset, const uint8_t* mask,
                           int64_t mask_cols, int32_t* out, void* scratch, size_t scratch_bytes,
                           cudaStream_t stream) {
  if (k <= 0 || rows <= 0) return cudaSuccess;
  const RowsTopKLayout l(rows, n, k);
  if (scratch_bytes < l.total) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(scratch);
  cudaError_t rc = SortTopKRows(score, rows, n, mask, mask_cols, base, l, stream);
  if (rc != cudaSuccess) return rc;
  auto* sel_in = reinterpret_cast<uint32_t*>(base + l.sel_in);
  auto* sel_out = reinterpret_cast<uint32_t*>(base + l.sel_out);
  auto* off_k = reinterpret_cast<int*>(base + l.off_k);
  TopKTakeRowsKernel<<<GridFor(rows * k), kThreads, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(base + l.keys_out), rows, n, k, sel_in);
  SegmentOffsetsKernel<<<GridFor(rows + 1), kThreads, 0, stream>>>(rows, k, off_k);
  rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  size_t temp_bytes = l.temp_bytes;
  rc = cub::DeviceSegmentedRadixSort::SortKeys(
      base + l.temp, temp_bytes, static_cast<const uint32_t*>(sel_in), sel_out,
      static_cast<int>(rows * k), static_cast<int>(rows), static_cast<const int*>(off_k),
      static_cast<const int*>(off_k + 1), 0, 32, stream);
  if (rc != cudaSuccess) return rc;
  SelectOutRowsKernel<<<GridFor(rows * k), kThreads, 0, stream>>>(sel_out, rows, k, visible, offset,
                                                                  out);
  return cudaGetLastError();
}

size_t MoeRouteScratchBytes(int64_t rows, int n_experts, int top_k) {
  const size_t re = static_cast<size_t>(rows) * n_experts, rk = static_cast<size_t>(rows) * top_k;
  return AlignUp(re * 4) * 2 + AlignUp(re) + AlignUp(rk * 4) * 2;
}

cudaError_t MoeRoute(const float* z, int64_t rows, int n_experts, const float* bias, int top_k,
                     float route_scale, int32_t* experts, float* weights, int32_t* ranked,
                     void* scratch, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const size_t re = static_cast<size_t>(rows) * n_experts, rk = static_cast<size_t>(rows) * top_k;
  auto* base = static_cast<uint8_t*>(scratch);
  auto* s = reinterpret_cast<float*>(base);
  auto* biased = reinterpret_cast<float*>(base + AlignUp(re * 4));
  auto* chosen = base + 2 * AlignUp(re * 4);
  auto* sel = reinterpret_cast<int32_t*>(chosen + AlignUp(re));
  auto* wts = reinterpret_cast<float*>(chosen + AlignUp(re) + AlignUp(rk * 4));
  MoeRouteKernel<<<GridFor(rows, 64), 64, 0, stream>>>(z, rows, n_experts, bias, top_k, route_scale,
                                                       experts, weights, ranked, s, biased, chosen,
                                                       sel, wts);
  return cudaGetLastError();
}

cudaError_t MoeGroup(const int32_t* experts, const float* weights, int64_t rows, int n_experts,
                     int top_k, int n_shared, int64_t* starts, int64_t* src_rows,
                     int64_t* slot_rows, float* entry_weights, cudaStream_t stream) {
  const int lists = n_experts + n_shared;
  MoeCountKernel<<<static_cast<unsigned>(n_experts), kThreads, 0, stream>>>(experts, rows, top_k,
                                                                            starts);
  MoeStartsKernel<<<1, 1, 0, stream>>>(rows, n_experts, n_shared, starts);
  if (rows > 0) {
    MoeFillKernel<<<static_cast<unsigned>(lists), kThreads, 0, stream>>>(
        experts, weights, rows, n_experts, top_k, n_shared, starts, src_rows, slot_rows,
        entry_weights);
  }
  return cudaGetLastError();
}

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
  auto* T = reinterpret_cast<double*>(base + l.T);
  auto* P = reinterpret_cast<double*>(base + l.P);
  auto* hit = reinterpret_cast<int64_t*>(base + l.hit);
  auto* last = reinterpret_cast<int64_t*>(base + l.last);
  auto* keep = reinterpret_cast<int64_t*>(base + l.keep);
  auto* mx = reinterpret_cast<float*>(base + l.mx);
  const int64_t nb = l.nb;
  const unsigned row_grid = static_cast<unsigned>(rows);
  // Blocked sum of probs (order, lim, positive_only) into P.
  auto blocked = [&](const uint64_t* sorted, int64_t lim, bool positive_only) {
    LaunchBlockedSums(probs, rows, n, nb, sorted, lim, positive_only, T, P, stream);
  };
  // 1. Softmax of x / T.
  RowMaxKernel<<<row_grid, kThreads, 0, stream>>>(x, n, mx);
  WeightBlockSumsKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(x, rows, n, nb, mx,
                                                                     1.f / temperature, probs, T);
  BlockPrefixKernel<<<GridFor(rows), kThreads, 0, stream>>>(T, rows, nb, P);
  NormalizeKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(probs, rows, n, nb, P);
  // 2. Top-k, then top-p over the top-k's mass.
  if (use_k || use_p) {
    const int64_t k = use_k ? top_k : n;
    auto* keys_in = reinterpret_cast<uint64_t*>(base + l.keys_in);
    auto* keys_out = reinterpret_cast<uint64_t*>(base + l.keys_out);
    auto* off = reinterpret_cast<int*>(base + l.off);
    SegmentOffsetsKernel<<<GridFor(rows + 1), kThreads, 0, stream>>>(rows, n, off);
    TopKKeysRowsKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(probs, rows, n, nullptr, 0,
                                                                   keys_in);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
    size_t temp_bytes = l.temp_bytes;
    rc = cub::DeviceSegmentedRadixSort::SortKeys(
        base + l.temp, temp_bytes, static_cast<const uint64_t*>(keys_in), keys_out,
        static_cast<int>(rows * n), static_cast<int>(rows), static_cast<const int*>(off),
        static_cast<const int*>(off + 1), 0, 64, stream);
    if (rc != cudaSuccess) return rc;
    if (use_p) {
      blocked(keys_out, k, false);
      TopPFindKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(
          probs, keys_out, rows, n, nb, k, P, static_cast<double>(top_p), hit);
      KeepKernel<<<GridFor(rows), kThreads, 0, stream>>>(hit, rows, nb, k, keep);
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
  NormalizeKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(probs, rows, n, nb, P);
  LaunchDraw(probs, rows, n, nb, u, T, P, hit, last, out, stream);
  return cudaGetLastError();
}

// Scratch layout of VerifyDrafts over n: d f32 [n], T f64 [nb], P f64 [nb + 1], hit / last i64
// [nb], row i64, uf f64.
struct VerifyLayout {
  int64_t nb = 0;
  size_t d = 0, T = 0, P = 0, hit = 0, last = 0, row = 0, uf = 0, total = 0;
  explicit VerifyLayout(int64_t n) : nb(sampling::SumBlocks(n)) {
    const size_t b = static_cast<size_t>(nb);
    ScratchCursor c;
    d = c.Take(static_cast<size_t>(n) * 4);
    T = c.Take(b * 8);
    P = c.Take((b + 1) * 8);
    hit = c.Take(b * 8);
    last = c.Take(b * 8);
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
  auto* T = reinterpret_cast<double*>(base + l.T);
  auto* P = reinterpret_cast<double*>(base + l.P);
  auto* hit = reinterpret_cast<int64_t*>(base + l.hit);
  auto* last = reinterpret_cast<int64_t*>(base + l.last);
  auto* row = reinterpret_cast<int64_t*>(base + l.row);
  auto* uf = reinterpret_cast<double*>(base + l.uf);
  const int64_t nb = l.nb;
  AcceptDraftsKernel<<<1, 1, 0, stream>>>(p, q, drafts, k, n, u, out, row, uf);
  ResidualKernel<<<GridFor(n), kThreads, 0, stream>>>(p, q, k, n, row, d);
  LaunchBlockedSums(d, 1, n, nb, nullptr, n, true, T, P, stream);  // the residual's mass
  ResidualFallbackKernel<<<GridFor(n), kThreads, 0, stream>>>(p, k, n, row, P, nb, d);
  // DrawIndex of d with uf (its sums again: d may have fallen back to p_r).
  LaunchDraw(d, 1, n, nb, uf, T, P, hit, last, out + 1, stream);
  if (chosen != nullptr) {
    ChosenTokensKernel<<<GridFor(k + 1), kThreads, 0, stream>>>(drafts, k, out, chosen);
  }
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
