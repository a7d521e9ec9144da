#include <cuda_runtime.h>

#include "kernels/cuda/cuda_device.h"

namespace epd::kernels::cuda {

int DeviceCount(std::string* why) {
  int count = 0;  // cudaGetDeviceCount leaves it unwritten when the driver is missing.
  cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    if (why) *why = cudaGetErrorString(rc);
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  if (count == 0 && why) *why = "no CUDA device";
  return count;
}

void ReleaseDevice(int device) {
  // No device is made current again afterwards: since CUDA 12 that would open a context anew.
  if (cudaSetDevice(device) == cudaSuccess) cudaDeviceReset();
  cudaGetLastError();
}

std::string DeviceSummary() {
  if (DeviceCount(nullptr) == 0) return "";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "";
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major * 10 + prop.minor) + ")";
}

}  // namespace epd::kernels::cuda
