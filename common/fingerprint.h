#pragma once

// The config fingerprint: one short string that two processes compare before they exchange KV.
// It covers the model config (canonical JSON), the cache layout version and DSpark on/off, so a
// worker never pairs with, and a store never serves, state of a different model or layout.
#include <string>
#include <string_view>

namespace epd::common {

struct FingerprintInputs {
  std::string canonical_config_json;  // model config, keys sorted, no whitespace
  int cache_layout_version = 1;       // bump when a KV byte layout changes. Default: 1
  bool dspark = true;                 // DSpark state is part of the hand-off. Default: on
};

// 32 lower-case hex chars (xxHash3-128 of the inputs).
std::string ConfigFingerprint(const FingerprintInputs& in);

// Re-serializes arbitrary JSON text canonically (sorted keys, no whitespace); returns empty on
// parse error.
std::string CanonicalJson(std::string_view json_text);

}  // namespace epd::common
