#pragma once

// A self-contained TextCodec for tests and for a model without a tokenizer.json (the golden
// checkpoints): token id = byte value. Its vocabulary is 256, or the model's when larger, so a
// token-id prompt may use every id of the model; an id past 255 has no text. RenderChat writes the
// MODEL.md §5 shape with the real marker strings spelled as bytes; ParseAssistant understands
// </think> and the DSML tool-call block. Thread-safe (stateless).
#include "services/router/text_codec.h"

namespace epd::services::router {

class ByteTextCodec final : public TextCodec {
 public:
  explicit ByteTextCodec(int32_t vocab_size = 256);
  absl::StatusOr<std::vector<int32_t>> EncodePrompt(std::string_view text) const override;
  absl::StatusOr<std::vector<int32_t>> RenderChat(const ChatRenderInput& input) const override;
  std::unique_ptr<Detokenizer> NewDetokenizer() const override;
  ParsedAssistant ParseAssistant(std::string_view text, bool thinking,
                                 bool parse_tools) const override;
  std::string TokenBytes(int32_t id) const override {
    return id >= 0 && id < 256 ? std::string(1, static_cast<char>(id)) : std::string();
  }
  int32_t vocab_size() const override { return vocab_size_; }

  // The rendered prompt as text (what RenderChat encodes), for tests.
  absl::StatusOr<std::string> RenderChatText(const ChatRenderInput& input) const;

 private:
  int32_t vocab_size_;
};

// Renders tool calls in the DSML block format (MODEL.md §5); used by ByteTextCodec and tests
// that script a model emitting tool calls.
std::string RenderDsmlToolCalls(const std::vector<ToolCall>& calls);

// Maps a reasoning_effort string to the 1..100 number of the effort line; nullopt-like -1 when
// invalid. low 50, medium 75, high 75, xhigh 90, max 100 (the deployed tiers 50/75/100), or a
// number "1".."100".
int ReasoningEffortValue(std::string_view effort);

}  // namespace epd::services::router
