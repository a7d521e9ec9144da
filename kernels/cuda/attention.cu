// Attention-side ops of CudaBackend: sparse attention with sink, compressor pooling, indexer
// scores, score masking. Mirrors kernels/cpu/ops.cc (SparseAttention, IndexerScores) and
// kernels/cpu/cpu_backend.cc (CompressPool, MaskScores).
#include <array>
#include <atomic>
#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/row_codec.h"
#include "kernels/torch_math.h"

namespace epd::kernels::cuda {
namespace {

using codec::RoundBf16;
using codec::StdMax;
using torch_math::DotDpFrom;
using torch_math::TorchExp;
using torch_math::TorchSum;

constexpr int kChunkLen = 64;  // the reference's chunk of list entries
constexpr int kMaxGroup = 4;   // heads per thread block
constexpr int kTileDims = 64;  // dims of a chunk's KV rows in shared memory when all do not fit
constexpr int kAttnThreads = kMaxGroup * kChunkLen;
// SparseAttentionKernel's static shared memory (p, pe, pb, tj and the per-head scalars): with the
// dynamic part above 48 KiB in all, the launch must opt in.
constexpr size_t kAttnStaticSmem =
    sizeof(float) * (3 * kMaxGroup * kChunkLen + 4 * kMaxGroup) + sizeof(int32_t) * kChunkLen;

__device__ __forceinline__ const float* KvRow(const AttentionArgs& a, int32_t t) {
  return t >= a.kv_ext_start ? a.kv_ext + (t - a.kv_ext_start) * a.head_dim
                             : a.kv + static_cast<int64_t>(t) * a.head_dim;
}

// Dims d0 .. d0 + nd of the chunk's listed KV rows into tile (row j at j * stride: entry j; 0 for
// a skipped or absent entry). Consecutive threads read consecutive dims of a row.
__device__ __forceinline__ void LoadKvTile(const AttentionArgs& a, const int32_t* tj, int n, int d0,
                                           int nd, float* tile, int stride) {
#pragma unroll 4
  for (int e = threadIdx.x; e < kChunkLen * nd; e += blockDim.x) {
    const int j = e / nd, i = e % nd;
    const int32_t t = tj[j];
    tile[j * stride + i] = (j < n && t >= 0) ? KvRow(a, t)[d0 + i] : 0.f;
  }
}

// ops.cc SparseAttention, one thread block of 256 threads per (row, group of G <= 4 heads), in
// the reference's operation order (kernels/torch_math.h). Per chunk of 64 list entries, whose KV
// rows pass through shared memory td dims at a time (td = head_dim, the whole rows, when they fit
// the device's shared memory, else kTileDims; loaded by every thread of the block, read once per
// tile and shared by its heads):
// 1. thread (g, j) = (tid / 64, tid % 64), g < G: p = DotSeq(q_g, kv_t) * scale, the dot running
//    in index order across the tiles.
// 2. thread g: cmax, m_new, alpha = TorchExp(m - m_new); threads (g, j): e_j = TorchExp(p_j -
//    m_new) (0 for a skipped entry) and its bf16; thread g: den = den * alpha + TorchSum(e_0..).
// 3. for each of a head's dims: the chunk's sum cs = bf16(e_j) * kv_t[d] added in entry order
//    from +0, then num[d] = num[d] * alpha + cs (the reference forms the chunk's sum first).
// Finally den += TorchExp(sink - m) and out = bf16(num / den). Online softmax starts from
// m = -1e30. Dynamic shared memory: q and num of the block's heads ([G][head_dim] each), then the
// tile ([64][td + 1]: padded rows, so the threads of a dot read different banks).
__global__ void __launch_bounds__(kAttnThreads)
    SparseAttentionKernel(AttentionArgs a, int G, int groups_per_row, int td) {
  extern __shared__ float smem[];
  const int hd = a.head_dim, stride = td + 1;
  float* qs = smem;                 // [G][hd]
  float* num = smem + G * hd;       // [G][hd]
  float* tile = smem + 2 * G * hd;  // [kChunkLen][stride]
  __shared__ float p[kMaxGroup][kChunkLen], pe[kMaxGroup][kChunkLen], pb[kMaxGroup][kChunkLen];
  __shared__ int32_t tj[kChunkLen];
  __shared__ float m_s[kMaxGroup], mnew_s[kMaxGroup], alpha_s[kMaxGroup], den_s[kMaxGroup];
  const int64_t r = blockIdx.x / groups_per_row;
  const int h0 = static_cast<int>(blockIdx.x % groups_per_row) * G;
  const int gh = a.heads - h0 < G ? a.heads - h0 : G;  // heads of this block
  const int tid = threadIdx.x, nt = blockDim.x;
  const int g = tid / kChunkLen, j = tid % kChunkLen;  // this thread's head and entry
  const float* q = a.q + (r * a.heads + h0) * hd;
  for (int e = tid; e < G * hd; e += nt) {
    qs[e] = e < gh * hd ? q[e] : 0.f;
    num[e] = 0.f;
  }
  if (tid < G) {
    m_s[tid] = -1e30f;
    den_s[tid] = 0.f;
  }
  const int32_t* idx = a.idx + r * a.list_len;
  for (int64_t c0 = 0; c0 < a.list_len; c0 += kChunkLen) {
    const int n = static_cast<int>(a.list_len - c0 < kChunkLen ? a.list_len - c0 : kChunkLen);
    __syncthreads();  // the previous chunk is done with tj and the tile
    if (tid < kChunkLen) tj[tid] = tid < n ? idx[c0 + tid] : -1;
    __syncthreads();
    const bool scored = g < gh && j < n;
    const bool listed = scored && tj[j] >= 0;
    float dot = 0.f;
    for (int d0 = 0; d0 < hd; d0 += td) {
      const int nd = hd - d0 < td ? hd - d0 : td;
      if (d0 > 0) __syncthreads();  // every thread is done with the previous tile
      LoadKvTile(a, tj, n, d0, nd, tile, stride);
      __syncthreads();
      if (listed) {
        const float* qg = qs + g * hd + d0;
        const float* kt = tile + j * stride;
        for (int i = 0; i < nd; ++i) dot += qg[i] * kt[i];
      }
    }
    if (scored) p[g][j] = listed ? dot * a.scale : -INFINITY;
    __syncthreads();
    if (tid < gh) {
      float cmax = -INFINITY;
      for (int jj = 0; jj < n; ++jj) {
        if (tj[jj] >= 0) cmax = StdMax(cmax, p[tid][jj]);
      }
      const float m_new = StdMax(m_s[tid], cmax);
      alpha_s[tid] = TorchExp(m_s[tid] - m_new);
      mnew_s[tid] = m_new;
    }
    __syncthreads();
    if (scored) {
      const float e = listed ? TorchExp(p[g][j] - mnew_s[g]) : 0.f;
      pe[g][j] = e;
      pb[g][j] = RoundBf16(e);
    }
    __syncthreads();
    if (tid < gh) {
      den_s[tid] = den_s[tid] * alpha_s[tid] + TorchSum(pe[tid], n);
      m_s[tid] = mnew_s[tid];
    }
    for (int d0 = 0; d0 < hd; d0 += td) {
      const int nd = hd - d0 < td ? hd - d0 : td;
      if (hd > td) {  // else the tile still holds the chunk's rows
        if (d0 > 0) __syncthreads();
        LoadKvTile(a, tj, n, d0, nd, tile, stride);
        __syncthreads();
      }
      for (int e = tid; e < gh * nd; e += nt) {
        const int gg = e / nd, dl = e % nd;
        float* nm = num + gg * hd + d0 + dl;
        float cs = 0.f;  // the chunk's sum first, then onto the rescaled numerator
        for (int jj = 0; jj < n; ++jj) {
          if (tj[jj] < 0) continue;
          cs += pb[gg][jj] * tile[jj * stride + dl];
        }
        *nm = *nm * alpha_s[gg] + cs;
      }
    }
  }
  __syncthreads();
  if (tid < gh) den_s[tid] += TorchExp(a.sink[h0 + tid] - m_s[tid]);
  __syncthreads();
  float* out = a.out + (r * a.heads + h0) * hd;
  for (int e = tid; e < gh * hd; e += nt) out[e] = RoundBf16(num[e] / den_s[e / hd]);
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

// Where IndexerScoresKernel's keys are: an array [n, dim] (keys), else per query row r a paged
// stream of packed rows (page table tables[r], rows_per_page[r] rows a page) whose row t is key
// t, decoded as UnpackRows decodes it.
struct IndexKeys {
  const float* keys = nullptr;
  RowCodec codec = RowCodec::kF32;
  const uint8_t* const* const* tables = nullptr;
  const int64_t* rows_per_page = nullptr;
  int64_t row_bytes = 0;
};

// ops.cc IndexerScores over a tile of 32 keys, for query row blockIdx.y (q [rows, heads, dim],
// w [rows, heads]): the keys pass through shared memory once, td dims at a time (td even; td ==
// dim when a whole key row fits); thread (lane, warp) carries the running dot DotDp(q_h, k_t)
// of key t0 + lane for heads h = warp, warp + 8, ... from tile to tile (the pairs stay in order:
// a tile starts at an even dim), then forms the term bf16(max(bf16(dot), 0) * w[h]); then thread
// t sums its key's terms over the heads in order from +0 and rounds to bf16.
// valid: null (every key), or [rows]: keys at or past valid[r] score -inf.
constexpr int kIndexKeys = 32, kIndexThreads = 256;

__global__ void __launch_bounds__(kIndexThreads)
    IndexerScoresKernel(const float* q, const float* w, int heads, IndexKeys keys, int64_t n,
                        int64_t dim, int64_t td, const int64_t* valid, float* score) {
  extern __shared__ float smem[];
  const int64_t stride = td + 1;              // a padded row: lanes read different banks
  float* kt = smem;                           // [kIndexKeys][td + 1]
  float* terms = smem + kIndexKeys * stride;  // [heads][kIndexKeys]: dots, then terms
  const int64_t r = blockIdx.y, t0 = static_cast<int64_t>(blockIdx.x) * kIndexKeys;
  const int64_t nv = valid != nullptr && valid[r] < n ? valid[r] : n;  // never past the keys
  const float* qr = q + r * heads * dim;
  const float* wr = w + r * heads;
  const int tid = threadIdx.x, lane = tid % kIndexKeys, warp = tid / kIndexKeys;
  constexpr int kWarps = kIndexThreads / kIndexKeys;
  // Paged keys: each of the tile's key rows is found once (its page and offset: two 64-bit
  // divisions and two dependent loads), not once per element.
  __shared__ const uint8_t* key_row[kIndexKeys];
  if (keys.keys == nullptr && tid < kIndexKeys) {
    const int64_t t = t0 + tid;
    const uint8_t* at = nullptr;
    if (t < nv) at = row_codec::PagedRow(keys.tables[r], keys.rows_per_page[r], t, keys.row_bytes);
    key_row[tid] = at;
  }
  // Each thread's running dots start at +0, the empty dot (what a dim of 0 leaves them).
  for (int h = warp; h < heads; h += kWarps) terms[h * kIndexKeys + lane] = 0.f;
  __syncthreads();
  for (int64_t d0 = 0; d0 < dim; d0 += td) {
    const int64_t len = dim - d0 < td ? dim - d0 : td;
    // Warp w fills key rows w, w + 8, ...; its lanes take consecutive elements (coalesced reads,
    // one bank each in the padded rows).
    for (int j = warp; j < kIndexKeys; j += kWarps) {
      const int64_t t = t0 + j;
      for (int64_t i = lane; i < len; i += kIndexKeys) {
        float v = 0.f;
        if (t < nv) {
          v = keys.keys != nullptr ? keys.keys[t * dim + d0 + i]
                                   : row_codec::UnpackElement(keys.codec, key_row[j], dim, d0 + i);
        }
        kt[j * stride + i] = v;
      }
    }
    __syncthreads();
    if (t0 + lane < nv) {
      for (int h = warp; h < heads; h += kWarps) {
        float* dot = terms + h * kIndexKeys + lane;
        *dot = DotDpFrom(qr + h * dim + d0, kt + lane * stride, 0, len, *dot);
      }
    }
    __syncthreads();  // the tile is read before the next one overwrites it
  }
  if (t0 + lane < nv) {
    for (int h = warp; h < heads; h += kWarps) {
      float* term = terms + h * kIndexKeys + lane;
      *term = RoundBf16(StdMax(RoundBf16(*term), 0.f) * wr[h]);
    }
  }
  __syncthreads();
  const int64_t t = t0 + tid;
  if (tid >= kIndexKeys || t >= n) return;
  if (t >= nv) {
    score[r * n + t] = -INFINITY;
    return;
  }
  float acc = 0.f;
  for (int h = 0; h < heads; ++h) acc += terms[h * kIndexKeys + tid];
  score[r * n + t] = RoundBf16(acc);
}

// Lets `kernel` take `dynamic` bytes of dynamic shared memory beside its `fixed` static bytes:
// past 48 KiB in all, a launch must opt in. The allowance (per device) only grows, so a smaller
// launch never lowers it under a larger one recorded in a graph before; the read and the raise
// are one step for all threads.
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel* kernel, size_t dynamic, size_t fixed) {
  if (dynamic + fixed <= 48 * 1024) return cudaSuccess;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  cudaFuncAttributes attr{};
  if (cudaError_t rc = cudaFuncGetAttributes(&attr, kernel); rc != cudaSuccess) return rc;
  if (static_cast<size_t>(attr.maxDynamicSharedSizeBytes) >= dynamic) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(dynamic));
}

// The current device's opt-in shared memory per block, asked once per device.
cudaError_t SharedMemoryOptin(int* optin) {
  static std::array<std::atomic<int>, 64> known{};  // 0: not asked yet
  int device = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc != cudaSuccess) return rc;
  const bool cached = device >= 0 && device < static_cast<int>(known.size());
  if (cached && (*optin = known[device].load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  rc = cudaDeviceGetAttribute(optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (rc == cudaSuccess && cached) known[device].store(*optin, std::memory_order_relaxed);
  return rc;
}

cudaError_t LaunchIndexerScores(const float* q, const float* w, int heads, const IndexKeys& keys,
                                int64_t n, int64_t dim, int64_t rows, const int64_t* valid,
                                float* score, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  int optin = 0;
  if (cudaError_t rc = SharedMemoryOptin(&optin); rc != cudaSuccess) return rc;
  // The dynamic shared memory of a tile of td dims, beside the static key_row table.
  constexpr int64_t kFixed = kIndexKeys * sizeof(void*);
  auto dynamic = [heads](int64_t td) {
    return (kIndexKeys * (td + 1) + static_cast<int64_t>(heads) * kIndexKeys) *
           static_cast<int64_t>(sizeof(float));
  };
  // Whole key rows where they fit (the release's dim of 128 at 64 heads: 24 KiB); else the
  // widest tile of a multiple of 32 dims that fits (above about 1,750 dims at 64 heads).
  int64_t td = dim;
  if (dynamic(td) + kFixed > optin) {
    const int64_t floats = (optin - kFixed) / static_cast<int64_t>(sizeof(float));
    td = (floats - static_cast<int64_t>(heads) * kIndexKeys) / kIndexKeys - 1;
    td -= td % kIndexKeys;
    if (td <= 0) return cudaErrorInvalidValue;  // the heads' terms alone exceed shared memory
  }
  const size_t smem = static_cast<size_t>(dynamic(td));
  if (cudaError_t rc = AllowSharedMemory(IndexerScoresKernel, smem, kFixed); rc != cudaSuccess)
    return rc;
  const dim3 grid(static_cast<unsigned>((n + kIndexKeys - 1) / kIndexKeys),
                  static_cast<unsigned>(rows));
  IndexerScoresKernel<<<grid, kIndexThreads, smem, stream>>>(q, w, heads, keys, n, dim, td, valid,
                                                             score);
  return cudaGetLastError();
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
  if (a.rows == 0 || a.heads == 0) return cudaSuccess;
  int optin = 0;
  cudaError_t rc = SharedMemoryOptin(&optin);
  if (rc != cudaSuccess) return rc;
  const int64_t hd = a.head_dim;
  // Dynamic shared memory of G heads with a tile of td dims.
  auto dynamic = [hd](int G, int64_t td) {
    return (2 * G * hd + kChunkLen * (td + 1)) * static_cast<int64_t>(sizeof(float));
  };
  auto fits = [&](int G, int64_t td) {
    return dynamic(G, td) + static_cast<int64_t>(kAttnStaticSmem) <= optin;
  };
  // Heads per block: enough blocks to fill the GPU first (a decode row of 64 heads: 64 blocks),
  // then 4 heads sharing each KV tile; fewer when q and num of G heads do not fit.
  const int64_t row_heads = a.rows * a.heads;
  int G = row_heads >= 1024 ? 4 : row_heads >= 512 ? 2 : 1;
  while (G > 1 && !fits(G, kTileDims)) G /= 2;
  if (!fits(G, kTileDims)) return cudaErrorInvalidValue;  // head_dim past the shared memory
  // The whole rows of a chunk at once when they fit (release: 64 x 513 floats, 131 KiB): one load
  // and two barriers per chunk instead of two per 64 dims in each pass.
  const int64_t td = fits(G, hd) ? hd : kTileDims;
  const int groups_per_row = (a.heads + G - 1) / G;
  const int64_t blocks = a.rows * groups_per_row;
  const size_t smem = static_cast<size_t>(dynamic(G, td));
  rc = AllowSharedMemory(SparseAttentionKernel, smem, kAttnStaticSmem);
  if (rc != cudaSuccess) return rc;
  SparseAttentionKernel<<<static_cast<unsigned>(blocks), kAttnThreads, smem, stream>>>(
      a, G, groups_per_row, static_cast<int>(td));
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
  return LaunchIndexerScores(q, w, heads, IndexKeys{.keys = keys}, n, dim, 1, nullptr, score,
                             stream);
}

cudaError_t IndexerScoresRows(const float* q, const float* w, int heads, const float* keys,
                              int64_t n, int64_t dim, int64_t rows, const int64_t* valid,
                              float* score, cudaStream_t stream) {
  return LaunchIndexerScores(q, w, heads, IndexKeys{.keys = keys}, n, dim, rows, valid, score,
                             stream);
}

cudaError_t IndexerScoresPaged(const float* q, const float* w, int heads, RowCodec codec,
                               const uint8_t* const* const* tables, const int64_t* rows_per_page,
                               const int64_t* valid, int64_t n, int64_t dim, int64_t rows,
                               float* score, cudaStream_t stream) {
  const IndexKeys keys{.codec = codec,
                       .tables = tables,
                       .rows_per_page = rows_per_page,
                       .row_bytes = row_codec::RowBytes(codec, dim)};
  return LaunchIndexerScores(q, w, heads, keys, n, dim, rows, valid, score, stream);
}

cudaError_t MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                       int64_t mask_cols, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MaskScoresKernel<<<GridFor(n), kThreads, 0, stream>>>(score, n, valid, mask, mask_cols);
  return cudaGetLastError();
}

}  // namespace epd::kernels::cuda
