#pragma once

// The G3 stored-value format (kvstore/g3_rocksdb.h): [32-byte header | payload], little-endian
// header: magic "EPDK" u32 | version u16 | header bytes u16 | write_unix_ms i64 |
// payload bytes u64 | checksum u64 (xxHash3-64 of the payload, seeded by the first 24 header
// bytes). Pure functions, reentrant; fuzzed by tests/fuzz/fuzz_kvstore_value.cc.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace epd::kvstore {

inline constexpr size_t kG3HeaderBytes = 32;
inline constexpr uint16_t kG3HeaderVersion = 1;

struct G3Value {
  int64_t write_ms = 0;
  std::span<const uint8_t> payload;  // points into the decoded bytes
  uint64_t checksum = 0;             // the header's: XXH3-64 of the payload seeded by `seed`
  uint64_t seed = 0;
};

// Fills `header` (kG3HeaderBytes) for `payload` written at `write_ms`.
void EncodeG3Header(uint8_t* header, int64_t write_ms, std::span<const uint8_t> payload);
// Header + payload in one string (tests, fuzzing).
std::string EncodeG3Value(int64_t write_ms, std::span<const uint8_t> payload);
// Verifies magic, version, header size, payload size and (unless `verify_checksum` is false: the
// caller then checks `checksum` over its own copy of the payload) the checksum. DataLoss naming
// the field that does not verify.
absl::StatusOr<G3Value> DecodeG3Value(std::span<const uint8_t> stored, bool verify_checksum = true);
// Whether a value written at `write_ms` is at least `ttl_ms` old at `now_ms`. Write times come from
// disk (the compaction filter reads them without a checksum): no overflow for any value; a write
// time far in the future is not expired, one far in the past is.
bool G3Expired(int64_t write_ms, int64_t now_ms, int64_t ttl_ms);
// The write time from a header with the right magic, without the checksum (compaction filter).
bool G3HeaderWriteMs(std::span<const uint8_t> stored, int64_t* write_ms);

}  // namespace epd::kvstore
