// MoE routing of CudaBackend: MoeRoute (each row's experts and weights) and MoeGroup (each
// expert's list of rows, built on the device). Mirrors kernels/cpu (cpu_backend.cc MoeRoute /
// MoeGroup): the same experts and lists for the same inputs; the weights in the reference's order,
// their softplus through common.cuh's ExpF / Log1pF.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace epd::kernels::cuda {
namespace {

using codec::IsNan;

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

}  // namespace

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

}  // namespace epd::kernels::cuda
