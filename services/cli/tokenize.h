#pragma once

// `epd tokenize`: encodes a text file with a model directory's tokenizer.json and writes the ids
// as raw little-endian int32 (the training tool's data format, tools/train/README.md). Special
// token strings in the text (<｜begin▁of▁sentence｜>, <｜User｜>, ...) encode as their tokens,
// so chat-formatted training text keeps its protocol tokens.
#include <string>

#include "absl/status/status.h"

namespace CLI {
class App;
}

namespace epd::services {

struct TokenizeOptions {
  std::string model_dir;  // directory holding tokenizer.json
  std::string in;         // UTF-8 text file
  std::string out;        // output: int32 LE ids
};

void AddTokenizeFlags(CLI::App& app, TokenizeOptions* o);

// Writes the ids; returns the number of tokens through `*n_tokens` (may be null).
absl::Status Tokenize(const TokenizeOptions& o, int64_t* n_tokens);

int RunTokenizeCommand(const TokenizeOptions& o);

}  // namespace epd::services
