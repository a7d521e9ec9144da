#pragma once

// The G1 hot tier's device arena (kvstore/block_arena.h, ArenaKind::kDevice): one cudaMalloc'd
// region of num_blocks x block_bytes in HBM, handed out by block index. BlockAddress returns a
// device pointer (what the UCX transfer engine registers for RMA on a GPU host); CopyIn/CopyOut
// move bytes between host memory and a block on the arena's own non-blocking stream and wait for
// the copy, so the bytes are in place for any stream when they return.
//
// CUDA-free header (host code includes it without nvcc); built only when the CUDA toolkit is
// found (EPD_WITH_CUDA), linked against the CUDA runtime only, never the driver stub.
// Thread-safety: as BlockArena (distinct blocks concurrently).
//
// Test tree only (issue 48): no worker or daemon uses a device arena yet (the daemon's G1 hot tier
// is a host arena), so no production target builds it; it lives beside its tests
// (kvstore_device_arena_test.cc, on a GPU and on the emulated device, tests/gpu/CMakeLists.txt).
// When a worker takes its G1 blocks from HBM, it moves back under kvstore/ as a production library.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kvstore/block_arena.h"

namespace epd::kvstore {

// FailedPrecondition naming the cause when there is no driver or no device `device` (so a caller
// falls back to MakeHostArena); ResourceExhausted when HBM cannot hold the arena; InvalidArgument
// for zero sizes.
absl::StatusOr<std::unique_ptr<BlockArena>> MakeDeviceArena(size_t block_bytes, uint32_t num_blocks,
                                                            int device = 0);

}  // namespace epd::kvstore
