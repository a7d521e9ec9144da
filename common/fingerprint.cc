#include "common/fingerprint.h"

#include <nlohmann/json.hpp>

#include "common/hash.h"

namespace epd::common {

std::string ConfigFingerprint(const FingerprintInputs& in) {
  std::string buf = "epd-fingerprint-v1\n";
  buf += in.canonical_config_json;
  buf += "\nlayout=" + std::to_string(in.cache_layout_version);
  buf += "\ndspark=";
  buf += in.dspark ? "1" : "0";
  auto digest = Xxh3_128(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf.data()),
                                                  buf.size()));
  return ToHex(digest);
}

std::string CanonicalJson(std::string_view json_text) {
  // nlohmann::json stores objects in a std::map, so dump() is already key-sorted.
  auto j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return "";
  return j.dump();
}

}  // namespace epd::common
