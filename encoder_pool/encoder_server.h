#pragma once

// The encoder worker's job handler: EncoderStage + the hand-off to prefill (docs/workers.md).
#include <memory>

#include "absl/status/statusor.h"
#include "services/worker/worker_runtime.h"

namespace epd::encoder_pool {

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeEncoderHandler(
    const worker::WorkerSetup& setup);

}  // namespace epd::encoder_pool
