// Element-wise and per-row ops of CudaBackend. Each kernel names the reference it mirrors
// (kernels/cpu/ops.cc, kernels/cpu/cpu_backend.cc, kernels/format.cc); a value is computed by one
// thread in the reference's order, and the sums the reference takes in double are taken in double
// in the same sequential order, so these results are bit-identical to the CPU's apart from the
// transcendental functions (common.cuh: ExpF, Log1pF, CosF, SinF). The reference's own fp32
// arithmetic (torch's sum order, Sleef's exp) comes from kernels/torch_math.h, the same code the
// CPU backend runs.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/hc_math.h"
#include "kernels/torch_math.h"

namespace epd::kernels::cuda {
namespace {

using codec::Abs;
using codec::Clamp;
using codec::DecodeE2M1;
using codec::DecodeE4M3;
using codec::DecodeE8M0;
using codec::EncodeE2M1;
using codec::Pow2Ceil;
using codec::RoundBf16;
using codec::RoundE4M3;
using codec::StdMax;
using codec::StdMin;
using torch_math::TorchExp;
using torch_math::TorchMeanSquare;
using torch_math::TorchSumOf;

__device__ __forceinline__ int64_t Tid() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// ops.cc RmsNormBf16: one block per row; the mean square in torch's order (thread 0), then
// y = bf16(w * (x * inv)) in parallel. x and y may alias: every read of the sum is done before the
// barrier.
__global__ void RmsNormKernel(const float* x, const float* w, int64_t dim, float eps, float* y) {
  __shared__ float inv_s;
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  if (threadIdx.x == 0) inv_s = 1.f / sqrtf(TorchMeanSquare(xr, dim) + eps);
  __syncthreads();
  const float inv = inv_s;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = RoundBf16(w[i] * (xr[i] * inv));
}

// rope.cc RopeCosSin: angle = fp32(pos) * freq.
__global__ void RopeTablesKernel(const float* freqs, int n_pairs, const int64_t* positions,
                                 int64_t rows, float* cos, float* sin) {
  const int64_t e = Tid();
  if (e >= rows * n_pairs) return;
  const int64_t r = e / n_pairs;
  const int i = static_cast<int>(e % n_pairs);
  const float ang = static_cast<float>(positions[r]) * freqs[i];
  cos[e] = CosF(ang);
  sin[e] = SinF(ang);
}

// ops.cc Rope.
__global__ void RopeKernel(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
                           const float* cos, const float* sin, bool inverse) {
  const int64_t e = Tid();
  if (e >= rows * heads * n_pairs) return;
  const int i = static_cast<int>(e % n_pairs);
  const int64_t rh = e / n_pairs;
  const int64_t r = rh / heads;
  float* v = x + rh * stride + offset;
  const float c = cos[r * n_pairs + i], s = sin[r * n_pairs + i];
  const float a = v[2 * i], b = v[2 * i + 1];
  const float si = inverse ? -s : s;
  v[2 * i] = RoundBf16(a * c - b * si);
  v[2 * i + 1] = RoundBf16(a * si + b * c);
}

// cpu_backend.cc RoundBf16 / ScaleRoundBf16.
__global__ void ScaleRoundKernel(float* x, int64_t n, float scale, bool scaled) {
  const int64_t i = Tid();
  if (i < n) x[i] = RoundBf16(scaled ? x[i] * scale : x[i]);
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  const int64_t i = Tid();
  if (i < n) x[i] += y[i];
}

// torch.sigmoid: Sleef's exp on its vectorized path, glibc's expf (here ExpF) on its scalar path
// (the 4-element tensors of a single-token call).
__device__ __forceinline__ float Sigmoid(float x, bool vector_exp) {
  return 1.f / (1.f + (vector_exp ? TorchExp(-x) : ExpF(-x)));
}

// ops.cc HcMixes after the projection (m = DotSeq(h, fn_j) from GemmPlain): one thread per row.
__global__ void HcMixesKernel(int64_t rows, const float* h, int hc, int64_t dim, const float* mm,
                              const float* scale, const float* base, int sinkhorn_iters,
                              float hc_eps, float norm_eps, float* pre, float* post, float* comb,
                              bool vector_exp) {
  const int64_t r = Tid();
  if (r >= rows) return;
  const int64_t n = hc * dim;
  const int nm = (2 + hc) * hc;
  const float* hr = h + r * n;
  const float rs = 1.f / sqrtf(TorchMeanSquare(hr, n) + norm_eps);
  const float* m0 = mm + r * nm;
  float* pr = pre + r * hc;
  float* po = post + r * hc;
  float* cb = comb + r * hc * hc;
  for (int j = 0; j < hc; ++j) {
    pr[j] = Sigmoid((m0[j] * rs) * scale[0] + base[j], vector_exp) + hc_eps;
  }
  for (int j = 0; j < hc; ++j) {
    po[j] = 2.f * Sigmoid((m0[hc + j] * rs) * scale[1] + base[hc + j], vector_exp);
  }
  hc_math::HcComb(m0 + 2 * hc, rs, scale[2], base + 2 * hc, hc, sinkhorn_iters, hc_eps, cb);
}

// ops.cc HcPre: y[r, d] = bf16(sum_j pre[r, j] * h[r, j, d]), j in order from 0.
__global__ void HcPreKernel(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
                            float* y) {
  const int64_t e = Tid();
  if (e >= rows * dim) return;
  const int64_t r = e / dim, d = e % dim;
  float s = 0.f;
  for (int j = 0; j < hc; ++j) s += pre[r * hc + j] * h[(r * hc + j) * dim + d];
  y[e] = RoundBf16(s);
}

// ops.cc HcPost: out = bf16(post * y + s), s = the sum over j in order of comb * res (the
// reference's torch.sum). Thread (r, d) computes every k into tmp, then copies its own column: it
// is the only reader of res[r, :, d], so out may alias res.
__global__ void HcPostKernel(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                             const float* post, const float* comb, float* tmp, float* out) {
  const int64_t e = Tid();
  if (e >= rows * dim) return;
  const int64_t r = e / dim, d = e % dim;
  const float* cb = comb + r * hc * hc;
  for (int k = 0; k < hc; ++k) {
    float s = 0.f;
    for (int j = 0; j < hc; ++j) s += cb[j * hc + k] * res[(r * hc + j) * dim + d];
    tmp[(r * hc + k) * dim + d] = RoundBf16(post[r * hc + k] * y[r * dim + d] + s);
  }
  for (int k = 0; k < hc; ++k) out[(r * hc + k) * dim + d] = tmp[(r * hc + k) * dim + d];
}

// cpu_backend.cc HcMean.
__global__ void HcMeanKernel(int64_t rows, const float* h, int hc, int64_t dim, float* y,
                             int64_t y_stride) {
  const int64_t e = Tid();
  if (e >= rows * dim) return;
  const int64_t i = e / dim, d = e % dim;
  float sum = 0.f;
  for (int64_t j = 0; j < hc; ++j) sum += h[(i * hc + j) * dim + d];
  y[i * y_stride + d] = RoundBf16(sum / static_cast<float>(hc));
}

// cpu_backend.cc SwiGlu (torch's F.silu with Sleef's exp).
__global__ void SwiGluKernel(const float* g, const float* u, int64_t n, int64_t inter, float lim,
                             const float* row_weights, float* h) {
  const int64_t e = Tid();
  if (e >= n) return;
  const float uu = Clamp(u[e], -lim, lim);
  const float gg = StdMin(g[e], lim);
  const float silu = gg / (1.f + TorchExp(-gg));
  h[e] = RoundBf16(row_weights != nullptr ? silu * uu * row_weights[e / inter] : silu * uu);
}

// cpu_backend.cc CopyRows: one thread per element; a null index list is the identity. The CPU
// reference refuses a negative row; reading the lists back to refuse it here would synchronize
// every call, so a negative row's element is skipped (never written outside `dst`).
__global__ void CopyRowsKernel(const float* src, const int64_t* src_rows, float* dst,
                               const int64_t* dst_rows, int64_t n, int64_t dim) {
  const int64_t e = Tid();
  if (e >= n * dim) return;
  const int64_t i = e / dim, d = e % dim;
  const int64_t from = src_rows != nullptr ? src_rows[i] : i;
  const int64_t to = dst_rows != nullptr ? dst_rows[i] : i;
  if (from < 0 || to < 0) return;
  dst[to * dim + d] = src[from * dim + d];
}

// cpu_backend.cc SumSlots: slots summed in order from 0.
__global__ void SumSlotsKernel(const float* ys, int64_t rows, int64_t slots, int64_t dim,
                               float* out) {
  const int64_t e = Tid();
  if (e >= rows * dim) return;
  const int64_t r = e / dim, d = e % dim;
  float acc = 0.f;
  for (int64_t j = 0; j < slots; ++j) acc += ys[(r * slots + j) * dim + d];
  out[e] = RoundBf16(acc);
}

// cpu_backend.cc Fp8RowLookup.
__global__ void Fp8RowLookupKernel(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                                   const int64_t* ids, int64_t n, float* out) {
  const int64_t e = Tid();
  if (e >= n * dim) return;
  const int64_t r = e / dim, i = e % dim;
  const int64_t id = ids[r];
  out[e] = RoundBf16(DecodeE4M3(table[id * dim + i]) *
                     DecodeE8M0(table_scale[id * (dim / 32) + i / 32]));
}

// The product the reference sums: h * (qw * kw) * key, element by element.
struct EngramProd {
  const float* h;
  const float* qw;
  const float* kw;
  const float* key;
  EPD_HD float operator()(int64_t d) const { return h[d] * (qw[d] * kw[d]) * key[d]; }
};

// cpu_backend.cc Engram (EngramGate / EngramGateSingleToken): one block per (row, hc stream).
// The two mean squares (threads 0 and 1) and the product sum (thread 0) in torch's order, then
// gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))); the update of h is parallel after the
// barrier.
__global__ void EngramGateKernel(float* h, const float* e, int hc, int64_t D, const float* q_weight,
                                 const float* k_weight, float norm_eps, float inv_sqrt_d,
                                 bool vector_exp) {
  __shared__ float rnorm[2];
  __shared__ float gate_s;
  const int64_t r = blockIdx.x / hc;
  const int64_t j = blockIdx.x % hc;
  const float* er = e + r * (hc + 1) * D;
  const float* value = er + hc * D;
  float* hj = h + (r * hc + j) * D;
  const float* key = er + j * D;
  const float* qw = q_weight + j * D;
  const float* kw = k_weight + j * D;
  if (threadIdx.x < 2) {
    rnorm[threadIdx.x] = 1.f / sqrtf(TorchMeanSquare(threadIdx.x == 0 ? hj : key, D) + norm_eps);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float dot =
        TorchSumOf(D, EngramProd{hj, qw, kw, key}) * (rnorm[0] * rnorm[1]) * inv_sqrt_d;
    const float sg = dot > 0.f ? 1.f : (dot < 0.f ? -1.f : 0.f);
    gate_s = Sigmoid(sg * sqrtf(StdMax(fabsf(dot), 1e-6f)), vector_exp);
  }
  __syncthreads();
  const float gate = gate_s;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) hj[d] = RoundBf16(hj[d] + gate * value[d]);
}

// cpu_backend.cc Embed.
// `bf16`: the table is bf16 bits (widened exactly), else fp32 values.
__global__ void EmbedKernel(const void* table, bool bf16, int64_t dim, const int32_t* ids,
                            int64_t rows, int hc, float* h) {
  const int64_t e = Tid();
  if (e >= rows * hc * dim) return;
  const int64_t d = e % dim, i = e / (hc * dim);
  const int64_t at = static_cast<int64_t>(ids[i]) * dim + d;
  h[e] = bf16 ? codec::Bf16BitsToF32(static_cast<const uint16_t*>(table)[at])
              : static_cast<const float*>(table)[at];
}

// format.cc Fp8QuantDequantRow / Fp4IndexQuantDequantRow / Fp4KvQuantDequantRow: one thread per
// (row, block); the block's amax sequentially as the reference (max ignores NaN either way).
__global__ void QuantDequantKernel(int kind, float* x, int64_t rows, int64_t dim, int block,
                                   int64_t nb) {
  const int64_t e = Tid();
  if (e >= rows * nb) return;
  const int64_t r = e / nb, b0 = (e % nb) * block;
  float* xb = x + r * dim + b0;
  const int n = static_cast<int>(dim - b0 < block ? dim - b0 : block);
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = StdMax(amax, Abs(xb[i]));
  if (kind == 0) {
    const float s = Pow2Ceil(StdMax(amax, 1e-4f) * (1.f / 448.f));
    for (int i = 0; i < n; ++i) xb[i] = RoundBf16(RoundE4M3(Clamp(xb[i] / s, -448.f, 448.f)) * s);
  } else {
    const float s = kind == 1 ? Pow2Ceil(StdMax(amax, 6.f * 0x1p-126f) * (1.f / 6.f))
                              : RoundE4M3(StdMax(amax, 6.f * 0x1p-9f) / 6.f);
    for (int i = 0; i < n; ++i) {
      xb[i] = RoundBf16(DecodeE2M1(EncodeE2M1(Clamp(xb[i] / s, -6.f, 6.f))) * s);
    }
  }
}

}  // namespace

cudaError_t RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y,
                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, w, dim, eps, y);
  return cudaGetLastError();
}

cudaError_t RopeTables(const float* freqs, int n_pairs, const int64_t* positions, int64_t rows,
                       float* cos, float* sin, cudaStream_t stream) {
  const int64_t n = rows * n_pairs;
  if (n == 0) return cudaSuccess;
  RopeTablesKernel<<<GridFor(n), kThreads, 0, stream>>>(freqs, n_pairs, positions, rows, cos, sin);
  return cudaGetLastError();
}

cudaError_t Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
                 const float* cos, const float* sin, bool inverse, cudaStream_t stream) {
  const int64_t n = rows * heads * n_pairs;
  if (n == 0) return cudaSuccess;
  RopeKernel<<<GridFor(n), kThreads, 0, stream>>>(x, rows, heads, stride, offset, n_pairs, cos, sin,
                                                  inverse);
  return cudaGetLastError();
}

cudaError_t ScaleRoundBf16(float* x, int64_t n, float scale, bool scaled, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ScaleRoundKernel<<<GridFor(n), kThreads, 0, stream>>>(x, n, scale, scaled);
  return cudaGetLastError();
}

cudaError_t Add(float* x, const float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AddKernel<<<GridFor(n), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t HcMixesFinish(int64_t rows, const float* h, int hc, int64_t dim, const float* m,
                          const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                          float norm_eps, float* pre, float* post, float* comb, bool vector_exp,
                          cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  HcMixesKernel<<<GridFor(rows, 64), 64, 0, stream>>>(rows, h, hc, dim, m, scale, base,
                                                      sinkhorn_iters, hc_eps, norm_eps, pre, post,
                                                      comb, vector_exp);
  return cudaGetLastError();
}

cudaError_t HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre, float* y,
                  cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  HcPreKernel<<<GridFor(rows * dim), kThreads, 0, stream>>>(rows, h, hc, dim, pre, y);
  return cudaGetLastError();
}

cudaError_t HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                   const float* post, const float* comb, float* tmp, float* out,
                   cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  HcPostKernel<<<GridFor(rows * dim), kThreads, 0, stream>>>(rows, y, res, hc, dim, post, comb, tmp,
                                                             out);
  return cudaGetLastError();
}

cudaError_t HcMean(int64_t rows, const float* h, int hc, int64_t dim, float* y, int64_t y_stride,
                   cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  HcMeanKernel<<<GridFor(rows * dim), kThreads, 0, stream>>>(rows, h, hc, dim, y, y_stride);
  return cudaGetLastError();
}

cudaError_t SwiGlu(const float* g, const float* u, int64_t rows, int64_t inter, float limit,
                   const float* row_weights, float* h, cudaStream_t stream) {
  const int64_t n = rows * inter;
  if (n <= 0) return cudaSuccess;
  SwiGluKernel<<<GridFor(n), kThreads, 0, stream>>>(g, u, n, inter, limit, row_weights, h);
  return cudaGetLastError();
}

cudaError_t CopyRows(const float* src, const int64_t* src_rows, float* dst,
                     const int64_t* dst_rows, int64_t n, int64_t dim, cudaStream_t stream) {
  if (n * dim <= 0) return cudaSuccess;
  CopyRowsKernel<<<GridFor(n * dim), kThreads, 0, stream>>>(src, src_rows, dst, dst_rows, n, dim);
  return cudaGetLastError();
}

cudaError_t SumSlots(const float* ys, int64_t rows, int64_t slots, int64_t dim, float* out,
                     cudaStream_t stream) {
  if (rows * dim <= 0) return cudaSuccess;
  SumSlotsKernel<<<GridFor(rows * dim), kThreads, 0, stream>>>(ys, rows, slots, dim, out);
  return cudaGetLastError();
}

cudaError_t Fp8RowLookup(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                         const int64_t* ids, int64_t n, float* out, cudaStream_t stream) {
  if (n * dim <= 0) return cudaSuccess;
  Fp8RowLookupKernel<<<GridFor(n * dim), kThreads, 0, stream>>>(table, table_scale, dim, ids, n,
                                                                out);
  return cudaGetLastError();
}

cudaError_t EngramGate(float* h, const float* e, int64_t rows, int hc, int64_t dim,
                       const float* q_weight, const float* k_weight, float norm_eps,
                       float inv_sqrt_d, bool vector_exp, cudaStream_t stream) {
  if (rows * hc == 0) return cudaSuccess;
  EngramGateKernel<<<static_cast<unsigned>(rows * hc), kThreads, 0, stream>>>(
      h, e, hc, dim, q_weight, k_weight, norm_eps, inv_sqrt_d, vector_exp);
  return cudaGetLastError();
}

cudaError_t Embed(const void* table, bool bf16, int64_t dim, const int32_t* ids, int64_t rows,
                  int hc, float* h, cudaStream_t stream) {
  const int64_t n = rows * hc * dim;
  if (n <= 0) return cudaSuccess;
  EmbedKernel<<<GridFor(n), kThreads, 0, stream>>>(table, bf16, dim, ids, rows, hc, h);
  return cudaGetLastError();
}

cudaError_t QuantDequant(int kind, float* x, int64_t rows, int64_t dim, cudaStream_t stream) {
  const int block = kind == 2 ? 16 : 32;
  const int64_t nb = (dim + block - 1) / block;
  if (rows * nb <= 0) return cudaSuccess;
  QuantDequantKernel<<<GridFor(rows * nb), kThreads, 0, stream>>>(kind, x, rows, dim, block, nb);
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
