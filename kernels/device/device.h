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

// The backend of `spec`: the CPU reference, or MakeCudaBackend(index) (FailedPrecondition naming
// the missing device when there is no GPU; FailedPrecondition when the build has no CUDA backend).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const DeviceSpec& spec);

// Whether the model forward (model/model.cc) can run on `spec`. cpu: OK. cuda: the device must
// exist (the MakeBackend error otherwise), and even then the answer is FailedPrecondition saying
// why: the forward keeps its activations in host std::vectors, which a device backend cannot
// read, so it runs only on the CPU backend today (docs/cuda.md).
absl::Status CheckModelCanRunOn(const DeviceSpec& spec);

}  // namespace epd::kernels
