// Text handling in the router: UTF-8 checks, the byte codec (chat rendering, detokenizer,
// assistant parsing), and the streaming splitter / stop matcher, checked against the one-shot
// parse at every split point.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "services/router/byte_text_codec.h"
#include "services/router/router_core.h"
#include "services/router/utf8.h"

namespace epd::services::router {
namespace {

const std::string kDsmlOpen = "<\xEF\xBD\x9C" "DSML\xEF\xBD\x9C";
const std::string kDsmlClose = "</\xEF\xBD\x9C" "DSML\xEF\xBD\x9C";

TEST(Utf8Test, ValidatesPerRfc3629) {
  EXPECT_TRUE(IsValidUtf8("plain"));
  EXPECT_TRUE(IsValidUtf8("Gr\xC3\xBC\xC3\x9F" "e \xE4\xB8\x96 \xF0\x9F\x98\x80"));
  EXPECT_FALSE(IsValidUtf8("\xC3\x28"));          // bad continuation
  EXPECT_FALSE(IsValidUtf8("\xC0\xAF"));          // overlong
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));      // surrogate
  EXPECT_FALSE(IsValidUtf8("\xF4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xE4\xB8"));          // truncated
}

TEST(ByteCodecTest, DetokenizerOnlyEmitsCompleteCharacters) {
  ByteTextCodec codec;
  const std::string text = "a\xE4\xB8\x96\xF0\x9F\x98\x80z";
  auto detok = codec.NewDetokenizer();
  std::string out;
  std::vector<std::string> deltas;
  for (unsigned char c : text) {
    deltas.push_back(detok->Push(c));
    EXPECT_TRUE(IsValidUtf8(deltas.back()));
    out += deltas.back();
  }
  out += detok->Flush();
  EXPECT_EQ(out, text);
  EXPECT_EQ(deltas[1], "");                    // first byte of a 3-byte character held
  EXPECT_EQ(deltas[3], "\xE4\xB8\x96");        // released when complete
  // Ill-formed bytes become U+FFFD at once; a truncated tail at Flush too.
  auto d2 = codec.NewDetokenizer();
  EXPECT_EQ(d2->Push(0xFF), "\xEF\xBF\xBD");
  EXPECT_EQ(d2->Push(0xE4), "");
  EXPECT_EQ(d2->Flush(), "\xEF\xBF\xBD");
}

// A model without a tokenizer whose vocabulary is larger than the bytes (the golden sets): every
// id of the model is a valid prompt id, and an id past 255 has no text; a smaller vocabulary
// still gets the 256 bytes.
TEST(ByteCodecTest, TakesTheModelsVocabularyAndIdsPastTheBytesHaveNoText) {
  EXPECT_EQ(ByteTextCodec().vocab_size(), 256);
  EXPECT_EQ(ByteTextCodec(100).vocab_size(), 256);
  const ByteTextCodec codec(600);
  EXPECT_EQ(codec.vocab_size(), 600);
  auto detok = codec.NewDetokenizer();
  std::string out = detok->Push('a');
  out += detok->Push(300);
  out += detok->Push(599);
  out += detok->Push('b');
  out += detok->Flush();
  EXPECT_EQ(out, "ab");
  EXPECT_EQ(codec.TokenBytes(300), "");
  EXPECT_EQ(codec.TokenBytes('a'), "a");
}

TEST(ByteCodecTest, RendersTheChatShapeWithEffortToolsAndToolResults) {
  ByteTextCodec codec;
  ChatRenderInput in;
  in.thinking = true;
  in.reasoning_effort = "max";
  in.tools_json = R"([{"type":"function","function":{"name":"f"}}])";
  in.messages = {{.role = "system", .content = "be brief"},
                 {.role = "user", .content = "q1"},
                 {.role = "assistant",
                  .content = "a1",
                  .reasoning_content = "old thoughts",
                  .tool_calls = {{"c1", "f", R"({"k":"v"})"}}},
                 {.role = "tool", .content = "result", .tool_call_id = "c1"}};
  auto text = codec.RenderChatText(in);
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("Reasoning Effort: 100 (range 1-100"), std::string::npos);
  EXPECT_NE(text->find("be brief"), std::string::npos);
  EXPECT_NE(text->find("\"name\":\"f\""), std::string::npos);
  EXPECT_EQ(text->find("old thoughts"), std::string::npos);  // earlier turns drop reasoning
  EXPECT_NE(text->find("<tool_result>result</tool_result>"), std::string::npos);
  EXPECT_NE(text->find(kDsmlOpen + " parameter name=\"k\" string=\"true\">v"), std::string::npos);
  EXPECT_EQ(text->substr(text->size() - 7), "<think>");  // thinking mode opens <think>
  in.thinking = false;
  text = codec.RenderChatText(in);
  EXPECT_EQ(text->substr(text->size() - 8), "</think>");
  EXPECT_EQ(text->find("Reasoning Effort"), std::string::npos);  // thinking mode only
  in.reasoning_effort = "extreme";
  EXPECT_EQ(codec.RenderChat(in).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ByteCodecTest, ParsesReasoningContentAndToolCalls) {
  ByteTextCodec codec;
  const std::string calls = RenderDsmlToolCalls(
      {{"", "get", R"({"city":"Paris","n":3,"deep":{"a":[1,2]}})"}, {"", "other", "{}"}});
  auto p = codec.ParseAssistant("hmm</think>Sure." + calls, /*thinking=*/true, true);
  EXPECT_EQ(p.reasoning, "hmm");
  EXPECT_EQ(p.content, "Sure.");
  ASSERT_EQ(p.tool_calls.size(), 2u);
  EXPECT_EQ(p.tool_calls[0].name, "get");
  EXPECT_EQ(nlohmann::json::parse(p.tool_calls[0].arguments_json),
            nlohmann::json::parse(R"({"city":"Paris","n":3,"deep":{"a":[1,2]}})"));
  EXPECT_EQ(p.tool_calls[1].name, "other");
  // Without tools the block stays text; an unterminated block stays text.
  EXPECT_EQ(codec.ParseAssistant("x" + calls, false, false).content, "x" + calls);
  const std::string cut = "x" + calls.substr(0, calls.size() - 5);
  EXPECT_EQ(codec.ParseAssistant(cut, false, true).content, cut);
  // Thinking that never ends is all reasoning.
  EXPECT_EQ(codec.ParseAssistant("still thinking", true, true).reasoning, "still thinking");
}

// Streams `text` through the splitter in pieces cut at `cut` and returns the concatenation.
Delta SplitAt(const std::string& text, size_t cut, bool thinking, bool tools) {
  AssistantSplitter s(AssistantMarkers{}, thinking, tools);
  Delta total;
  for (const auto& piece : {text.substr(0, cut), text.substr(cut)}) {
    Delta d = s.Push(piece);
    total.reasoning += d.reasoning;
    total.content += d.content;
  }
  Delta d = s.Finish();
  total.reasoning += d.reasoning;
  total.content += d.content;
  return total;
}

TEST(AssistantSplitterTest, StreamedPartsEqualTheOneShotParseAtEverySplitPoint) {
  ByteTextCodec codec;
  const std::string text = "why</think>The answer <is> 42." +
                           RenderDsmlToolCalls({{"", "f", R"({"a":"b"})"}});
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    Delta d = SplitAt(text, cut, true, true);
    auto p = codec.ParseAssistant(text, true, true);
    EXPECT_EQ(d.reasoning, p.reasoning) << cut;
    EXPECT_EQ(d.content, p.content) << cut;  // the tool block is never streamed as content
  }
  // Chat mode, no tools: everything is content, markers included.
  EXPECT_EQ(SplitAt(text, 5, false, false).content, text);
}

TEST(AssistantSplitterTest, HoldsOnlyAPossibleMarkerPrefix) {
  AssistantSplitter s(AssistantMarkers{}, true, false);
  EXPECT_EQ(s.Push("abc</th").reasoning, "abc");
  EXPECT_EQ(s.Push("x").reasoning, "</thx");  // not the marker after all
  Delta d = s.Push("</think>done");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "done");
}

TEST(StopMatcherTest, StopsAcrossPiecesAndNeverSplitsCharacters) {
  for (size_t cut = 0; cut <= 12; ++cut) {
    const std::string text = "hello STOP world";
    StopMatcher m({"STOP", "never"});
    bool stopped = false;
    std::string out = m.Push(text.substr(0, cut), &stopped);
    if (!stopped) out += m.Push(text.substr(cut), &stopped);
    EXPECT_TRUE(stopped) << cut;
    EXPECT_EQ(out, "hello ") << cut;
  }
  StopMatcher m({"xyz"});
  bool stopped = false;
  std::string out = m.Push("a\xE4\xB8\x96", &stopped);
  EXPECT_TRUE(IsValidUtf8(out));
  out += m.Flush();
  EXPECT_EQ(out, "a\xE4\xB8\x96");
  EXPECT_FALSE(stopped);
}

}  // namespace
}  // namespace epd::services::router
