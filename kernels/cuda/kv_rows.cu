// The KV pool's paged packed rows on the device: PackRows / UnpackRows of CudaBackend, TopKSlots
// (the top-k part of a decode call's attention lists, gathered with UnpackRows), and the pool
// blocks' DigestBlocks / BlocksEqual (sealing: kernels/xxh3_lanes.h, XXH3-64 as libxxhash). One
// thread packs one scale block and one thread block unpacks one row, through kernels/row_codec.h
// (the arithmetic of kernels/format.cc's PackKvEntry / PackIndexKey / PackSwaSlot and their Unpack
// functions, checked against them on the host in tests/kernels/codec_test.cc), so the bytes and
// values are bit-identical to the CPU backend's.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/row_codec.h"
#include "kernels/xxh3_lanes.h"

namespace epd::kernels::cuda {
namespace {

__device__ __forceinline__ int64_t Tid() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// One thread per (row i, scale block b). A negative listed row is refused by the CPU reference;
// here it is skipped (never written outside the pages).
__global__ void PackRowsKernel(RowCodec codec, const float* x, int64_t n, int64_t dim,
                               uint8_t* const* pages, int64_t rows_per_page, const int32_t* rows,
                               int64_t first) {
  const int64_t nb = dim / row_codec::Block(codec);
  const int64_t t = Tid();
  if (t >= n * nb) return;
  const int64_t i = t / nb, b = t % nb;
  const int64_t r = (rows != nullptr ? rows[i] : i) + first;
  if (r < 0) return;
  uint8_t* out = row_codec::PagedRow(pages, rows_per_page, r, row_codec::RowBytes(codec, dim));
  row_codec::PackBlock(codec, x + i * dim, dim, b, out);
}

// One thread block per row i (kRowThreads = 64 threads over its elements): the packed row's address
// is found once per thread (a 64-bit division by the rows a page), not once per element beside
// the element's own division by dim: two integer divisions an element, about the cost of its
// decode.
constexpr int kRowThreads = 64;

__device__ __forceinline__ void UnpackRow(RowCodec codec, const uint8_t* in, int64_t dim,
                                          float* out) {
  for (int64_t d = threadIdx.x; d < dim; d += kRowThreads) {
    out[d] = row_codec::UnpackElement(codec, in, dim, d);
  }
}

__global__ void __launch_bounds__(kRowThreads)
    UnpackRowsKernel(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page,
                     int64_t dim, const int32_t* rows, int64_t first, float* out) {
  const int64_t i = blockIdx.x;
  const int64_t r = (rows != nullptr ? rows[i] : i) + first;
  if (r < 0) return;  // a skipped slot: out row i stays as it is
  UnpackRow(codec, row_codec::PagedRow(pages, rows_per_page, r, row_codec::RowBytes(codec, dim)),
            dim, out + i * dim);
}

// UnpackRowsKernel over many streams: row i reads stream i / per_table.
__global__ void __launch_bounds__(kRowThreads)
    GatherRowsKernel(RowCodec codec, const uint8_t* const* const* tables,
                     const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                     const int32_t* rows, int64_t first, float* out) {
  const int64_t i = blockIdx.x;
  const int64_t r = rows[i] + first;
  if (r < 0) return;  // a skipped slot: out row i stays as it is
  const int64_t g = i / per_table;
  UnpackRow(codec,
            row_codec::PagedRow(tables[g], rows_per_page[g], r, row_codec::RowBytes(codec, dim)),
            dim, out + i * dim);
}

// cpu_backend.cc TopKSlots: one thread per (row, slot).
__global__ void TopKSlotsKernel(const int32_t* topk, int64_t rows, int64_t k, int64_t base,
                                bool per_slot, int32_t* list, int64_t list_len, int64_t offset) {
  const int64_t e = Tid();
  if (e >= rows * k) return;
  const int64_t r = e / k, j = e % k;
  const int32_t t = topk[e];
  list[r * list_len + offset + j] = t < 0 ? -1 : static_cast<int32_t>(base + (per_slot ? e : t));
}

// XXH3's default secret; each DigestBlocks block copies it to shared memory first (the lanes
// read it at different offsets, which constant memory would serialize).
__constant__ uint8_t kXxh3Secret[xxh3::kSecretBytes] = EPD_XXH3_DEFAULT_SECRET;

// Eight threads per block (xxh3::kLanes, within one warp): a long block's lane i accumulates in
// thread i (16 of each 64-byte stripe's bytes), the group's first thread gathers the eight
// accumulators by shuffle and merges them; a block of at most 240 bytes is hashed by that thread
// alone. A negative length (the CPU refuses it) hashes as empty. The grid is whole warps, so every
// thread reaches the shuffle.
__global__ void DigestBlocksKernel(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                                   uint64_t* out) {
  __shared__ uint64_t secret_words[xxh3::kSecretBytes / 8];  // 8-byte aligned
  auto* secret = reinterpret_cast<uint8_t*>(secret_words);
  for (int i = threadIdx.x; i < xxh3::kSecretBytes; i += blockDim.x) secret[i] = kXxh3Secret[i];
  __syncthreads();
  const int64_t t = Tid();
  const int64_t g = t / xxh3::kLanes;
  const int lane = static_cast<int>(t % xxh3::kLanes);
  const bool live = g < n;
  const int64_t len = live ? (bytes[g] < 0 ? 0 : bytes[g]) : 0;
  const bool is_long = live && static_cast<uint64_t>(len) > xxh3::kMidMax;
  const uint64_t acc =
      is_long ? xxh3::LongLane(blocks[g], static_cast<uint64_t>(len), secret, lane) : 0;
  uint64_t all[xxh3::kLanes];
  for (int j = 0; j < xxh3::kLanes; ++j) {
    all[j] = __shfl_sync(0xffffffffU, static_cast<unsigned long long>(acc), j, xxh3::kLanes);
  }
  if (!live || lane != 0) return;
  out[g] = is_long ? xxh3::MergeLanes(all, static_cast<uint64_t>(len), secret)
                   : xxh3::ShortDigest(blocks[g], static_cast<uint64_t>(len), secret);
}

// One thread block per pair: each thread compares a strided share of the bytes, and the block's
// vote (__syncthreads_or) is the answer. A negative length (the CPU refuses it) is unequal.
__global__ void BlocksEqualKernel(const uint8_t* const* a, const uint8_t* const* b,
                                  const int64_t* bytes, int32_t* equal) {
  const int64_t g = blockIdx.x;
  const int64_t len = bytes[g];
  const uint8_t* x = a[g];
  const uint8_t* y = b[g];
  int differ = len < 0 ? 1 : 0;
  for (int64_t i = threadIdx.x; i < len && differ == 0; i += blockDim.x) differ = x[i] != y[i];
  differ = __syncthreads_or(differ);
  if (threadIdx.x == 0) equal[g] = differ != 0 ? 0 : 1;
}

// One thread block per range: threads move a strided share of it, 16 bytes at a time on the
// device where both ends are 16-byte aligned (pool blocks and a staging buffer's row offsets
// usually are), the rest byte by byte. A negative length (the CPU refuses it) copies nothing.
__global__ void CopyBlocksKernel(uint8_t* const* dst, const uint8_t* const* src,
                                 const int64_t* bytes) {
  const int64_t g = blockIdx.x;
  const int64_t len = bytes[g];
  uint8_t* d = dst[g];
  const uint8_t* s = src[g];
  int64_t done = 0;
#if defined(__CUDA_ARCH__)
  if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s)) & 15) == 0) {
    const int64_t n16 = len > 0 ? len / 16 : 0;
    for (int64_t i = threadIdx.x; i < n16; i += blockDim.x) {
      reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    }
    done = n16 * 16;
  }
#endif
  for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
}

}  // namespace

cudaError_t CopyBlocks(uint8_t* const* dst, const uint8_t* const* src, const int64_t* bytes,
                       int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  CopyBlocksKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(dst, src, bytes);
  return cudaGetLastError();
}

cudaError_t TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base, bool per_slot,
                      int32_t* list, int64_t list_len, int64_t offset, cudaStream_t stream) {
  if (rows * k <= 0) return cudaSuccess;
  TopKSlotsKernel<<<GridFor(rows * k), kThreads, 0, stream>>>(topk, rows, k, base, per_slot, list,
                                                              list_len, offset);
  return cudaGetLastError();
}

cudaError_t DigestBlocks(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                         uint64_t* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  DigestBlocksKernel<<<GridFor(n * xxh3::kLanes), kThreads, 0, stream>>>(blocks, bytes, n, out);
  return cudaGetLastError();
}

cudaError_t BlocksEqual(const uint8_t* const* a, const uint8_t* const* b, const int64_t* bytes,
                        int64_t n, int32_t* equal, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  BlocksEqualKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(a, b, bytes, equal);
  return cudaGetLastError();
}

cudaError_t PackRows(RowCodec codec, const float* x, int64_t n, int64_t dim, uint8_t* const* pages,
                     int64_t rows_per_page, const int32_t* rows, int64_t first,
                     cudaStream_t stream) {
  const int64_t threads = n * (dim / row_codec::Block(codec));
  if (threads <= 0) return cudaSuccess;
  PackRowsKernel<<<GridFor(threads), kThreads, 0, stream>>>(codec, x, n, dim, pages, rows_per_page,
                                                            rows, first);
  return cudaGetLastError();
}

cudaError_t UnpackRows(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page,
                       int64_t dim, const int32_t* rows, int64_t first, int64_t n, float* out,
                       cudaStream_t stream) {
  if (n * dim <= 0) return cudaSuccess;
  if (n >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // one block a row
  UnpackRowsKernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
      codec, pages, rows_per_page, dim, rows, first, out);
  return cudaGetLastError();
}

cudaError_t GatherRows(RowCodec codec, const uint8_t* const* const* tables,
                       const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                       const int32_t* rows, int64_t first, int64_t n, float* out,
                       cudaStream_t stream) {
  if (n * dim <= 0) return cudaSuccess;
  if (n >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // one block a row
  GatherRowsKernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
      codec, tables, rows_per_page, per_table, dim, rows, first, out);
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
