// decode_pool/grammar: JSON schema and tool-call grammars, the byte matcher (valid prefixes,
// completion), the budget rule (an output is always completable within the tokens left) and the
// token mask over a small vocabulary; random walks through the mask always end in valid JSON.
#include "grammar/grammar.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

namespace epd::grammar {
namespace {

using json = nlohmann::ordered_json;

std::shared_ptr<const Grammar> MustCompile(const json& c) {
  auto g = Compile(c.dump());
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

bool Accepts(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Matcher m(g);
  return m.Advance(text) && m.Complete();
}

const json kNested = {
    {"type", "object"},
    {"properties",
     {{"name", {{"type", "string"}}},
      {"age", {{"type", "integer"}}},
      {"tags", {{"type", "array"}, {"items", {{"type", "string"}}}, {"maxItems", 3}}},
      {"address",
       {{"type", "object"},
        {"properties", {{"city", {{"type", "string"}}}, {"zip", {{"type", "string"}}}}},
        {"required", {"city"}},
        {"additionalProperties", false}}},
      {"kind", {{"enum", {"a", "b", 3}}}},
      {"score", {{"anyOf", {{{"type", "number"}}, {{"type", "null"}}}}}},
      {"ok", {{"type", "boolean"}}},
      {"v", {{"const", "x"}}}}},
    {"required", {"name", "age", "address", "ok"}},
    {"additionalProperties", false}};

TEST(GrammarTest, NestedSchemaAcceptsValidAndRefusesInvalid) {
  auto g = MustCompile({{"type", "json_schema"}, {"schema", kNested}});
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(Accepts(g, R"({"name":"x\"y","age":-12,"address":{"city":"P"},"ok":true})"));
  EXPECT_TRUE(Accepts(g, R"({"name":"","age":0,"tags":["a","b"],"address":{"city":"","zip":"1"},)"
                         R"("kind":3,"score":1.5e-3,"ok":false,"v":"x"})"));
  EXPECT_TRUE(Accepts(g, R"({"name":"é","age":1,"address":{"city":"c"},"score":null,"ok":true})"));
  // Missing required, extra key, wrong type, too many items, bad enum, leading zero, trailing.
  EXPECT_FALSE(Accepts(g, R"({"name":"x","address":{"city":"P"},"ok":true})"));
  EXPECT_FALSE(Accepts(g, R"({"name":"x","age":1,"address":{"city":"P"},"ok":true,"zz":1})"));
  EXPECT_FALSE(Accepts(g, R"({"name":"x","age":1.5,"address":{"city":"P"},"ok":true})"));
  EXPECT_FALSE(Accepts(
      g, R"({"name":"x","age":1,"tags":["1","2","3","4"],"address":{"city":"P"},"ok":true})"));
  EXPECT_FALSE(Accepts(g, R"({"name":"x","age":1,"address":{"city":"P"},"kind":"c","ok":true})"));
  EXPECT_FALSE(Accepts(g, R"({"name":"x","age":01,"address":{"city":"P"},"ok":true})"));
  EXPECT_FALSE(Accepts(g, R"({"name":"x","age":1,"address":{"city":"P"},"ok":true} )"));
  // A valid prefix is not complete.
  Matcher m(g);
  EXPECT_TRUE(m.Advance(R"({"name":"x","ag)"));
  EXPECT_FALSE(m.Complete());
  EXPECT_GT(m.MinRemaining(), 0);
  EXPECT_FALSE(m.Advance("x"));  // "agx" is no key
}

TEST(GrammarTest, MinRemainingIsTheShortestCompletion) {
  auto g = MustCompile({{"type", "json_schema"}, {"schema", kNested}});
  Matcher m(g);
  // {"name":"","age":0,"address":{"city":""},"ok":true}
  EXPECT_EQ(m.MinRemaining(),
            static_cast<int64_t>(
                std::string(R"({"name":"","age":0,"address":{"city":""},"ok":true})").size()));
  ASSERT_TRUE(m.Advance(R"({"name":"abc)"));
  EXPECT_EQ(
      m.MinRemaining(),
      static_cast<int64_t>(std::string(R"(","age":0,"address":{"city":""},"ok":true})").size()));
}

TEST(GrammarTest, JsonObjectAndTopLevelNumbers) {
  auto obj = MustCompile({{"type", "json_object"}});
  EXPECT_TRUE(Accepts(obj, R"({"a":[1,{"b":null}],"c":"d","e":-0.5E+2})"));
  EXPECT_TRUE(Accepts(obj, "{}"));
  EXPECT_FALSE(Accepts(obj, "[1]"));
  EXPECT_FALSE(Accepts(obj, R"({"a":})"));
  auto num = MustCompile({{"type", "json_schema"}, {"schema", {{"type", "number"}}}});
  EXPECT_TRUE(Accepts(num, "12.5"));
  EXPECT_FALSE(Accepts(num, "12."));
}

TEST(GrammarTest, UnsupportedKeywordIsNamed) {
  auto g =
      Compile(json{{"type", "json_schema"},
                   {"schema",
                    {{"type", "object"},
                     {"properties", {{"id", {{"type", "string"}, {"not", {{"const", "a"}}}}}}}}}}
                  .dump());
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("'not'"), std::string::npos) << g.status();
  EXPECT_NE(g.status().message().find("$.properties.id"), std::string::npos) << g.status();
  auto r = Compile(
      json{{"type", "json_schema"},
           {"schema", {{"type", "object"}, {"properties", json::object()}, {"required", {"x"}}}}}
          .dump());
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(Compile("{\"type\":\"yaml\"}").ok());
}

// A hostile schema cannot exhaust the stack: nesting beyond 32 levels is a named refusal, and
// constraint flags of the wrong JSON type are refusals, not exceptions.
TEST(GrammarTest, DeepNestingAndMistypedFlagsAreRefused) {
  auto nested = [](int levels) {
    json s = {{"type", "integer"}};
    for (int i = 0; i < levels; ++i) s = {{"type", "array"}, {"items", s}};
    return json{{"type", "json_schema"}, {"schema", s}};
  };
  auto ok = Compile(nested(30).dump());
  ASSERT_TRUE(ok.ok()) << ok.status();
  Matcher m(*ok);
  EXPECT_TRUE(m.Advance(std::string(30, '[') + "7" + std::string(30, ']')));
  EXPECT_TRUE(m.Complete());
  auto deep = Compile(nested(400).dump());
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.status().message().find("nested deeper than 32"), std::string::npos)
      << deep.status();
  EXPECT_FALSE(Compile(R"({"type":"json_object","thinking":"yes"})").ok());
  EXPECT_FALSE(
      Compile(R"({"type":"tool_calls","tools":[{"name":"f"}],"parallel":{}})").ok());
}

TEST(GrammarTest, ToolCallsInDsml) {
  const json tools = json::array(
      {{{"name", "get_weather"},
        {"parameters",
         {{"type", "object"},
          {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
          {"required", {"city"}}}}},
       {{"name", "noop"}}});
  auto one = MustCompile({{"type", "tool_calls"}, {"tools", tools}, {"parallel", false}});
  const std::string d =
      "\xEF\xBD\x9C"
      "DSML\xEF\xBD\x9C";
  const std::string call = "<" + d + " invoke name=\"get_weather\">\n<" + d +
                           " parameter name=\"city\" string=\"false\">\"Paris\"</" + d +
                           " parameter>\n</" + d + " invoke>\n";
  const std::string noop = "<" + d + " invoke name=\"noop\">\n</" + d + " invoke>\n";
  const std::string open = "<" + d + " calls>\n", close = "</" + d + " calls>";
  EXPECT_TRUE(Accepts(one, open + call + close));
  EXPECT_TRUE(Accepts(one, open + noop + close));
  EXPECT_FALSE(Accepts(one, open + call + noop + close));  // not parallel
  EXPECT_FALSE(Accepts(one, open + close));                // at least one call
  auto par = MustCompile({{"type", "tool_calls"}, {"tools", tools}, {"parallel", true}});
  EXPECT_TRUE(Accepts(par, open + call + noop + close));
  auto think = MustCompile({{"type", "tool_calls"}, {"tools", tools}, {"thinking", true}});
  EXPECT_TRUE(Accepts(think, "let me see</think>" + open + noop + close));
}

// A vocabulary of every single byte plus some multi-byte pieces; random walks through the mask
// (uniform over allowed tokens, EOS when allowed with probability 1/4) end in a complete match
// within the budget every time.
TEST(GrammarTest, RandomWalksThroughTheMaskAlwaysEndValid) {
  std::vector<std::string> vocab;
  for (int b = 0; b < 256; ++b) vocab.push_back(std::string(1, static_cast<char>(b)));
  for (const char* piece :
       {"{\"", "\":", "\",\"", "name", "age", "true", "null", "12", "\"}", "]}", "abc", "\\n", "é"})
    vocab.push_back(piece);
  const int32_t eos = static_cast<int32_t>(vocab.size());
  vocab.push_back("");
  TokenMasker masker(vocab, {}, eos);
  auto g = MustCompile({{"type", "json_schema"}, {"schema", kNested}});
  std::mt19937 rng(7);
  std::vector<uint8_t> allowed;
  for (int sample = 0; sample < 20; ++sample) {
    Matcher m(g);
    std::string out;
    const int max_tokens = 80;
    int n = 0;
    for (; n < max_tokens; ++n) {
      const int count = masker.Mask(m, max_tokens - n - 1, &allowed);
      ASSERT_GT(count, 0);
      std::vector<int32_t> ids;
      for (size_t i = 0; i < allowed.size(); ++i)
        if (allowed[i]) ids.push_back(static_cast<int32_t>(i));
      if (allowed[static_cast<size_t>(eos)] && rng() % 4 == 0) break;
      int32_t id = ids[rng() % ids.size()];
      if (id == eos) break;
      ASSERT_TRUE(m.Advance(vocab[static_cast<size_t>(id)]));
      out += vocab[static_cast<size_t>(id)];
    }
    EXPECT_TRUE(m.Complete()) << out;
    auto parsed = json::parse(out, nullptr, false);
    ASSERT_FALSE(parsed.is_discarded()) << out;
    EXPECT_TRUE(parsed.contains("name") && parsed.contains("age") && parsed.contains("address"))
        << out;
    EXPECT_TRUE(parsed["age"].is_number()) << out;
  }
}

TEST(GrammarTest, CacheCompilesOncePerConstraint) {
  GrammarCache cache(2);
  const std::string a = R"({"type":"json_object"})";
  ASSERT_TRUE(cache.Get(a).ok());
  auto again = cache.Get(a);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(cache.misses(), 1);
  EXPECT_FALSE(cache.Get(R"({"type":"bad"})").ok());
}

}  // namespace
}  // namespace epd::grammar
