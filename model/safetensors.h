#pragma once

// Zero-copy safetensors reader: one file or a sharded checkpoint with model.safetensors.index.json.
// Files are mmapped read-only; TensorView pointers stay valid while the owning object lives.
// Thread-safety: immutable after Open(); concurrent reads are safe.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epd::model {

enum class DType { kBF16, kF16, kF32, kF8E4M3, kF8E8M0, kI8, kU8, kI32, kI64 };

std::string_view DTypeName(DType d);
int64_t DTypeSize(DType d);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // not owned; points into an mmapped file
  int64_t bytes = 0;
  std::string file;  // shard file name (for error messages)

  int64_t numel() const;
  std::string ShapeString() const;
};

// One mmapped .safetensors file.
class SafetensorsFile {
 public:
  // Parses and checks the header: size, JSON, dtypes, data offsets against the file size and
  // against shape x dtype size. Errors name the file and the tensor.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }
  int64_t file_bytes() const { return size_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  int64_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a checkpoint.
class TensorStore {
 public:
  // `path` is a .safetensors file, or a directory holding model.safetensors.index.json (+ shards)
  // or a single model.safetensors. Every shard named by the index must exist and every tensor the
  // index names must be in its shard. `progress` (may be empty) is called after each shard with
  // (shards done, shards total, bytes so far).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TensorStore>> Open(const std::string& path,
                                                                         bool log_progress = true);

  bool Has(std::string_view name) const { return index_.count(std::string(name)) > 0; }
  // NotFound naming the tensor if absent.
  [[nodiscard]] absl::StatusOr<TensorView> Get(std::string_view name) const;
  // Get + dtype + shape check; errors name the tensor, expected and actual.
  [[nodiscard]] absl::StatusOr<TensorView> Get(std::string_view name, DType dtype,
                                               const std::vector<int64_t>& shape) const;
  std::vector<std::string> Names() const;
  int64_t total_bytes() const { return total_bytes_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
  int64_t total_bytes_ = 0;
};

}  // namespace epd::model
