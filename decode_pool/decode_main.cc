// epd-decode: the decode worker process (docs/workers.md).
//
// Decode-only flags, taken out of argv before the shared worker flags are parsed:
//   --dspark-k N             drafts verified per step: -1 (default) = the k policy, 0..5 fixed
//   --dspark-time-model B,T,D  the policy's step time t(b,k) = B + T*b*(k+1) + D*b*[k>0]
//                            (relative units; default 1,0.02,0.05: a memory-bound accelerator)
// (--dspark on|off is a shared worker flag.)
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "decode_pool/decode_server.h"

namespace {

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
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    std::string name, value;
    if (a == "--dspark-k" || a == "--dspark-time-model") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "epd-decode: %s needs a value\n", a.c_str());
        return 1;
      }
      name = a;
      value = argv[++i];
    } else if (a.rfind("--dspark-k=", 0) == 0 || a.rfind("--dspark-time-model=", 0) == 0) {
      name = a.substr(0, a.find('='));
      value = a.substr(a.find('=') + 1);
    } else {
      args.push_back(argv[i]);
      continue;
    }
    if (name == "--dspark-k") {
      if (!absl::SimpleAtoi(value, &options.fixed_k) || options.fixed_k < -1 ||
          options.fixed_k > options.max_k) {
        std::fprintf(stderr, "epd-decode: --dspark-k %s: want an integer in [-1, %d]\n",
                     value.c_str(), options.max_k);
        return 1;
      }
    } else if (!ParseTimeModel(value, &options.time_model)) {
      std::fprintf(stderr,
                   "epd-decode: --dspark-time-model %s: want B,T,D (three numbers >= 0, B+T > 0)\n",
                   value.c_str());
      return 1;
    }
  }
  args.push_back(nullptr);
  return epd::worker::RunWorkerMain(static_cast<int>(args.size()) - 1, args.data(),
                                    epd::v1::POOL_DECODE,
                                    [&options](const epd::worker::WorkerSetup& setup) {
                                      return epd::decode_pool::MakeDecodeHandler(setup, options);
                                    });
}
