#pragma once

// DeepSeek-V4.1-Flash model configuration (MODEL.md §1) and the layer roles derived from it.
//
// Parsing accepts the HF config.json (fields nested under "text_config", or a flat text config)
// and the flat inference/config.json ModelArgs aliases (dim, n_layers, window_size, ...). Layer
// roles (SWA-only, Full, Reindex, Reuse, candidate source, which KV/index source a layer reads)
// are derived from compress_ratios and the source-layer lists, never hard-coded.
//
// Thread-safety: plain value types; const access is thread-safe.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epd::model {

// How a layer's attention obtains its global (compressed) KV and its top-k.
enum class LayerMode {
  kSwaOnly,  // compress ratio 0: window only.
  kFull,     // KV source: own compressor + indexer keys (+ queries).
  kReindex,  // own indexer queries on the latest KV source's index keys (candidate-masked).
  kReuse,    // uses the latest KV source's compressed KV and the latest index source's top-k.
};

std::string_view LayerModeName(LayerMode mode);

// Role of one layer (main layers 0..n_layers-1 and DSpark stages n_layers..n_layers+n_mtp-1).
struct LayerRole {
  int layer = 0;
  int compress_ratio = 0;
  LayerMode mode = LayerMode::kSwaOnly;
  bool is_kv_source = false;         // owns compressor + indexer keys
  bool has_wgate = false;            // ratio-2 compressor (softmax-gated pooling)
  bool is_index_source = false;      // owns indexer queries (wq_b, weights_proj)
  bool is_candidate_source = false;  // publishes the candidate block mask
  bool uses_candidates = false;      // index source after the candidate source: masks scores
  int kv_source = -1;                // layer whose compressed KV it reads (-1: none)
  int index_key_source = -1;         // layer whose index keys its queries score against
  int topk_source = -1;              // layer whose top-k it uses (itself if index source)
  bool has_engram = false;           // Engram applied to the residual before the block
  bool is_dspark_target = false;     // its input (mean over streams) feeds DSpark
  bool is_dspark_stage = false;      // mtp.S stage (SWA-only attention, own MoE size)
};

struct ModelConfig {
  // Dims.
  int64_t vocab_size = 0;
  int64_t dim = 0;     // hidden_size
  int n_layers = 0;    // num_hidden_layers
  int n_heads = 0;     // num_attention_heads
  int n_kv_heads = 1;  // num_key_value_heads; Default: 1
  int head_dim = 0;
  int rope_head_dim = 0;  // qk_rope_head_dim
  int64_t q_lora_rank = 0;
  int64_t o_lora_rank = 0;
  int o_groups = 0;
  float swiglu_limit = 10.f;  // Default: 10
  float norm_eps = 1e-20f;    // rms_norm_eps; Default: 1e-20
  // RoPE.
  int64_t max_position_embeddings = 0;
  double rope_theta = 10000.0;
  double compress_rope_theta = 160000.0;
  double rope_factor = 16.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  int64_t original_seq_len = 65536;
  // MoE.
  int n_routed_experts = 0;
  int n_shared_experts = 1;
  int n_activated_experts = 0;  // num_experts_per_tok
  int64_t moe_inter_dim = 0;    // moe_intermediate_size
  std::string score_func = "sqrtsoftplus";
  bool norm_topk_prob = true;
  float route_scale = 1.f;  // routed_scaling_factor
  // Attention / compression.
  int window_size = 0;               // sliding_window
  std::vector<int> compress_ratios;  // n_layers + n_mtp_layers entries
  std::vector<int> kv_source_layers;
  std::vector<int> index_source_layers;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  int candidate_source_layer = -1;
  int candidate_topk_blocks = 0;
  int candidate_block_size = 0;
  // mHC.
  int hc_mult = 0;
  int hc_sinkhorn_iters = 0;
  float hc_eps = 1e-6f;
  // Engram.
  std::vector<int> engram_layer_ids;
  std::vector<int64_t> engram_num_embeddings;
  int engram_max_ngram_size = 0;
  int64_t engram_vocab_size = 0;
  int engram_n_heads = 0;
  int engram_head_dim = 0;
  int engram_pad_id = 2;
  int64_t engram_compressed_vocab_size = 0;
  // DSpark.
  int n_mtp_layers = 0;  // num_nextn_predict_layers
  int dspark_block_size = 0;
  int64_t dspark_noise_token_id = 0;
  std::vector<int> dspark_target_layer_ids;
  int dspark_markov_rank = 0;
  int dspark_n_routed_experts = 0;
  int dspark_n_activated_experts = 0;
  // Tokens.
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;
  int64_t pad_token_id = 2;
  int64_t image_token_id = -1;
  // Quantization (top-level quantization_config); informational, checked by Validate.
  int weight_block_size = 32;  // Default: 32 (32x32 FP8 blocks)
  int vision_n_layers = 0;

  // Total layers with attention state: n_layers + n_mtp_layers.
  int total_layers() const { return n_layers + n_mtp_layers; }
  int nope_head_dim() const { return head_dim - rope_head_dim; }
  // The indexer's weight scale c = index_head_dim^-0.5 * index_n_heads^-0.5 as the reference
  // applies it: a Python float multiplying a bf16 tensor, which torch rounds to bf16 first
  // (double -> float -> bf16), so bf16(c), not fp32(c); they differ when c is not a power of two.
  float index_weight_scale() const;

  // Returns OK or InvalidArgument naming the first bad or missing field.
  [[nodiscard]] absl::Status Validate() const;

  // Derived roles of all total_layers() layers. Requires Validate() to be OK.
  std::vector<LayerRole> Roles() const;
};

// Parses config JSON text (HF nested text_config, flat text config, or inference/config.json).
// Does not validate; call Validate().
[[nodiscard]] absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text);
// Reads and parses a file, then validates it.
[[nodiscard]] absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// KV layout accounting (MODEL.md §4), bytes.
struct KvLayout {
  int64_t main_entry_bytes = 0;        // one packed compressed-latent entry (E2M1 + E4M3 per 16)
  int64_t index_key_bytes = 0;         // one packed index key (E2M1 + UE8M0 per 32)
  int64_t swa_slot_bytes = 0;          // one SWA ring slot (FP8 + UE8M0 per 32)
  int64_t swa_bytes_per_layer = 0;     // window * slot
  int64_t swa_bytes_per_sequence = 0;  // all total_layers() rings
  double global_bytes_per_token = 0;   // sum over KV sources of (entry + key) / ratio
  int64_t compressor_state_bytes = 0;  // fp32 kv/score tails of ratio>1 sources
  std::vector<std::pair<std::string, double>> per_source;  // "layer.N" -> bytes/token
};
KvLayout ComputeKvLayout(const ModelConfig& config);
// Ordered name/value pairs for printing.
std::vector<std::pair<std::string, std::string>> KvLayoutPairs(const ModelConfig& config);
// One "name: value" per line, incl. global_bytes_per_token and swa_bytes_per_layer_slot.
std::string FormatKvLayout(const ModelConfig& config);

}  // namespace epd::model
