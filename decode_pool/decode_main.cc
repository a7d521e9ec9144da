// epd-decode: the decode worker process (docs/workers.md). Besides the shared worker flags
// (runtime/worker/worker_runtime.h, incl. --dspark on|off) it takes:
//   --dspark-k N               drafts verified per step: -1 (default) = the k policy, 0..5 fixed
//   --dspark-time-model B,T,D  the policy's step time t(b,k) = B + T*b*(k+1) + D*b*[k>0]
//                              (ms). Default: the fit measured on the CPU reference backend, the
//                              backend the workers run today (docs/dspark.md); an accelerator
//                              deployment passes its own (e.g. 1,0.02,0.05: memory-bound).
//   --kv-pool-bytes N          capacity of the paged KV pool (model/kv_pool.h); requests are
//                              admitted by free blocks and preempted (swapped out) when it runs
//                              out (decode_server.cc). Default 0: sized from the backend's
//                              memory (model::DefaultKvPoolCapacity: 90 % of a device's free
//                              memory after the weights, a quarter of the host's on the CPU).
//   --kv-pool-share K          with --kv-pool-bytes 0: the default capacity divided by K, the
//                              decode workers sharing this GPU (or host); `epd serve` passes it.
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "decode_pool/decode_server.h"

namespace {

constexpr char kCpuTimeModel[] = "2.54,2.71,4.22";

bool ParseTimeModel(const std::string& v, epd::decode_pool::StepTimeModel* t) {
  std::vector<std::string> parts = absl::StrSplit(v, ',');
  double x[3];
  if (parts.size() != 3) return false;
  for (int i = 0; i < 3; ++i) {
    if (!absl::SimpleAtod(parts[i], &x[i]) || x[i] < 0) return false;
  }
  *t = {.base_s = x[0], .per_token_s = x[1], .draft_s = x[2]};
  return t->Seconds(1, 0) > 0;
}

}  // namespace

int main(int argc, char** argv) {
  epd::decode_pool::DecodeStageOptions options;
  ParseTimeModel(kCpuTimeModel, &options.time_model);
  auto add_flags = [&](CLI::App& app) {
    app.add_option("--kv-pool-bytes", options.kv_pool_bytes,
                   "Bytes of the paged KV pool the worker's sequences hold their global KV in "
                   "(admission and preemption go by it; default 0 = 90% of a GPU's free "
                   "memory after the weights, a quarter of the host's memory on the CPU)")
        ->check(CLI::NonNegativeNumber);
    app.add_option("--kv-pool-share", options.kv_pool_share,
                   "With --kv-pool-bytes 0: how many decode workers share this worker's GPU (or "
                   "host) memory; the default capacity is divided by it (default 1; epd serve "
                   "passes the count)")
        ->check(CLI::PositiveNumber);
    app.add_option("--dspark-k", options.fixed_k,
                   "DSpark drafts verified per step: -1 = chosen per step by the k policy, 0.." +
                       std::to_string(options.max_k) + " = fixed")
        ->check(CLI::Range(-1, options.max_k));
    // Parsed once, straight into the options (a bad value is a CLI error naming the flag).
    app.add_option_function<std::string>(
           "--dspark-time-model",
           [&options](const std::string& v) {
             if (!ParseTimeModel(v, &options.time_model))
               throw CLI::ValidationError("--dspark-time-model",
                                          "want B,T,D: three numbers >= 0 with B+T > 0, got " + v);
           },
           "The k policy's step time B,T,D in ms: t(b,k) = B + T*b*(k+1) + D*b*[k>0] (default: "
           "the CPU backend fit " +
               std::string(kCpuTimeModel) + ")")
        ->type_name("B,T,D");
  };
  return epd::worker::RunWorkerMain(
      argc, argv, epd::v1::POOL_DECODE,
      [&options](const epd::worker::WorkerSetup& setup) {
        return epd::decode_pool::MakeDecodeHandler(setup, options);
      },
      add_flags);
}
