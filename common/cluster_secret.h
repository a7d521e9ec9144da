#pragma once
// The per-cluster secret every internal plane authenticates with (docs/security.md): loading it
// (never from argv, no built-in default) and the primitives the planes build on (HMAC-SHA256,
// constant-time comparison, random nonces; OpenSSL's libcrypto).

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace epd::common {

// Shortest secret accepted: a proof (HMAC) seen on the wire must not allow guessing it offline.
inline constexpr size_t kMinClusterSecretBytes = 16;

// The cluster secret, in this order: the file `secret_file` (a flag such as
// --cluster-secret-file; empty = none), the file $EPD_CLUSTER_SECRET_FILE, $EPD_CLUSTER_SECRET,
// and $EPD_CLUSTER_TOKEN (the older name). A file's trailing newlines are dropped. None of them
// set, or a secret shorter than kMinClusterSecretBytes: an error that names
// --cluster-secret-file and $EPD_CLUSTER_SECRET. There is no default.
absl::StatusOr<std::string> LoadClusterSecret(std::string_view secret_file = {});

// Only the environment ($EPD_CLUSTER_SECRET_FILE, $EPD_CLUSTER_SECRET, $EPD_CLUSTER_TOKEN);
// empty when none is set or it cannot be read (callers that need one report it).
std::string ClusterSecretFromEnv();

// 32 raw bytes.
std::string HmacSha256(std::string_view key, std::string_view data);
// Equal length and bytes, in time independent of where they differ (CRYPTO_memcmp).
bool ConstantTimeEquals(std::string_view a, std::string_view b);
// `n` bytes from OpenSSL's CSPRNG.
std::string RandomBytes(size_t n);
// Lowercase hex of `bytes`, and back (empty on bad input).
std::string ToHex(std::string_view bytes);
std::string FromHex(std::string_view hex);
// A fresh random secret of 32 bytes, hex-encoded (what `epd serve` generates).
std::string NewClusterSecret();

}  // namespace epd::common
