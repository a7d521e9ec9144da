#pragma once

// Deterministic hashing (xxHash3): stable across processes, restarts and machines.
// Never use std::hash or absl::Hash for anything that is stored or sent.
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace epd::common {

uint64_t Xxh3_64(std::span<const uint8_t> bytes, uint64_t seed = 0);
inline uint64_t Xxh3_64(std::string_view s, uint64_t seed = 0) {
  return Xxh3_64(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()),
                 seed);
}

// 128-bit digest as 16 bytes, big-endian high half first.
std::array<uint8_t, 16> Xxh3_128(std::span<const uint8_t> bytes);

// Lower-case hex of bytes.
std::string ToHex(std::span<const uint8_t> bytes);

}  // namespace epd::common
