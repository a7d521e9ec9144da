#pragma once

// Fixed-size pages ("blocks") of memory that the G1 hot tier hands out by index. One interface,
// two kinds: a host arena (always built; used without a GPU and in tests) and a device arena
// (HBM, to be added with the CUDA backend: it implements the same calls with cudaMemcpy and
// returns device pointers from BlockAddress, which the UCX transfer engine can register).
// Thread-safety: distinct blocks may be accessed concurrently; the pool serialises allocation.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epd::kvstore {

enum class ArenaKind { kHost, kDevice };

class BlockArena {
 public:
  virtual ~BlockArena() = default;
  virtual ArenaKind kind() const = 0;
  // Bytes per block (the page size), > 0.
  virtual size_t block_bytes() const = 0;
  virtual uint32_t num_blocks() const = 0;
  // Address of block `index` in the arena's memory space: a host pointer for kHost, a device
  // pointer for kDevice. Valid for the arena's lifetime; owned by the arena.
  virtual void* BlockAddress(uint32_t index) = 0;
  // Copies `src` (src.size() <= block_bytes) from host memory into the start of block `index`.
  virtual absl::Status CopyIn(uint32_t index, std::span<const uint8_t> src) = 0;
  // Copies the first dst.size() (<= block_bytes) bytes of block `index` into host memory.
  virtual absl::Status CopyOut(uint32_t index, std::span<uint8_t> dst) = 0;
};

// Host-memory arena of num_blocks x block_bytes, 64-byte aligned, allocated once, untouched until
// written (pages are committed lazily by the OS). InvalidArgument for zero sizes.
absl::StatusOr<std::unique_ptr<BlockArena>> MakeHostArena(size_t block_bytes, uint32_t num_blocks);

}  // namespace epd::kvstore
