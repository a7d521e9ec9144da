// epd-encoder: the encoder worker process (docs/workers.md).
#include "encoder_pool/encoder_server.h"

int main(int argc, char** argv) {
  return epd::worker::RunWorkerMain(argc, argv, epd::v1::POOL_ENCODER,
                                    epd::encoder_pool::MakeEncoderHandler);
}
