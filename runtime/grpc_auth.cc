#include "runtime/grpc_auth.h"

#include <grpcpp/support/client_interceptor.h>

#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cluster_secret.h"

namespace epd::runtime {
namespace {

int64_t NowUnixMs() { return absl::ToUnixMillis(absl::Now()); }
std::string_view SV(absl::string_view s) { return {s.data(), s.size()}; }

class AuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  AuthInterceptor(std::string method, const std::string* secret)
      : method_(std::move(method)), secret_(secret) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA) &&
        !secret_->empty()) {
      methods->GetSendInitialMetadata()->insert(
          {kClusterAuthMetadata,
           MakeClusterAuthToken(*secret_, method_, NowUnixMs(),
                                common::ToHex(common::RandomBytes(16)))});
    }
    methods->Proceed();
  }

 private:
  std::string method_;
  const std::string* secret_;
};

class AuthInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit AuthInterceptorFactory(std::string secret) : secret_(std::move(secret)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* info) override {
    return new AuthInterceptor(info->method() != nullptr ? info->method() : "", &secret_);
  }

 private:
  std::string secret_;
};

}  // namespace

std::string MakeClusterAuthToken(absl::string_view secret, absl::string_view method,
                                 int64_t unix_ms, absl::string_view nonce_hex) {
  const std::string mac = common::HmacSha256(
      SV(secret), absl::StrCat("epd-grpc-v1\n", method, "\n", unix_ms, "\n", nonce_hex));
  return absl::StrCat("v1.", unix_ms, ".", nonce_hex, ".", common::ToHex(mac));
}

std::shared_ptr<grpc::Channel> CreateClusterChannel(
    const std::string& target, const std::string& secret, const grpc::ChannelArguments& args,
    std::shared_ptr<grpc::ChannelCredentials> creds) {
  if (creds == nullptr) creds = grpc::InsecureChannelCredentials();
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> f;
  f.push_back(std::make_unique<AuthInterceptorFactory>(secret));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args,
                                                                 std::move(f));
}

ClusterAuthChecker::ClusterAuthChecker(std::string secret, absl::Duration window)
    : secret_(std::move(secret)), window_ms_(absl::ToInt64Milliseconds(window)) {}

grpc::Status ClusterAuthChecker::Check(const grpc::ServerContext& ctx, absl::string_view method) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kClusterAuthMetadata);
  absl::Status s =
      it == md.end()
          ? absl::UnauthenticatedError("no x-epd-auth metadata")
          : CheckToken(absl::string_view(it->second.data(), it->second.size()), method,
                       NowUnixMs());
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      absl::StrCat("cluster authentication failed for ", method, ": ",
                                   s.message(),
                                   " (internal planes need the cluster secret: "
                                   "--cluster-secret-file or $EPD_CLUSTER_SECRET; "
                                   "docs/security.md)"));
}

absl::Status ClusterAuthChecker::CheckToken(absl::string_view token, absl::string_view method,
                                            int64_t now_unix_ms) {
  if (secret_.empty()) return absl::UnauthenticatedError("this process has no cluster secret");
  std::vector<absl::string_view> parts = absl::StrSplit(token, '.');
  int64_t ms = 0;
  if (parts.size() != 4 || parts[0] != "v1" || !absl::SimpleAtoi(parts[1], &ms) ||
      parts[2].size() != 32 || parts[3].size() != 64)
    return absl::UnauthenticatedError("malformed x-epd-auth metadata");
  const std::string expected = common::ToHex(common::HmacSha256(
      secret_, absl::StrCat("epd-grpc-v1\n", method, "\n", ms, "\n", parts[2])));
  if (!common::ConstantTimeEquals(SV(parts[3]), expected))
    return absl::UnauthenticatedError("bad MAC (wrong secret, or made for another method)");
  if (ms < now_unix_ms - window_ms_ || ms > now_unix_ms + window_ms_)
    return absl::UnauthenticatedError("timestamp outside the window (clock skew or a replay)");
  std::lock_guard<std::mutex> lock(mu_);
  while (!expiry_.empty() && expiry_.front().first < now_unix_ms) {
    seen_.erase(expiry_.front().second);
    expiry_.pop_front();
  }
  std::string nonce(parts[2]);
  if (!seen_.insert(nonce).second) return absl::UnauthenticatedError("replayed nonce");
  // Kept until its timestamp leaves the window: after that the time check refuses it.
  const int64_t expires = std::max(ms + window_ms_, now_unix_ms);
  if (!expiry_.empty() && expires < expiry_.back().first) {
    // Out of order (clock skew between callers): keep the deque sorted enough by clamping up.
    expiry_.emplace_back(expiry_.back().first, std::move(nonce));
  } else {
    expiry_.emplace_back(expires, std::move(nonce));
  }
  return absl::OkStatus();
}

}  // namespace epd::runtime
