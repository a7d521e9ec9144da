#pragma once
// Cluster-secret authentication of the internal gRPC planes (worker registry, worker control,
// kvstore; docs/security.md). Each call carries metadata `x-epd-auth`:
//   v1.<unix ms>.<nonce: 32 hex>.<HMAC-SHA256(secret, "epd-grpc-v1\n" method "\n" ms "\n" nonce), hex>
// The server (a check at the top of each handler) refuses a call whose MAC does not verify, whose
// time is outside the window, or whose nonce it has seen within the window (a replay). The secret
// never crosses the wire. It authenticates the caller, not the message body (TLS on these ports
// would add that; not done yet).

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>

namespace epd::runtime {

inline constexpr char kClusterAuthMetadata[] = "x-epd-auth";

// The metadata value for one call of `method` ("/epd.v1.KvStore/Put").
std::string MakeClusterAuthToken(absl::string_view secret, absl::string_view method,
                                 int64_t unix_ms, absl::string_view nonce_hex);

// A channel whose every call carries the metadata (a client interceptor). An empty secret sends
// none (the server then refuses the calls with UNAUTHENTICATED naming the fix).
std::shared_ptr<grpc::Channel> CreateClusterChannel(
    const std::string& target, const std::string& secret,
    const grpc::ChannelArguments& args = grpc::ChannelArguments(),
    std::shared_ptr<grpc::ChannelCredentials> creds = nullptr);

class ClusterAuthChecker {
 public:
  explicit ClusterAuthChecker(std::string secret, absl::Duration window = absl::Seconds(60));
  // OK, or UNAUTHENTICATED (the reason says which check failed, never a value).
  grpc::Status Check(const grpc::ServerContext& ctx, absl::string_view method);
  absl::Status CheckToken(absl::string_view token, absl::string_view method, int64_t now_unix_ms);

 private:
  std::string secret_;
  int64_t window_ms_;
  std::mutex mu_;
  absl::flat_hash_set<std::string> seen_;               // nonces within the window
  std::deque<std::pair<int64_t, std::string>> expiry_;  // (expires at ms, nonce), in order
};

}  // namespace epd::runtime
