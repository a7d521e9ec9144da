#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/config.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

namespace fs = std::filesystem;

// Writes a safetensors file with the given tensors (name -> dtype, shape, bytes).
struct T {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};
void WriteSafetensors(const std::string& path, const std::vector<T>& ts, int64_t truncate_by = 0,
                      const std::string& header_override = "") {
  nlohmann::json h;
  int64_t off = 0;
  for (const T& t : ts) {
    h[t.name] = {{"dtype", t.dtype},
                 {"shape", t.shape},
                 {"data_offsets", {off, off + (int64_t)t.data.size()}}};
    off += t.data.size();
  }
  std::string hs = header_override.empty() ? h.dump() : header_override;
  std::ofstream out(path, std::ios::binary);
  uint64_t n = hs.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(hs.data(), hs.size());
  std::vector<uint8_t> all;
  for (const T& t : ts) all.insert(all.end(), t.data.begin(), t.data.end());
  all.resize(all.size() - truncate_by);
  out.write(reinterpret_cast<const char*>(all.data()), all.size());
}

TEST(SafetensorsTest, GoldenCheckpointLoadsWithAllTensors) {
  auto store =
      TensorStore::Open(testing::SourcePath("tests/data/golden/v41-tiny-a/model.safetensors"));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Names().size(), 826u);
  auto v = (*store)->Get("layers.2.attn.wq_a.weight", DType::kF8E4M3, {128, 256});
  EXPECT_TRUE(v.ok()) << v.status();
  auto cfg = LoadModelConfig(testing::SourcePath("tests/data/golden/v41-tiny-a/config.json"));
  ASSERT_TRUE(cfg.ok());
  auto w = ModelWeights::Load(*cfg, std::shared_ptr<const TensorStore>(std::move(*store)));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->layers.size(), 11u);
  EXPECT_EQ((*w)->layers[4].attn.cmp_wgate.size(), 0u);  // ratio-1 source: no wgate
  EXPECT_EQ((*w)->layers[2].attn.cmp_wgate.size(), 128u * 256u);
}

TEST(SafetensorsTest, ErrorsNameTheCause) {
  testing::TempDir dir;
  const std::string p = dir.path() + "/a.safetensors";
  std::vector<T> ts = {{"x.weight", "BF16", {2, 2}, std::vector<uint8_t>(8, 1)},
                       {"y.scale", "F8_E8M0", {3}, std::vector<uint8_t>(3, 127)}};
  WriteSafetensors(p, ts);
  auto ok = TensorStore::Open(p, false);
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto missing = (*ok)->Get("z.weight");
  EXPECT_NE(std::string(missing.status().message()).find("z.weight"), std::string::npos);
  auto shape = (*ok)->Get("x.weight", DType::kBF16, {4});
  EXPECT_NE(std::string(shape.status().message()).find("x.weight"), std::string::npos);
  EXPECT_NE(std::string(shape.status().message()).find("[2,2]"), std::string::npos);
  auto dtype = (*ok)->Get("x.weight", DType::kF32, {2, 2});
  EXPECT_NE(std::string(dtype.status().message()).find("BF16"), std::string::npos);

  WriteSafetensors(p, ts, /*truncate_by=*/2);
  auto trunc = TensorStore::Open(p, false);
  ASSERT_FALSE(trunc.ok());
  EXPECT_NE(std::string(trunc.status().message()).find("y.scale"), std::string::npos)
      << trunc.status();
  EXPECT_NE(std::string(trunc.status().message()).find("truncated"), std::string::npos);

  WriteSafetensors(p, ts, 0, "{\"x\": [1,2");
  auto bad = TensorStore::Open(p, false);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("header"), std::string::npos) << bad.status();

  WriteSafetensors(p, {{"x", "BF16", {3}, std::vector<uint8_t>(4, 0)}});
  auto size = TensorStore::Open(p, false);
  ASSERT_FALSE(size.ok());
  EXPECT_NE(std::string(size.status().message()).find("'x'"), std::string::npos) << size.status();

  std::ofstream(dir.path() + "/tiny.safetensors", std::ios::binary) << "abc";
  EXPECT_FALSE(TensorStore::Open(dir.path() + "/tiny.safetensors", false).ok());
}

// Found probing tests/fuzz/fuzz_safetensors (corpus: regress-shape-overflow): a shape whose element
// count overflows int64 (signed-overflow UB; wrapped, [2^32, 2^32] x F32 "needs" 0 bytes).
TEST(SafetensorsTest, ShapeWhoseByteSizeOverflowsIsRefused) {
  testing::TempDir dir;
  const std::string p = dir.path() + "/a.safetensors";
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {4294967296, 4294967296, 16}, {4294967296, 4294967296}, {INT64_MAX, 2}}) {
    WriteSafetensors(p, {{"big", "F32", shape, std::vector<uint8_t>(4, 0)}});
    auto st = SafetensorsFile::Open(p);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(std::string(st.status().message()).find("overflows"), std::string::npos)
        << st.status();
  }
  // A zero-sized tensor with huge other dims is still a valid, empty tensor.
  WriteSafetensors(p, {{"empty", "F32", {0, 4294967296, 4294967296}, {}}});
  auto ok = SafetensorsFile::Open(p);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->tensors().at("empty").bytes, 0);
}

TEST(SafetensorsTest, ShardedIndex) {
  testing::TempDir dir;
  WriteSafetensors(dir.path() + "/s1.safetensors", {{"a", "F32", {1}, std::vector<uint8_t>(4, 0)}});
  WriteSafetensors(dir.path() + "/s2.safetensors", {{"b", "I8", {2}, std::vector<uint8_t>(2, 0)}});
  nlohmann::json idx = {{"weight_map", {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}}}};
  std::ofstream(dir.path() + "/model.safetensors.index.json") << idx.dump();
  auto s = TensorStore::Open(dir.path(), false);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE((*s)->Has("a"));
  EXPECT_TRUE((*s)->Has("b"));
  idx["weight_map"]["c"] = "s2.safetensors";
  std::ofstream(dir.path() + "/model.safetensors.index.json") << idx.dump();
  auto m = TensorStore::Open(dir.path(), false);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(std::string(m.status().message()).find("'c'"), std::string::npos) << m.status();
  idx["weight_map"]["c"] = "s3.safetensors";
  std::ofstream(dir.path() + "/model.safetensors.index.json") << idx.dump();
  auto n = TensorStore::Open(dir.path(), false);
  ASSERT_FALSE(n.ok());
  EXPECT_NE(std::string(n.status().message()).find("s3.safetensors"), std::string::npos)
      << n.status();
}

TEST(SafetensorsTest, WrongShapeInCheckpointIsNamed) {
  auto cfg = LoadModelConfig(testing::SourcePath("tests/data/golden/v41-tiny-a/config.json"));
  ASSERT_TRUE(cfg.ok());
  cfg->q_lora_rank = 96;  // config now implies wq_a [96, 256]
  auto store = TensorStore::Open(
      testing::SourcePath("tests/data/golden/v41-tiny-a/model.safetensors"), false);
  ASSERT_TRUE(store.ok());
  auto w = ModelWeights::Load(*cfg, std::shared_ptr<const TensorStore>(std::move(*store)));
  ASSERT_FALSE(w.ok());
  EXPECT_NE(std::string(w.status().message()).find("layers.0.attn.q_norm.weight"),
            std::string::npos)
      << w.status();
}

}  // namespace
}  // namespace epd::model
