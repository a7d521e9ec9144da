#include "tests/gpu/kvstore_device_arena.h"

#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace epd::kvstore {
namespace {

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

class DeviceArena final : public BlockArena {
 public:
  DeviceArena(int device, void* base, cudaStream_t stream, size_t block_bytes, uint32_t num_blocks)
      : device_(device),
        base_(static_cast<uint8_t*>(base)),
        stream_(stream),
        block_bytes_(block_bytes),
        num_blocks_(num_blocks) {}
  ~DeviceArena() override {
    cudaSetDevice(device_);
    cudaStreamDestroy(stream_);
    cudaFree(base_);
  }

  ArenaKind kind() const override { return ArenaKind::kDevice; }
  size_t block_bytes() const override { return block_bytes_; }
  uint32_t num_blocks() const override { return num_blocks_; }
  void* BlockAddress(uint32_t index) override {
    return index < num_blocks_ ? base_ + static_cast<size_t>(index) * block_bytes_ : nullptr;
  }

  absl::Status CopyIn(uint32_t index, std::span<const uint8_t> src) override {
    if (auto s = Check(index, src.size()); !s.ok()) return s;
    if (src.empty()) return absl::OkStatus();
    cudaError_t e = Copy(BlockAddress(index), src.data(), src.size(), cudaMemcpyHostToDevice);
    if (e != cudaSuccess)
      return absl::InternalError(
          absl::StrCat("device arena: copy into block ", index, ": ", CudaError(e)));
    return absl::OkStatus();
  }

  absl::Status CopyOut(uint32_t index, std::span<uint8_t> dst) override {
    if (auto s = Check(index, dst.size()); !s.ok()) return s;
    if (dst.empty()) return absl::OkStatus();
    cudaError_t e = Copy(dst.data(), BlockAddress(index), dst.size(), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess)
      return absl::InternalError(
          absl::StrCat("device arena: copy out of block ", index, ": ", CudaError(e)));
    return absl::OkStatus();
  }

 private:
  // A copy on the arena's own stream, waited for: the block's bytes are in place when CopyIn or
  // CopyOut returns, for any stream that reads them next. (A plain cudaMemcpy runs on the legacy
  // stream, which non-blocking streams such as the CUDA backend's do not wait for, and from
  // pageable memory it may return before the device holds the bytes.)
  cudaError_t Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return e;
    if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, stream_); e != cudaSuccess) return e;
    return cudaStreamSynchronize(stream_);
  }

  absl::Status Check(uint32_t index, size_t bytes) const {
    if (index >= num_blocks_)
      return absl::OutOfRangeError(
          absl::StrCat("device arena: block ", index, " of ", num_blocks_));
    if (bytes > block_bytes_)
      return absl::InvalidArgumentError(
          absl::StrCat("device arena: ", bytes, " bytes exceed the block size ", block_bytes_));
    return absl::OkStatus();
  }

  int device_;
  uint8_t* base_;
  cudaStream_t stream_;
  size_t block_bytes_;
  uint32_t num_blocks_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BlockArena>> MakeDeviceArena(size_t block_bytes, uint32_t num_blocks,
                                                            int device) {
  if (block_bytes == 0 || num_blocks == 0)
    return absl::InvalidArgumentError("device arena: block size and block count must be > 0");
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return absl::FailedPreconditionError(absl::StrCat(
        "device arena: no CUDA device (", e == cudaSuccess ? "0 devices" : CudaError(e), ")"));
  }
  if (device < 0 || device >= count)
    return absl::FailedPreconditionError(
        absl::StrCat("device arena: device ", device, " of ", count));
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return absl::FailedPreconditionError(
        absl::StrCat("device arena: cudaSetDevice(", device, "): ", CudaError(e)));
  const size_t bytes = block_bytes * static_cast<size_t>(num_blocks);
  void* base = nullptr;
  if (cudaError_t e = cudaMalloc(&base, bytes); e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("device arena: cudaMalloc of ", bytes, " bytes: ", CudaError(e)));
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    cudaFree(base);
    return absl::InternalError(absl::StrCat("device arena: cudaStreamCreate: ", CudaError(e)));
  }
  return std::unique_ptr<BlockArena>(
      new DeviceArena(device, base, stream, block_bytes, num_blocks));
}

}  // namespace epd::kvstore
