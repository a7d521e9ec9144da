#include "model/engram_constants.h"

#include <gtest/gtest.h>

#include "model/nano/nano_generator.h"
#include "tokenizer/tokenizer.h"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

using json = nlohmann::json;

// The Engram fields of shared/golden/v41-tiny-a/config.json.
json GoldenTextConfig() {
  return json::parse(R"({"engram_layer_ids": [1, 3], "engram_num_embeddings": [3688, 3904],
    "engram_max_ngram_size": 4, "engram_vocab_size": 600, "engram_n_heads": 2, "engram_head_dim": 32,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 512})");
}

std::vector<int32_t> Identity(int n) {
  std::vector<int32_t> m(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) m[static_cast<size_t>(i)] = i;
  return m;
}

TEST(EngramConstantsTest, MatchesGoldenReadme) {
  auto c = ComputeEngramConstants(GoldenTextConfig(), Identity(512), 512);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->multipliers,
            (std::vector<std::vector<int64_t>>{
                {14831304026200453, 936705081716061, 6959601268494069, 14319439928568407},
                {5327545137947969, 15804252993068197, 2105304604748359, 13605204602324401}}));
  EXPECT_EQ(c->primes,
            (std::vector<std::vector<std::vector<int64_t>>>{{{601, 607}, {613, 617}, {619, 631}},
                                                            {{641, 643}, {647, 653}, {659, 661}}}));
  EXPECT_EQ(c->offsets,
            (std::vector<std::vector<std::vector<int64_t>>>{
                {{0, 601}, {1208, 1821}, {2438, 3057}}, {{0, 641}, {1284, 1931}, {2584, 3243}}}));
  EXPECT_EQ(c->num_embeddings, (std::vector<int64_t>{3688, 3904}));
  EXPECT_EQ(c->pad_id, 2);
}

TEST(EngramConstantsTest, NumpyPcg64MatchesNumpy) {
  // numpy.random.default_rng(42).random() == 0.7739560485559633
  NumpyPcg64 rng(42);
  EXPECT_DOUBLE_EQ(rng.NextDouble(), 0.7739560485559633);
  // The multipliers are odd and inside the bound.
  for (int64_t m : EngramMultipliers(14, 4, 99092)) {
    EXPECT_EQ(m % 2, 1);
    EXPECT_LT(m, std::numeric_limits<int64_t>::max() / 99092);
  }
}

TEST(EngramConstantsTest, ConfigMismatchIsNamed) {
  json tc = GoldenTextConfig();
  tc["engram_num_embeddings"] = {3688, 3905};
  auto c = ComputeEngramConstants(tc, Identity(512), 512);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("engram_num_embeddings"), std::string::npos);
  tc = GoldenTextConfig();
  auto c2 = ComputeEngramConstants(tc, Identity(512), 500);
  ASSERT_FALSE(c2.ok());
  EXPECT_NE(c2.status().message().find("engram_compressed_vocab_size"), std::string::npos);
  tc.erase("engram_n_heads");
  auto c3 = ComputeEngramConstants(tc, Identity(512), 512);
  ASSERT_FALSE(c3.ok());
  EXPECT_NE(c3.status().message().find("engram_n_heads"), std::string::npos);
}

TEST(EngramConstantsTest, NormalizationPipeline) {
  EXPECT_EQ(EngramNormalize("Café"), "cafe");
  EXPECT_EQ(EngramNormalize("  Hello\t\n World "), "hello world");
  EXPECT_EQ(EngramNormalize(" "), " ");         // lone-space sentinel
  EXPECT_EQ(EngramNormalize("\n\n"), " ");      // collapses to the sentinel
  EXPECT_EQ(EngramNormalize("ＡＢＣ"), "abc");  // NFKC folds full-width forms
  EXPECT_EQ(EngramNormalize("ﬁ"), "fi");
  EXPECT_EQ(EngramNormalize("Ñandú"), "nandu");
  EXPECT_EQ(EngramNormalize("<｜User｜>"), "<|user|>");
  EXPECT_EQ(EngramNormalize(""), "");
}

TEST(EngramConstantsTest, NanoTokenMap) {
  auto text = NanoTokenizerJson();
  ASSERT_TRUE(text.ok());
  auto tok = Tokenizer::FromJson(*text);
  ASSERT_TRUE(tok.ok());
  int64_t classes = 0;
  std::vector<int32_t> map = BuildCompressedTokenMap(**tok, &classes);
  ASSERT_EQ(map.size(), 2048u);
  EXPECT_LT(classes, 2048);
  EXPECT_GT(classes, 1000);
  // Classes are numbered by first occurrence.
  int32_t next = 0;
  for (int32_t c : map) {
    ASSERT_LE(c, next);
    if (c == next) ++next;
  }
  EXPECT_EQ(next, classes);
  // Case folds together; incomplete UTF-8 bytes are keyed by their own token string.
  EXPECT_EQ(map[3 + 'A'], map[3 + 'a']);
  EXPECT_NE(map[3 + 0x80], map[3 + 0x81]);
  EXPECT_NE(map[3 + 'a'], map[3 + 'b']);
}

TEST(EngramConstantsTest, JsonRoundTripAndValidation) {
  auto c = ComputeEngramConstants(GoldenTextConfig(), Identity(512), 512);
  ASSERT_TRUE(c.ok());
  testing::TempDir dir;
  ASSERT_TRUE(c->Save(dir.File("engram_constants.json")).ok());
  auto back = EngramConstants::Load(dir.File("engram_constants.json"));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->multipliers, c->multipliers);
  EXPECT_EQ(back->primes, c->primes);
  EXPECT_EQ(back->offsets, c->offsets);
  EXPECT_EQ(back->token_map, c->token_map);
  EXPECT_EQ(back->pad_id, 2);
  json j = c->ToJson();
  j["primes"][0].erase(0);
  EXPECT_FALSE(EngramConstants::FromJson(j).ok());
  j = c->ToJson();
  j["token_map"][5] = 512;
  EXPECT_FALSE(EngramConstants::FromJson(j).ok());
  EXPECT_FALSE(EngramConstants::Load(dir.File("missing.json")).ok());
}

}  // namespace
}  // namespace epd::model
