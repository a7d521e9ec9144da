#include "kernels/device/device.h"

#include <charconv>

#include "absl/strings/str_cat.h"

#if defined(EPD_HAVE_CUDA)
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_device.h"
#endif

namespace epd::kernels {

std::string DeviceSpec::ToString() const {
  return kind == Kind::kCpu ? std::string("cpu") : absl::StrCat("cuda:", index);
}

absl::StatusOr<DeviceSpec> ParseDeviceSpec(std::string_view text) {
  DeviceSpec spec;
  if (text == "cpu") return spec;
  if (text == "cuda") {
    spec.kind = DeviceSpec::Kind::kCuda;
    return spec;
  }
  if (text.substr(0, 5) == "cuda:" && text.size() > 5) {
    const std::string_view n = text.substr(5);
    int index = -1;
    auto [ptr, ec] = std::from_chars(n.data(), n.data() + n.size(), index);
    if (ec == std::errc() && ptr == n.data() + n.size() && index >= 0) {
      spec.kind = DeviceSpec::Kind::kCuda;
      spec.index = index;
      return spec;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device ", std::string(text), ": expected cpu, cuda or cuda:N (N >= 0)"));
}

bool CudaBackendBuilt() {
#if defined(EPD_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const DeviceSpec& spec) {
  if (spec.kind == DeviceSpec::Kind::kCpu) return MakeCpuBackend();
#if defined(EPD_HAVE_CUDA)
  return MakeCudaBackend(spec.index);
#else
  return absl::FailedPreconditionError(
      absl::StrCat(spec.ToString(),
                   " is not available: this epd build has no CUDA backend (nvcc was not found "
                   "when it was configured, or CUDA was disabled)"));
#endif
}

int CudaDeviceCount() {
#if defined(EPD_HAVE_CUDA)
  return cuda::DeviceCount(nullptr);
#else
  return 0;
#endif
}

absl::Status CheckModelCanRunOn(const DeviceSpec& spec) {
  if (spec.kind == DeviceSpec::Kind::kCpu) return absl::OkStatus();
  absl::Status status = MakeBackend(spec).status();  // the backend is gone at the semicolon
#if defined(EPD_HAVE_CUDA)
  if (status.ok()) cuda::ReleaseDevice(spec.index);
#endif
  return status;
}

bool WeightsInBackend(const DeviceSpec& spec) { return spec.kind != DeviceSpec::Kind::kCpu; }

absl::Status DeviceLost(const Backend& backend) {
#if defined(EPD_HAVE_CUDA)
  return CudaDeviceLost(backend);
#else
  (void)backend;
  return absl::OkStatus();
#endif
}

}  // namespace epd::kernels
