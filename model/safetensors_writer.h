#pragma once

// Writes safetensors files (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}} padded
// with spaces to a multiple of 8, then the tensor bytes. Tensors are laid out in name order
// (as the golden generator does), so the same tensors give the same bytes.
//
// Thread-safety: not thread-safe; one writer per file.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epd::model {

// Bytes per element of a safetensors dtype ("BF16" 2, "F32" 4, "F8_E4M3" 1, "F8_E8M0" 1, "I8" 1,
// ...); error for an unknown dtype.
absl::StatusOr<size_t> SafetensorsDtypeSize(const std::string& dtype);

class SafetensorsWriter {
 public:
  // Adds a tensor; `data` holds the raw little-endian bytes (size must equal
  // prod(shape) * dtype size). Errors: duplicate name, unknown dtype, size mismatch.
  absl::Status Add(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                   std::string data);

  // Writes the file (via a temporary file renamed into place).
  absl::Status Write(const std::string& path,
                     const std::map<std::string, std::string>& metadata = {{"format", "pt"}}) const;

  size_t num_tensors() const { return tensors_.size(); }
  uint64_t data_bytes() const { return data_bytes_; }
  std::vector<std::string> names() const;

 private:
  struct Tensor {
    std::string dtype;
    std::vector<int64_t> shape;
    std::string data;
  };
  std::map<std::string, Tensor> tensors_;
  uint64_t data_bytes_ = 0;
};

// Writes `model.safetensors.index.json`: {"metadata": {"total_size": total_size},
// "weight_map": {tensor name: shard file name}}.
absl::Status WriteSafetensorsIndex(const std::string& path, uint64_t total_size,
                                   const std::map<std::string, std::string>& weight_map);

}  // namespace epd::model
