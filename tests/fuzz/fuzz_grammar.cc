// libFuzzer target: constrained-decoding constraints (grammar/grammar.h) as a client
// can send them (response_format json_schema, tools via the router, or SamplingParams.constraint
// over gRPC). Input: the constraint JSON, optionally followed by a NUL byte and bytes to match.
// Compile either refuses with a Status or yields a grammar; a Matcher then consumes the bytes.
// Properties: nothing throws or crashes; a dead matcher stays dead; a live matcher's shortest
// completion is finite.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "grammar/grammar.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  std::string_view text;
  if (const size_t nul = in.find('\0'); nul != std::string_view::npos) {
    text = in.substr(nul + 1);
    in = in.substr(0, nul);
  }
  auto g = epd::grammar::Compile(in);
  if (!g.ok()) return 0;
  epd::grammar::Matcher m(*g);
  for (size_t i = 0; i < text.size() && i < 4096; ++i) {
    const bool was_dead = m.dead();
    const bool ok = m.Advance(text.substr(i, 1));
    if (was_dead && ok) __builtin_trap();  // a dead matcher never comes back
    if (!m.dead() && m.MinRemaining() == INT64_MAX) __builtin_trap();
  }
  (void)m.Complete();
  return 0;
}
