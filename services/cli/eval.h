#pragma once

// `epd eval`: held-out perplexity through the serving path (docs/demo.md). The data file's text
// is encoded with the model's tokenizer and cut into windows of `context` + `score` tokens. Each
// window's first `context` tokens are the prompt, run as a worker runs it: EncoderPass over the
// whole prompt, DecoderReplay on its tail (the whole prompt = exact; `window + dspark block`
// rows = the decoder bounded replay), then `score` teacher-forced DecodeSteps. The reported
// perplexity is exp(mean negative log-likelihood) of the `score` tokens after each prompt, so
// the replay and the KV format act on what is measured. --kv full keeps compressed KV and index
// keys unquantized (ModelOptions::unquantized_kv) instead of the FP4 format.
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace CLI {
class App;
}

namespace epd::services {

struct EvalOptions {
  std::string model_dir;
  std::string data;        // UTF-8 text
  int64_t context = 1024;  // prompt tokens per window. Default 1024
  int64_t score = 64;      // scored tokens after each prompt. Default 64
  int64_t windows = 4;     // at most this many windows (fewer when the data is short). Default 4
  std::string replay = "exact";  // "exact" | "bounded"
  std::string kv = "fp4";        // "fp4" (the checkpoint format) | "full"
};

struct EvalResult {
  int64_t windows = 0;
  int64_t scored_tokens = 0;
  double mean_nll = 0;  // nats per token
  double perplexity = 0;
  int64_t tail_rows = 0;  // rows the decoder replayed per window
};

void AddEvalFlags(CLI::App& app, EvalOptions* o);
absl::StatusOr<EvalResult> RunEval(const EvalOptions& o);
// Prints one JSON line with the options and the result; exit code.
int RunEvalCommand(const EvalOptions& o);

}  // namespace epd::services
