#pragma once

// The decode worker's job handler: receive prefill's hand-off (or prefill locally when the chain
// has no prefill stage), generate with DecodeStage and stream the tokens (docs/workers.md).
#include <memory>

#include "absl/status/statusor.h"
#include "decode_pool/decode_stage.h"
#include "runtime/worker/worker_runtime.h"

namespace epd::decode_pool {

// DSpark draft + verify runs when setup.dspark (options.dspark is overridden by it); the other
// DSpark options (fixed k, the policy's time model) come from `options`.
absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeDecodeHandler(
    const worker::WorkerSetup& setup, DecodeStageOptions options = {});

}  // namespace epd::decode_pool
