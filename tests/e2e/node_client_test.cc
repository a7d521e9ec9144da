// The official OpenAI Node SDK (tests/clients/) against a real epd-router + fake decode worker:
// chat, streamed chat, completions, model list, and proper error objects for bad requests.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/e2e/router_cluster.h"

namespace epd {
namespace {

TEST(NodeClientTest, OfficialOpenAiSdkTalksToTheRouter) {
  if (epd::testing::RunCommand("command -v node >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "node is not installed; install nodejs, then run tests/clients/install.sh";
  }
  const std::string clients = epd::testing::SourcePath("tests/clients");
  if (!std::filesystem::exists(clients + "/node_modules/openai/package.json")) {
    GTEST_SKIP() << "tests/clients/node_modules is missing: run tests/clients/install.sh";
  }
  epd::testing::RouterCluster c({"--api-key", "node-key", "--max-tokens-limit", "512"});
  ASSERT_NE(c.AddWorker("decode", "d0", {"--token-interval-ms", "1"}), nullptr);
  std::string out;
  const int rc = epd::testing::RunCommand(
      "cd " + clients + " && EPD_BASE_URL=http://127.0.0.1:" + std::to_string(c.http_port()) +
          "/v1 EPD_API_KEY=node-key timeout 60 node openai_client_test.mjs 2>&1",
      &out);
  EXPECT_EQ(rc, 0) << out << "\n--- router log ---\n" << c.router().proc.ReadLog();
  EXPECT_NE(out.find("ALL OK"), std::string::npos) << out;
}

}  // namespace
}  // namespace epd
