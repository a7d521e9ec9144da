// Engram (MODEL.md §3 "Engram"): the constants' checks and JSON form, the n-gram hash of one
// position (engram.h), and the model's Engram sublayer (model.h): a sequence's hash ids
// (Model::EngramHashes), the table lookup and the gate on the residual stream (Model::Engram,
// Model::EngramFromIds).
#include "model/engram.h"

#include <algorithm>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/model.h"
#include "model/scratch.h"
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

// ---- The model's Engram sublayer ----

absl::Status Model::Engram(int l, const int64_t* hash_ids, int64_t stride, int64_t rows, float* h,
                           bool single_token_calls) const {
  const ModelConfig& c = config_;
  const int64_t nid = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  std::vector<int64_t> ids(rows * nid);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < nid; ++j) ids[r * nid + j] = hash_ids[r * stride + j];
  }
  Scratch ws(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(const int64_t* ids_dev, ws.Copy(ids));
  return EngramFromIds(ws, l, ids_dev, rows, h, single_token_calls);
}

absl::Status Model::EngramFromIds(Scratch& outer, int l, const int64_t* ids_dev, int64_t rows,
                                  float* h, bool single_token_calls) const {
  const ModelConfig& c = config_;
  const EngramWeights& E = *weights_->layers[l].engram;
  const int64_t D = c.dim, hc = c.hc_mult, ehd = c.engram_head_dim;
  const int64_t nid = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  if (E.table.shape.size() != 2 || E.table.shape[1] != ehd)
    return absl::InternalError("model: Engram table shape does not match engram_head_dim");
  Scratch ws(backend_, outer.pool(), &outer);
  ASSIGN_OR_RETURN(float* in, ws.Alloc<float>(rows * nid * ehd));
  ASSIGN_OR_RETURN(float* e, ws.Alloc<float>(rows * (hc + 1) * D));
  RETURN_IF_ERROR(
      backend_.Fp8RowLookup(E.table.data, E.table_scale.data, ehd, ids_dev, rows * nid, in));
  RETURN_IF_ERROR(backend_.LinearQuant(in, rows, E.wkv, e));
  return single_token_calls
             ? backend_.EngramGateSingleToken(h, e, rows, static_cast<int>(hc), D,
                                              E.q_weight.data(), E.k_weight.data(), c.norm_eps)
             : backend_.EngramGate(h, e, rows, static_cast<int>(hc), D, E.q_weight.data(),
                                   E.k_weight.data(), c.norm_eps);
}

std::vector<int64_t> Model::EngramHashes(const SequenceState& state,
                                         std::span<const int32_t> ids) const {
  const ModelConfig& c = config_;
  const int nl = static_cast<int>(c.engram_layer_ids.size());
  const int per = (c.engram_max_ngram_size - 1) * c.engram_n_heads;
  const int64_t S = static_cast<int64_t>(ids.size());
  std::vector<int64_t> out(S * nl * per);
  std::vector<int64_t> hist(state.engram_history);
  const int nh = c.engram_max_ngram_size;
  for (int64_t i = 0; i < S; ++i) {
    hist.push_back(EngramCompressedId(engram_, ids[i]));
    int64_t recent[16];
    const int n = std::min<int>(nh, static_cast<int>(hist.size()));
    for (int s = 0; s < n; ++s) recent[s] = hist[hist.size() - 1 - s];
    for (int li = 0; li < nl; ++li) {
      EngramHashRow(engram_, li, recent, n, nh, c.engram_n_heads, out.data() + (i * nl + li) * per);
    }
  }
  return out;
}

}  // namespace epd::model
