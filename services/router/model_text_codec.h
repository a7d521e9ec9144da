#pragma once

// The real TextCodec: an adapter over tokenizer/tokenizer.h (byte-level BPE from tokenizer.json) and
// tokenizer/chat_format.h (DeepSeek-V4.1 chat format). Token counts are the model's real token
// counts, so the router's context-length checks are exact.
//
// Untrusted text never becomes a special id: EncodePrompt uses EncodeOrdinary, and RenderChat
// replaces every added-token text (and the placeholder introducer U+E000) found in user-supplied
// strings (message content, reasoning, tool-call arguments, tool schemas) by a private-use
// placeholder before chat_format renders the conversation; the rendered text is then encoded
// with added tokens recognised only outside placeholders, and each placeholder's original text
// is encoded as plain text. For content without added-token text the ids equal
// Tokenizer::Encode(chat_format::RenderChat(...)). Added tokens' lstrip/rstrip are not honoured
// in RenderChat (none of the DeepSeek protocol tokens use them).
//
// The detokenizer drops BOS/EOS/PAD ids and keeps the other added tokens (</think>, ｜DSML｜)
// as text so ParseAssistant and the router's streaming splitter see the markers.
//
// Thread-safety: immutable after Load; all methods const and safe from any thread.
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"
#include "services/router/text_codec.h"

namespace epd::services::router {

class ModelTextCodec final : public TextCodec {
 public:
  // Loads `model_dir`/tokenizer.json. Errors name the file.
  static absl::StatusOr<std::unique_ptr<ModelTextCodec>> Load(const std::string& model_dir);
  // Wraps an already loaded tokenizer (takes ownership).
  explicit ModelTextCodec(std::unique_ptr<model::Tokenizer> tokenizer);

  absl::StatusOr<std::vector<int32_t>> EncodePrompt(std::string_view text) const override;
  absl::StatusOr<std::vector<int32_t>> RenderChat(const ChatRenderInput& input) const override;
  // The detokenizer refers to this codec: it must not outlive it.
  std::unique_ptr<Detokenizer> NewDetokenizer() const override;
  ParsedAssistant ParseAssistant(std::string_view text, bool thinking,
                                 bool parse_tools) const override;
  std::string TokenBytes(int32_t id) const override;
  int32_t vocab_size() const override { return tokenizer_->vocab_size(); }

  const model::Tokenizer& tokenizer() const { return *tokenizer_; }

 private:
  struct Token {
    std::string text;
    int32_t id;
  };
  // Length of the longest added token starting at text[pos] (0 if none); sets *id.
  size_t MatchAdded(std::string_view text, size_t pos, int32_t* id) const;
  // Replaces added-token text / U+E000 in `s` by placeholders recorded in *originals.
  std::string Protect(std::string_view s, std::vector<std::string>* originals) const;

  std::unique_ptr<model::Tokenizer> tokenizer_;
  std::unordered_map<unsigned char, std::vector<Token>> added_by_first_byte_;  // longest first
  std::vector<int32_t> skipped_ids_;  // BOS, EOS, PAD: not emitted as text
};

}  // namespace epd::services::router
