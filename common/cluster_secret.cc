#include "common/cluster_secret.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace epd::common {
namespace {

constexpr char kHowTo[] =
    "pass --cluster-secret-file FILE or set $EPD_CLUSTER_SECRET (the same secret on every "
    "process of the cluster; `epd serve` makes one for its children; docs/security.md)";

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read cluster secret file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

absl::StatusOr<std::string> Check(std::string secret, std::string_view from) {
  if (secret.size() < kMinClusterSecretBytes)
    return absl::InvalidArgumentError(absl::StrCat("the cluster secret from ", std::string(from), " is ",
                                                   secret.size(), " bytes; at least ",
                                                   kMinClusterSecretBytes, " are needed: ", kHowTo));
  return secret;
}

}  // namespace

absl::StatusOr<std::string> LoadClusterSecret(std::string_view secret_file) {
  if (!secret_file.empty()) {
    auto s = ReadSecretFile(std::string(secret_file));
    if (!s.ok()) return s.status();
    return Check(std::move(*s), absl::StrCat("--cluster-secret-file ", std::string(secret_file)));
  }
  if (const char* f = std::getenv("EPD_CLUSTER_SECRET_FILE"); f != nullptr && *f != '\0') {
    auto s = ReadSecretFile(f);
    if (!s.ok()) return s.status();
    return Check(std::move(*s), "$EPD_CLUSTER_SECRET_FILE");
  }
  for (const char* name : {"EPD_CLUSTER_SECRET", "EPD_CLUSTER_TOKEN"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0')
      return Check(v, absl::StrCat("$", name));
  }
  return absl::FailedPreconditionError(absl::StrCat("no cluster secret: ", kHowTo));
}

std::string ClusterSecretFromEnv() {
  auto s = LoadClusterSecret();
  return s.ok() ? *s : std::string();
}

std::string HmacSha256(std::string_view key, std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), out,
           &len) == nullptr)
    throw std::runtime_error("HMAC-SHA256 failed");
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (n > 0 &&
      RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1)
    throw std::runtime_error("RAND_bytes failed");
  return out;
}

std::string ToHex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::string FromHex(std::string_view hex) {
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() % 2 != 0) return {};
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return {};
    out[i] = static_cast<char>((hi << 4) | lo);
  }
  return out;
}

std::string NewClusterSecret() { return ToHex(RandomBytes(32)); }

}  // namespace epd::common
