#pragma once

// `epd generate`: offline generation for one request in one process through the staged path
// (model/stages.h): EncoderPass -> DecoderReplay -> DecodeStep, greedy. For tests and debugging
// of the disaggregated path without any daemon. docs/model.md, "epd generate".
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace CLI {
class App;
}

namespace epd::services {

struct GenerateOptions {
  // config.json + safetensors (+ engram_constants.json, or the golden manifest.json)
  std::string model_dir;
  std::string prompt;           // text prompt, encoded with <model_dir>/tokenizer.json (plain text)
  std::string prompt_ids_file;  // JSON list of ids, or {"prompt_ids": [...]}; no tokenizer needed
  int max_tokens = 16;          // Default: 16 generated tokens (stops early at EOS)
  bool ignore_eos = false;      // Default: stop at the config's eos_token_id
  std::string dump_logits;      // raw LE float32 [1 + steps, vocab]: prefill last row, each step
  int64_t tail_rows = 0;        // encoder tail rows; 0 = the whole prompt (exact). Default: 0
  bool monolithic = false;      // Model::Prefill/Decode instead of the stage runners (reference)
  // Teacher forcing: JSON list of ids (or {"generated_ids": [...]}) fed as the generated tokens
  // instead of the argmax; the logits of every step are still computed and dumped. The run
  // generates min(max_tokens, list length) tokens and does not stop at EOS.
  std::string force_ids_file;
  // Backend: "cpu" (the reference) or "cuda[:N]". The model forward runs only on the CPU today;
  // cuda fails at once with a message naming the device and the reason (docs/cuda.md).
  std::string device = "cpu";
};

struct GenerateResult {
  int64_t prompt_tokens = 0;
  std::vector<int32_t> ids;  // generated ids
  std::string text;          // detokenized ids (empty without tokenizer.json)
  bool has_text = false;
  std::string finish_reason;  // "stop" (EOS) or "length"
  // With force_ids_file: the model's own argmax at each step (ids holds the forced ids).
  std::vector<int32_t> argmax_ids;
};

void AddGenerateFlags(CLI::App& app, GenerateOptions* options);
// Errors name the cause (missing model dir, bad ids file, ids out of the vocabulary, ...).
absl::StatusOr<GenerateResult> RunGenerate(const GenerateOptions& options);
// Runs and prints one JSON line {"prompt_tokens", "ids", "text"?, "finish_reason"}; exit code.
int RunGenerateCommand(const GenerateOptions& options);

}  // namespace epd::services
