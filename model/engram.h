#pragma once

// Engram n-gram hashing constants and the hash (MODEL.md §3 "Engram").
//
// The constants (compressed token map, NumPy-PCG64 multipliers, primes, offsets) are computed
// offline or by model/engram_constants* (another component); this struct is what the forward
// pass consumes. It can be filled from JSON: {"multipliers": [[...] per engram layer],
// "primes": [[[...] per head] per n-gram order] per layer], "offsets": [[...] per layer],
// "pad_id": 2, "token_map": [...] (optional; absent = identity)} — the layout of the golden
// manifest's "engram" object. Model::Load looks for `engram_constants.json` in the model dir.

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"

namespace epd::model {

struct EngramConstants {
  // [n_engram_layers][max_ngram] int64 odd multipliers m[layer][s].
  std::vector<std::vector<int64_t>> multipliers;
  // [n_engram_layers][max_ngram-1][n_heads] primes, n-gram order 2.. in order.
  std::vector<std::vector<std::vector<int64_t>>> primes;
  // [n_engram_layers][(max_ngram-1)*n_heads] row offsets (cumulative sums of the primes).
  std::vector<std::vector<int64_t>> offsets;
  // Compressed token map: token id -> compressed id. Empty = identity.
  std::vector<int32_t> token_map;
  // Compressed id of the pad token (token_map[engram_pad_id]).
  int64_t pad_compressed_id = 2;

  int64_t Compressed(int64_t token) const {
    return token_map.empty() ? token : token_map[static_cast<size_t>(token)];
  }
  // Checks sizes against the config.
  [[nodiscard]] absl::Status Validate(const ModelConfig& config) const;
};

[[nodiscard]] absl::StatusOr<EngramConstants> ParseEngramConstantsJson(std::string_view json_text);

// Table row ids of engram layer `layer_index` (index into engram_layer_ids) for one position.
// `history` holds the compressed ids of positions p, p-1, ..., p-(max_ngram-1) (fewer near the
// start: missing ones are the pad id). out: [(max_ngram-1) * n_heads], order (n=2,h=0..), (n=3,..).
void EngramHashRow(const EngramConstants& k, int layer_index, const int64_t* history, int n_history,
                   int max_ngram, int n_heads, int64_t* out);

}  // namespace epd::model
