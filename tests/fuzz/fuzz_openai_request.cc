// libFuzzer target: the OpenAI HTTP request body as the router's /v1/chat/completions and
// /v1/completions handlers read it (UTF-8 check, JSON parse, ParseOpenAiRequest with the chat
// messages, tools and sampling fields), then what RouterCore::Prepare does with it: the shared
// request validator (ValidateSpec), the byte codec's chat rendering / prompt encoding and the
// length check (ValidateLength). Input: byte 0 selects chat (even) or completions (odd); the
// rest is the body.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "services/router/byte_text_codec.h"
#include "services/router/openai_http.h"
#include "services/router/request_validator.h"
#include "services/router/utf8.h"

namespace r = epd::services::router;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) == 0;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  if (!r::IsValidUtf8(body)) return 0;
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  bool stream = false, include_usage = false;
  auto spec = r::ParseOpenAiRequest(j, chat, &stream, &include_usage);
  // Every refusal names its cause.
  if (!spec.ok()) {
    if (spec.status().message().empty()) __builtin_trap();
    return 0;
  }
  static const r::CoreOptions options;  // epd-nano, context 8192
  spec->model = options.model;          // reach the checks behind the model name too
  if (auto s = r::ValidateSpec(*spec, options); !s.ok()) {
    if (s.message().empty()) __builtin_trap();
    return 0;
  }
  static const r::ByteTextCodec codec;
  size_t tokens = 0;
  if (spec->chat) {
    auto ids = codec.RenderChat(*spec->chat);
    if (!ids.ok()) return 0;
    tokens = ids->size();
  } else if (spec->prompt_ids) {
    tokens = spec->prompt_ids->size();
  } else {
    auto ids = codec.EncodePrompt(spec->prompt_text);
    if (!ids.ok()) return 0;
    tokens = ids->size();
  }
  auto max_tokens = r::ValidateLength(static_cast<int64_t>(tokens), spec->sampling.max_tokens(),
                                      options, spec->chat ? "messages" : "prompt");
  if (max_tokens.ok() && (*max_tokens <= 0 || *max_tokens > options.max_tokens_limit)) {
    __builtin_trap();  // an accepted request runs with a max_tokens inside the server's limit
  }
  return 0;
}
