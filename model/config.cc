#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/format.h"
#include "nlohmann/json.hpp"

namespace epd::model {
namespace {

using Json = nlohmann::json;

// Looks up the first present key of `keys` in `obj`.
const Json* Find(const Json& obj, std::initializer_list<const char*> keys, std::string* found) {
  for (const char* k : keys) {
    auto it = obj.find(k);
    if (it != obj.end() && !it->is_null()) {
      *found = k;
      return &*it;
    }
  }
  return nullptr;
}

std::string KeyList(std::initializer_list<const char*> keys) {
  std::vector<std::string> v(keys.begin(), keys.end());
  return absl::StrJoin(v, "' / '");
}

#define EPD_CFG(expr)         \
  do {                        \
    absl::Status _s = (expr); \
    if (!_s.ok()) return _s;  \
  } while (0)

// The first present key of `keys` in `obj` (*value stays null when absent and not required).
absl::Status FindField(const Json& obj, std::initializer_list<const char*> keys, bool required,
                       std::string* key, const Json** value) {
  *value = Find(obj, keys, key);
  if (*value == nullptr && required)
    return absl::InvalidArgumentError(absl::StrCat("config: missing field '", KeyList(keys), "'"));
  return absl::OkStatus();
}

template <typename T>
absl::Status Get(const Json& obj, std::initializer_list<const char*> keys, bool required, T* out) {
  std::string key;
  const Json* v = nullptr;
  EPD_CFG(FindField(obj, keys, required, &key, &v));
  if (v == nullptr) return absl::OkStatus();
  if constexpr (std::is_same_v<T, bool>) {
    if (!v->is_boolean())
      return absl::InvalidArgumentError(
          absl::StrCat("config: field '", key, "' must be a boolean"));
    *out = v->get<bool>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v->is_string())
      return absl::InvalidArgumentError(absl::StrCat("config: field '", key, "' must be a string"));
    *out = v->get<std::string>();
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v->is_number())
      return absl::InvalidArgumentError(absl::StrCat("config: field '", key, "' must be a number"));
    *out = static_cast<T>(v->get<double>());
  } else {
    if (!v->is_number_integer() &&
        !(v->is_number_float() && std::floor(v->get<double>()) == v->get<double>())) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: field '", key, "' must be an integer"));
    }
    *out = static_cast<T>(v->is_number_integer() ? v->get<int64_t>()
                                                 : static_cast<int64_t>(v->get<double>()));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status GetList(const Json& obj, std::initializer_list<const char*> keys, bool required,
                     std::vector<T>* out) {
  std::string key;
  const Json* v = nullptr;
  EPD_CFG(FindField(obj, keys, required, &key, &v));
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_array())
    return absl::InvalidArgumentError(absl::StrCat("config: field '", key, "' must be a list"));
  out->clear();
  for (const Json& e : *v) {
    if (!e.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: field '", key, "' must hold integers"));
    }
    out->push_back(static_cast<T>(e.get<int64_t>()));
  }
  return absl::OkStatus();
}

absl::Status Bad(std::string_view field, std::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("config: field '", std::string(field), "' ", std::string(why)));
}

bool Contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

std::string_view LayerModeName(LayerMode mode) {
  switch (mode) {
    case LayerMode::kSwaOnly:
      return "swa_only";
    case LayerMode::kFull:
      return "full";
    case LayerMode::kReindex:
      return "reindex";
    case LayerMode::kReuse:
      return "reuse";
  }
  return "?";
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text) {
  Json root = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError("config: not a valid JSON object");
  }
  const Json& t =
      root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
  ModelConfig c;
  EPD_CFG(Get(t, {"vocab_size"}, true, &c.vocab_size));
  EPD_CFG(Get(t, {"hidden_size", "dim"}, true, &c.dim));
  EPD_CFG(Get(t, {"num_hidden_layers", "n_layers"}, true, &c.n_layers));
  EPD_CFG(Get(t, {"num_attention_heads", "n_heads"}, true, &c.n_heads));
  EPD_CFG(Get(t, {"num_key_value_heads"}, false, &c.n_kv_heads));
  EPD_CFG(Get(t, {"head_dim"}, true, &c.head_dim));
  EPD_CFG(Get(t, {"qk_rope_head_dim", "rope_head_dim"}, true, &c.rope_head_dim));
  EPD_CFG(Get(t, {"q_lora_rank"}, true, &c.q_lora_rank));
  EPD_CFG(Get(t, {"o_lora_rank"}, true, &c.o_lora_rank));
  EPD_CFG(Get(t, {"o_groups"}, true, &c.o_groups));
  EPD_CFG(Get(t, {"swiglu_limit"}, false, &c.swiglu_limit));
  EPD_CFG(Get(t, {"rms_norm_eps", "norm_eps"}, false, &c.norm_eps));
  EPD_CFG(Get(t, {"max_position_embeddings", "max_seq_len"}, false, &c.max_position_embeddings));
  EPD_CFG(Get(t, {"rope_theta"}, false, &c.rope_theta));
  EPD_CFG(Get(t, {"compress_rope_theta"}, false, &c.compress_rope_theta));
  if (auto it = t.find("rope_scaling"); it != t.end() && it->is_object()) {
    EPD_CFG(Get(*it, {"factor"}, false, &c.rope_factor));
    EPD_CFG(Get(*it, {"beta_fast"}, false, &c.beta_fast));
    EPD_CFG(Get(*it, {"beta_slow"}, false, &c.beta_slow));
    EPD_CFG(Get(*it, {"original_max_position_embeddings"}, false, &c.original_seq_len));
  }
  EPD_CFG(Get(t, {"rope_factor"}, false, &c.rope_factor));
  EPD_CFG(Get(t, {"beta_fast"}, false, &c.beta_fast));
  EPD_CFG(Get(t, {"beta_slow"}, false, &c.beta_slow));
  EPD_CFG(Get(t, {"original_seq_len"}, false, &c.original_seq_len));
  EPD_CFG(Get(t, {"n_routed_experts"}, true, &c.n_routed_experts));
  EPD_CFG(Get(t, {"n_shared_experts"}, false, &c.n_shared_experts));
  EPD_CFG(Get(t, {"num_experts_per_tok", "n_activated_experts"}, true, &c.n_activated_experts));
  EPD_CFG(Get(t, {"moe_intermediate_size", "moe_inter_dim"}, true, &c.moe_inter_dim));
  EPD_CFG(Get(t, {"scoring_func", "score_func"}, false, &c.score_func));
  EPD_CFG(Get(t, {"norm_topk_prob"}, false, &c.norm_topk_prob));
  EPD_CFG(Get(t, {"routed_scaling_factor", "route_scale"}, false, &c.route_scale));
  EPD_CFG(Get(t, {"sliding_window", "window_size"}, true, &c.window_size));
  EPD_CFG(GetList(t, {"compress_ratios"}, true, &c.compress_ratios));
  EPD_CFG(GetList(t, {"kv_source_layer_ids", "kv_source_layers"}, true, &c.kv_source_layers));
  EPD_CFG(
      GetList(t, {"index_source_layer_ids", "index_source_layers"}, true, &c.index_source_layers));
  EPD_CFG(Get(t, {"index_n_heads"}, true, &c.index_n_heads));
  EPD_CFG(Get(t, {"index_head_dim"}, true, &c.index_head_dim));
  EPD_CFG(Get(t, {"index_topk"}, true, &c.index_topk));
  EPD_CFG(Get(t, {"candidate_source_layer_id", "candidate_source_layer"}, true,
              &c.candidate_source_layer));
  EPD_CFG(Get(t, {"candidate_topk_blocks"}, true, &c.candidate_topk_blocks));
  EPD_CFG(Get(t, {"candidate_block_size"}, true, &c.candidate_block_size));
  EPD_CFG(Get(t, {"hc_mult"}, true, &c.hc_mult));
  EPD_CFG(Get(t, {"hc_sinkhorn_iters"}, true, &c.hc_sinkhorn_iters));
  EPD_CFG(Get(t, {"hc_eps"}, false, &c.hc_eps));
  EPD_CFG(GetList(t, {"engram_layer_ids"}, false, &c.engram_layer_ids));
  EPD_CFG(GetList(t, {"engram_num_embeddings"}, false, &c.engram_num_embeddings));
  EPD_CFG(Get(t, {"engram_max_ngram_size"}, false, &c.engram_max_ngram_size));
  EPD_CFG(Get(t, {"engram_vocab_size"}, false, &c.engram_vocab_size));
  EPD_CFG(Get(t, {"engram_n_heads"}, false, &c.engram_n_heads));
  EPD_CFG(Get(t, {"engram_head_dim"}, false, &c.engram_head_dim));
  EPD_CFG(Get(t, {"engram_pad_token_id", "engram_pad_id"}, false, &c.engram_pad_id));
  EPD_CFG(Get(t, {"engram_compressed_vocab_size"}, false, &c.engram_compressed_vocab_size));
  EPD_CFG(Get(t, {"num_nextn_predict_layers", "n_mtp_layers"}, false, &c.n_mtp_layers));
  EPD_CFG(Get(t, {"dspark_block_size"}, false, &c.dspark_block_size));
  EPD_CFG(Get(t, {"dspark_noise_token_id"}, false, &c.dspark_noise_token_id));
  EPD_CFG(GetList(t, {"dspark_target_layer_ids"}, false, &c.dspark_target_layer_ids));
  EPD_CFG(Get(t, {"dspark_markov_rank"}, false, &c.dspark_markov_rank));
  EPD_CFG(Get(t, {"dspark_n_routed_experts"}, false, &c.dspark_n_routed_experts));
  EPD_CFG(Get(t, {"dspark_num_experts_per_tok", "dspark_n_activated_experts"}, false,
              &c.dspark_n_activated_experts));
  // Token ids: text_config first, then the top level.
  for (const Json* o : std::initializer_list<const Json*>{&root, &t}) {
    EPD_CFG(Get(*o, {"bos_token_id"}, false, &c.bos_token_id));
    EPD_CFG(Get(*o, {"eos_token_id"}, false, &c.eos_token_id));
    EPD_CFG(Get(*o, {"pad_token_id"}, false, &c.pad_token_id));
    EPD_CFG(Get(*o, {"image_token_id"}, false, &c.image_token_id));
  }
  if (auto it = root.find("quantization_config"); it != root.end() && it->is_object()) {
    if (auto b = it->find("weight_block_size"); b != it->end()) {
      if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() || (*b)[0] != (*b)[1]) {
        return Bad("quantization_config.weight_block_size", "must be [n, n]");
      }
      c.weight_block_size = (*b)[0].get<int>();
    }
  }
  if (auto it = root.find("vision_config"); it != root.end() && it->is_object()) {
    EPD_CFG(Get(*it, {"num_hidden_layers"}, false, &c.vision_n_layers));
  }
  EPD_CFG(Get(root, {"vision_n_layers"}, false, &c.vision_n_layers));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("config: cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = ParseModelConfig(ss.str());
  if (!c.ok())
    return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  if (absl::Status s = c->Validate(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return c;
}

absl::Status ModelConfig::Validate() const {
  auto pos = [](std::string_view f, int64_t v) -> absl::Status {
    if (v <= 0) return Bad(f, absl::StrCat("must be > 0 (got ", v, ")"));
    return absl::OkStatus();
  };
  EPD_CFG(pos("vocab_size", vocab_size));
  EPD_CFG(pos("hidden_size", dim));
  EPD_CFG(pos("num_hidden_layers", n_layers));
  EPD_CFG(pos("num_attention_heads", n_heads));
  EPD_CFG(pos("head_dim", head_dim));
  EPD_CFG(pos("qk_rope_head_dim", rope_head_dim));
  EPD_CFG(pos("q_lora_rank", q_lora_rank));
  EPD_CFG(pos("o_lora_rank", o_lora_rank));
  EPD_CFG(pos("o_groups", o_groups));
  EPD_CFG(pos("n_routed_experts", n_routed_experts));
  EPD_CFG(pos("num_experts_per_tok", n_activated_experts));
  EPD_CFG(pos("moe_intermediate_size", moe_inter_dim));
  EPD_CFG(pos("sliding_window", window_size));
  EPD_CFG(pos("hc_mult", hc_mult));
  EPD_CFG(pos("hc_sinkhorn_iters", hc_sinkhorn_iters));
  if (n_kv_heads != 1) return Bad("num_key_value_heads", "must be 1 (single-KV-head MQA)");
  if (rope_head_dim >= head_dim || rope_head_dim % 2 != 0) {
    return Bad("qk_rope_head_dim", "must be even and < head_dim");
  }
  if (n_heads % o_groups != 0) return Bad("o_groups", "must divide num_attention_heads");
  if (n_activated_experts > n_routed_experts)
    return Bad("num_experts_per_tok", "exceeds n_routed_experts");
  if (score_func != "sqrtsoftplus") return Bad("scoring_func", "only 'sqrtsoftplus' is supported");
  if (weight_block_size != 32)
    return Bad("quantization_config.weight_block_size", "must be [32, 32]");
  if (dim % 32 != 0) return Bad("hidden_size", "must be a multiple of 32");
  if (head_dim % 32 != 0) return Bad("head_dim", "must be a multiple of 32");
  if (moe_inter_dim % 32 != 0) return Bad("moe_intermediate_size", "must be a multiple of 32");
  if (!(norm_eps >= 0.f)) return Bad("rms_norm_eps", "must be >= 0");
  if (rope_theta <= 0 || compress_rope_theta <= 0) return Bad("rope_theta", "must be > 0");
  if (static_cast<int>(compress_ratios.size()) != n_layers + n_mtp_layers) {
    return Bad(
        "compress_ratios",
        absl::StrCat("must have num_hidden_layers + num_nextn_predict_layers = ",
                     n_layers + n_mtp_layers, " entries (got ", compress_ratios.size(), ")"));
  }
  for (size_t i = 0; i < compress_ratios.size(); ++i) {
    int r = compress_ratios[i];
    if (r < 0) return Bad("compress_ratios", absl::StrCat("entry ", i, " is negative"));
    if (static_cast<int>(i) >= n_layers && r != 0) {
      return Bad("compress_ratios", absl::StrCat("DSpark stage entry ", i, " must be 0"));
    }
  }
  int prev = -1;
  for (int l : kv_source_layers) {
    if (l < 0 || l >= n_layers)
      return Bad("kv_source_layer_ids", absl::StrCat("layer ", l, " out of range"));
    if (l <= prev) return Bad("kv_source_layer_ids", "must be strictly increasing");
    if (compress_ratios[l] == 0)
      return Bad("kv_source_layer_ids", absl::StrCat("layer ", l, " has compress ratio 0"));
    if (!Contains(index_source_layers, l)) {
      return Bad("index_source_layer_ids", absl::StrCat("must include KV source layer ", l));
    }
    prev = l;
  }
  prev = -1;
  for (int l : index_source_layers) {
    if (l < 0 || l >= n_layers)
      return Bad("index_source_layer_ids", absl::StrCat("layer ", l, " out of range"));
    if (l <= prev) return Bad("index_source_layer_ids", "must be strictly increasing");
    if (compress_ratios[l] == 0)
      return Bad("index_source_layer_ids", absl::StrCat("layer ", l, " has compress ratio 0"));
    prev = l;
  }
  // Every compressed layer needs an earlier (or own) KV source with the same ratio, and an index
  // source.
  for (int l = 0; l < n_layers; ++l) {
    if (compress_ratios[l] == 0) continue;
    int src = -1, isrc = -1;
    for (int s : kv_source_layers)
      if (s <= l) src = s;
    for (int s : index_source_layers)
      if (s <= l) isrc = s;
    if (src < 0)
      return Bad("kv_source_layer_ids", absl::StrCat("no KV source at or before layer ", l));
    if (isrc < 0)
      return Bad("index_source_layer_ids", absl::StrCat("no index source at or before layer ", l));
    if (compress_ratios[src] != compress_ratios[l]) {
      return Bad("compress_ratios", absl::StrCat("layer ", l, " ratio ", compress_ratios[l],
                                                 " differs from its KV source layer ", src));
    }
  }
  if (!Contains(kv_source_layers, candidate_source_layer)) {
    return Bad("candidate_source_layer_id", "must be one of kv_source_layer_ids");
  }
  if (candidate_source_layer != kv_source_layers.back()) {
    // The decoder (layers from the candidate source on) owns no global KV (MODEL.md §6).
    return Bad("candidate_source_layer_id", "must be the last of kv_source_layer_ids");
  }
  EPD_CFG(pos("index_n_heads", index_n_heads));
  EPD_CFG(pos("index_head_dim", index_head_dim));
  EPD_CFG(pos("index_topk", index_topk));
  EPD_CFG(pos("candidate_topk_blocks", candidate_topk_blocks));
  EPD_CFG(pos("candidate_block_size", candidate_block_size));
  if (index_head_dim % 32 != 0 || index_head_dim <= rope_head_dim) {
    return Bad("index_head_dim", "must be a multiple of 32 and > qk_rope_head_dim");
  }
  if (!engram_layer_ids.empty()) {
    if (engram_num_embeddings.size() != engram_layer_ids.size()) {
      return Bad("engram_num_embeddings", "must have one entry per engram_layer_ids entry");
    }
    for (int l : engram_layer_ids) {
      if (l < 0 || l >= n_layers)
        return Bad("engram_layer_ids", absl::StrCat("layer ", l, " out of range"));
    }
    EPD_CFG(pos("engram_max_ngram_size", engram_max_ngram_size));
    EPD_CFG(pos("engram_n_heads", engram_n_heads));
    EPD_CFG(pos("engram_head_dim", engram_head_dim));
    EPD_CFG(pos("engram_compressed_vocab_size", engram_compressed_vocab_size));
    if (engram_max_ngram_size < 2) return Bad("engram_max_ngram_size", "must be >= 2");
    if (engram_head_dim % 32 != 0) return Bad("engram_head_dim", "must be a multiple of 32");
  }
  if (n_mtp_layers > 0) {
    EPD_CFG(pos("dspark_block_size", dspark_block_size));
    EPD_CFG(pos("dspark_markov_rank", dspark_markov_rank));
    EPD_CFG(pos("dspark_n_routed_experts", dspark_n_routed_experts));
    EPD_CFG(pos("dspark_num_experts_per_tok", dspark_n_activated_experts));
    if (dspark_n_activated_experts > dspark_n_routed_experts) {
      return Bad("dspark_num_experts_per_tok", "exceeds dspark_n_routed_experts");
    }
    if (dspark_target_layer_ids.empty()) return Bad("dspark_target_layer_ids", "must not be empty");
    for (int l : dspark_target_layer_ids) {
      if (l < 0 || l >= n_layers)
        return Bad("dspark_target_layer_ids", absl::StrCat("layer ", l, " out of range"));
    }
    if (dspark_noise_token_id < 0 || dspark_noise_token_id >= vocab_size) {
      return Bad("dspark_noise_token_id", "out of vocabulary range");
    }
  }
  return absl::OkStatus();
}

float ModelConfig::index_weight_scale() const {
  const double c = std::pow(static_cast<double>(index_head_dim), -0.5) *
                   std::pow(static_cast<double>(index_n_heads), -0.5);
  return kernels::format::RoundBf16(static_cast<float>(c));
}

std::vector<LayerRole> ModelConfig::Roles() const {
  std::vector<LayerRole> roles(total_layers());
  int last_kv = -1, last_index = -1;
  for (int l = 0; l < total_layers(); ++l) {
    LayerRole& r = roles[l];
    r.layer = l;
    r.compress_ratio = compress_ratios[l];
    r.is_dspark_stage = l >= n_layers;
    if (!r.is_dspark_stage) {
      r.has_engram = Contains(engram_layer_ids, l);
      r.is_dspark_target = Contains(dspark_target_layer_ids, l);
    }
    if (r.compress_ratio == 0 || r.is_dspark_stage) continue;
    r.is_kv_source = Contains(kv_source_layers, l);
    r.is_index_source = Contains(index_source_layers, l);
    if (r.is_kv_source) last_kv = l;
    if (r.is_index_source) last_index = l;
    r.mode = r.is_kv_source ? LayerMode::kFull
                            : (r.is_index_source ? LayerMode::kReindex : LayerMode::kReuse);
    r.has_wgate = r.is_kv_source && r.compress_ratio > 1;
    r.is_candidate_source = l == candidate_source_layer;
    r.uses_candidates = r.is_index_source && !r.is_kv_source && l > candidate_source_layer;
    r.kv_source = last_kv;
    r.index_key_source = r.is_index_source ? last_kv : -1;
    r.topk_source = last_index;
  }
  return roles;
}

KvLayout ComputeKvLayout(const ModelConfig& c) {
  KvLayout k;
  k.main_entry_bytes = c.head_dim / 2 + c.head_dim / 16;
  k.index_key_bytes = c.index_head_dim / 2 + c.index_head_dim / 32;
  k.swa_slot_bytes = c.head_dim + c.head_dim / 32;
  k.swa_bytes_per_layer = k.swa_slot_bytes * c.window_size;
  k.swa_bytes_per_sequence = k.swa_bytes_per_layer * c.total_layers();
  for (int l : c.kv_source_layers) {
    int r = c.compress_ratios[l];
    double per = static_cast<double>(k.main_entry_bytes + k.index_key_bytes) / r;
    k.global_bytes_per_token += per;
    k.per_source.emplace_back(absl::StrCat("layer.", l), per);
    if (r > 1) k.compressor_state_bytes += int64_t{2} * r * c.head_dim * 4;
  }
  return k;
}

std::vector<std::pair<std::string, std::string>> KvLayoutPairs(const ModelConfig& c) {
  KvLayout k = ComputeKvLayout(c);
  auto num = [](double v) {
    if (v == std::floor(v)) return absl::StrCat(static_cast<int64_t>(v));
    return absl::StrCat(v);
  };
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("main_entry_bytes", num(k.main_entry_bytes));
  out.emplace_back("index_key_bytes", num(k.index_key_bytes));
  out.emplace_back("swa_bytes_per_layer_slot", num(k.swa_slot_bytes));
  out.emplace_back("swa_slots_per_layer", num(c.window_size));
  out.emplace_back("swa_bytes_per_layer", num(k.swa_bytes_per_layer));
  out.emplace_back("swa_layers", num(c.total_layers()));
  out.emplace_back("swa_bytes_per_sequence", num(k.swa_bytes_per_sequence));
  for (const auto& [name, v] : k.per_source) {
    out.emplace_back(absl::StrCat("global_bytes_per_token.", name), num(v));
  }
  out.emplace_back("global_bytes_per_token", num(k.global_bytes_per_token));
  out.emplace_back("compressor_state_bytes", num(k.compressor_state_bytes));
  out.emplace_back("engram_history_tokens", num(std::max(0, c.engram_max_ngram_size - 1)));
  return out;
}

std::string FormatKvLayout(const ModelConfig& c) {
  std::string s;
  for (const auto& [k, v] : KvLayoutPairs(c)) absl::StrAppend(&s, k, ": ", v, "\n");
  return s;
}

}  // namespace epd::model
