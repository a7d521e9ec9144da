#pragma once

// CUDA-free header: host code includes it without nvcc.
#include <string>

namespace epd::kernels::cuda {

// Number of usable CUDA devices. Returns 0 and sets *why when there is no driver or no GPU.
int DeviceCount(std::string* why);

// Name and compute capability of device 0, e.g. "NVIDIA H200 (sm_90)"; empty without a GPU.
std::string DeviceSummary();

// Destroys this process's context on `device` (cudaDeviceReset), freeing the GPU memory it held.
// Only for a process that is done with the device: every allocation, stream and graph of it
// becomes invalid (`epd serve`'s device check, which runs no model itself).
void ReleaseDevice(int device);

}  // namespace epd::kernels::cuda
