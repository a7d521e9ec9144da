// Embedded copy of model/configs/nano.json (a test checks that the two agree).

#include <string_view>

namespace epd::model {

std::string_view NanoConfigJson() {
  static constexpr std::string_view kJson = R"json({
  "architectures": [
    "DeepseekV41ForCausalLM"
  ],
  "model_type": "deepseek_v41",
  "dtype": "bfloat16",
  "bos_token_id": 0,
  "eos_token_id": 1,
  "pad_token_id": 2,
  "image_token_id": 2047,
  "quantization_config": {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [
      32,
      32
    ],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4"
  },
  "text_config": {
    "model_type": "deepseek_v41_text",
    "vocab_size": 2048,
    "hidden_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 64,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": false,
    "tie_word_embeddings": false,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "rope_scaling": {
      "type": "yarn",
      "factor": 16,
      "beta_fast": 32,
      "beta_slow": 1,
      "original_max_position_embeddings": 65536
    },
    "compress_rope_theta": 160000,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": true,
    "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    "compress_ratios": [
      0,
      0,
      2,
      2,
      2,
      2,
      1,
      1,
      1,
      1,
      1,
      1,
      0,
      0,
      0
    ],
    "kv_source_layer_ids": [
      2,
      4,
      6
    ],
    "index_source_layer_ids": [
      2,
      4,
      6,
      8,
      10
    ],
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 16,
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "engram_layer_ids": [
      1,
      3
    ],
    "engram_num_embeddings": [
      24738,
      25058
    ],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 4096,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 1796,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 2045,
    "dspark_target_layer_ids": [
      9,
      10,
      11
    ],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 3,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2
  },
  "vision_config": {
    "num_hidden_layers": 0,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "downsample_ratio": 3,
    "max_image_tokens": 1024
  }
}
)json";
  return kJson;
}

}  // namespace epd::model
