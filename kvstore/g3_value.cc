#include "kvstore/g3_value.h"

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "common/little_endian.h"

namespace epd::kvstore {
namespace {

constexpr uint32_t kMagic = 0x4B445045;  // "EPDK" little-endian

using common::LoadLe;
using common::StoreLe;

uint64_t Seed(const uint8_t* header) {
  return common::Xxh3_64(std::span<const uint8_t>(header, 24));
}

uint64_t Checksum(const uint8_t* header, std::span<const uint8_t> payload) {
  return common::Xxh3_64(payload, Seed(header));
}

}  // namespace

void EncodeG3Header(uint8_t* h, int64_t write_ms, std::span<const uint8_t> payload) {
  StoreLe<uint32_t>(h, kMagic);
  StoreLe<uint16_t>(h + 4, kG3HeaderVersion);
  StoreLe<uint16_t>(h + 6, static_cast<uint16_t>(kG3HeaderBytes));
  StoreLe<int64_t>(h + 8, write_ms);
  StoreLe<uint64_t>(h + 16, payload.size());
  StoreLe<uint64_t>(h + 24, Checksum(h, payload));
}

std::string EncodeG3Value(int64_t write_ms, std::span<const uint8_t> payload) {
  std::string out(kG3HeaderBytes + payload.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  EncodeG3Header(p, write_ms, payload);
  if (!payload.empty()) std::copy(payload.begin(), payload.end(), p + kG3HeaderBytes);
  return out;
}

absl::StatusOr<G3Value> DecodeG3Value(std::span<const uint8_t> stored, bool verify_checksum) {
  const size_t n = stored.size();
  if (n < kG3HeaderBytes) {
    return absl::DataLossError(absl::StrCat("G3 value of ", n, " bytes is shorter than its ",
                                            kG3HeaderBytes, "-byte header"));
  }
  const uint8_t* p = stored.data();
  if (LoadLe<uint32_t>(p) != kMagic) return absl::DataLossError("G3 value: bad magic");
  if (LoadLe<uint16_t>(p + 4) != kG3HeaderVersion) {
    return absl::DataLossError(
        absl::StrCat("G3 value: header version ", LoadLe<uint16_t>(p + 4), " is not ",
                     kG3HeaderVersion));
  }
  if (LoadLe<uint16_t>(p + 6) != kG3HeaderBytes) {
    return absl::DataLossError("G3 value: bad header size");
  }
  if (LoadLe<uint64_t>(p + 16) != n - kG3HeaderBytes) {
    return absl::DataLossError(absl::StrCat("G3 value: header says ", LoadLe<uint64_t>(p + 16),
                                            " payload bytes, ", n - kG3HeaderBytes, " stored"));
  }
  G3Value v;
  v.payload = stored.subspan(kG3HeaderBytes);
  v.seed = Seed(p);
  v.checksum = LoadLe<uint64_t>(p + 24);
  if (verify_checksum && v.checksum != common::Xxh3_64(v.payload, v.seed)) {
    return absl::DataLossError("G3 value: checksum mismatch");
  }
  v.write_ms = LoadLe<int64_t>(p + 8);
  return v;
}

bool G3Expired(int64_t write_ms, int64_t now_ms, int64_t ttl_ms) {
  int64_t age = 0;
  if (__builtin_sub_overflow(now_ms, write_ms, &age)) return write_ms < now_ms;
  return age >= ttl_ms;
}

bool G3HeaderWriteMs(std::span<const uint8_t> stored, int64_t* write_ms) {
  if (stored.size() < kG3HeaderBytes) return false;
  if (LoadLe<uint32_t>(stored.data()) != kMagic) return false;
  *write_ms = LoadLe<int64_t>(stored.data() + 8);
  return true;
}

}  // namespace epd::kvstore
