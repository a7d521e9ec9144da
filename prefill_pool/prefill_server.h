#pragma once

// The prefill worker's job handler: receive the encoder's hand-off, PrefillStage, hand the whole
// sequence state to decode (docs/workers.md).
#include <memory>

#include "absl/status/statusor.h"
#include "runtime/worker/worker_runtime.h"

namespace epd::prefill_pool {

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakePrefillHandler(
    const worker::WorkerSetup& setup);

}  // namespace epd::prefill_pool
