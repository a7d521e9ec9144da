// The KV pool's paged packed rows on the device: PackRows / UnpackRows of CudaBackend, and
// TopKSlots (the top-k part of a decode call's attention lists, gathered with UnpackRows). One
// thread packs one scale block and one thread unpacks one element, through kernels/row_codec.h (the
// arithmetic of kernels/format.cc's PackKvEntry / PackIndexKey / PackSwaSlot and their Unpack
// functions, checked against them on the host in tests/kernels/codec_test.cc), so the bytes and
// values are bit-identical to the CPU backend's.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/row_codec.h"

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
  uint8_t* out = pages[r / rows_per_page] + (r % rows_per_page) * row_codec::RowBytes(codec, dim);
  row_codec::PackBlock(codec, x + i * dim, dim, b, out);
}

// One thread per element (i, d).
__global__ void UnpackRowsKernel(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page,
                                 int64_t dim, const int32_t* rows, int64_t first, int64_t n,
                                 float* out) {
  const int64_t e = Tid();
  if (e >= n * dim) return;
  const int64_t i = e / dim, d = e % dim;
  const int64_t r = (rows != nullptr ? rows[i] : i) + first;
  if (r < 0) return;  // a skipped slot: out row i stays as it is
  const uint8_t* in =
      pages[r / rows_per_page] + (r % rows_per_page) * row_codec::RowBytes(codec, dim);
  out[e] = row_codec::UnpackElement(codec, in, dim, d);
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

}  // namespace

cudaError_t TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base, bool per_slot,
                      int32_t* list, int64_t list_len, int64_t offset, cudaStream_t stream) {
  if (rows * k <= 0) return cudaSuccess;
  TopKSlotsKernel<<<GridFor(rows * k), kThreads, 0, stream>>>(topk, rows, k, base, per_slot, list,
                                                              list_len, offset);
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
  UnpackRowsKernel<<<GridFor(n * dim), kThreads, 0, stream>>>(codec, pages, rows_per_page, dim,
                                                              rows, first, n, out);
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
