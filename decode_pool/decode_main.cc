// epd-decode: the decode worker process (docs/workers.md).
#include "decode_pool/decode_server.h"

int main(int argc, char** argv) {
  return epd::worker::RunWorkerMain(argc, argv, epd::v1::POOL_DECODE,
                                    epd::decode_pool::MakeDecodeHandler);
}
