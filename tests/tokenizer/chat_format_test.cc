#include "tokenizer/chat_format.h"

#include <gtest/gtest.h>

#include <random>

#include "model/nano/nano_generator.h"
#include "tokenizer/tokenizer.h"

namespace epd::model {
namespace {

using json = nlohmann::json;

const std::string kBos = "<｜begin▁of▁sentence｜>";
const std::string kEos = "<｜end▁of▁sentence｜>";

ChatMessage Msg(std::string role, std::string content, std::string reasoning = "") {
  ChatMessage m;
  m.role = std::move(role);
  m.content = std::move(content);
  m.reasoning_content = std::move(reasoning);
  return m;
}

const std::string kWeatherCall =
    "<｜DSML｜ calls>\n"
    "<｜DSML｜ invoke name=\"get_weather\">\n"
    "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n"
    "<｜DSML｜ parameter name=\"days\" string=\"false\">3</｜DSML｜ parameter>\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>";

TEST(ChatFormatTest, ChatModeSystemAndUser) {
  auto s = RenderChat({Msg("system", "You are helpful."), Msg("user", "Hi")}, {}, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, kBos + "<｜System｜>You are helpful.<｜User｜>Hi<｜Assistant｜></think>");
}

TEST(ChatFormatTest, ThinkingModeWithEffortLine) {
  ChatRenderOptions o;
  o.thinking = true;
  o.reasoning_effort = *ParseReasoningEffort("high");
  auto s = RenderChat({Msg("user", "Hi")}, {}, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(
      *s,
      kBos +
          "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough "
          "the reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>");
  // Chat mode never writes the effort line.
  o.thinking = false;
  EXPECT_EQ(*RenderChat({Msg("user", "Hi")}, {}, o), kBos + "<｜User｜>Hi<｜Assistant｜></think>");
}

TEST(ChatFormatTest, EarlierTurnsDropReasoning) {
  ChatRenderOptions o;
  o.thinking = true;
  auto s = RenderChat({Msg("user", "Q1"), Msg("assistant", "A1", "R1"), Msg("user", "Q2")}, {}, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, kBos + "<｜User｜>Q1<｜Assistant｜></think>A1" + kEos +
                    "<｜User｜>Q2<｜Assistant｜><think>");
}

TEST(ChatFormatTest, ToolLoopKeepsCurrentReasoningAndMergesResults) {
  ChatRenderOptions o;
  o.thinking = true;
  ChatMessage call = Msg("assistant", "", "R");
  call.tool_calls = {{"get_weather", R"({"city": "Paris", "days": 3})"}};
  auto s = RenderChat({Msg("user", "Q"), call, Msg("tool", "sunny"), Msg("tool", "rainy")}, {}, o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, kBos + "<｜User｜>Q<｜Assistant｜><think>R</think>" + kWeatherCall + kEos +
                    "<｜User｜><tool_result>sunny</tool_result><tool_result>rainy</tool_result>"
                    "<｜Assistant｜><think>");
  // Content before the calls is separated by a blank line; chat mode.
  call.content = "Let me check.";
  auto c = RenderChat({Msg("user", "Q"), call, Msg("tool", "sunny"), Msg("user", "and tomorrow?")},
                      {}, {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(
      *c, kBos + "<｜User｜>Q<｜Assistant｜></think>Let me check.\n\n" + kWeatherCall + kEos +
              "<｜User｜><tool_result>sunny</tool_result>\n\nand tomorrow?<｜Assistant｜></think>");
}

TEST(ChatFormatTest, MidConversationSystemTriggersAssistantHeader) {
  auto s =
      RenderChat({Msg("user", "Q"), Msg("assistant", "A"), Msg("system", "Be brief.")}, {}, {});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, kBos + "<｜User｜>Q<｜Assistant｜></think>A" + kEos +
                    "<｜System｜>Be brief.<｜Assistant｜></think>");
}

TEST(ChatFormatTest, ToolsGoIntoTheSystemPrompt) {
  json tool = json::parse(R"({"type": "function", "function": {"name": "get_weather",
      "description": "Weather of a city", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}}}})");
  auto s = RenderChat({Msg("system", "sys"), Msg("user", "Q")}, {tool}, {});
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->starts_with(kBos + "<｜System｜>sys\n\n## Tools\n\n")) << *s;
  EXPECT_NE(s->find(tool["function"].dump() + "\n"), std::string::npos);
  EXPECT_TRUE(s->ends_with("<｜User｜>Q<｜Assistant｜></think>"));
}

TEST(ChatFormatTest, RenderErrors) {
  EXPECT_FALSE(RenderChat({Msg("robot", "x")}, {}, {}).ok());
  EXPECT_FALSE(RenderChat({Msg("user", "Q"), Msg("tool", "orphan")}, {}, {}).ok());
  ChatMessage bad = Msg("assistant", "");
  bad.tool_calls = {{"f", "not json"}};
  auto st = RenderChat({Msg("user", "Q"), bad}, {}, {});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("not a JSON object"), std::string::npos);
  ChatRenderOptions o;
  o.reasoning_effort = 0;
  EXPECT_FALSE(RenderChat({Msg("user", "Q")}, {}, o).ok());
}

TEST(ChatFormatTest, ReasoningEffortAliases) {
  EXPECT_EQ(*ParseReasoningEffort("low"), 25);
  EXPECT_EQ(*ParseReasoningEffort("medium"), 50);
  EXPECT_EQ(*ParseReasoningEffort("high"), 75);
  EXPECT_EQ(*ParseReasoningEffort("max"), 100);
  EXPECT_EQ(*ParseReasoningEffort("60"), 60);
  EXPECT_FALSE(ParseReasoningEffort("0").ok());
  EXPECT_FALSE(ParseReasoningEffort("101").ok());
  EXPECT_FALSE(ParseReasoningEffort("xhigh").ok());
  EXPECT_FALSE(ParseReasoningEffort("5x").ok());
}

TEST(ChatFormatTest, ParsesReasoningContentAndToolCalls) {
  auto p = ParseCompletion("R</think>Let me check.\n\n" + kWeatherCall + kEos + "junk", true);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->reasoning, "R");
  EXPECT_EQ(p->content, "Let me check.");
  EXPECT_TRUE(p->finished);
  ASSERT_EQ(p->tool_calls.size(), 1u);
  EXPECT_EQ(p->tool_calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(p->tool_calls[0].arguments),
            json::parse(R"({"city": "Paris", "days": 3})"));
  // Unfinished reasoning; chat mode; plain content.
  auto u = ParseCompletion("still thinking", true);
  EXPECT_EQ(u->reasoning, "still thinking");
  EXPECT_EQ(u->content, "");
  EXPECT_FALSE(u->finished);
  auto c = ParseCompletion("Hello!" + kEos, false);
  EXPECT_EQ(c->content, "Hello!");
  EXPECT_EQ(c->reasoning, "");
  EXPECT_TRUE(c->tool_calls.empty());
}

TEST(ChatFormatTest, ToolCallsRoundTrip) {
  std::vector<ToolCall> calls = {
      {"search",
       R"({"query":"a \"quoted\" <b>","limit":5,"filters":{"lang":["en","fr"]},"exact":true})"},
      {"noargs", "{}"}};
  auto text = RenderToolCalls(calls);
  ASSERT_TRUE(text.ok());
  auto p = ParseCompletion(*text, false);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->tool_calls.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(p->tool_calls[i].name, calls[i].name);
    EXPECT_EQ(json::parse(p->tool_calls[i].arguments), json::parse(calls[i].arguments));
  }
}

TEST(ChatFormatTest, MalformedDsmlIsNamed) {
  auto a = ParseCompletion("x<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n", false);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("not terminated"), std::string::npos);
  auto b = ParseCompletion(
      "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"n\" "
      "string=\"false\">"
      "{oops</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
      false);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("not JSON"), std::string::npos);
}

TEST(ChatFormatTest, StreamingParserMatchesWholeTextParse) {
  const std::vector<std::pair<std::string, bool>> cases = {
      {"<think>R1 </thi\nnk> still</think>Hello\n\nworld" + kEos + "ignored", true},
      {"R</think>Let me check.\n\n" + kWeatherCall + kEos, true},
      {"</think>Plain answer with <｜DSML｜ not a call and \n\n trailing\n", false},
      {"Sure.\n" + kWeatherCall + "\n" + kWeatherCall + kEos, false},
      {"unfinished reasoning <｜end", true},
      {"", true},
  };
  std::mt19937 rng(7);
  for (const auto& [text, thinking] : cases) {
    auto whole = ParseCompletion(text, thinking);
    ASSERT_TRUE(whole.ok()) << text;
    for (int trial = 0; trial < 20; ++trial) {
      StreamingCompletionParser p(thinking);
      std::string reasoning, content;
      std::vector<ToolCall> calls;
      auto take = [&](const StreamingCompletionParser::Delta& d) {
        reasoning += d.reasoning;
        content += d.content;
        calls.insert(calls.end(), d.tool_calls.begin(), d.tool_calls.end());
      };
      size_t i = 0;
      while (i < text.size()) {
        const size_t n = trial == 0 ? 1 : 1 + rng() % 9;
        auto d = p.Add(std::string_view(text).substr(i, n));
        ASSERT_TRUE(d.ok()) << d.status();
        take(*d);
        i += n;
      }
      auto f = p.Finish();
      ASSERT_TRUE(f.ok());
      take(*f);
      EXPECT_EQ(content, whole->content) << text;
      EXPECT_EQ(reasoning, whole->reasoning) << text;
      ASSERT_EQ(calls.size(), whole->tool_calls.size()) << text;
      for (size_t k = 0; k < calls.size(); ++k) EXPECT_EQ(calls[k], whole->tool_calls[k]);
      EXPECT_EQ(p.finished(), true);
    }
  }
  // Content interleaved between two call blocks streams as content.
  StreamingCompletionParser p(false);
  auto d = p.Add("A\n\n" + kWeatherCall + " then B");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->content, "A then B");
  EXPECT_EQ(d->tool_calls.size(), 1u);
  EXPECT_EQ(ParseCompletion("A\n\n" + kWeatherCall + " then B", false)->content, "A then B");
  StreamingCompletionParser bad(false);
  ASSERT_TRUE(bad.Add("<｜DSML｜ calls>\n<｜DSML｜ invoke").ok());
  EXPECT_FALSE(bad.Finish().ok());
}

TEST(ChatFormatTest, OpenAiMessages) {
  auto m = MessagesFromOpenAi(json::parse(R"([
    {"role": "developer", "content": "sys"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function",
      "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
    {"role": "tool", "tool_call_id": "1", "content": "ok"}])"));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 4u);
  EXPECT_EQ((*m)[0].role, "system");
  EXPECT_EQ((*m)[1].content, "ab");
  EXPECT_EQ((*m)[2].tool_calls[0], (ToolCall{"f", "{\"x\": 1}"}));
  EXPECT_FALSE(MessagesFromOpenAi(json::parse(R"([{"content": "x"}])")).ok());
  EXPECT_FALSE(
      MessagesFromOpenAi(json::parse(R"([{"role": "user", "content": [{"type": "image_url"}]}])"))
          .ok());
}

TEST(ChatFormatTest, RenderedPromptTokenizesProtocolTokens) {
  auto tok = Tokenizer::FromJson(*NanoTokenizerJson());
  ASSERT_TRUE(tok.ok());
  ChatRenderOptions o;
  o.thinking = true;
  auto s = RenderChat({Msg("system", "S"), Msg("user", "Hello")}, {}, o);
  std::vector<int32_t> ids = (*tok)->Encode(*s);
  EXPECT_EQ(ids.front(), 0);
  EXPECT_EQ(ids[1], *(*tok)->TokenId("<｜System｜>"));
  EXPECT_EQ(ids[ids.size() - 2], *(*tok)->TokenId("<｜Assistant｜>"));
  EXPECT_EQ(ids.back(), *(*tok)->TokenId("<think>"));
  EXPECT_EQ(*(*tok)->Decode(ids), *s);
}

// Found by tests/fuzz/fuzz_dsml (corpus: regress-invalid-utf8-parameter): a string parameter with
// invalid UTF-8 made the arguments' JSON dump throw out of the parser.
TEST(ChatFormatTest, InvalidUtf8InAToolCallParameterIsReplacedNotThrown) {
  const std::string text = std::string("<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n") +
                           "<｜DSML｜ parameter name=\"a\" string=\"true\">x\xff\xfey" +
                           "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  auto parsed = ParseCompletion(text, /*thinking=*/false);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->tool_calls.size(), 1u);
  EXPECT_EQ(parsed->tool_calls[0].arguments, "{\"a\":\"x\xef\xbf\xbd\xef\xbf\xbdy\"}");
}

}  // namespace
}  // namespace epd::model
