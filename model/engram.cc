#include "model/engram.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace epd::model {

absl::Status ValidateEngramConstants(const EngramConstants& k, const ModelConfig& c) {
  const size_t nl = c.engram_layer_ids.size();
  const size_t no = static_cast<size_t>(c.engram_max_ngram_size - 1);
  const auto& multipliers = k.multipliers;
  const auto& primes = k.primes;
  const auto& offsets = k.offsets;
  const auto& token_map = k.token_map;
  if (multipliers.size() != nl || primes.size() != nl || offsets.size() != nl) {
    return absl::InvalidArgumentError(
        absl::StrCat("engram constants: need one entry per engram layer (", nl, ")"));
  }
  for (size_t l = 0; l < nl; ++l) {
    if (multipliers[l].size() != static_cast<size_t>(c.engram_max_ngram_size)) {
      return absl::InvalidArgumentError(
          "engram constants: multipliers must have max_ngram entries");
    }
    if (primes[l].size() != no || offsets[l].size() != no) {
      return absl::InvalidArgumentError(
          "engram constants: primes/offsets sizes do not match the config");
    }
    int64_t total = 0;
    for (const auto& hs : primes[l]) {
      if (hs.size() != static_cast<size_t>(c.engram_n_heads)) {
        return absl::InvalidArgumentError("engram constants: primes need engram_n_heads per order");
      }
      for (int64_t p : hs) total += p;
    }
    if (total != c.engram_num_embeddings[l]) {
      return absl::InvalidArgumentError(
          absl::StrCat("engram constants: primes of layer ", c.engram_layer_ids[l], " sum to ",
                       total, ", config engram_num_embeddings says ", c.engram_num_embeddings[l]));
    }
  }
  if (!token_map.empty() && static_cast<int64_t>(token_map.size()) != c.vocab_size) {
    return absl::InvalidArgumentError("engram constants: token_map must have vocab_size entries");
  }
  return absl::OkStatus();
}

absl::StatusOr<EngramConstants> ParseEngramConstantsJson(std::string_view text) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError("engram constants: bad JSON");
  if (j.contains("engram") && j["engram"].is_object()) j = j["engram"];
  EngramConstants k;
  try {
    k.multipliers = j.at("multipliers").get<std::vector<std::vector<int64_t>>>();
    k.primes = j.at("primes").get<std::vector<std::vector<std::vector<int64_t>>>>();
    const nlohmann::json& off = j.at("offsets");
    k.offsets.clear();
    for (size_t l = 0; l < off.size(); ++l) {
      if (!off[l].empty() && off[l][0].is_array()) {
        k.offsets.push_back(off[l].get<std::vector<std::vector<int64_t>>>());
        continue;
      }
      // Flat [(max_ngram-1)*n_heads] per layer: split like the primes.
      const std::vector<int64_t> flat = off[l].get<std::vector<int64_t>>();
      std::vector<std::vector<int64_t>> per;
      size_t i = 0;
      for (const auto& hs : k.primes.at(l)) {
        if (i + hs.size() > flat.size()) throw std::out_of_range("offsets shorter than primes");
        per.emplace_back(flat.begin() + i, flat.begin() + i + hs.size());
        i += hs.size();
      }
      k.offsets.push_back(std::move(per));
    }
    if (j.contains("pad_compressed_id")) {
      k.pad_id = j["pad_compressed_id"].get<int32_t>();
    } else if (j.contains("pad_id")) {
      k.pad_id = j["pad_id"].get<int32_t>();
    }
    k.n_heads =
        k.primes.empty() || k.primes[0].empty() ? 0 : static_cast<int32_t>(k.primes[0][0].size());
    k.max_ngram_size = k.multipliers.empty() ? 0 : static_cast<int32_t>(k.multipliers[0].size());
    if (j.contains("token_map") && j["token_map"].is_array()) {
      k.token_map = j["token_map"].get<std::vector<int32_t>>();
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("engram constants: ", e.what()));
  }
  return k;
}

void EngramHashRow(const EngramConstants& k, int li, const int64_t* history, int n_history,
                   int max_ngram, int n_heads, int64_t* out) {
  const std::vector<int64_t>& m = k.multipliers[li];
  auto tok = [&](int s) -> uint64_t {
    return static_cast<uint64_t>(s < n_history ? history[s] : static_cast<int64_t>(k.pad_id));
  };
  // int64 wrap-around arithmetic, as NumPy does.
  uint64_t r = (tok(0) * static_cast<uint64_t>(m[0])) ^ (tok(1) * static_cast<uint64_t>(m[1]));
  for (int n = 2; n <= max_ngram; ++n) {
    if (n > 2) r ^= tok(n - 1) * static_cast<uint64_t>(m[n - 1]);
    const int64_t rs = static_cast<int64_t>(r);
    for (int h = 0; h < n_heads; ++h) {
      const int64_t p = k.primes[li][n - 2][h];
      int64_t mod = rs % p;
      if (mod < 0) mod += p;
      out[(n - 2) * n_heads + h] = mod + k.offsets[li][n - 2][h];
    }
  }
}

}  // namespace epd::model
