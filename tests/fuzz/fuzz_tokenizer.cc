// libFuzzer target: tokenizer.json loading (Tokenizer::FromJson: model, vocab, merges, added
// tokens, normalizer, pre-tokenizer, decoder). A tokenizer that loads then encodes and decodes a
// fixed text with its markers, and decodes its own ids back.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto tok = epd::model::Tokenizer::FromJson(text);
  if (!tok.ok()) return 0;
  static constexpr std::string_view kSample =
      "<｜begin▁of▁sentence｜>Hello, world! 123 Grüße 世界\n\n<｜User｜>x<think>y</think>";
  const auto ids = (*tok)->Encode(kSample);
  auto back = (*tok)->Decode(ids);
  if (!back.ok()) __builtin_trap();  // ids it produced always decode
  (void)(*tok)->DecodeLossy(ids, /*skip_special=*/true);
  (void)(*tok)->EncodeOrdinary(kSample);
  return 0;
}
