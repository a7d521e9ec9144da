// libFuzzer target: the OpenAI HTTP request body as the router's /v1/chat/completions and
// /v1/completions handlers read it (UTF-8 check, JSON parse, ParseOpenAiRequest with the chat
// messages, tools and sampling fields), then the chat rendering of the byte codec.
// Input: byte 0 selects chat (even) or completions (odd); the rest is the body.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "services/router/byte_text_codec.h"
#include "services/router/openai_http.h"
#include "services/router/utf8.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) == 0;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  if (!epd::services::router::IsValidUtf8(body)) return 0;
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  bool stream = false, include_usage = false;
  auto spec = epd::services::router::ParseOpenAiRequest(j, chat, &stream, &include_usage);
  if (!spec.ok()) {
    // Every refusal names its cause.
    if (spec.status().message().empty()) __builtin_trap();
    return 0;
  }
  if (spec->chat) {
    static const epd::services::router::ByteTextCodec codec;
    (void)codec.RenderChat(*spec->chat);
  }
  return 0;
}
