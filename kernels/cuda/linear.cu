// The linears of CudaBackend: FP8 activation quantization, the block-scaled FP8/FP4 GEMM of
// LinearQuant and the plain GEMM of LinearBf16/LinearF32 (and HcMixes' projection).
// Mirrors kernels/cpu/ops.cc (LinearQuant's K-order block dots), kernels/torch_math.h (DotDp, DotSeq) and
// kernels/format.cc (QuantizeFp8Row): every output is computed by one thread in the reference's
// order, so results do not depend on the tile, the batch or the launch.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/torch_math.h"

namespace epd::kernels::cuda {
namespace {

using codec::Abs;
using codec::Bf16BitsToF32;
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

__device__ __forceinline__ float WeightAt(const GemmWeight& w, int64_t o, int64_t i) {
  switch (w.kind) {
    case WeightKind::kFp8Packed:
      return DecodeE4M3(static_cast<const uint8_t*>(w.data)[o * w.in + i]);
    case WeightKind::kFp4Packed: {
      const uint8_t byte = static_cast<const uint8_t*>(w.data)[o * (w.in / 2) + i / 2];
      return DecodeE2M1((i & 1) ? static_cast<uint8_t>(byte >> 4)
                                : static_cast<uint8_t>(byte & 0xf));
    }
    case WeightKind::kBf16:
      return Bf16BitsToF32(static_cast<const uint16_t*>(w.data)[o * w.in + i]);
    case WeightKind::kF32:
    default:
      return static_cast<const float*>(w.data)[o * w.in + i];
  }
}

// The weight scale of output o for the quantization block at element c0: its E8M0 code decoded,
// or the float itself.
__device__ __forceinline__ float WeightScale(const uint8_t* scale_codes, const float* scale_values,
                                             int64_t o, int64_t c0, int block_rows, int block_cols,
                                             int64_t scale_cols) {
  const int64_t si = (o / block_rows) * scale_cols + c0 / block_cols;
  return scale_codes != nullptr ? DecodeE8M0(scale_codes[si]) : scale_values[si];
}

// Stages chunk b (elements c0 = b * kChunk .. c0 + n - 1) of the tile at outputs o0.. and rows r0..
// in shared memory: x's rows into xs and the weight rows into ws (0 past rows, w.out or n); with
// `scales` (LinearQuant: the chunk is a quantization block) the rows' activation scales into xsc
// and the outputs' weight scales into wsc. Every thread of the block takes part; the caller's
// barrier follows. GemmTile and GemmTermsKernel load through it alike.
__device__ __forceinline__ void StageChunk(const float* x, const float* act_scale, int64_t rows,
                                           const GemmWeight& w, const uint8_t* scale_codes,
                                           const float* scale_values, int block_rows,
                                           int block_cols, int64_t scale_cols, int64_t o0,
                                           int64_t r0, int64_t b, int n, bool scales,
                                           float (&xs)[kTileR][kChunk + 1],
                                           float (&ws)[kTileO][kChunk + 1], float (&xsc)[kTileR],
                                           float (&wsc)[kTileO]) {
  const int t = threadIdx.x;
  const int64_t K = w.in, nb = (K + kChunk - 1) / kChunk, c0 = b * kChunk;
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
  if (!scales) return;
  if (t < kTileR) {
    const int64_t r = r0 + t;
    xsc[t] = r < rows ? act_scale[r * nb + b] : 0.f;
  }
  if (t < kTileO) {
    const int64_t o = o0 + t;
    wsc[t] = o < w.out
                 ? WeightScale(scale_codes, scale_values, o, c0, block_rows, block_cols, scale_cols)
                 : 0.f;
  }
}

// One tile of kTileR rows x kTileO outputs; K in chunks of 32 through shared memory. Thread t owns
// output t % 64 for rows (t / 64) * 4 .. +3.
// kQuant: the chunk is one quantization block: its BlockDot is finished per chunk and added as
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
    StageChunk(x, act_scale, rows, w, scale_codes, scale_values, block_rows, block_cols, scale_cols,
               o0, r0, b, n, kQuant, xs, ws, xsc, wsc);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerThread; ++rr) {
      const int rl = rg * kRowsPerThread + rr;
      if (r0 + rl >= rows) break;  // a tile's missing rows (a decode step's) cost nothing
      if (kQuant) {
        acc[rr] += BlockDot(xs[rl], ws[ol], n) * xsc[rl] * wsc[ol];  // this block's (n <= 32)
      } else if (bf16) {
        // DotDp's pairs; chunks are even, so only K's last odd element stands alone.
        acc[rr] = torch_math::DotDpFrom(xs[rl], ws[ol], 0, n, acc[rr]);
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
// quantization block b, the term BlockDot_b * act_scale * weight_scale exactly as GemmTile<true> (same
// loads, same BlockDot, same products) and stores it; GemmSumTermsKernel then adds each output's terms
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
    StageChunk(x, act_scale, rows, w, scale_codes, scale_values, block_rows, block_cols, scale_cols,
               o0, 0, b, n, true, xs, ws, xsc, wsc);
    __syncthreads();
    const int64_t o = o0 + ol;
#pragma unroll
    for (int rr = 0; rr < kRowsPerThread; ++rr) {
      const int rl = rg * kRowsPerThread + rr;
      if (rl >= rows || o >= w.out) continue;
      terms[(b * rows + rl) * w.out + o] = BlockDot(xs[rl], ws[ol], n) * xsc[rl] * wsc[ol];
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

// ---- Skinny tiles: LinearQuant of at most kSkinnyRows rows, read at the weights' bandwidth ----
// A decode step's GEMM has a few rows, so the bytes to read are the weights', once. GemmTile reads
// them one byte a thread and walks all of K in each block; here each warp owns one output and its
// 32 lanes read 32 consecutive quantization blocks of that output's row (1 KiB of FP8 codes, 512 B
// of FP4, in 16-byte loads: coalesced). The block's 8 warps share the rows' activations of those
// blocks through shared memory. Lane L computes block b's term for every row exactly as GemmTile
// does (the same BlockDot: the block's products added in K order from +0; then
// d * act_scale * weight_scale); the terms go through shared memory and lane r adds row r's terms
// in block order onto its running sum from +0, as GemmTile's acc does: bit-identical (-fmad=false).
constexpr int kSkinnyRows = 8, kSkinnyWarps = kThreads / 32, kPassBlocks = 32;
constexpr int kXsStride = kChunk + 1;  // a padded block of activations: lane L reads bank L + i

struct Bytes16 {
  uint8_t b[16];
};
__device__ __forceinline__ Bytes16 Load16(const uint8_t* p) {
  Bytes16 v;
#if defined(__CUDA_ARCH__)
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const unsigned words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 16; ++i) v.b[i] = static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)));
#else
  for (int i = 0; i < 16; ++i) v.b[i] = p[i];
#endif
  return v;
}

// wv[0..31] = the weight values of output o at elements c0 .. c0+n-1 (0 past n); c0 is a multiple
// of 32. `vec`: the row's codes are 16-byte aligned and n == 32. A LinearQuant weight: kFp8Packed,
// kFp4Packed, or kF32 (decoded values); never kBf16, which only the plain GEMM takes.
__device__ __forceinline__ void LoadWeightBlock(const GemmWeight& w, int64_t o, int64_t c0, int n,
                                                bool vec, float* wv) {
  switch (w.kind) {
    case WeightKind::kFp8Packed: {
      const uint8_t* p = static_cast<const uint8_t*>(w.data) + o * w.in + c0;
      if (vec) {
        const Bytes16 a = Load16(p), b = Load16(p + 16);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          wv[i] = DecodeE4M3(a.b[i]);
          wv[16 + i] = DecodeE4M3(b.b[i]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) wv[i] = i < n ? DecodeE4M3(p[i]) : 0.f;
      }
      return;
    }
    case WeightKind::kFp4Packed: {
      const uint8_t* p = static_cast<const uint8_t*>(w.data) + o * (w.in / 2) + c0 / 2;
      if (vec) {
        const Bytes16 a = Load16(p);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          wv[2 * i] = DecodeE2M1(static_cast<uint8_t>(a.b[i] & 0xf));
          wv[2 * i + 1] = DecodeE2M1(static_cast<uint8_t>(a.b[i] >> 4));
        }
      } else {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          wv[i] = i < n ? DecodeE2M1((i & 1) ? static_cast<uint8_t>(p[i / 2] >> 4)
                                             : static_cast<uint8_t>(p[i / 2] & 0xf))
                        : 0.f;
        }
      }
      return;
    }
    case WeightKind::kF32:
    default: {
      const float* p = static_cast<const float*>(w.data) + o * w.in + c0;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) wv[i] = i < n ? p[i] : 0.f;
      return;
    }
  }
}

// Rows 0 .. rt-1 (rt <= kSkinnyRows) of x / act_scale / y (row strides K, nb, out) through w, for
// the block's outputs blockIdx.x * kSkinnyWarps + warp. Every thread of the block makes the same
// barriers (a warp past the last output computes nothing and writes nothing).
__device__ __forceinline__ void SkinnyTile(const float* x, const float* act_scale, int rt,
                                           const GemmWeight& w, const uint8_t* scale_codes,
                                           const float* scale_values, int block_rows,
                                           int block_cols, int64_t scale_cols, float* y) {
  __shared__ float xs[kSkinnyRows][kPassBlocks * kXsStride];
  __shared__ float xsc[kSkinnyRows][kPassBlocks];
  __shared__ float ts[kSkinnyWarps][kSkinnyRows][kPassBlocks + 1];
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int64_t K = w.in, nb = (K + kChunk - 1) / kChunk;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kSkinnyWarps + warp;
  const bool live = o < w.out;
  const int64_t row_bytes = w.kind == WeightKind::kFp8Packed   ? K
                            : w.kind == WeightKind::kFp4Packed ? K / 2
                                                               : K * 4;
  const bool aligned =
      K % kChunk == 0 && row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
  float acc = 0.f;  // lane r < rt: row r's running sum
  for (int64_t p0 = 0; p0 < nb; p0 += kPassBlocks) {
    const int np = static_cast<int>(nb - p0 < kPassBlocks ? nb - p0 : kPassBlocks);
    const int64_t k0 = p0 * kChunk;
    const int64_t kn = K - k0 < kPassBlocks * kChunk ? K - k0 : kPassBlocks * kChunk;
    // The lane's weight block first: its loads are in flight while the block stages activations.
    float wv[kChunk];
    float wsc = 0.f;
    int n = 0;
    if (live && lane < np) {
      const int64_t c0 = (p0 + lane) * kChunk;
      n = static_cast<int>(K - c0 < kChunk ? K - c0 : kChunk);
      LoadWeightBlock(w, o, c0, n, aligned && n == kChunk, wv);
      wsc = WeightScale(scale_codes, scale_values, o, c0, block_rows, block_cols, scale_cols);
    }
    for (int e = t; e < rt * kPassBlocks * kChunk; e += kThreads) {
      const int r = e / (kPassBlocks * kChunk), k = e % (kPassBlocks * kChunk);
      xs[r][(k / kChunk) * kXsStride + k % kChunk] = k < kn ? x[r * K + k0 + k] : 0.f;
    }
    for (int e = t; e < rt * kPassBlocks; e += kThreads) {
      const int r = e / kPassBlocks, b = e % kPassBlocks;
      xsc[r][b] = b < np ? act_scale[r * nb + p0 + b] : 0.f;
    }
    __syncthreads();
#pragma unroll 1
    for (int r = 0; r < rt; ++r) {
      const float* xr = &xs[r][lane * kXsStride];
      float d = 0.f;  // BlockDot: K order from +0
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        if (i < n) d += xr[i] * wv[i];
      }
      ts[warp][r][lane] = n > 0 ? d * xsc[r][lane] * wsc : 0.f;
    }
    __syncthreads();
    if (lane < rt) {
      for (int j = 0; j < np; ++j) acc += ts[warp][lane][j];
    }
    // The next pass writes xs after this pass's second barrier (every read of xs is before it)
    // and ts after its own first barrier (every read of ts is before that).
  }
  // K == 0: no pass ran; the reference's empty dot is +0.
  if (live && lane < rt) y[lane * w.out + o] = RoundBf16(acc);
}

// The group holding row tile blockIdx.y, counting the groups' tiles in order (group g has
// ceil(n_g / tile_rows) tiles), and the tile's index within it; g = n_groups past the last tile.
// Block-wide (every thread calls it; barriers): the groups' tile counts, kThreads at a time, go
// through an inclusive scan in shared memory, and the one thread whose group holds the tile
// publishes it. A thread walking the starts alone read 2 x n_groups of them (a decode step's
// 385 groups) in every block of the grid.
__device__ __forceinline__ void FindGroupTile(const int64_t* starts, int n_groups, int tile_rows,
                                              int* group, int64_t* group_tile) {
  __shared__ int64_t scan[kThreads];
  __shared__ int64_t carry, found_tile;
  __shared__ int found;
  const int t = threadIdx.x;
  const int64_t tile = blockIdx.y;
  if (t == 0) {
    carry = 0;
    found = n_groups;
    found_tile = 0;
  }
  __syncthreads();
  for (int base = 0; base < n_groups; base += kThreads) {
    const int g = base + t;
    const int64_t tiles =
        g < n_groups ? (starts[g + 1] - starts[g] + tile_rows - 1) / tile_rows : 0;
    scan[t] = tiles;
    __syncthreads();
    for (int off = 1; off < kThreads; off <<= 1) {
      const int64_t add = t >= off ? scan[t - off] : 0;
      __syncthreads();
      scan[t] += add;
      __syncthreads();
    }
    const int64_t before = carry + scan[t] - tiles;  // the tiles of the groups before g
    if (tiles > 0 && tile >= before && tile < before + tiles) {
      found = g;
      found_tile = tile - before;
    }
    __syncthreads();
    if (t == kThreads - 1) carry += scan[t];
    __syncthreads();
    if (found < n_groups) break;  // the same shared value for every thread
  }
  *group = found;
  *group_tile = found_tile;
}

__global__ void __launch_bounds__(kThreads, 3)
    SkinnyGemmQuantKernel(const float* x, const float* act_scale, int64_t rows, GemmWeight w,
                          const uint8_t* scale_codes, const float* scale_values, int block_rows,
                          int block_cols, int64_t scale_cols, float* y) {
  const int64_t nb = (w.in + kChunk - 1) / kChunk,
                r0 = static_cast<int64_t>(blockIdx.y) * kSkinnyRows;
  const int rt = static_cast<int>(rows - r0 < kSkinnyRows ? rows - r0 : kSkinnyRows);
  SkinnyTile(x + r0 * w.in, act_scale + r0 * nb, rt, w, scale_codes, scale_values, block_rows,
             block_cols, scale_cols, y + r0 * w.out);
}

// GroupedLinearQuant in skinny tiles: block row y is the y-th tile of kSkinnyRows rows counted over
// the groups in order (as GroupedGemmQuantKernel's 16-row tiles).
__global__ void __launch_bounds__(kThreads, 3)
    SkinnyGroupedGemmQuantKernel(const float* q, const float* act_scale, const int64_t* starts,
                                 int n_groups, const GroupWeight* groups, GemmWeight w,
                                 int block_rows, int block_cols, int64_t scale_cols, float* y) {
  int g = 0;
  int64_t tile = 0;
  FindGroupTile(starts, n_groups, kSkinnyRows, &g, &tile);
  if (g == n_groups) return;  // whole blocks leave together
  const int64_t nb = (w.in + kChunk - 1) / kChunk;
  const int64_t at = starts[g] + tile * kSkinnyRows, n = starts[g + 1] - at;
  GemmWeight gw = w;
  gw.data = groups[g].codes;
  SkinnyTile(q + at * w.in, act_scale + at * nb,
             static_cast<int>(n < kSkinnyRows ? n : kSkinnyRows), gw, groups[g].scale_codes,
             nullptr, block_rows, block_cols, scale_cols, y + at * w.out);
}

// GroupedLinearQuant: block row y is the y-th row tile counted over the groups in order (group g
// has ceil(n_g / kTileR) tiles; blocks past the last tile leave). A tile never spans two groups,
// so each output is the same thread computation as GemmKernel's for that group's rows alone.
__global__ void __launch_bounds__(kThreads)
    GroupedGemmQuantKernel(const float* q, const float* act_scale, const int64_t* starts,
                           int n_groups, const GroupWeight* groups, GemmWeight w, int block_rows,
                           int block_cols, int64_t scale_cols, float* y) {
  int g = 0;
  int64_t tile = 0;
  FindGroupTile(starts, n_groups, kTileR, &g, &tile);
  if (g == n_groups) return;  // whole blocks leave together
  const int64_t at = starts[g], n = starts[g + 1] - at, nb = (w.in + kChunk - 1) / kChunk;
  GemmWeight gw = w;
  gw.data = groups[g].codes;
  GemmTile<true>(q + at * w.in, act_scale + at * nb, n, gw, groups[g].scale_codes, nullptr,
                 block_rows, block_cols, scale_cols, true, y + at * w.out,
                 static_cast<int64_t>(blockIdx.x) * kTileO, tile * kTileR);
}

// ---- Chains: the plain GEMM of at most kChainRows rows ----
// A plain dot is one running sum over all of K (DotSeq, DotDp), so an output's adds cannot be
// spread; with few rows GemmTile then has few threads to give them (HcMixes' projection at the
// release config: 24 outputs over K = 20,480, one block walking 640 chunks of 32, each a global
// round trip and two barriers). Here thread t of a block runs the chain of output
// blockIdx.x * 32 + t % 32 and row t / 32 over K in chunks of 128 from shared memory (padded:
// the 32 outputs of a warp read 32 banks), while every thread's loads of the next chunk are in
// flight: two buffers, one barrier a chunk. The adds are GemmTile's, in the same order
// (kernels/torch_math.h), from +0.
constexpr int kChainOuts = 32, kChainRows = kThreads / kChainOuts, kChainK = 128;
constexpr int kChainWLoads = kChainOuts * kChainK / kThreads;  // weight values a thread stages
constexpr int kChainXLoads = kChainRows * kChainK / kThreads;  // activation values a thread stages

// kBf16W: the weight is bf16 bits (WeightKind::kBf16), else fp32 values; one kernel each keeps the
// loads free of a per-element branch (93 registers, no spill, either form, sm_90: 2 blocks an SM;
// one kernel for both read 127).
template <bool kBf16W>
__global__ void __launch_bounds__(kThreads)
    PlainChainKernel(const float* x, int64_t rows, GemmWeight w, bool bf16, float* y) {
  __shared__ float ws[2][kChainOuts][kChainK + 1];
  __shared__ float xs[2][kChainRows][kChainK];
  const int t = threadIdx.x;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kChainOuts, K = w.in;
  const int64_t nc = (K + kChainK - 1) / kChainK;
  const int ol = t % kChainOuts, rl = t / kChainOuts;
  const bool mine = rl < rows && o0 + ol < w.out;
  float wr[kChainWLoads], xr[kChainXLoads];
  // Staged element e = t + j * kThreads of a chunk: consecutive threads read consecutive k of one
  // row (coalesced).
  auto load = [&](int64_t c) {
#pragma unroll
    for (int j = 0; j < kChainWLoads; ++j) {
      const int e = t + j * kThreads, oe = e / kChainK;
      const int64_t k = c * kChainK + e % kChainK;
      const int64_t at = (o0 + oe) * K + k;
      wr[j] = (o0 + oe < w.out && k < K)
                  ? (kBf16W ? Bf16BitsToF32(static_cast<const uint16_t*>(w.data)[at])
                            : static_cast<const float*>(w.data)[at])
                  : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kChainXLoads; ++j) {
      const int e = t + j * kThreads, re = e / kChainK;
      const int64_t k = c * kChainK + e % kChainK;
      xr[j] = (re < rows && k < K) ? x[re * K + k] : 0.f;
    }
  };
  auto store = [&](int b) {
#pragma unroll
    for (int j = 0; j < kChainWLoads; ++j) {
      const int e = t + j * kThreads;
      ws[b][e / kChainK][e % kChainK] = wr[j];
    }
#pragma unroll
    for (int j = 0; j < kChainXLoads; ++j) {
      const int e = t + j * kThreads;
      xs[b][e / kChainK][e % kChainK] = xr[j];
    }
  };
  float sum = 0.f;
  if (nc > 0) {
    load(0);
    store(0);
  }
  __syncthreads();
  for (int64_t c = 0; c < nc; ++c) {
    const int b = static_cast<int>(c & 1);
    if (c + 1 < nc) load(c + 1);  // in flight during this chunk's adds
    if (mine) {
      const float* xa = xs[b][rl];
      const float* wa = ws[b][ol];
      const int n = static_cast<int>(K - c * kChainK < kChainK ? K - c * kChainK : kChainK);
      if (bf16) {  // DotDp's pairs; chunks are even, so only K's last odd element stands alone
        sum = torch_math::DotDpFrom(xa, wa, 0, n, sum);
      } else {  // DotSeq: index order
        for (int i = 0; i < n; ++i) sum += xa[i] * wa[i];
      }
    }
    // Buffer b ^ 1 was last read before the previous chunk's barrier.
    if (c + 1 < nc) store(b ^ 1);
    __syncthreads();
  }
  if (mine) y[rl * w.out + o0 + ol] = bf16 ? RoundBf16(sum) : sum;
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
  // Skinny tiles, or GemmKernel fills the GPU, or K is short.
  if (rows <= kSkinnyRows || rows > kTileR || nb < 2 * kSplitChunks) return 0;
  return nb * rows * w.out * static_cast<int64_t>(sizeof(float));
}

bool GroupedGemmSkinny(int64_t rows, int n_groups) {
  return rows <= static_cast<int64_t>(kSkinnyRows) * n_groups;
}

int64_t GroupedGemmGridRows(int64_t rows, int n_groups) {
  // Each group's tiles are ceil(n_g / tile) <= n_g / tile + 1 for a group with rows, and at most
  // min(n_groups, rows) groups have rows.
  const int64_t tile = GroupedGemmSkinny(rows, n_groups) ? kSkinnyRows : kTileR;
  return (rows + tile - 1) / tile + (rows < n_groups ? rows : n_groups);
}

cudaError_t GemmQuant(const float* q, const float* s, int64_t rows, const GemmWeight& w,
                      const uint8_t* scale_codes, const float* scale_values, int block_rows,
                      int block_cols, int64_t scale_cols, float* y, float* terms,
                      cudaStream_t stream) {
  if (rows == 0 || w.out == 0) return cudaSuccess;
  if (rows <= kSkinnyRows) {
    const dim3 grid(static_cast<unsigned>((w.out + kSkinnyWarps - 1) / kSkinnyWarps), 1);
    SkinnyGemmQuantKernel<<<grid, kThreads, 0, stream>>>(q, s, rows, w, scale_codes, scale_values,
                                                         block_rows, block_cols, scale_cols, y);
    return cudaGetLastError();
  }
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
  const auto grid_rows = static_cast<unsigned>(GroupedGemmGridRows(rows, n_groups));
  if (GroupedGemmSkinny(rows, n_groups)) {
    const dim3 grid(static_cast<unsigned>((w.out + kSkinnyWarps - 1) / kSkinnyWarps), grid_rows);
    SkinnyGroupedGemmQuantKernel<<<grid, kThreads, 0, stream>>>(
        q, s, starts, n_groups, groups, w, block_rows, block_cols, scale_cols, y);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((w.out + kTileO - 1) / kTileO), grid_rows);
  GroupedGemmQuantKernel<<<grid, kThreads, 0, stream>>>(q, s, starts, n_groups, groups, w,
                                                        block_rows, block_cols, scale_cols, y);
  return cudaGetLastError();
}

cudaError_t GemmPlain(const float* x, int64_t rows, const GemmWeight& w, bool bf16, float* y,
                      cudaStream_t stream) {
  if (rows == 0 || w.out == 0) return cudaSuccess;
  if (rows <= kChainRows) {
    const auto grid = GridFor(w.out, kChainOuts);
    if (w.kind == WeightKind::kBf16) {
      PlainChainKernel<true><<<grid, kThreads, 0, stream>>>(x, rows, w, bf16, y);
    } else {
      PlainChainKernel<false><<<grid, kThreads, 0, stream>>>(x, rows, w, bf16, y);
    }
    return cudaGetLastError();
  }
  GemmKernel<false><<<GemmGrid(rows, w.out), kThreads, 0, stream>>>(
      x, nullptr, rows, w, nullptr, nullptr, 1, 1, 0, bf16, y);
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
