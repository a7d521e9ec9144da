#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <random>
#include <thread>

#include "tokenizer/bpe_trainer.h"
#include "model/nano/nano_generator.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

using json = nlohmann::json;

const Tokenizer& Nano() {
  static const Tokenizer* t = [] {
    auto text = NanoTokenizerJson();
    EXPECT_TRUE(text.ok()) << text.status();
    auto tok = Tokenizer::FromJson(*text);
    EXPECT_TRUE(tok.ok()) << tok.status();
    return tok->release();
  }();
  return *t;
}

std::string Cp(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

std::string RandomUtf8(std::mt19937& rng, int len) {
  static const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x20, 0x7E},     {0x20, 0x7E},       {0x20, 0x7E},     {'\n', '\n'},     {'\t', '\t'},
      {0xA0, 0x17F},    {0x300, 0x36F},     {0x400, 0x4FF},   {0x4E00, 0x9FA5}, {0x3040, 0x30FF},
      {0xAC00, 0xD7A3}, {0x1F300, 0x1F64F}, {0x2000, 0x206F}, {0xFF01, 0xFF5E}, {'0', '9'}};
  std::string s;
  for (int i = 0; i < len; ++i) {
    const auto& r = ranges[rng() % ranges.size()];
    s += Cp(static_cast<char32_t>(r.first + rng() % (r.second - r.first + 1)));
  }
  return s;
}

TEST(TokenizerTest, NanoVocabLayout) {
  const Tokenizer& t = Nano();
  EXPECT_EQ(t.vocab_size(), 2048);
  EXPECT_EQ(t.TokenId("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_EQ(t.TokenId("<｜end▁of▁sentence｜>"), 1);
  EXPECT_EQ(t.TokenId("<｜▁pad▁｜>"), 2);
  EXPECT_EQ(t.TokenId("<｜deepseek_image｜>"), 2047);
  for (const char* s :
       {"<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜System｜>"}) {
    ASSERT_TRUE(t.TokenId(s).has_value()) << s;
    EXPECT_TRUE(t.IsAddedToken(*t.TokenId(s))) << s;
  }
  EXPECT_TRUE(t.IsSpecial(0));
  EXPECT_FALSE(t.IsSpecial(*t.TokenId("<｜System｜>")));  // V4.1: normalized, not special
  EXPECT_EQ(t.TokenString(3 + 'a'), "a");                 // byte tokens at 3..258
  EXPECT_FALSE(t.TokenId("no such token").has_value());
}

TEST(TokenizerTest, NanoTrainingIsDeterministic) {
  auto a = NanoTokenizerJson();
  auto b = NanoTokenizerJson();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
}

TEST(TokenizerTest, SpecialTokensInTextMapToTheirIds) {
  const Tokenizer& t = Nano();
  const int32_t user = *t.TokenId("<｜User｜>"), asst = *t.TokenId("<｜Assistant｜>");
  const int32_t think = *t.TokenId("<think>");
  std::vector<int32_t> ids = t.Encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>");
  ASSERT_GE(ids.size(), 5u);
  EXPECT_EQ(ids.front(), 0);
  EXPECT_EQ(ids[1], user);
  EXPECT_EQ(ids[ids.size() - 2], asst);
  EXPECT_EQ(ids.back(), think);
  // EncodeOrdinary does not recognise them.
  std::vector<int32_t> plain = t.EncodeOrdinary("<｜User｜>");
  EXPECT_EQ(std::count(plain.begin(), plain.end(), user), 0);
  EXPECT_EQ(*t.Decode(plain), "<｜User｜>");
  // Adjacent added tokens and partial prefixes.
  EXPECT_EQ(t.Encode("<think></think>"), (std::vector<int32_t>{think, *t.TokenId("</think>")}));
  auto partial = t.Encode("<thin");
  EXPECT_EQ(std::count(partial.begin(), partial.end(), think), 0);
}

TEST(TokenizerTest, RoundTripRandomUtf8) {
  const Tokenizer& t = Nano();
  std::mt19937 rng(1234);
  for (int i = 0; i < 300; ++i) {
    const std::string s = RandomUtf8(rng, 1 + static_cast<int>(rng() % 60));
    auto ids = t.Encode(s);
    auto back = t.Decode(ids);
    ASSERT_TRUE(back.ok());
    ASSERT_EQ(*back, s) << "case " << i;
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < t.vocab_size());
  }
}

TEST(TokenizerTest, RoundTripArbitraryBytes) {
  const Tokenizer& t = Nano();
  std::mt19937 rng(99);
  for (int i = 0; i < 200; ++i) {
    std::string s;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) s += static_cast<char>(rng() & 0xFF);
    ASSERT_EQ(*t.Decode(t.Encode(s)), s) << "case " << i;
  }
}

TEST(TokenizerTest, CompressesCorpusText) {
  const Tokenizer& t = Nano();
  const std::string text = "The weather is nice today. I think that this is a good idea.";
  auto ids = t.Encode(text);
  EXPECT_LT(ids.size(), text.size() / 3) << "merges are not applied";
  EXPECT_EQ(*t.Decode(ids), text);
}

TEST(TokenizerTest, PreTokenizerFollowsDeepSeekSplits) {
  const Tokenizer& t = Nano();
  auto bl = [](const std::string& raw) {
    std::string m;
    for (char c : raw) m += Tokenizer::ByteToUnicode()[static_cast<uint8_t>(c)];
    return m;
  };
  std::vector<std::string> expected;
  for (const char* w : {"Hello", " world", " ", "123", "45", " ", "你好", "abc", "!!\n\n", "x"}) {
    expected.push_back(bl(w));
  }
  EXPECT_EQ(t.PreTokenize("Hello world 12345 你好abc!!\n\nx"), expected);
}

json MiniTokenizer(const std::vector<std::string>& merges) {
  json vocab = json::object();
  int id = 0;
  for (const std::string& b : Tokenizer::ByteToUnicode()) vocab[b] = id++;
  for (const char* s : {"ab", "bc", "abc"}) vocab[s] = id++;
  json j;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}};
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  j["decoder"] = {{"type", "ByteLevel"}};
  j["added_tokens"] =
      json::array({{{"id", id}, {"content", "<X>"}, {"special", true}, {"rstrip", true}}});
  return j;
}

TEST(TokenizerTest, MergesApplyInRankOrder) {
  auto t1 = Tokenizer::FromJson(MiniTokenizer({"a b", "ab c"}).dump());
  ASSERT_TRUE(t1.ok()) << t1.status();
  EXPECT_EQ((*t1)->Encode("abc"), (std::vector<int32_t>{*(*t1)->TokenId("abc")}));
  auto t2 = Tokenizer::FromJson(MiniTokenizer({"b c", "a b", "ab c"}).dump());
  ASSERT_TRUE(t2.ok());
  // "b c" has the lower rank, so "abc" becomes a + bc and "ab c" never applies.
  EXPECT_EQ((*t2)->Encode("abc"),
            (std::vector<int32_t>{*(*t2)->TokenId("a"), *(*t2)->TokenId("bc")}));
  // rstrip on the added token swallows following whitespace.
  EXPECT_EQ((*t2)->Encode("<X>   a"),
            (std::vector<int32_t>{*(*t2)->TokenId("<X>"), *(*t2)->TokenId("a")}));
  // Array-form merges are accepted too.
  json j = MiniTokenizer({});
  j["model"]["merges"] = json::array({json::array({"a", "b"})});
  auto t3 = Tokenizer::FromJson(j.dump());
  ASSERT_TRUE(t3.ok()) << t3.status();
  EXPECT_EQ((*t3)->Encode("ab"), (std::vector<int32_t>{*(*t3)->TokenId("ab")}));
}

TEST(TokenizerTest, NormalizerSequenceAppliesBeforeBpe) {
  json j = MiniTokenizer({"a b"});
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers", json::array({{{"type", "NFKC"}}, {{"type", "Lowercase"}}})}};
  auto t = Tokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->Encode("ＡB"), (*t)->Encode("ab"));  // full-width A, upper-case B
  EXPECT_EQ((*t)->Encode("ab"), (std::vector<int32_t>{*(*t)->TokenId("ab")}));
  j["normalizer"] = {{"type", "Replace"}};
  EXPECT_FALSE(Tokenizer::FromJson(j.dump()).ok());
}

TEST(TokenizerTest, ConcurrentEncodeIsSafe) {
  const Tokenizer& t = Nano();
  const std::string text = std::string(NanoCorpus().substr(0, 2000));
  const std::vector<int32_t> expected = t.Encode(text);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        if (t.Encode(text) != expected) ++mismatches;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(TokenizerTest, BadFilesNameTheProblem) {
  auto expect_error = [](const std::string& text, const std::string& needle) {
    auto t = Tokenizer::FromJson(text);
    ASSERT_FALSE(t.ok()) << needle;
    EXPECT_NE(t.status().message().find(needle), std::string::npos) << t.status();
  };
  expect_error("not json", "not a JSON object");
  expect_error("{}", "no \"model\"");
  json j = MiniTokenizer({"a b"});
  j["model"]["type"] = "WordPiece";
  expect_error(j.dump(), "WordPiece");
  j = MiniTokenizer({"a q"});
  expect_error(j.dump(), "merge 0");
  j = MiniTokenizer({});
  j["model"]["vocab"].erase("a");
  expect_error(j.dump(), "byte 97");
  j = MiniTokenizer({});
  j["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  expect_error(j.dump(), "regex");
  j = MiniTokenizer({});
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  expect_error(j.dump(), "Metaspace");
  auto missing = Tokenizer::FromFile("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/tokenizer.json"), std::string::npos);
  EXPECT_FALSE(Nano().Decode(std::vector<int32_t>{5000}).ok());
}

TEST(TokenizerTest, FromFileRoundTrip) {
  testing::TempDir dir;
  {
    std::ofstream out(dir.File("tokenizer.json"));
    out << *NanoTokenizerJson();
  }
  auto t = Tokenizer::FromFile(dir.File("tokenizer.json"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->Encode("hello world"), Nano().Encode("hello world"));
}

TEST(TokenizerTest, IncrementalDetokenizerEmitsOnlyCompleteUtf8) {
  const Tokenizer& t = Nano();
  const std::string text = "héllo 你好 🙂 ok";
  // Byte tokens one by one: a 4-byte emoji must come out in one piece.
  IncrementalDetokenizer d(t);
  std::string all;
  for (char c : text) {
    const int32_t id = 3 + static_cast<uint8_t>(c);
    auto piece = d.Add(id);
    ASSERT_TRUE(piece.ok());
    EXPECT_TRUE(IsValidUtf8(*piece));
    // A lead byte produces nothing until its character completes.
    if (static_cast<uint8_t>(c) >= 0xC0) {
      EXPECT_TRUE(piece->empty());
    }
    all += *piece;
  }
  all += d.Flush();
  EXPECT_EQ(all, text);
  // Encoded ids too.
  IncrementalDetokenizer d2(t);
  std::string all2;
  for (int32_t id : t.Encode(text)) all2 += *d2.Add(id);
  EXPECT_EQ(all2 + d2.Flush(), text);
  // A truncated character is flushed as U+FFFD; an invalid byte is replaced immediately.
  IncrementalDetokenizer d3(t);
  EXPECT_EQ(*d3.Add(3 + 0xE4), "");
  EXPECT_EQ(d3.Flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(*d3.Add(3 + 0xFF), "\xEF\xBF\xBD");
}

TEST(TokenizerTest, LossyDecodeMatchesRustSemantics) {
  EXPECT_EQ(Utf8Lossy("a\x80z"), "a\xEF\xBF\xBDz");
  EXPECT_EQ(Utf8Lossy("\xE4\xBD"), "\xEF\xBF\xBD");    // truncated: one replacement
  EXPECT_EQ(Utf8Lossy("\xE4\xBDx"), "\xEF\xBF\xBDx");  // maximal subpart
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_TRUE(IsValidUtf8("你好🙂"));
  EXPECT_FALSE(IsValidUtf8("\xC0\xAF"));
}

}  // namespace
}  // namespace epd::model
