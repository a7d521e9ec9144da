// epd-prefill: the prefill worker process (docs/workers.md).
#include "prefill_pool/prefill_server.h"

int main(int argc, char** argv) {
  return epd::worker::RunWorkerMain(argc, argv, epd::v1::POOL_PREFILL,
                                    epd::prefill_pool::MakePrefillHandler);
}
