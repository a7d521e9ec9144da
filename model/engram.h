#pragma once

// Engram n-gram hashing constants and the hash (MODEL.md §3 "Engram").
//
// The constants themselves (EngramConstants: compressed token map, NumPy-PCG64 multipliers,
// primes, offsets) come from model/engram_constants.h (computed from the config + tokenizer, or
// loaded from `engram_constants.json`). ParseEngramConstantsJson also reads the golden manifest's
// "engram" object: {"multipliers": [[...]], "primes": [[[...]]], "offsets": [[...] flat per layer
// or [[...]] per order], "pad_id": 2, "token_map": [...] (optional; absent = identity)}.

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/engram_constants.h"

namespace epd::model {

// Checks the constants' sizes against the config (one entry per engram layer, primes summing to
// engram_num_embeddings, token map covering the vocabulary).
[[nodiscard]] absl::Status ValidateEngramConstants(const EngramConstants& k,
                                                   const ModelConfig& config);

// Compressed id of a token (identity when the token map is empty).
inline int64_t EngramCompressedId(const EngramConstants& k, int64_t token) {
  return k.token_map.empty() ? token : k.token_map[static_cast<size_t>(token)];
}

[[nodiscard]] absl::StatusOr<EngramConstants> ParseEngramConstantsJson(std::string_view json_text);

// Table row ids of engram layer `layer_index` (index into engram_layer_ids) for one position.
// `history` holds the compressed ids of positions p, p-1, ..., p-(max_ngram-1) (fewer near the
// start: missing ones are the pad id). out: [(max_ngram-1) * n_heads], order (n=2,h=0..), (n=3,..).
void EngramHashRow(const EngramConstants& k, int layer_index, const int64_t* history, int n_history,
                   int max_ngram, int n_heads, int64_t* out);

}  // namespace epd::model
