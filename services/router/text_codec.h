#pragma once

// The router's view of text: tokenization, chat rendering (MODEL.md §5), incremental
// detokenization and parsing of the assistant's output. The real implementation adapts
// tokenizer/tokenizer.h and tokenizer/chat_format.h; ByteTextCodec (byte_text_codec.h) is a small
// self-contained one for tests. Token ids are int32 as on the wire (proto Job.prompt_ids).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace epd::services::router {

// One OpenAI tool call: `arguments_json` is the JSON object text of the arguments.
struct ToolCall {
  std::string id;  // "call_..." (the router assigns one when the model gives none)
  std::string name;
  std::string arguments_json;
};

// One chat message after validation. role: system | developer | user | assistant | tool.
struct ChatMessage {
  std::string role;
  std::string content;
  std::string reasoning_content;     // assistant turns only; earlier turns drop it when rendered
  std::vector<ToolCall> tool_calls;  // assistant turns only
  std::string tool_call_id;          // tool turns only
  std::string name;                  // optional speaker / tool name
};

struct ChatRenderInput {
  std::vector<ChatMessage> messages;
  std::string tools_json;        // OpenAI `tools` array as JSON text; empty = no tools
  bool thinking = false;         // thinking mode: the prompt ends with <think>, else </think>
  std::string reasoning_effort;  // passed through: "" | low | medium | high | xhigh | max | 1..100
};

// The assistant output split into its parts. `content` excludes the tool-call block.
struct ParsedAssistant {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
};

// The literal strings that separate the parts of an assistant output, so the router can stream
// reasoning and content as they arrive and hold back a tool-call block until it is complete.
struct AssistantMarkers {
  std::string think_end = "</think>";
  std::string tool_calls_begin = "<\xEF\xBD\x9C" "DSML\xEF\xBD\x9C calls>";  // <｜DSML｜ calls>
};

// Turns ids into text one id at a time. Every returned string is complete UTF-8: bytes of a
// character split over several ids are held until the character is complete. Not thread-safe;
// one per request.
class Detokenizer {
 public:
  virtual ~Detokenizer() = default;
  // Appends one id; returns the newly completed text (possibly empty).
  virtual std::string Push(int32_t id) = 0;
  // End of output: returns what is still held, with incomplete sequences as U+FFFD.
  virtual std::string Flush() = 0;
};

// Thread-safe: every method is const and may be called from any thread.
class TextCodec {
 public:
  virtual ~TextCodec() = default;

  // Plain-text prompt (/v1/completions) to ids. No BOS/EOS is added.
  virtual absl::StatusOr<std::vector<int32_t>> EncodePrompt(std::string_view text) const = 0;
  // Chat conversation to prompt ids, ending with the assistant header. InvalidArgument on a
  // conversation the format cannot express (the message names the cause).
  virtual absl::StatusOr<std::vector<int32_t>> RenderChat(const ChatRenderInput& input) const = 0;
  virtual std::unique_ptr<Detokenizer> NewDetokenizer() const = 0;
  // Splits a complete assistant output. With thinking, text before think_end is reasoning (all
  // of it when think_end never comes). With parse_tools, a complete tool-call block becomes
  // tool_calls; an unparseable block stays in content.
  virtual ParsedAssistant ParseAssistant(std::string_view text, bool thinking,
                                         bool parse_tools) const = 0;
  virtual AssistantMarkers Markers() const { return AssistantMarkers{}; }
  // The raw bytes one token stands for (logprobs' `bytes`; may be part of a UTF-8 character).
  // Empty for an id outside the vocabulary.
  virtual std::string TokenBytes(int32_t id) const = 0;
  // Ids at or above this are invalid in a prompt given as ids.
  virtual int32_t vocab_size() const = 0;
};

}  // namespace epd::services::router
