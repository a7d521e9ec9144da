#pragma once

// Fixed-width integers as little-endian bytes, independent of the host's byte order: the on-disk
// layouts of the kvstore (G3 value header, RocksDB metadata) use these.

#include <cstddef>
#include <cstdint>

namespace epd::common {

template <typename T>
void StoreLe(uint8_t* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i)
    p[i] = static_cast<uint8_t>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
}

template <typename T>
T LoadLe(const uint8_t* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

}  // namespace epd::common
