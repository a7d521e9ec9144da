#pragma once

// Helpers shared by the transfer tests, the peer binary and the benchmark: deterministic payloads
// for a manifest, a bulk manifest, and a byte comparison that names the first differing segment.
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "epd/v1/transfer.pb.h"
#include "transfer/manifest.h"
#include "tests/testing/handoff_layout.h"

namespace epd::transfer::testing {

// splitmix64 stream seeded per (seed, segment): both processes regenerate identical bytes.
inline void FillSegment(uint8_t* dst, uint64_t len, uint64_t seed, int segment) {
  uint64_t x =
      seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(segment) * 0xbf58476d1ce4e5b9ull;
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(dst + i, &z, 8);
  }
  for (; i < len; ++i) dst[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
}

inline void FillPayload(const epd::v1::Manifest& m, uint8_t* dst, uint64_t seed) {
  uint64_t at = 0;
  for (int i = 0; i < m.segments_size(); ++i) {
    FillSegment(dst + at, m.segments(i).byte_length(), seed, i);
    at += m.segments(i).byte_length();
  }
}

// Empty string if `got` equals the deterministic payload of `m`, else which segment differs.
inline std::string ComparePayload(const epd::v1::Manifest& m, const uint8_t* got, uint64_t seed) {
  uint64_t at = 0;
  std::string want;
  for (int i = 0; i < m.segments_size(); ++i) {
    const uint64_t len = m.segments(i).byte_length();
    want.resize(len);
    FillSegment(reinterpret_cast<uint8_t*>(want.data()), len, seed, i);
    if (std::memcmp(want.data(), got + at, len) != 0) {
      for (uint64_t b = 0; b < len; ++b)
        if (static_cast<uint8_t>(want[b]) != got[at + b])
          return absl::StrCat(DescribeSegment(m, i), " differs at byte ", b);
    }
    at += len;
  }
  return "";
}

// `count` raw segments of `bytes` each.
inline epd::v1::Manifest BulkManifest(const std::string& request_id, const std::string& fp,
                                      int count, uint64_t bytes) {
  epd::v1::Manifest m;
  m.set_request_id(request_id);
  m.set_config_fingerprint(fp);
  for (int i = 0; i < count; ++i) {
    AddRawBytesSegment(m, epd::v1::SEGMENT_BLOCK, -1, 0, 0, bytes);
  }
  return m;
}

inline epd::testing::HandoffRequest NanoRequest(const std::string& request_id, const std::string& fp,
                                  int64_t prompt = 1000, int64_t cached = 0) {
  epd::testing::HandoffRequest r;
  r.request_id = request_id;
  r.config_fingerprint = fp;
  r.prompt_length = prompt;
  r.cached_length = cached;
  return r;
}

}  // namespace epd::transfer::testing
