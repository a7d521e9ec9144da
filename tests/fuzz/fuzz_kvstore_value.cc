// libFuzzer target: a G3 (RocksDB) stored value as the kvstore decodes it on a read
// (kvstore/g3_value.h): header, sizes, checksum, and the expiry check on its write time. A value
// that decodes re-encodes to the same bytes; the input's payload, encoded, decodes back.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "kvstore/g3_value.h"

namespace kv = epd::kvstore;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto v = kv::DecodeG3Value(bytes);
  if (v.ok()) {
    const std::string again = kv::EncodeG3Value(v->write_ms, v->payload);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0) __builtin_trap();
  }
  int64_t write_ms = 0;
  if (kv::G3HeaderWriteMs(bytes, &write_ms)) {
    // Any write time from disk, against any clock and TTL: no overflow.
    (void)kv::G3Expired(write_ms, INT64_MIN, 1);
    (void)kv::G3Expired(write_ms, INT64_MAX, INT64_MAX);
    (void)kv::G3Expired(write_ms, 1700000000000, 72ll * 3600 * 1000);
  }
  // Round trip of arbitrary payloads.
  int64_t ms = 0;
  if (size >= 8) std::memcpy(&ms, data, 8);
  const std::string enc = kv::EncodeG3Value(ms, bytes);
  auto back = kv::DecodeG3Value(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(enc.data()), enc.size()));
  if (!back.ok() || back->write_ms != ms || back->payload.size() != size) __builtin_trap();
  return 0;
}
