#pragma once

// Deterministic byte-level BPE trainer that writes a Hugging Face `tokenizer.json` in the
// DeepSeek layout (MODEL.md §5): specials first in the BPE table, then the 256 byte tokens,
// then merges, then the added (protocol) tokens. Used to build the nano model's tokenizer.
//
// Determinism: the same corpus and options give the same bytes on every platform (pairs are
// chosen by count, ties broken by the lexicographically smallest (left, right) token strings).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace epd::model {

// The DeepSeek-V3/V4 pre-tokenizer: digits in runs of <= 3, CJK/kana runs, then the
// punctuation/letter regex, then ByteLevel without its own regex (JSON text).
extern const char* const kDeepSeekPreTokenizerJson;

struct BpeTrainerOptions {
  // Tokens at ids 0.. (special, also in model.vocab), e.g. BOS, EOS, PAD.
  std::vector<std::string> leading_specials;
  struct Added {
    std::string content;
    bool special = true;
  };
  // Tokens appended after the merged tokens (added_tokens only).
  std::vector<Added> trailing_added;
  // Total vocabulary size (leading + 256 bytes + merged tokens + trailing). Training stops
  // with an error if the corpus cannot supply enough merges.
  int32_t vocab_size = 2048;
};

// Returns the tokenizer.json text.
absl::StatusOr<std::string> TrainByteLevelBpe(std::string_view corpus,
                                              const BpeTrainerOptions& options);

}  // namespace epd::model
