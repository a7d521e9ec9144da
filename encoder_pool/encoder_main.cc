// epd-encoder: the encoder worker process (docs/workers.md).
#include <CLI/CLI.hpp>
#include <string>

#include "encoder_pool/encoder_server.h"

int main(int argc, char** argv) {
  std::string streaming = "on";
  auto add_flags = [&](CLI::App& app) {
    app.add_option("--handoff-streaming", streaming,
                   "Layer-streamed hand-off to prefill: on (each finished layer group is sent "
                   "while the next layers run; default) or off (the whole hand-off after the "
                   "pass). Prefill accepts both (docs/transfer.md)")
        ->check(CLI::IsMember({"on", "off"}));
  };
  auto factory = [&](const epd::worker::WorkerSetup& setup) {
    epd::encoder_pool::EncoderOptions options;
    options.handoff_streaming = streaming == "on";
    return epd::encoder_pool::MakeEncoderHandler(setup, options);
  };
  return epd::worker::RunWorkerMain(argc, argv, epd::v1::POOL_ENCODER, factory, add_flags);
}
