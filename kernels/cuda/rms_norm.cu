#include <cuda_runtime.h>

#include "kernels/cuda/rms_norm.h"

namespace epd::kernels::cuda {
namespace {

// One block per row; a fixed-order tree reduction keeps the result independent of other rows.
__global__ void RmsNormKernel(const float* x, const float* w, float* y, int64_t dim, float eps) {
  extern __shared__ float partial[];
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) acc += xr[i] * xr[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float inv = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

bool Check(cudaError_t rc, std::string* error) {
  if (rc == cudaSuccess) return true;
  if (error) *error = cudaGetErrorString(rc);
  return false;
}

}  // namespace

bool RmsNormF32Host(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps,
                    std::string* error) {
  if (rows <= 0 || dim <= 0) return true;  // nothing to do (a grid of 0 blocks is an error)
  float *dx = nullptr, *dw = nullptr, *dy = nullptr;
  const size_t n = static_cast<size_t>(rows * dim) * sizeof(float);
  bool ok = Check(cudaMalloc(&dx, n), error) && Check(cudaMalloc(&dy, n), error) &&
            Check(cudaMalloc(&dw, dim * sizeof(float)), error) &&
            Check(cudaMemcpy(dx, x, n, cudaMemcpyHostToDevice), error) &&
            Check(cudaMemcpy(dw, w, dim * sizeof(float), cudaMemcpyHostToDevice), error);
  if (ok) {
    constexpr int kThreads = 256;
    RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, kThreads * sizeof(float)>>>(dx, dw, dy,
                                                                                       dim, eps);
    ok = Check(cudaGetLastError(), error) && Check(cudaDeviceSynchronize(), error) &&
         Check(cudaMemcpy(y, dy, n, cudaMemcpyDeviceToHost), error);
  }
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
  return ok;
}

}  // namespace epd::kernels::cuda
