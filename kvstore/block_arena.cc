#include "kvstore/block_arena.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace epd::kvstore {
namespace {

class HostArena final : public BlockArena {
 public:
  HostArena(uint8_t* base, size_t block_bytes, uint32_t num_blocks)
      : base_(base), block_bytes_(block_bytes), num_blocks_(num_blocks) {}
  ~HostArena() override { std::free(base_); }

  ArenaKind kind() const override { return ArenaKind::kHost; }
  size_t block_bytes() const override { return block_bytes_; }
  uint32_t num_blocks() const override { return num_blocks_; }
  void* BlockAddress(uint32_t index) override { return base_ + index * block_bytes_; }

  absl::Status CopyIn(uint32_t index, std::span<const uint8_t> src) override {
    if (index >= num_blocks_ || src.size() > block_bytes_) {
      return absl::OutOfRangeError(
          absl::StrCat("host arena: block ", index, " / ", src.size(), " bytes out of range"));
    }
    if (!src.empty()) std::memcpy(BlockAddress(index), src.data(), src.size());
    return absl::OkStatus();
  }

  absl::Status CopyOut(uint32_t index, std::span<uint8_t> dst) override {
    if (index >= num_blocks_ || dst.size() > block_bytes_) {
      return absl::OutOfRangeError(
          absl::StrCat("host arena: block ", index, " / ", dst.size(), " bytes out of range"));
    }
    if (!dst.empty()) std::memcpy(dst.data(), BlockAddress(index), dst.size());
    return absl::OkStatus();
  }

 private:
  uint8_t* base_;
  size_t block_bytes_;
  uint32_t num_blocks_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BlockArena>> MakeHostArena(size_t block_bytes, uint32_t num_blocks) {
  if (block_bytes == 0 || num_blocks == 0) {
    return absl::InvalidArgumentError(absl::StrCat("host arena needs block_bytes > 0 and ",
                                                   "num_blocks > 0, got ", block_bytes, " x ",
                                                   num_blocks));
  }
  const size_t total = block_bytes * num_blocks;
  const size_t rounded = (total + 63) / 64 * 64;
  void* base = std::aligned_alloc(64, rounded);
  if (base == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host arena: cannot allocate ", total, " bytes"));
  }
  return std::unique_ptr<BlockArena>(
      new HostArena(static_cast<uint8_t*>(base), block_bytes, num_blocks));
}

}  // namespace epd::kvstore
