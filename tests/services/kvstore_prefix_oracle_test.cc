// KvStorePrefixOracle against a real epd-kvstore process.
#include "services/router/kvstore_prefix_oracle.h"

#include <gtest/gtest.h>

#include <numeric>

#include "kvstore/chain_hash.h"
#include "kvstore/kvstore_client.h"
#include "model/fingerprint.h"
#include "model/nano/nano_generator.h"
#include "tests/testing/subprocess.h"

namespace epd::services::router {
namespace {

using epd::testing::BinaryPath;
using epd::testing::Subprocess;
using epd::testing::TempDir;

constexpr int kBlock = 16;

std::vector<int32_t> Prompt(int n, int salt = 0) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (i * 7 + salt) % 2000;
  return ids;
}

TEST(KvStorePrefixOracleTest, ReportsCachedWholeBlocksOfTheSameFingerprint) {
  TempDir dir;
  // The fingerprint of a generated model directory, as workers compute it.
  ASSERT_TRUE(model::GenerateNanoModel(dir.File("nano")).ok());
  auto fp = model::ModelDirFingerprint(dir.File("nano"));
  ASSERT_TRUE(fp.ok()) << fp.status();
  EXPECT_EQ(fp->size(), 32u);
  auto fp_other = model::ModelDirFingerprint(dir.File("nano"), /*cache_layout_version=*/2);
  ASSERT_TRUE(fp_other.ok());
  EXPECT_NE(*fp, *fp_other);
  EXPECT_FALSE(model::ModelDirFingerprint(dir.File("missing")).ok());

  const std::string port_file = dir.File("kv.ports.json");
  Subprocess kv = Subprocess::Start(
      {BinaryPath("epd-kvstore"), "--data-dir", dir.File("data"), "--grpc-port", "0",
       "--metrics-port", "0", "--port-file", port_file, "--drain-timeout-ms", "500"},
      dir.File("kv.log"));
  auto port = epd::testing::WaitForPortFile(port_file, "grpc", std::chrono::seconds(30));
  ASSERT_TRUE(port.has_value()) << kv.ReadLog();
  const std::string target = "127.0.0.1:" + std::to_string(*port);

  // A worker stored the first 3 blocks of a 5.5-block prompt.
  const std::vector<int32_t> prompt = Prompt(kBlock * 5 + 8);
  auto hashes = kvstore::ChainHashes(prompt, kBlock, *fp);
  ASSERT_EQ(hashes.size(), 5u);
  auto client = kvstore::KvStoreClient::Create(target);
  for (int b = 0; b < 3; ++b) {
    ASSERT_TRUE(client->Put(kvstore::Tier::kG3, kvstore::AsBytes(hashes[b]), "kv-bytes").ok());
  }

  prometheus::Registry metrics;
  KvOracleOptions options;
  options.target = target;
  options.block_tokens = kBlock;
  options.default_fingerprint = *fp;
  KvStorePrefixOracle oracle(options, metrics);
  EXPECT_EQ(oracle.Lookup(prompt, *fp).cached_tokens, 3 * kBlock);
  EXPECT_EQ(oracle.Lookup(prompt, "").cached_tokens, 3 * kBlock);  // the default fingerprint
  // Another config's fingerprint shares nothing.
  EXPECT_EQ(oracle.Lookup(prompt, *fp_other).cached_tokens, 0);
  // A prompt that diverges inside block 1 shares only block 0.
  std::vector<int32_t> diverged = prompt;
  diverged[kBlock + 3] += 1;
  EXPECT_EQ(oracle.Lookup(diverged, *fp).cached_tokens, kBlock);
  // Shorter than one block: nothing to look up.
  EXPECT_EQ(oracle.Lookup(Prompt(kBlock - 1), *fp).cached_tokens, 0);
  EXPECT_EQ(oracle.errors(), 0);

  // The kvstore goes down: a miss and a counted error, never a failure.
  kv.Stop();
  PrefixHint hint = oracle.Lookup(prompt, *fp);
  EXPECT_EQ(hint.cached_tokens, 0);
  EXPECT_EQ(oracle.errors(), 1);
}

TEST(KvStorePrefixOracleTest, UnreachableKvstoreIsAMissNotAnError) {
  prometheus::Registry metrics;
  KvOracleOptions options;
  options.target = "127.0.0.1:" + std::to_string(epd::testing::PickFreePort());
  options.block_tokens = kBlock;
  options.default_fingerprint = "fp";
  KvStorePrefixOracle oracle(options, metrics);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(oracle.Lookup(Prompt(64), "").cached_tokens, 0);
  EXPECT_EQ(oracle.errors(), 3);
  EXPECT_EQ(oracle.lookups(), 3);
}

}  // namespace
}  // namespace epd::services::router
