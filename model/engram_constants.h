#pragma once

// Engram hashing constants (MODEL.md §3 "Engram"), computed exactly as the reference
// (engram.py + NumPy) does, and their JSON form (`engram_constants.json`).
//
// Row id for layer l, n-gram order n (2..max_ngram), head h at position p:
//   r_1 = t0*m[l][0] XOR t1*m[l][1]; r_k = r_(k-1) XOR t_k*m[l][k]   (int64, wrapping)
//   row = (r_(n-1) mod primes[l][n-2][h]) + offsets[l][n-2][h]
// with t_s = token_map[id at p-s] (pad_id when p < s, sticky to the left).
//
// Thread-safety: plain values; the free functions are reentrant.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace epd::model {

class Tokenizer;

struct EngramConstants {
  int32_t max_ngram_size = 4;         // n-grams 2..max_ngram_size
  int32_t n_heads = 0;                // hash heads per n-gram order
  int64_t engram_vocab_size = 0;      // the primes start above engram_vocab_size - 1
  int64_t compressed_vocab_size = 0;  // number of token classes
  int32_t pad_id = 0;                 // compressed id used for positions before the start
  std::vector<int32_t> token_map;     // [vocab] token id -> compressed id
  std::vector<int32_t> layer_ids;     // engram layers, in config order
  std::vector<std::vector<int64_t>> multipliers;           // [layer][max_ngram], odd
  std::vector<std::vector<std::vector<int64_t>>> primes;   // [layer][max_ngram-1][n_heads]
  std::vector<std::vector<std::vector<int64_t>>> offsets;  // [layer][max_ngram-1][n_heads]
  std::vector<int64_t> num_embeddings;                     // [layer] table rows = sum of primes

  nlohmann::json ToJson() const;
  static absl::StatusOr<EngramConstants> FromJson(const nlohmann::json& j);
  absl::Status Save(const std::string& path) const;
  static absl::StatusOr<EngramConstants> Load(const std::string& path);
};

// Compressed token map of a tokenizer (engram.py's CompressedTokenizer): each id decoded alone
// (specials kept), normalized by NFKC, NFD, strip accents (Mn), lowercase, [ \t\r\n]+ -> " ",
// a lone " " kept, strip; an empty result keeps the decoded text; ids whose decode contains
// U+FFFD are keyed by their raw token string. Classes are numbered by first occurrence.
// `*num_classes` receives the class count.
std::vector<int32_t> BuildCompressedTokenMap(const Tokenizer& tokenizer, int64_t* num_classes);

// The normalization alone (exposed for tests).
std::string EngramNormalize(const std::string& text);

// [layer][n-gram][head] primes: one global walk; for every n-gram order the search restarts
// at engram_vocab_size - 1 and never reuses a prime handed out before (any layer).
std::vector<std::vector<std::vector<int64_t>>> EngramPrimes(int num_layers, int max_ngram,
                                                            int n_heads, int64_t engram_vocab_size);

// 2 * default_rng(10007 * layer_id).integers(0, (2^63-1) // V // 2, size=max_ngram) + 1.
std::vector<int64_t> EngramMultipliers(int64_t layer_id, int max_ngram,
                                       int64_t compressed_vocab_size);

// All constants from a text_config (HF key names: engram_layer_ids, engram_max_ngram_size,
// engram_vocab_size, engram_n_heads, engram_pad_token_id) and a token map. Errors name a
// missing field, and a mismatch with engram_num_embeddings / engram_compressed_vocab_size
// when the config carries them.
absl::StatusOr<EngramConstants> ComputeEngramConstants(const nlohmann::json& text_config,
                                                       std::vector<int32_t> token_map,
                                                       int64_t compressed_vocab_size);

// NumPy's default_rng(seed) bit generator: SeedSequence(seed) -> PCG64 (XSL-RR 128/64),
// bit-exact with numpy >= 1.17.
class NumpyPcg64 {
 public:
  explicit NumpyPcg64(uint64_t seed);
  uint64_t NextUint64();
  uint32_t NextUint32();  // buffered halves of one 64-bit output, low half first
  double NextDouble();    // (next_uint64 >> 11) * 2^-53
  // Generator.integers(0, high, dtype=int64) for one value (Lemire, as NumPy).
  int64_t Integers(int64_t high);

 private:
  unsigned __int128 state_ = 0;
  unsigned __int128 inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uinteger_ = 0;
};

// SeedSequence(entropy).generate_state(n_words) as uint32 words.
std::vector<uint32_t> SeedSequenceState(uint64_t entropy, int n_words);

}  // namespace epd::model
