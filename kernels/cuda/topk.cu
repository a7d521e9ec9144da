// Selection ops of CudaBackend: stable top-k, candidate selection (CandidateMask, by blocks) and
// index-list selection (SelectTopK), of one row or of many. Integer results, exact: the same
// indices as kernels/cpu (ops.cc StableTopK, cpu_backend.cc CandidateMask / SelectTopK) for the
// same inputs.
//
// Stable top-k is a radix sort (CUB, deterministic) of 64-bit keys (descending value, then
// ascending index): key = (~ordered(v) << 32) | index, where ordered() maps fp32 to uint32 in
// value order and -0 to +0 (the reference's comparator treats them as equal). NaN values have no
// defined place in the reference (its comparator is not a strict weak order with NaN) and none
// here. SortTopKRows (sort_rows.h) is the rows' sort, which SampleLogits (sampling.cu) uses too.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/sort_rows.h"

namespace epd::kernels::cuda {
namespace {

using codec::F32Bits;

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

__global__ void TopKKeysKernel(const float* v, int64_t n, uint64_t* keys) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) keys[i] = TopKKey(v[i], i);
}

// The indices of the first k sorted keys, as Index (int32_t or uint32_t).
template <typename Index>
__global__ void TopKTakeKernel(const uint64_t* sorted, int64_t k, Index* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < k) out[j] = static_cast<Index>(sorted[j] & 0xffffffffu);
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

// out[0..k) = the indices of v [n]'s stable top-k (k <= n), sorted in l's scratch at base.
template <typename Index>
cudaError_t TopKIndices(const float* v, int64_t n, int64_t k, uint8_t* base, const TopKLayout& l,
                        Index* out, cudaStream_t stream) {
  const cudaError_t rc = SortTopK(v, n, base, l, stream);
  if (rc != cudaSuccess) return rc;
  TopKTakeKernel<Index><<<GridFor(k), kThreads, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(base + l.keys_out), k, out);
  return cudaGetLastError();
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

// SortTopKRows of v [rows, n] in l's scratch at `scratch`: the sorted keys at l.keys_out.
cudaError_t SortRows(const float* v, int64_t rows, int64_t n, const uint8_t* mask,
                     int64_t mask_cols, uint8_t* scratch, const RowsTopKLayout& l,
                     cudaStream_t stream) {
  return SortTopKRows(v, rows, n, mask, mask_cols, reinterpret_cast<uint64_t*>(scratch + l.keys_in),
                      reinterpret_cast<uint64_t*>(scratch + l.keys_out),
                      reinterpret_cast<int*>(scratch + l.off_n), scratch + l.temp, l.temp_bytes,
                      stream);
}

}  // namespace

size_t SortTopKRowsTempBytes(int64_t rows, int64_t n) {
  return CubSegmentedBytes<uint64_t>(rows * n, rows);
}

cudaError_t SortTopKRows(const float* v, int64_t rows, int64_t n, const uint8_t* mask,
                         int64_t mask_cols, uint64_t* keys_in, uint64_t* keys_out, int* off,
                         void* temp, size_t temp_bytes, cudaStream_t stream) {
  SegmentOffsetsKernel<<<GridFor(rows + 1), kThreads, 0, stream>>>(rows, n, off);
  TopKKeysRowsKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(v, rows, n, mask, mask_cols,
                                                                 keys_in);
  cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  return cub::DeviceSegmentedRadixSort::SortKeys(
      temp, temp_bytes, static_cast<const uint64_t*>(keys_in), keys_out, static_cast<int>(rows * n),
      static_cast<int>(rows), static_cast<const int*>(off), static_cast<const int*>(off + 1), 0, 64,
      stream);
}

size_t TopKScratchBytes(int64_t n) { return TopKLayout(n).total; }

cudaError_t StableTopK(const float* v, int64_t n, int64_t k, int32_t* out, void* scratch,
                       size_t scratch_bytes, cudaStream_t stream) {
  k = k < n ? k : n;
  if (k <= 0) return cudaSuccess;
  const TopKLayout l(n);
  if (scratch_bytes < l.total) return cudaErrorInvalidValue;
  return TopKIndices(v, n, k, static_cast<uint8_t*>(scratch), l, out, stream);
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
  auto* sel_in = reinterpret_cast<uint32_t*>(base + l.sel_in);
  auto* sel_out = reinterpret_cast<uint32_t*>(base + l.sel_out);
  cudaError_t rc = TopKIndices(score, n, k, base, l, sel_in, stream);
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
  rc = SortRows(bscore, rows, nb, nullptr, 0, base, l, stream);
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
  cudaError_t rc = SortRows(score, rows, n, mask, mask_cols, base, l, stream);
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

}  // namespace epd::kernels::cuda
