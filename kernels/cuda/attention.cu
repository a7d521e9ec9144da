// Attention-side ops of CudaBackend: sparse attention with sink, compressor pooling, indexer
// scores, score masking. Mirrors kernels/cpu/ops.cc (SparseAttention, IndexerScores) and
// kernels/cpu/cpu_backend.cc (CompressPool, MaskScores).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/torch_math.h"

namespace epd::kernels::cuda {
namespace {

using codec::RoundBf16;
using codec::StdMax;
using torch_math::DotSeq;
using torch_math::TorchExp;
using torch_math::TorchSum;

constexpr int kAttnThreads = 128;
constexpr int kChunkLen = 64;  // the reference's chunk of list entries

__device__ __forceinline__ const float* KvRow(const AttentionArgs& a, int32_t t) {
  return t >= a.kv_ext_start ? a.kv_ext + (t - a.kv_ext_start) * a.head_dim
                             : a.kv + static_cast<int64_t>(t) * a.head_dim;
}

// ops.cc SparseAttention, one block per (row, head), in the reference's operation order
// (kernels/torch_math.h). Per chunk of 64 list entries:
// 1. thread j: p[j] = DotSeq(q, kv_t) * scale (index order).
// 2. thread 0: cmax, m_new, alpha = TorchExp(m - m_new); threads j: e_j = TorchExp(p_j - m_new)
//    (0 for a masked entry) and its bf16; thread 0: den = den * alpha + TorchSum(e_0..e_{n-1}).
// 3. every thread, for its dims: num[d] = num[d] * alpha, then += bf16(e_j) * kv_t[d] in entry
//    order.
// Finally den += TorchExp(sink - m) and out = bf16(num / den). Online softmax starts from
// m = -1e30.
__global__ void __launch_bounds__(kAttnThreads) SparseAttentionKernel(AttentionArgs a) {
  extern __shared__ float smem[];
  const int hd = a.head_dim;
  float* num = smem;      // [hd]
  float* qs = smem + hd;  // [hd]
  __shared__ float p[kChunkLen], pb[kChunkLen], pe[kChunkLen];
  __shared__ int32_t tj[kChunkLen];
  __shared__ float m_s, mnew_s, alpha_s, den_s;
  const int64_t r = blockIdx.x / a.heads;
  const int h = static_cast<int>(blockIdx.x % a.heads);
  const int tid = threadIdx.x;
  const float* q = a.q + (r * a.heads + h) * hd;
  for (int d = tid; d < hd; d += kAttnThreads) {
    num[d] = 0.f;
    qs[d] = q[d];
  }
  if (tid == 0) {
    m_s = -1e30f;
    den_s = 0.f;
  }
  const int32_t* idx = a.idx + r * a.list_len;
  __syncthreads();
  for (int64_t c0 = 0; c0 < a.list_len; c0 += kChunkLen) {
    const int n = static_cast<int>(a.list_len - c0 < kChunkLen ? a.list_len - c0 : kChunkLen);
    if (tid < n) {
      const int32_t t = idx[c0 + tid];
      tj[tid] = t;
      p[tid] = t < 0 ? -INFINITY : DotSeq(qs, KvRow(a, t), hd) * a.scale;
    }
    __syncthreads();
    if (tid == 0) {
      float cmax = -INFINITY;
      for (int j = 0; j < n; ++j) {
        if (tj[j] >= 0) cmax = StdMax(cmax, p[j]);
      }
      const float m_new = StdMax(m_s, cmax);
      alpha_s = TorchExp(m_s - m_new);
      mnew_s = m_new;
    }
    __syncthreads();
    if (tid < n) {
      const float e = tj[tid] >= 0 ? TorchExp(p[tid] - mnew_s) : 0.f;
      pe[tid] = e;
      pb[tid] = RoundBf16(e);
    }
    __syncthreads();
    if (tid == 0) {
      den_s = den_s * alpha_s + TorchSum(pe, n);
      m_s = mnew_s;
    }
    const float alpha = alpha_s;
    for (int d = tid; d < hd; d += kAttnThreads) {
      float acc = num[d] * alpha;
      for (int j = 0; j < n; ++j) {
        const int32_t t = tj[j];
        if (t < 0) continue;
        acc += pb[j] * KvRow(a, t)[d];
      }
      num[d] = acc;
    }
    __syncthreads();
  }
  if (tid == 0) den_s += TorchExp(a.sink[h] - m_s);
  __syncthreads();
  float* out = a.out + (r * a.heads + h) * hd;
  for (int d = tid; d < hd; d += kAttnThreads) out[d] = RoundBf16(num[d] / den_s);
}

// cpu_backend.cc CompressPool: one thread per group and channel.
__global__ void CompressPoolKernel(const float* kv_all, const float* score_all, int64_t groups,
                                   int ratio, int64_t hd, float* out_all) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= groups * hd) return;
  const int64_t g = i / hd, ch = i % hd;
  const float* kv = kv_all + g * ratio * hd;
  const float* score = score_all + g * ratio * hd;
  float* out = out_all + g * hd;
  float mx = -INFINITY;
  for (int r = 0; r < ratio; ++r) mx = StdMax(mx, score[r * hd + ch]);
  float sum = 0.f;
  float e[8];
  for (int r = 0; r < ratio; ++r) {
    e[r] = ExpF(score[r * hd + ch] - mx);
    sum += e[r];
  }
  float acc = 0.f;
  for (int r = 0; r < ratio; ++r) acc += kv[r * hd + ch] * (e[r] / sum);
  out[ch] = RoundBf16(acc);
}

// ops.cc IndexerScores of one key kt against q [heads, dim], w [heads]: each head's dot an fp32
// sum in index order, heads in order.
__device__ __forceinline__ float IndexerScoreOfKey(const float* q, const float* w, int heads,
                                                   const float* kt, int64_t dim) {
  float acc = 0.f;
  for (int h = 0; h < heads; ++h) {
    const float* qh = q + h * dim;
    float d = 0.f;
    for (int64_t e = 0; e < dim; ++e) d += qh[e] * kt[e];
    const float s = StdMax(RoundBf16(d), 0.f);
    acc += RoundBf16(s * w[h]);
  }
  return RoundBf16(acc);
}

// ops.cc IndexerScores: one thread per key.
__global__ void IndexerScoresKernel(const float* q, const float* w, int heads, const float* keys,
                                    int64_t n, int64_t dim, float* score) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  score[t] = IndexerScoreOfKey(q, w, heads, keys + t * dim, dim);
}

// cpu_backend.cc IndexerScoresRows: IndexerScoresKernel's score of key t for row blockIdx.y,
// -inf past the row's valid keys.
__global__ void IndexerScoresRowsKernel(const float* q, const float* w, int heads,
                                        const float* keys, int64_t n, int64_t dim,
                                        const int64_t* valid, float* score) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = blockIdx.y;
  if (t >= n) return;
  float* sr = score + r * n;
  if (t >= valid[r]) {
    sr[t] = -INFINITY;
    return;
  }
  sr[t] = IndexerScoreOfKey(q + r * heads * dim, w + r * heads, heads, keys + t * dim, dim);
}

// cpu_backend.cc MaskScores.
__global__ void MaskScoresKernel(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                                 int64_t mask_cols) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  if (t >= valid) score[t] = -INFINITY;
  if (mask != nullptr && (t >= mask_cols || !mask[t])) score[t] = -INFINITY;
}

}  // namespace

cudaError_t SparseAttention(const AttentionArgs& a, cudaStream_t stream) {
  const int64_t blocks = a.rows * a.heads;
  if (blocks == 0) return cudaSuccess;
  const size_t smem = 2 * static_cast<size_t>(a.head_dim) * sizeof(float);
  if (smem > 48 * 1024) {
    cudaError_t rc = cudaFuncSetAttribute(
        SparseAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (rc != cudaSuccess) return rc;
  }
  SparseAttentionKernel<<<static_cast<unsigned>(blocks), kAttnThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t CompressPool(const float* kv, const float* score, int64_t groups, int ratio,
                         int64_t dim, float* out, cudaStream_t stream) {
  if (dim <= 0 || groups <= 0) return cudaSuccess;
  CompressPoolKernel<<<GridFor(groups * dim), kThreads, 0, stream>>>(kv, score, groups, ratio, dim,
                                                                     out);
  return cudaGetLastError();
}

cudaError_t IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                          int64_t dim, float* score, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  IndexerScoresKernel<<<GridFor(n, 128), 128, 0, stream>>>(q, w, heads, keys, n, dim, score);
  return cudaGetLastError();
}

cudaError_t IndexerScoresRows(const float* q, const float* w, int heads, const float* keys,
                              int64_t n, int64_t dim, int64_t rows, const int64_t* valid,
                              float* score, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((n + 127) / 128), static_cast<unsigned>(rows));
  IndexerScoresRowsKernel<<<grid, 128, 0, stream>>>(q, w, heads, keys, n, dim, valid, score);
  return cudaGetLastError();
}

cudaError_t MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                       int64_t mask_cols, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MaskScoresKernel<<<GridFor(n), kThreads, 0, stream>>>(score, n, valid, mask, mask_cols);
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
