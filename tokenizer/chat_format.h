#pragma once

// DeepSeek-V4.1 chat format (MODEL.md §5; our reading of encoding/encoding.py, documented in
// docs/nano_model.md): renders an OpenAI-style conversation to prompt text for the tokenizer,
// and parses generated text back into reasoning, content and DSML tool calls.
//
//   <｜begin▁of▁sentence｜><｜System｜>[effort line][system text][\n\n tools block]
//   <｜User｜>text<｜Assistant｜></think>content<｜end▁of▁sentence｜>        (chat mode / earlier
//   turns) <｜User｜>text<｜Assistant｜><think>reasoning</think>content[calls]<｜end▁of▁sentence｜>
//   <｜User｜><tool_result>...</tool_result>...<｜Assistant｜>...          (tool results)
//
// Thread-safety: free functions, reentrant.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace epd::model {

inline constexpr std::string_view kBosText = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEosText = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kSystemText = "<｜System｜>";
inline constexpr std::string_view kUserText = "<｜User｜>";
inline constexpr std::string_view kAssistantText = "<｜Assistant｜>";
inline constexpr std::string_view kThinkStart = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";
inline constexpr std::string_view kDsml = "｜DSML｜";

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object, as text (OpenAI `function.arguments`)
  bool operator==(const ToolCall&) const = default;
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  std::string reasoning_content;     // assistant only
  std::vector<ToolCall> tool_calls;  // assistant only
};

struct ChatRenderOptions {
  bool thinking = false;                // Default: chat mode (prompt ends with </think>)
  std::optional<int> reasoning_effort;  // 1..100; written only in thinking mode
  bool add_generation_prompt = true;    // Default: end with the assistant header
  bool add_bos = true;                  // Default: start with BOS
};

// "low" 25, "medium" 50, "high" 75, "max" 100, or a decimal 1..100.
absl::StatusOr<int> ParseReasoningEffort(std::string_view text);

// Renders `messages` (and OpenAI `tools`: [{"type":"function","function":{...}}] or bare
// function objects) to prompt text. Errors: unknown role, bad tool-call arguments JSON,
// effort out of range, a tool message with no preceding assistant tool call.
absl::StatusOr<std::string> RenderChat(const std::vector<ChatMessage>& messages,
                                       const std::vector<nlohmann::json>& tools,
                                       const ChatRenderOptions& options);

// OpenAI chat `messages` JSON -> ChatMessage list (content may be a string, null, or an array of
// {"type":"text","text":...} parts; tool_calls[].function.{name,arguments}).
absl::StatusOr<std::vector<ChatMessage>> MessagesFromOpenAi(const nlohmann::json& messages);

struct ParsedCompletion {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  bool finished = false;  // the text contained the EOS token text
};

// Parses generated text (what follows the rendered prompt). In thinking mode everything before
// the first </think> is reasoning (all of it when </think> never came). Text after EOS is ignored.
// Errors name malformed DSML (unterminated block, missing name, non-JSON non-string parameter).
absl::StatusOr<ParsedCompletion> ParseCompletion(std::string_view text, bool thinking);

// Incremental form of ParseCompletion for streaming: feed text deltas as they are detokenized;
// each call returns the reasoning/content text that is now certain (a possible partial marker
// such as "</thi" or trailing newlines before a tool-call block is held back). Tool calls are
// parsed when the block closes. Not thread-safe (one per stream).
class StreamingCompletionParser {
 public:
  explicit StreamingCompletionParser(bool thinking) : in_reasoning_(thinking) {}

  struct Delta {
    std::string reasoning;
    std::string content;
    std::vector<ToolCall> tool_calls;  // completed calls (the whole block at once)
  };
  // Appends generated text. Errors: malformed DSML block.
  absl::StatusOr<Delta> Add(std::string_view text);
  // End of generation: flushes held-back text; an unterminated tool-call block is an error.
  absl::StatusOr<Delta> Finish();
  bool finished() const { return finished_; }  // EOS text seen

 private:
  bool in_reasoning_;
  bool in_calls_ = false;
  bool finished_ = false;
  bool started_ = false;  // the first characters were inspected for a leading <think>/</think>
  std::string pending_;
};

// DSML block for `calls` (no leading separator), as the model writes it.
absl::StatusOr<std::string> RenderToolCalls(const std::vector<ToolCall>& calls);

}  // namespace epd::model
