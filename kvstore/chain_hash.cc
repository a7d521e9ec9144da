#include "kvstore/chain_hash.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/hash.h"

namespace epd::kvstore {
namespace {

constexpr std::string_view kDomain = "epd.kv.chain.v1";

void AppendLe32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

std::string_view TierLabel(Tier tier) {
  switch (tier) {
    case Tier::kG1:
      return "g1";
    case Tier::kG2:
      return "g2";
    case Tier::kG3:
      return "g3";
    case Tier::kAuto:
      break;
  }
  return "auto";
}

std::string_view MissReasonName(MissReason reason) {
  switch (reason) {
    case MissReason::kNone:
      return "";
    case MissReason::kAbsent:
      return "absent";
    case MissReason::kExpired:
      return "expired";
    case MissReason::kChecksum:
      return "checksum";
  }
  return "absent";
}

BlockHash ChainHash(const BlockHash& parent, std::span<const int32_t> tokens,
                    std::string_view config_fingerprint) {
  // Layout: domain | parent(16) | len(fp) LE32 | fp | n_tokens LE32 | tokens LE32 each.
  std::string buf;
  buf.reserve(kDomain.size() + 16 + 8 + config_fingerprint.size() + 4 * tokens.size());
  buf.append(kDomain);
  buf.append(reinterpret_cast<const char*>(parent.data()), parent.size());
  AppendLe32(&buf, static_cast<uint32_t>(config_fingerprint.size()));
  buf.append(config_fingerprint);
  AppendLe32(&buf, static_cast<uint32_t>(tokens.size()));
  for (int32_t t : tokens) AppendLe32(&buf, static_cast<uint32_t>(t));
  const auto digest = common::Xxh3_128(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf.data()), buf.size()));
  BlockHash out;
  std::memcpy(out.data(), digest.data(), out.size());
  return out;
}

std::vector<BlockHash> ChainHashes(std::span<const int32_t> tokens, size_t block_tokens,
                                   std::string_view config_fingerprint) {
  std::vector<BlockHash> out;
  if (block_tokens == 0) return out;
  out.reserve(tokens.size() / block_tokens);
  BlockHash parent = kRootParent;
  for (size_t begin = 0; begin + block_tokens <= tokens.size(); begin += block_tokens) {
    parent = ChainHash(parent, tokens.subspan(begin, block_tokens), config_fingerprint);
    out.push_back(parent);
  }
  return out;
}

absl::StatusOr<BlockHash> BlockHashFromBytes(std::string_view bytes) {
  if (bytes.size() != kBlockHashBytes) {
    return absl::InvalidArgumentError(absl::StrCat("block key must be ", kBlockHashBytes,
                                                   " bytes (a chain hash), got ", bytes.size()));
  }
  BlockHash out;
  std::memcpy(out.data(), bytes.data(), out.size());
  return out;
}

}  // namespace epd::kvstore
