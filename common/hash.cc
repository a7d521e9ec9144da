#include "common/hash.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace epd::common {

uint64_t Xxh3_64(std::span<const uint8_t> bytes, uint64_t seed) {
  return XXH3_64bits_withSeed(bytes.data(), bytes.size(), seed);
}

std::array<uint8_t, 16> Xxh3_128(std::span<const uint8_t> bytes) {
  XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  std::array<uint8_t, 16> out{};
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<uint8_t>(h.high64 >> (56 - 8 * i));
    out[8 + i] = static_cast<uint8_t>(h.low64 >> (56 - 8 * i));
  }
  return out;
}

std::string ToHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

}  // namespace epd::common
