// The linears of CudaBackend: FP8 activation quantization, the block-scaled FP8/FP4 GEMM of
// LinearQuant and the plain GEMM of LinearBf16/LinearF32 (and HcMixes' projection).
// Mirrors kernels/cpu/ops.cc (LinearQuant, Dot8), kernels/torch_math.h (DotDp, DotSeq) and
// kernels/format.cc (QuantizeFp8Row): every output is computed by one thread in the reference's
// order, so results do not depend on the tile, the batch or the launch.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace epd::kernels::cuda {
namespace {

using codec::Abs;
using codec::Clamp;
using codec::DecodeE2M1;
using codec::DecodeE4M3;
using codec::DecodeE8M0;
using codec::IsNan;
using codec::Pow2Ceil;
using codec::RoundBf16;
using codec::RoundE4M3;
using codec::StdMax;

// format::QuantizeFp8Row: one warp per block of 32 (the last block of a row may be shorter).
// amax = max(|x|) over the block ignoring NaN (std::max keeps the running value), then
// max(amax, 1e-4), scale = Pow2Ceil(amax * fp32(1/448)), q = RoundE4M3(clamp(x / scale, ±448)).
__global__ void QuantizeFp8Kernel(const float* x, int64_t rows, int64_t k, int64_t nb, float* q,
                                  float* scales) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * nb) return;  // whole warps leave together
  const int64_t r = warp / nb, b = warp % nb;
  const int64_t i = b * 32 + lane;
  const bool in = i < k;
  const float v = in ? x[r * k + i] : 0.f;
  float a = in ? Abs(v) : 0.f;
  if (IsNan(a)) a = 0.f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
  const float amax = StdMax(a, 1e-4f);
  const float s = Pow2Ceil(amax * (1.f / 448.f));
  if (lane == 0) scales[r * nb + b] = s;
  if (in) q[r * k + i] = RoundE4M3(Clamp(v / s, -448.f, 448.f));
}

constexpr int kTileO = 64, kTileR = 16, kChunk = 32, kRowsPerThread = kTileR / (kThreads / kTileO);
static_assert(kTileR == 16, "launch.h's GroupedGemmRowTiles counts 16-row tiles");

__device__ __forceinline__ float WeightAt(const GemmWeight& w, int64_t o, int64_t i) {
  switch (w.kind) {
    case WeightKind::kFp8Packed:
      return DecodeE4M3(static_cast<const uint8_t*>(w.data)[o * w.in + i]);
    case WeightKind::kFp4Packed: {
      const uint8_t byte = static_cast<const uint8_t*>(w.data)[o * (w.in / 2) + i / 2];
      return DecodeE2M1((i & 1) ? static_cast<uint8_t>(byte >> 4)
                                : static_cast<uint8_t>(byte & 0xf));
    }
    case WeightKind::kF32:
    default:
      return static_cast<const float*>(w.data)[o * w.in + i];
  }
}

// One tile of kTileR rows x kTileO outputs; K in chunks of 32 through shared memory. Thread t owns
// output t % 64 for rows (t / 64) * 4 .. +3.
// kQuant: the chunk is one quantization block: its Dot8 is finished per chunk and added as
//   acc += d * act_scale * weight_scale (ops.cc LinearQuant).
// !kQuant: one running sum per output over the whole row, chunk after chunk (ops.cc LinearBf16 /
//   LinearF32, kernels/torch_math.h): bf16 in DotDp's pairwise order (per pair the odd element
//   first; chunks are even, so only the row's odd last element stands alone), else in DotSeq's
//   index order.
// The tile at outputs o0.. and rows r0.. of a block (GemmKernel, GroupedGemmQuantKernel).
template <bool kQuant>
__device__ __forceinline__ void GemmTile(const float* x, const float* act_scale, int64_t rows,
                                         const GemmWeight& w, const uint8_t* scale_codes,
                                         const float* scale_values, int block_rows,
                                         int block_cols, int64_t scale_cols, bool bf16, float* y,
                                         int64_t o0, int64_t r0) {
  __shared__ float xs[kTileR][kChunk + 1];
  __shared__ float ws[kTileO][kChunk + 1];
  __shared__ float xsc[kTileR];
  __shared__ float wsc[kTileO];
  const int t = threadIdx.x;
  const int ol = t % kTileO, rg = t / kTileO;
  const int64_t K = w.in, nb = (K + kChunk - 1) / kChunk;
  float acc[kRowsPerThread];
#pragma unroll
  for (int rr = 0; rr < kRowsPerThread; ++rr) acc[rr] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t c0 = b * kChunk;
    const int n = static_cast<int>(K - c0 < kChunk ? K - c0 : kChunk);
    for (int e = t; e < kTileR * kChunk; e += kThreads) {
      const int rl = e / kChunk, i = e % kChunk;
      const int64_t r = r0 + rl;
      xs[rl][i] = (r < rows && i < n) ? x[r * K + c0 + i] : 0.f;
    }
    for (int e = t; e < kTileO * kChunk; e += kThreads) {
      const int ot = e / kChunk, i = e % kChunk;
      const int64_t o = o0 + ot;
      ws[ot][i] = (o < w.out && i < n) ? WeightAt(w, o, c0 + i) : 0.f;
    }
    if (kQuant) {
      if (t < kTileR) {
        const int64_t r = r0 + t;
        xsc[t] = r < rows ? act_scale[r * nb + b] : 0.f;
      }
      if (t < kTileO) {
        const int64_t o = o0 + t;
        float sc = 0.f;
        if (o < w.out) {
          const int64_t si = (o / block_rows) * scale_cols + c0 / block_cols;
          sc = scale_codes != nullptr ? DecodeE8M0(scale_codes[si]) : scale_values[si];
        }
        wsc[t] = sc;
      }
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerThread; ++rr) {
      const int rl = rg * kRowsPerThread + rr;
      if (kQuant) {
        // Dot8 of this block (n <= 32 elements).
        const int n8 = n / 8 * 8;
        float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < n8; i += 8) {
#pragma unroll
          for (int j = 0; j < 8; ++j) l[j] += xs[rl][i + j] * ws[ol][i + j];
        }
        float d = Tree8(l);
        for (int i = n8; i < n; ++i) d += xs[rl][i] * ws[ol][i];
        acc[rr] += d * xsc[rl] * wsc[ol];
      } else if (bf16) {
        float sum = acc[rr];
        int i = 0;
        for (; i + 2 <= n; i += 2) {
          sum += xs[rl][i + 1] * ws[ol][i + 1];
          sum += xs[rl][i] * ws[ol][i];
        }
        if (i < n) sum += xs[rl][i] * ws[ol][i];
        acc[rr] = sum;
      } else {
        float sum = acc[rr];
        for (int i = 0; i < n; ++i) sum += xs[rl][i] * ws[ol][i];
        acc[rr] = sum;
      }
    }
    __syncthreads();
  }
  const int64_t o = o0 + ol;
  if (o >= w.out) return;
#pragma unroll
  for (int rr = 0; rr < kRowsPerThread; ++rr) {
    const int64_t r = r0 + rg * kRowsPerThread + rr;
    if (r >= rows) continue;
    // K == 0: no chunk ran; the reference's empty dot is +0.
    y[r * w.out + o] = (kQuant || bf16) ? RoundBf16(acc[rr]) : acc[rr];
  }
}

template <bool kQuant>
__global__ void __launch_bounds__(kThreads)
    GemmKernel(const float* x, const float* act_scale, int64_t rows, GemmWeight w,
               const uint8_t* scale_codes, const float* scale_values, int block_rows,
               int block_cols, int64_t scale_cols, bool bf16, float* y) {
  GemmTile<kQuant>(x, act_scale, rows, w, scale_codes, scale_values, block_rows, block_cols,
                   scale_cols, bf16, y, static_cast<int64_t>(blockIdx.x) * kTileO,
                   static_cast<int64_t>(blockIdx.y) * kTileR);
}

// LinearQuant of at most kTileR rows (a decode step): GemmKernel<true> would run ceil(out / 64)
// blocks, each walking all of K, too few to fill the GPU (wq_a: 20 blocks for 160 K blocks). Here
// the K blocks are spread over the grid's y, kSplitChunks per block: each block computes, per
// quantization block b, the term Dot8_b * act_scale * weight_scale exactly as GemmTile<true> (same
// loads, same Dot8, same products) and stores it; GemmSumTermsKernel then adds each output's terms
// in block order from +0, as GemmTile's running acc does. Bit-identical to GemmKernel<true>
// (-fmad=false: no contraction of the product into the add).
constexpr int kSplitChunks = 4;

__global__ void __launch_bounds__(kThreads)
    GemmTermsKernel(const float* x, const float* act_scale, int64_t rows, GemmWeight w,
                    const uint8_t* scale_codes, const float* scale_values, int block_rows,
                    int block_cols, int64_t scale_cols, float* terms) {
  __shared__ float xs[kTileR][kChunk + 1];
  __shared__ float ws[kTileO][kChunk + 1];
  __shared__ float xsc[kTileR];
  __shared__ float wsc[kTileO];
  const int t = threadIdx.x;
  const int ol = t % kTileO, rg = t / kTileO;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kTileO;
  const int64_t K = w.in, nb = (K + kChunk - 1) / kChunk;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * kSplitChunks;
  const int64_t b1 = b0 + kSplitChunks < nb ? b0 + kSplitChunks : nb;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t c0 = b * kChunk;
    const int n = static_cast<int>(K - c0 < kChunk ? K - c0 : kChunk);
    for (int e = t; e < kTileR * kChunk; e += kThreads) {
      const int rl = e / kChunk, i = e % kChunk;
      xs[rl][i] = (rl < rows && i < n) ? x[rl * K + c0 + i] : 0.f;
    }
    for (int e = t; e < kTileO * kChunk; e += kThreads) {
      const int ot = e / kChunk, i = e % kChunk;
      const int64_t o = o0 + ot;
      ws[ot][i] = (o < w.out && i < n) ? WeightAt(w, o, c0 + i) : 0.f;
    }
    if (t < kTileR) xsc[t] = t < rows ? act_scale[t * nb + b] : 0.f;
    if (t < kTileO) {
      const int64_t o = o0 + t;
      float sc = 0.f;
      if (o < w.out) {
        const int64_t si = (o / block_rows) * scale_cols + c0 / block_cols;
        sc = scale_codes != nullptr ? DecodeE8M0(scale_codes[si]) : scale_values[si];
      }
      wsc[t] = sc;
    }
    __syncthreads();
    const int64_t o = o0 + ol;
#pragma unroll
    for (int rr = 0; rr < kRowsPerThread; ++rr) {
      const int rl = rg * kRowsPerThread + rr;
      if (rl >= rows || o >= w.out) continue;
      const int n8 = n / 8 * 8;
      float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int i = 0; i < n8; i += 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j) l[j] += xs[rl][i + j] * ws[ol][i + j];
      }
      float d = Tree8(l);
      for (int i = n8; i < n; ++i) d += xs[rl][i] * ws[ol][i];
      terms[(b * rows + rl) * w.out + o] = d * xsc[rl] * wsc[ol];
    }
    __syncthreads();
  }
}

// y[r, o] = bf16(+0 + terms[0, r, o] + terms[1, r, o] + ...), in block order.
__global__ void GemmSumTermsKernel(const float* terms, int64_t nb, int64_t n, float* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) acc += terms[b * n + i];
  y[i] = RoundBf16(acc);
}

// GroupedLinearQuant: block row y is the y-th row tile counted over the groups in order (group g
// has ceil(n_g / kTileR) tiles; blocks past the last tile leave). A tile never spans two groups,
// so each output is the same thread computation as GemmKernel's for that group's rows alone.
__global__ void __launch_bounds__(kThreads)
    GroupedGemmQuantKernel(const float* q, const float* act_scale, const int64_t* starts,
                           int n_groups, const GroupWeight* groups, GemmWeight w, int block_rows,
                           int block_cols, int64_t scale_cols, float* y) {
  int64_t tile = blockIdx.y;
  int g = 0;
  for (; g < n_groups; ++g) {
    const int64_t n = starts[g + 1] - starts[g];
    const int64_t tiles = (n + kTileR - 1) / kTileR;
    if (tile < tiles) break;
    tile -= tiles;
  }
  if (g == n_groups) return;  // whole blocks leave together
  const int64_t at = starts[g], n = starts[g + 1] - at, nb = (w.in + kChunk - 1) / kChunk;
  GemmWeight gw = w;
  gw.data = groups[g].codes;
  GemmTile<true>(q + at * w.in, act_scale + at * nb, n, gw, groups[g].scale_codes, nullptr,
                 block_rows, block_cols, scale_cols, true, y + at * w.out,
                 static_cast<int64_t>(blockIdx.x) * kTileO, tile * kTileR);
}

dim3 GemmGrid(int64_t rows, int64_t out) {
  return dim3(static_cast<unsigned>((out + kTileO - 1) / kTileO),
              static_cast<unsigned>((rows + kTileR - 1) / kTileR));
}

}  // namespace

cudaError_t QuantizeFp8Rows(const float* x, int64_t rows, int64_t k, float* q, float* scales,
                            cudaStream_t stream) {
  const int64_t nb = (k + 31) / 32;
  if (rows == 0 || nb == 0) return cudaSuccess;
  QuantizeFp8Kernel<<<GridFor(rows * nb * 32), kThreads, 0, stream>>>(x, rows, k, nb, q, scales);
  return cudaGetLastError();
}

int64_t GemmQuantTermsBytes(int64_t rows, const GemmWeight& w) {
  const int64_t nb = (w.in + kChunk - 1) / kChunk;
  if (rows > kTileR || nb < 2 * kSplitChunks) return 0;  // GemmKernel fills the GPU, or K is short
  return nb * rows * w.out * static_cast<int64_t>(sizeof(float));
}

cudaError_t GemmQuant(const float* q, const float* s, int64_t rows, const GemmWeight& w,
                      const uint8_t* scale_codes, const float* scale_values, int block_rows,
                      int block_cols, int64_t scale_cols, float* y, float* terms,
                      cudaStream_t stream) {
  if (rows == 0 || w.out == 0) return cudaSuccess;
  if (terms != nullptr && GemmQuantTermsBytes(rows, w) > 0) {
    const int64_t nb = (w.in + kChunk - 1) / kChunk;
    const dim3 grid(static_cast<unsigned>((w.out + kTileO - 1) / kTileO),
                    static_cast<unsigned>((nb + kSplitChunks - 1) / kSplitChunks));
    GemmTermsKernel<<<grid, kThreads, 0, stream>>>(q, s, rows, w, scale_codes, scale_values,
                                                   block_rows, block_cols, scale_cols, terms);
    if (cudaError_t rc = cudaGetLastError(); rc != cudaSuccess) return rc;
    GemmSumTermsKernel<<<GridFor(rows * w.out), kThreads, 0, stream>>>(terms, nb, rows * w.out, y);
    return cudaGetLastError();
  }
  GemmKernel<true><<<GemmGrid(rows, w.out), kThreads, 0, stream>>>(
      q, s, rows, w, scale_codes, scale_values, block_rows, block_cols, scale_cols, true, y);
  return cudaGetLastError();
}

cudaError_t GroupedGemmQuant(const float* q, const float* s, int64_t rows, const int64_t* starts,
                             int n_groups, const GroupWeight* groups, const GemmWeight& w,
                             int block_rows, int block_cols, int64_t scale_cols, float* y,
                             cudaStream_t stream) {
  if (rows == 0 || w.out == 0 || n_groups == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((w.out + kTileO - 1) / kTileO),
                  static_cast<unsigned>(GroupedGemmRowTiles(rows, n_groups)));
  GroupedGemmQuantKernel<<<grid, kThreads, 0, stream>>>(q, s, starts, n_groups, groups, w,
                                                        block_rows, block_cols, scale_cols, y);
  return cudaGetLastError();
}

cudaError_t GemmPlain(const float* x, int64_t rows, const GemmWeight& w, bool bf16, float* y,
                      cudaStream_t stream) {
  if (rows == 0 || w.out == 0) return cudaSuccess;
  GemmKernel<false><<<GemmGrid(rows, w.out), kThreads, 0, stream>>>(
      x, nullptr, rows, w, nullptr, nullptr, 1, 1, 0, bf16, y);
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
