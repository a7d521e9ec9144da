// runtime/grpc_auth.h and common/cluster_secret.h: the per-call proof of the internal gRPC planes
// (docs/security.md). The planes themselves, attacked on real processes: tests/e2e/outsider_e2e_test.cc.
#include "runtime/grpc_auth.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include "common/cluster_secret.h"

namespace epd::runtime {
namespace {

constexpr char kSecret[] = "a-cluster-secret-of-32-bytes-xyz";
constexpr char kPut[] = "/epd.v1.KvStore/Put";

TEST(GrpcAuthTest, AGoodProofPassesOnceAndAReplayOrAnotherMethodOrSecretIsRefused) {
  ClusterAuthChecker auth(kSecret, absl::Seconds(60));
  const int64_t now = 1'800'000'000'000;
  const std::string nonce = common::ToHex(common::RandomBytes(16));
  const std::string token = MakeClusterAuthToken(kSecret, kPut, now, nonce);
  EXPECT_EQ(token.find(kSecret), std::string::npos);
  EXPECT_TRUE(auth.CheckToken(token, kPut, now).ok());
  EXPECT_NE(auth.CheckToken(token, kPut, now).message().find("replayed"), std::string::npos);
  const std::string other = common::ToHex(common::RandomBytes(16));
  EXPECT_NE(auth.CheckToken(MakeClusterAuthToken(kSecret, kPut, now, other),
                            "/epd.v1.KvStore/Get", now)
                .message()
                .find("bad MAC"),
            std::string::npos);
  EXPECT_FALSE(auth.CheckToken(MakeClusterAuthToken("another-secret-of-the-same-size", kPut,
                                                    now, other),
                               kPut, now)
                   .ok());
  // Outside the window either way: refused even with a fresh nonce.
  for (int64_t skew : {-61'000, 61'000}) {
    const std::string n = common::ToHex(common::RandomBytes(16));
    EXPECT_NE(auth.CheckToken(MakeClusterAuthToken(kSecret, kPut, now + skew, n), kPut, now)
                  .message()
                  .find("window"),
              std::string::npos);
  }
  EXPECT_FALSE(auth.CheckToken("v1.garbage", kPut, now).ok());
  EXPECT_FALSE(auth.CheckToken("", kPut, now).ok());
  // A checker without a secret refuses everything.
  ClusterAuthChecker none("");
  EXPECT_FALSE(none.CheckToken(MakeClusterAuthToken("", kPut, now, other), kPut, now).ok());
}

TEST(GrpcAuthTest, TheSecretComesFromTheEnvironmentAndHasNoDefault) {
  const std::string saved = common::ClusterSecretFromEnv();
  unsetenv("EPD_CLUSTER_SECRET");
  unsetenv("EPD_CLUSTER_SECRET_FILE");
  unsetenv("EPD_CLUSTER_TOKEN");
  auto none = common::LoadClusterSecret();
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("--cluster-secret-file"), std::string::npos);
  EXPECT_NE(none.status().message().find("$EPD_CLUSTER_SECRET"), std::string::npos);
  setenv("EPD_CLUSTER_TOKEN", "short", 1);
  EXPECT_FALSE(common::LoadClusterSecret().ok());
  setenv("EPD_CLUSTER_TOKEN", kSecret, 1);  // the old name still works
  EXPECT_EQ(common::LoadClusterSecret().value_or(""), kSecret);
  unsetenv("EPD_CLUSTER_TOKEN");
  setenv("EPD_CLUSTER_SECRET", saved.c_str(), 1);
  EXPECT_EQ(common::HmacSha256("key", "The quick brown fox jumps over the lazy dog").size(), 32u);
  EXPECT_EQ(common::ToHex(common::HmacSha256("key", "The quick brown fox jumps over the lazy dog")),
            "f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8");
  EXPECT_TRUE(common::ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(common::ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(common::ConstantTimeEquals("abc", "abcd"));
}

}  // namespace
}  // namespace epd::runtime
