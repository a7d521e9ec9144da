#pragma once

// The encoder worker's job handler: EncoderStage + the hand-off to prefill (docs/workers.md).
#include <memory>

#include "absl/status/statusor.h"
#include "runtime/worker/worker_runtime.h"

namespace epd::encoder_pool {

struct EncoderOptions {
  // --handoff-streaming on|off: send each finished layer group of the hand-off while the next
  // layers run (worker::HandoffStreamSender), or the whole hand-off once the pass ended. The
  // prefill worker accepts both (HandoffPeer::ReceiveStreamable).
  bool handoff_streaming = true;
};

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeEncoderHandler(
    const worker::WorkerSetup& setup, const EncoderOptions& options = {});

}  // namespace epd::encoder_pool
