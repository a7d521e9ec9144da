// libFuzzer target: the DSML tool-call parsers. model::ParseCompletion and the streaming parser
// fed the same text in pieces (the model-side parser the ModelTextCodec uses), and the router's
// ByteTextCodec::ParseAssistant. Input: byte 0 = flags (bit 0 thinking, bit 1 parse tools, bits
// 2-7 the streaming piece size); the rest is generated text.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tokenizer/chat_format.h"
#include "services/router/byte_text_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool thinking = data[0] & 1;
  const bool parse_tools = data[0] & 2;
  const size_t piece = 1 + (data[0] >> 2);
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);

  auto whole = epd::model::ParseCompletion(text, thinking);
  if (whole.ok()) {
    // A parsed call renders back to a DSML block.
    if (!whole->tool_calls.empty()) (void)epd::model::RenderToolCalls(whole->tool_calls);
  }

  epd::model::StreamingCompletionParser stream(thinking);
  bool failed = false;
  for (size_t i = 0; i < text.size() && !failed; i += piece) {
    failed = !stream.Add(text.substr(i, piece)).ok();
  }
  if (!failed) (void)stream.Finish();

  static const epd::services::router::ByteTextCodec codec;
  (void)codec.ParseAssistant(text, thinking, parse_tools);
  return 0;
}
