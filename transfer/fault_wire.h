#pragma once

// A Wire decorator that injects failures on the sending side: drop, delay, truncate or corrupt a
// chosen message, or disconnect when it is sent. Used by the tests to show that every failure
// ends in a clean error on both sides within the deadline, with every buffer released.
#include <memory>

#include "absl/time/time.h"
#include "transfer/wire.h"

namespace epd::transfer {

struct FaultPlan {
  enum class Action { kNone, kDrop, kDelay, kTruncate, kCorrupt, kDisconnect };
  enum class Target { kData, kControl };
  Action action = Action::kNone;
  Target target = Target::kData;
  int nth = 0;  // which matching message (0-based); -1 = every one
  absl::Duration delay = absl::Milliseconds(100);  // kDelay
  // kDelay: successive delayed messages leave at least `delay` apart (a slow link), instead of
  // each being held `delay` from when it was sent.
  bool spaced = false;
  uint64_t truncate_bytes = 1;  // kTruncate: bytes cut from the end of the chunk
  uint64_t corrupt_offset = 0;  // kCorrupt: byte flipped within the chunk (clamped)
};

// Thread-safe. `inner` is started/stopped by this wire.
std::unique_ptr<Wire> MakeFaultWire(std::unique_ptr<Wire> inner, FaultPlan plan);

}  // namespace epd::transfer
