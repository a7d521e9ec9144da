#include "model/config.h"

#include <gtest/gtest.h>

#include <cmath>

#include <fstream>
#include <sstream>

#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

std::string Read(const std::string& rel) {
  std::ifstream in(testing::SourcePath(rel));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(ConfigTest, OfficialConfigGives890BytesPerToken) {
  auto c =
      LoadModelConfig(testing::SourcePath("tests/data/configs/deepseek-v4.1-flash/config.json"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_layers, 40);
  EXPECT_EQ(c->compress_ratios.size(), 43u);
  EXPECT_EQ(c->norm_eps, 1e-20f);
  KvLayout k = ComputeKvLayout(*c);
  EXPECT_EQ(k.main_entry_bytes, 288);
  EXPECT_EQ(k.index_key_bytes, 68);
  EXPECT_EQ(k.swa_slot_bytes, 528);
  EXPECT_EQ(k.global_bytes_per_token, 890);
  const std::string text = FormatKvLayout(*c);
  EXPECT_NE(text.find("global_bytes_per_token: 890\n"), std::string::npos) << text;
  EXPECT_NE(text.find("swa_bytes_per_layer_slot: 528\n"), std::string::npos) << text;
}

TEST(ConfigTest, OfficialRolesAreDerived) {
  auto c =
      LoadModelConfig(testing::SourcePath("tests/data/configs/deepseek-v4.1-flash/config.json"));
  ASSERT_TRUE(c.ok());
  auto roles = c->Roles();
  ASSERT_EQ(roles.size(), 43u);
  EXPECT_EQ(roles[0].mode, LayerMode::kSwaOnly);
  EXPECT_EQ(roles[1].mode, LayerMode::kSwaOnly);
  EXPECT_TRUE(roles[1].has_engram);
  EXPECT_EQ(roles[2].mode, LayerMode::kFull);
  EXPECT_TRUE(roles[2].has_wgate);
  EXPECT_EQ(roles[7].mode, LayerMode::kReuse);
  EXPECT_EQ(roles[7].kv_source, 2);
  EXPECT_EQ(roles[13].kv_source, 8);
  EXPECT_EQ(roles[20].mode, LayerMode::kFull);
  EXPECT_FALSE(roles[20].has_wgate);
  EXPECT_TRUE(roles[20].is_candidate_source);
  EXPECT_EQ(roles[24].mode, LayerMode::kReindex);
  EXPECT_TRUE(roles[24].uses_candidates);
  EXPECT_EQ(roles[24].index_key_source, 20);
  EXPECT_EQ(roles[24].kv_source, 20);
  EXPECT_EQ(roles[25].mode, LayerMode::kReuse);
  EXPECT_EQ(roles[25].topk_source, 24);
  EXPECT_EQ(roles[21].topk_source, 20);
  EXPECT_TRUE(roles[39].is_dspark_target);
  EXPECT_TRUE(roles[40].is_dspark_stage);
  EXPECT_EQ(roles[40].mode, LayerMode::kSwaOnly);
}

TEST(ConfigTest, GoldenTinyConfigsParseAndAgree) {
  auto hf = LoadModelConfig(testing::SourcePath("tests/data/golden/v41-tiny-a/config.json"));
  ASSERT_TRUE(hf.ok()) << hf.status();
  auto flat =
      LoadModelConfig(testing::SourcePath("tests/data/golden/v41-tiny-a/inference_config.json"));
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_EQ(hf->dim, 256);
  EXPECT_EQ(flat->dim, 256);
  EXPECT_EQ(hf->compress_ratios, flat->compress_ratios);
  EXPECT_EQ(hf->kv_source_layers, flat->kv_source_layers);
  EXPECT_EQ(hf->index_source_layers, flat->index_source_layers);
  EXPECT_EQ(hf->candidate_source_layer, flat->candidate_source_layer);
  EXPECT_EQ(hf->engram_num_embeddings, flat->engram_num_embeddings);
  EXPECT_EQ(hf->dspark_n_activated_experts, flat->dspark_n_activated_experts);
  EXPECT_EQ(hf->rope_factor, flat->rope_factor);
  EXPECT_EQ(hf->original_seq_len, flat->original_seq_len);
  auto roles = hf->Roles();
  EXPECT_EQ(roles[3].mode, LayerMode::kReuse);
  EXPECT_EQ(roles[3].kv_source, 2);
  EXPECT_EQ(roles[6].mode, LayerMode::kReindex);
  EXPECT_EQ(roles[7].topk_source, 6);
  EXPECT_EQ(roles[7].kv_source, 4);
}

// Mutates the golden HF config and expects an error naming `field`.
void ExpectBad(const std::function<void(nlohmann::json&)>& mutate, const std::string& field) {
  auto j = nlohmann::json::parse(Read("tests/data/golden/v41-tiny-a/config.json"));
  mutate(j);
  auto c = ParseModelConfig(j.dump());
  absl::Status s = c.ok() ? c->Validate() : c.status();
  ASSERT_FALSE(s.ok()) << "expected an error for " << field;
  EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
}

TEST(ConfigTest, BrokenConfigsNameTheField) {
  ExpectBad([](auto& j) { j["text_config"].erase("hidden_size"); }, "hidden_size");
  ExpectBad([](auto& j) { j["text_config"]["compress_ratios"].erase(0); }, "compress_ratios");
  ExpectBad(
      [](auto& j) {
        j["text_config"]["kv_source_layer_ids"] = {4, 2};
      },
      "kv_source_layer_ids");
  ExpectBad([](auto& j) { j["text_config"]["candidate_source_layer_id"] = 6; },
            "candidate_source_layer_id");
  // A KV source, but not the last one (the decoder layers must own no global KV).
  ExpectBad([](auto& j) { j["text_config"]["candidate_source_layer_id"] = 2; },
            "candidate_source_layer_id");
  ExpectBad([](auto& j) { j["text_config"]["vocab_size"] = "big"; }, "vocab_size");
  ExpectBad([](auto& j) { j["text_config"]["engram_num_embeddings"] = {1}; },
            "engram_num_embeddings");
  ExpectBad(
      [](auto& j) {
        j["text_config"]["dspark_target_layer_ids"] = {5, 99};
      },
      "dspark_target_layer_ids");
  ExpectBad([](auto& j) { j["text_config"]["num_attention_heads"] = 3; }, "o_groups");
  ExpectBad(
      [](auto& j) {
        j["quantization_config"]["weight_block_size"] = {128, 128};
      },
      "weight_block_size");
  EXPECT_FALSE(ParseModelConfig("{not json").ok());
}


// The indexer's weight scale is bf16(c) (torch rounds the Python scalar to the bf16 tensor's
// dtype): with 6 heads c = 128^-0.5 * 6^-0.5 = 0.0360843..., fp32 0x3d13cd3a, bf16 0x3d14 =
// 0.0361328125; with 8 heads c = 2^-5 either way.
TEST(ConfigTest, IndexWeightScaleIsBf16OfTheScalar) {
  ModelConfig c;
  c.index_head_dim = 128;
  c.index_n_heads = 6;
  EXPECT_EQ(c.index_weight_scale(), 0.0361328125f);
  EXPECT_NE(c.index_weight_scale(), static_cast<float>(std::pow(128.0, -0.5) * std::pow(6.0, -0.5)));
  c.index_n_heads = 8;
  EXPECT_EQ(c.index_weight_scale(), 0x1p-5f);
  c.index_n_heads = 64;  // the release config: 128^-0.5 * 64^-0.5 = 2^-6.5, not a power of two
  EXPECT_EQ(c.index_weight_scale(), 0.01104736328125f);
}

}  // namespace
}  // namespace epd::model
