#pragma once

// Which backend a process runs on: `--device cpu|cuda[:N]` (epd generate, epd serve, the worker
// mains). The one place outside kernels/cuda that knows whether the CUDA backend was built.

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace epd::kernels {

struct DeviceSpec {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;                 // kCuda: the CUDA device ordinal
  std::string ToString() const;  // "cpu", "cuda:0"
};

// "cpu", "cuda" (= cuda:0) or "cuda:N"; InvalidArgument naming the text otherwise.
absl::StatusOr<DeviceSpec> ParseDeviceSpec(std::string_view text);

// True when this build holds the CUDA backend (nvcc was found at configure time).
bool CudaBackendBuilt();

// The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies; no context is opened): 0
// without a GPU, a driver or the CUDA backend.
int CudaDeviceCount();

// The backend of `spec`: the CPU reference, or MakeCudaBackend(index) (FailedPrecondition naming
// the missing device when there is no GPU; FailedPrecondition when the build has no CUDA backend).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const DeviceSpec& spec);

// Whether the model forward (model/model.cc) can run on `spec`, checked before any port, file or
// model is opened, by a process that does not run the model itself (`epd serve`; a process that
// does makes its backend with MakeBackend at that point instead). cpu: OK. cuda: the CUDA backend
// must open on the device (the MakeBackend error otherwise: no GPU, no driver, an index past the
// last device, a build without CUDA). The check's context on the device is released afterwards
// (cuda::ReleaseDevice), so the checking process keeps no GPU memory; a process that also runs
// CUDA work on that device must not call it.
absl::Status CheckModelCanRunOn(const DeviceSpec& spec);

// Whether a model on `spec` loads its weights into the backend's memory (ModelWeights::Load's
// backend argument): a device backend cannot read host weights; the CPU backend reads them in
// place from the checkpoint's mapping (no copy).
bool WeightsInBackend(const DeviceSpec& spec);

// OK while `backend`'s device can run work. A GPU whose context a fault has made unusable (an
// illegal address in a kernel, an uncorrectable ECC error; kernels/cuda/cuda_backend.h,
// CudaDeviceLost): the first such error. Nothing in the process can use that GPU again, so a
// process that sees it exits and is restarted. The CPU backend is never lost.
absl::Status DeviceLost(const Backend& backend);

}  // namespace epd::kernels
