#pragma once

// All weights of a V4.1 model in compute form (MODEL.md §2), checked by name, dtype and shape
// against the config. FP8/FP4 weights stay in the checkpoint's format in backend memory
// (kernels::QuantWeight, packed codes + E8M0 scale bytes; the kernels dequantize on the fly);
// BF16 tensors become float arrays of the same values; wo_a (FP8, used as a bf16 linear) is
// dequantized to bf16 values. The Engram tables stay in the mmapped checkpoint and are
// dequantized per row on lookup.
//
// Ownership: ModelWeights keeps the TensorStore (mmaps) alive. Immutable after Load; thread-safe
// for concurrent reads.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace epd::model {

using kernels::QuantWeight;

struct ExpertWeights {
  QuantWeight w1, w2, w3;  // w1/w3 [inter, dim], w2 [dim, inter]
};

struct MoeWeights {
  std::vector<float> gate;       // [n_experts, dim] (bf16 values, used in fp32)
  std::vector<float> gate_bias;  // [n_experts]
  std::vector<ExpertWeights> experts;
  std::vector<ExpertWeights> shared;  // n_shared_experts (FP8)
  int n_experts = 0;
  int top_k = 0;
};

struct AttentionWeights {
  std::vector<float> attn_sink;  // [n_heads] fp32
  std::vector<float> q_norm;     // [q_lora]
  std::vector<float> kv_norm;    // [head_dim]
  QuantWeight wq_a;              // [q_lora, dim]
  QuantWeight wq_b;              // [n_heads*head_dim, q_lora]
  QuantWeight wkv;               // [head_dim, dim]
  std::vector<float> wo_a;       // [o_groups*o_lora, n_heads/o_groups*head_dim], dequantized bf16
  QuantWeight wo_b;              // [dim, o_groups*o_lora]
  // KV source only.
  std::vector<float> cmp_wkv;     // [head_dim, dim]
  std::vector<float> cmp_wgate;   // [head_dim, dim] (ratio 2 only)
  std::vector<float> cmp_norm;    // [head_dim]
  std::vector<float> idx_wk;      // [index_head_dim, head_dim]
  std::vector<float> idx_k_norm;  // [index_head_dim]
  // Index source only.
  QuantWeight idx_wq_b;                 // [index_n_heads*index_head_dim, q_lora]
  std::vector<float> idx_weights_proj;  // [index_n_heads, dim]
};

struct EngramWeights {
  TensorView table;             // F8_E4M3 [rows, engram_head_dim] (Backend::Fp8RowLookup)
  TensorView table_scale;       // F8_E8M0 [rows, engram_head_dim/32]
  QuantWeight wkv;              // [(hc+1)*dim, (max_ngram-1)*n_heads*head_dim]
  std::vector<float> q_weight;  // [hc, dim]
  std::vector<float> k_weight;  // [hc, dim]
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [dim]
  AttentionWeights attn;
  MoeWeights ffn;
  std::vector<float> hc_attn_fn, hc_attn_base, hc_attn_scale;
  std::vector<float> hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
  std::unique_ptr<EngramWeights> engram;  // engram layers only
};

struct DSparkWeights {
  QuantWeight main_proj;            // [dim, n_targets*dim]
  std::vector<float> main_norm;     // [dim]
  std::vector<float> norm;          // [dim] (mtp.{last}.norm)
  std::vector<float> markov_embed;  // [vocab, rank]
  std::vector<float> markov_head;   // [vocab, rank]
  std::vector<float> confidence;    // [1, dim + rank]
};

struct ModelWeights {
  std::vector<float> embed;          // [vocab, dim]
  std::vector<float> head;           // [vocab, dim]
  std::vector<float> norm;           // [dim]
  std::vector<LayerWeights> layers;  // total_layers(): main layers then DSpark stages
  std::unique_ptr<DSparkWeights> dspark;
  std::shared_ptr<const TensorStore> store;

  // Loads and checks every tensor the config implies. Errors name the tensor. The packed weights
  // go to `backend`'s memory (null: host memory); they must not outlive that backend.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ModelWeights>> Load(
      const ModelConfig& config, std::shared_ptr<const TensorStore> store,
      kernels::Backend* backend = nullptr);
  // Bytes the weights hold in memory (packed codes, float arrays, the Engram tables read in
  // place), to compare with the checkpoint's bytes (TensorStore::total_bytes()).
  int64_t ResidentBytes() const;
};

}  // namespace epd::model
