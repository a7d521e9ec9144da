#include "model/nano/nano_generator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "model/engram_constants.h"
#include "model/safetensors_writer.h"
#include "tokenizer/tokenizer.h"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

using json = nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct TensorInfo {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
  bool operator==(const TensorInfo& o) const { return dtype == o.dtype && shape == o.shape; }
};

// Minimal header reader for the test (the product reader lives elsewhere).
struct Safetensors {
  std::map<std::string, TensorInfo> tensors;
  std::string bytes;
  uint64_t data_start = 0;
  const char* Data(const std::string& name) const {
    return bytes.data() + data_start + tensors.at(name).begin;
  }
};

Safetensors Read(const std::string& path) {
  Safetensors s;
  s.bytes = ReadFile(path);
  EXPECT_GE(s.bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(s.bytes[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u);
  json h = json::parse(s.bytes.substr(8, n));
  s.data_start = 8 + n;
  uint64_t expect_off = 0;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    TensorInfo t{it.value()["dtype"], it.value()["shape"].get<std::vector<int64_t>>(),
                 it.value()["data_offsets"][0], it.value()["data_offsets"][1]};
    s.tensors[it.key()] = t;
  }
  for (const auto& [name, t] : s.tensors) {  // contiguous, in name order
    EXPECT_EQ(t.begin, expect_off) << name;
    expect_off = t.end;
  }
  EXPECT_EQ(s.data_start + expect_off, s.bytes.size());
  return s;
}

std::map<std::string, TensorInfo> GoldenLayout() {
  std::map<std::string, TensorInfo> out;
  std::istringstream in(ReadFile(testing::SourcePath("tests/model/data/v41_tiny_a_layout.txt")));
  std::string name, dtype, shape;
  while (in >> name >> dtype >> shape) {
    TensorInfo t{dtype, {}};
    std::stringstream ss(shape);
    std::string d;
    while (std::getline(ss, d, ',')) t.shape.push_back(std::stoll(d));
    out[name] = t;
  }
  return out;
}

json GoldenConfig() {
  // shared/golden/v41-tiny-a/config.json (text_config only; the generator reads nothing else).
  return json::parse(
      R"({"text_config": {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_lora_rank": 64,
    "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0], "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 6], "index_n_heads": 4, "index_head_dim": 128, "hc_mult": 4,
    "engram_layer_ids": [1, 3], "engram_num_embeddings": [3688, 3904], "engram_max_ngram_size": 4,
    "engram_n_heads": 2, "engram_head_dim": 32, "num_nextn_predict_layers": 3,
    "dspark_target_layer_ids": [5, 6, 7], "dspark_markov_rank": 32, "dspark_n_routed_experts": 4}})");
}

TEST(NanoGeneratorTest, GoldenConfigGivesTheGoldenTensorLayout) {
  testing::TempDir dir;
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 41001, dir.path()).ok());
  Safetensors s = Read(dir.File("model.safetensors"));
  const auto golden = GoldenLayout();
  ASSERT_EQ(golden.size(), 826u);
  EXPECT_EQ(s.tensors.size(), golden.size());
  for (const auto& [name, t] : golden) {
    auto it = s.tensors.find(name);
    ASSERT_NE(it, s.tensors.end()) << "missing " << name;
    EXPECT_EQ(it->second, t) << name << " " << it->second.dtype;
  }
  // The golden checkpoint itself, when the golden directory has been copied into the repo.
  const std::string gpath = testing::SourcePath("tests/data/golden/v41-tiny-a/model.safetensors");
  if (std::filesystem::exists(gpath)) {
    Safetensors g = Read(gpath);
    EXPECT_EQ(g.tensors, s.tensors);
    EXPECT_EQ(g.bytes.size(), s.bytes.size());
  }
  // The index names every tensor.
  json index = json::parse(ReadFile(dir.File("model.safetensors.index.json")));
  EXPECT_EQ(index["weight_map"].size(), 826u);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), s.bytes.size() - s.data_start);
}

TEST(NanoGeneratorTest, DeterministicPerSeed) {
  testing::TempDir a, b, c;
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 5, a.path()).ok());
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 5, b.path()).ok());
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 6, c.path()).ok());
  EXPECT_EQ(ReadFile(a.File("model.safetensors")), ReadFile(b.File("model.safetensors")));
  EXPECT_NE(ReadFile(a.File("model.safetensors")), ReadFile(c.File("model.safetensors")));
}

// The threaded builder (a release-config layer's gigabytes, cuda_model_bench): its bytes depend
// on the seed, not on the thread count; they are not the one-thread checkpoint's; the tensor
// layout is the same; and its values are the same distribution (each BF16 norm weight near 1).
TEST(NanoGeneratorTest, ThreadedBuilderIsDeterministicPerSeedWhateverTheThreads) {
  testing::TempDir one, two, three, other;
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 5, one.path()).ok());
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 5, two.path(), 2).ok());
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 5, three.path(), 3).ok());
  ASSERT_TRUE(GenerateCheckpoint(GoldenConfig(), 6, other.path(), 2).ok());
  const std::string a = ReadFile(two.File("model.safetensors"));
  EXPECT_EQ(a, ReadFile(three.File("model.safetensors")));
  EXPECT_NE(a, ReadFile(one.File("model.safetensors")));
  EXPECT_NE(a, ReadFile(other.File("model.safetensors")));
  Safetensors threaded = Read(two.File("model.safetensors"));
  Safetensors single = Read(one.File("model.safetensors"));
  EXPECT_EQ(threaded.tensors, single.tensors);  // names, dtypes, shapes, offsets
}

TEST(NanoGeneratorTest, BadConfigNamesTheField) {
  testing::TempDir dir;
  json cfg = GoldenConfig();
  cfg["text_config"].erase("q_lora_rank");
  absl::Status st = GenerateCheckpoint(cfg, 1, dir.path());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("q_lora_rank"), std::string::npos) << st;
  cfg = GoldenConfig();
  cfg["text_config"]["compress_ratios"] = {0, 0};
  st = GenerateCheckpoint(cfg, 1, dir.path());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("compress_ratios"), std::string::npos) << st;
}

float Bf16ToFloat(const char* p) {
  const uint32_t b = (static_cast<uint32_t>(static_cast<uint8_t>(p[1])) << 24) |
                     (static_cast<uint32_t>(static_cast<uint8_t>(p[0])) << 16);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

double E4m3ToDouble(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double mag =
      e == 0 ? (m / 8.0) * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (c & 0x80) ? -mag : mag;
}

class NanoModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    status_ = new absl::Status(GenerateNanoModel(dir_->path(), kNanoDefaultSeed));
  }
  static void TearDownTestSuite() {
    delete dir_;
    delete status_;
  }
  static testing::TempDir* dir_;
  static absl::Status* status_;
};
testing::TempDir* NanoModelTest::dir_ = nullptr;
absl::Status* NanoModelTest::status_ = nullptr;

TEST_F(NanoModelTest, WritesAConsistentModelDirectory) {
  ASSERT_TRUE(status_->ok()) << *status_;
  const json config = json::parse(ReadFile(dir_->File("config.json")));
  EXPECT_EQ(config, json::parse(ReadFile(testing::SourcePath("model/configs/nano.json"))));
  EXPECT_EQ(config, json::parse(NanoConfigJson()));
  const json& tc = config["text_config"];
  auto tok = Tokenizer::FromFile(dir_->File("tokenizer.json"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), tc["vocab_size"].get<int32_t>());
  EXPECT_EQ((*tok)->TokenId("<｜System｜>"), tc["dspark_noise_token_id"].get<int32_t>());
  auto engram = EngramConstants::Load(dir_->File("engram_constants.json"));
  ASSERT_TRUE(engram.ok()) << engram.status();
  EXPECT_EQ(engram->num_embeddings, tc["engram_num_embeddings"].get<std::vector<int64_t>>());
  EXPECT_EQ(engram->compressed_vocab_size, tc["engram_compressed_vocab_size"].get<int64_t>());
  EXPECT_EQ(engram->token_map.size(), 2048u);
  EXPECT_EQ(engram->pad_id, engram->token_map[2]);
  json tcfg = json::parse(ReadFile(dir_->File("tokenizer_config.json")));
  EXPECT_FALSE(tcfg["add_bos_token"].get<bool>());
}

TEST_F(NanoModelTest, TensorLayoutFollowsTheLayerRoles) {
  ASSERT_TRUE(status_->ok()) << *status_;
  Safetensors s = Read(dir_->File("model.safetensors"));
  auto has = [&](const std::string& n) { return s.tensors.contains(n); };
  for (int l = 0; l < 12; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".attn.";
    const bool kv_source = l == 2 || l == 4 || l == 6;
    EXPECT_EQ(has(p + "compressor.wkv.weight"), kv_source) << l;
    EXPECT_EQ(has(p + "compressor.wgate.weight"), l == 2 || l == 4) << l;  // ratio-2 sources only
    EXPECT_EQ(has(p + "indexer.wk.weight"), kv_source) << l;
    EXPECT_EQ(has(p + "indexer.wq_b.weight"), kv_source || l == 8 || l == 10) << l;
    EXPECT_EQ(has("layers." + std::to_string(l) + ".engram.embed.weight"), l == 1 || l == 3) << l;
    EXPECT_TRUE(has(p + "wq_a.scale"));
    EXPECT_TRUE(has("layers." + std::to_string(l) + ".ffn.experts.7.w2.weight"));
  }
  for (int st = 0; st < 3; ++st) {
    const std::string p = "mtp." + std::to_string(st) + ".";
    EXPECT_TRUE(has(p + "ffn.experts.3.w1.weight"));
    EXPECT_FALSE(has(p + "ffn.experts.4.w1.weight"));
    EXPECT_FALSE(has(p + "embed.weight"));
    EXPECT_FALSE(has(p + "head.weight"));
    EXPECT_FALSE(has(p + "attn.compressor.wkv.weight"));
  }
  EXPECT_EQ(s.tensors.at("mtp.0.main_proj.weight").shape, (std::vector<int64_t>{256, 768}));
  EXPECT_EQ(s.tensors.at("mtp.2.markov_head.head.weight").shape, (std::vector<int64_t>{2048, 32}));
  EXPECT_EQ(s.tensors.at("mtp.2.confidence_head.proj.weight").shape,
            (std::vector<int64_t>{1, 288}));
  EXPECT_EQ(s.tensors.at("layers.1.engram.embed.weight"), (TensorInfo{"F8_E4M3", {24738, 32}}));
  EXPECT_EQ(s.tensors.at("layers.3.engram.embed.scale"), (TensorInfo{"F8_E8M0", {25058, 1}}));
  EXPECT_EQ(s.tensors.at("layers.0.ffn.experts.0.w1.weight"), (TensorInfo{"I8", {64, 128}}));
  EXPECT_EQ(s.tensors.at("layers.0.ffn.experts.0.w1.scale"), (TensorInfo{"F8_E8M0", {64, 8}}));
  EXPECT_EQ(s.tensors.at("layers.0.attn.wq_b.scale"), (TensorInfo{"F8_E8M0", {16, 4}}));
  EXPECT_EQ(s.tensors.at("embed.weight"), (TensorInfo{"BF16", {2048, 256}}));
  EXPECT_EQ(s.tensors.at("layers.0.hc_attn_fn"), (TensorInfo{"F32", {24, 1024}}));
}

TEST_F(NanoModelTest, QuantizedWeightsAreWellScaled) {
  ASSERT_TRUE(status_->ok()) << *status_;
  Safetensors s = Read(dir_->File("model.safetensors"));
  // FP8 wq_a [128, 256]: dequantized std ~ 1/sqrt(256); every 32x32 block uses its range.
  const char* w = s.Data("layers.0.attn.wq_a.weight");
  const char* sc = s.Data("layers.0.attn.wq_a.scale");
  double sum2 = 0;
  std::vector<double> block_amax(4 * 8, 0);
  for (int r = 0; r < 128; ++r) {
    for (int c = 0; c < 256; ++c) {
      const uint8_t code = static_cast<uint8_t>(w[r * 256 + c]);
      ASSERT_NE(code & 0x7F, 0x7F) << "NaN code";
      const double q = E4m3ToDouble(code);
      const double v = q * std::ldexp(1.0, static_cast<uint8_t>(sc[(r / 32) * 8 + c / 32]) - 127);
      sum2 += v * v;
      block_amax[static_cast<size_t>((r / 32) * 8 + c / 32)] =
          std::max(block_amax[static_cast<size_t>((r / 32) * 8 + c / 32)], std::fabs(q));
    }
  }
  EXPECT_NEAR(std::sqrt(sum2 / (128 * 256)), 1 / 16.0, 0.1 / 16);
  for (double a : block_amax) EXPECT_GE(a, 224.0);  // pow2 scale is the tightest >= amax/448
  // FP4 expert w1 [64, 256] packed: both nibbles carry values (low = even element), std ~ 4/16.
  const char* e = s.Data("layers.0.ffn.experts.0.w1.weight");
  const char* es = s.Data("layers.0.ffn.experts.0.w1.scale");
  static const double kE2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  double e2 = 0;
  int low_nonzero = 0, high_nonzero = 0;
  for (int r = 0; r < 64; ++r) {
    for (int k = 0; k < 128; ++k) {
      const auto byte = static_cast<uint8_t>(e[r * 128 + k]);
      for (int half = 0; half < 2; ++half) {
        const uint8_t code = half == 0 ? (byte & 0xF) : (byte >> 4);
        const int col = 2 * k + half;
        const double v = (code & 8 ? -1 : 1) * kE2m1[code & 7] *
                         std::ldexp(1.0, static_cast<uint8_t>(es[r * 8 + col / 32]) - 127);
        e2 += v * v;
        (half == 0 ? low_nonzero : high_nonzero) += (code & 7) != 0;
      }
    }
  }
  EXPECT_NEAR(std::sqrt(e2 / (64 * 256)), 0.25, 0.04);
  EXPECT_GT(low_nonzero, 4000);
  EXPECT_GT(high_nonzero, 4000);
  // BF16 norms centre on 1, embeddings have unit scale.
  double n = 0;
  for (int i = 0; i < 256; ++i) n += Bf16ToFloat(s.Data("norm.weight") + 2 * i);
  EXPECT_NEAR(n / 256, 1.0, 0.03);
}

TEST(SafetensorsWriterTest, RejectsBadTensors) {
  SafetensorsWriter w;
  EXPECT_TRUE(w.Add("a", "F32", {2}, std::string(8, '\0')).ok());
  EXPECT_EQ(w.Add("a", "F32", {2}, std::string(8, '\0')).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(w.Add("b", "F32", {3}, std::string(8, '\0')).ok());
  EXPECT_FALSE(w.Add("c", "Q4", {1}, std::string(1, '\0')).ok());
  EXPECT_FALSE(w.Add("__metadata__", "I8", {1}, std::string(1, '\0')).ok());
  EXPECT_TRUE(w.Add("b", "BF16", {1, 3}, std::string(6, '\x01')).ok());
  testing::TempDir dir;
  ASSERT_TRUE(w.Write(dir.File("x.safetensors")).ok());
  Safetensors s = Read(dir.File("x.safetensors"));
  EXPECT_EQ(s.tensors.at("b").shape, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(s.tensors.at("a").begin, 0u);
  EXPECT_EQ(s.tensors.at("b").begin, 8u);
  EXPECT_FALSE(w.Write("/nonexistent-dir/x.safetensors").ok());
}

}  // namespace
}  // namespace epd::model
