#pragma once

// The decode worker's job handler: receive prefill's hand-off (or prefill locally when the chain
// has no prefill stage), generate with DecodeStage and stream the tokens (docs/workers.md).
#include <memory>

#include "absl/status/statusor.h"
#include "services/worker/worker_runtime.h"

namespace epd::decode_pool {

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeDecodeHandler(
    const worker::WorkerSetup& setup);

}  // namespace epd::decode_pool
