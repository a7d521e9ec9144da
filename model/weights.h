#pragma once

// All weights of a V4.1 model in compute form (MODEL.md §2), checked by name, dtype and shape
// against the config, all in the backend's memory (device memory for a GPU backend). FP8/FP4
// weights stay in the checkpoint's format (kernels::QuantWeight, packed codes + E8M0 scale bytes;
// the kernels dequantize on the fly). BF16 tensors that only a plain linear or Embed reads (the
// embeddings, the heads, the gates, the compressor and indexer projections) keep their bf16 bits;
// the other BF16 tensors (norms, the Engram gate's) become float arrays of the same values
// (WeightArray). wo_a (FP8, used as a
// bf16 linear) is dequantized to bf16 values, held as bf16 bits. The Engram tables are read in
// place from the mmapped checkpoint by a host-memory backend and copied into a device backend's
// memory; they are dequantized per row on lookup.
//
// Ownership: ModelWeights keeps the TensorStore (mmaps) alive. Immutable after Load; thread-safe
// for concurrent reads.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace epd::model {

using kernels::QuantWeight;

// A weight array in backend memory (device memory for a GPU backend): fp32 values, or bf16
// values held as their 16 bits (the plain linears' weights and the embeddings: half the bytes, same
// results; see kernels::PlainWeight). The model hands data() (fp32 arrays: norms, biases, tables)
// or plain() (a linear's weight, either form) to Backend ops only; there is no element access, so a
// host read of a weight does not compile (what a device backend needs: docs/cuda.md). Move-only.
class WeightArray {
 public:
  WeightArray() = default;
  WeightArray(kernels::Buffer buffer, int64_t size,
              kernels::PlainDtype dtype = kernels::PlainDtype::kF32)
      : buffer_(std::move(buffer)), size_(size), dtype_(dtype) {}
  // The values of an fp32 array; a bf16 array has no float view (a program error: abort).
  const float* data() const;
  // The array as a plain linear's weight, in its form.
  kernels::PlainWeight plain() const {
    kernels::PlainWeight w;
    w.data = size_ == 0 ? nullptr : buffer_.data();
    w.dtype = dtype_;
    return w;
  }
  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  kernels::PlainDtype dtype() const { return dtype_; }
  int64_t bytes() const { return size_ * kernels::PlainWeight::ElementBytes(dtype_); }
  kernels::MemoryKind kind() const { return buffer_.kind(); }

 private:
  kernels::Buffer buffer_;
  int64_t size_ = 0;
  kernels::PlainDtype dtype_ = kernels::PlainDtype::kF32;
};

struct ExpertWeights {
  QuantWeight w1, w2, w3;  // w1/w3 [inter, dim], w2 [dim, inter]
};

struct MoeWeights {
  WeightArray gate;       // [n_experts, dim] (bf16 bits, used in fp32)
  WeightArray gate_bias;  // [n_experts]
  std::vector<ExpertWeights> experts;
  std::vector<ExpertWeights> shared;  // n_shared_experts (FP8)
  int n_experts = 0;
  int top_k = 0;
};

struct AttentionWeights {
  WeightArray attn_sink;  // [n_heads] fp32
  WeightArray q_norm;     // [q_lora]
  WeightArray kv_norm;    // [head_dim]
  QuantWeight wq_a;              // [q_lora, dim]
  QuantWeight wq_b;              // [n_heads*head_dim, q_lora]
  QuantWeight wkv;               // [head_dim, dim]
  WeightArray wo_a;  // [o_groups*o_lora, n_heads/o_groups*head_dim], dequantized, bf16 bits
  QuantWeight wo_b;              // [dim, o_groups*o_lora]
  // KV source only.
  WeightArray cmp_wkv;     // [head_dim, dim] (bf16 bits)
  WeightArray cmp_wgate;   // [head_dim, dim] (ratio 2 only, bf16 bits)
  WeightArray cmp_norm;    // [head_dim]
  WeightArray idx_wk;      // [index_head_dim, head_dim] (bf16 bits)
  WeightArray idx_k_norm;  // [index_head_dim]
  // Index source only.
  QuantWeight idx_wq_b;                 // [index_n_heads*index_head_dim, q_lora]
  WeightArray idx_weights_proj;         // [index_n_heads, dim] (bf16 bits)
};

struct EngramWeights {
  TensorView table;        // F8_E4M3 [rows, engram_head_dim] (Backend::Fp8RowLookup)
  TensorView table_scale;  // F8_E8M0 [rows, engram_head_dim/32]
  // A device backend's copies of the two tables (table.data / table_scale.data point into them);
  // empty for a host-memory backend, which reads the mmapped checkpoint in place.
  kernels::Buffer table_copy, table_scale_copy;
  QuantWeight wkv;              // [(hc+1)*dim, (max_ngram-1)*n_heads*head_dim]
  WeightArray q_weight;  // [hc, dim]
  WeightArray k_weight;  // [hc, dim]
};

struct LayerWeights {
  WeightArray attn_norm, ffn_norm;  // [dim]
  AttentionWeights attn;
  MoeWeights ffn;
  WeightArray hc_attn_fn, hc_attn_base, hc_attn_scale;
  WeightArray hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
  std::unique_ptr<EngramWeights> engram;  // engram layers only
};

struct DSparkWeights {
  QuantWeight main_proj;            // [dim, n_targets*dim]
  WeightArray main_norm;     // [dim]
  WeightArray norm;          // [dim] (mtp.{last}.norm)
  WeightArray markov_embed;  // [vocab, rank] (bf16 bits)
  WeightArray markov_head;   // [vocab, rank] (bf16 bits)
  WeightArray confidence;    // [1, dim + rank] (bf16 bits)
};

struct ModelWeights {
  WeightArray embed;          // [vocab, dim] (bf16 bits)
  WeightArray head;           // [vocab, dim] (bf16 bits)
  WeightArray norm;           // [dim]
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

  // Every piece of memory the weights hold, by tensor name (a QuantWeight gives its codes and
  // its scale bytes; decoded QuantWeights, tests only, give their float arrays as host memory).
  struct Piece {
    std::string name;
    const void* data = nullptr;
    int64_t bytes = 0;
    kernels::MemoryKind kind = kernels::MemoryKind::kHost;
  };
  void ForEachPiece(const std::function<void(const Piece&)>& fn) const;
};

}  // namespace epd::model
