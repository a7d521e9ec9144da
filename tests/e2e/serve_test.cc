// The README's first command as a new user meets it: `epd serve` (kvstore, router and one real
// encoder, prefill and decode worker on 127.0.0.1, the nano demo model generated into the data
// folder on first start). Plain HTTP requests answer 200 streaming and not, the official OpenAI
// Node SDK (tests/clients) completes, streams, lists models and gets proper error objects, and
// Ctrl-C (SIGINT) stops every process.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::BinaryPath;
using epd::testing::Subprocess;
using epd::testing::TempDir;

TEST(ServeTest, EpdServeAnswersCurlAndTheOfficialOpenAiClient) {
  TempDir dir;
  const int http_port = epd::testing::PickFreePort();
  const int grpc_port = epd::testing::PickFreePort();
  Subprocess serve = Subprocess::Start({BinaryPath("epd"), "serve", "--data-dir", dir.File("data"),
                                        "--http-port", std::to_string(http_port), "--grpc-port",
                                        std::to_string(grpc_port), "--api-key", "node-key"},
                                       dir.File("serve.log"));
  bool ready = false;
  for (int i = 0; i < 1800 && !ready && serve.running(); ++i) {
    ready = serve.ReadLog().find("epd serve: ready") != std::string::npos;
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(ready) << serve.ReadLog();
  EXPECT_TRUE(std::filesystem::exists(dir.File("data") + "/models/nano/config.json"));

  httplib::Client cli("127.0.0.1", http_port);
  cli.set_read_timeout(120, 0);
  cli.set_bearer_token_auth("node-key");
  const nlohmann::json req = {
      {"model", "epd-nano"},
      {"messages", {{{"role", "user"}, {"content", "hello from a new user"}}}},
      {"max_tokens", 8}};
  auto plain = cli.Post("/v1/chat/completions", req.dump(), "application/json");
  ASSERT_TRUE(plain) << serve.ReadLog();
  ASSERT_EQ(plain->status, 200) << plain->body;
  auto body = nlohmann::json::parse(plain->body);
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_GT(body["usage"]["completion_tokens"].get<int>(), 0);
  nlohmann::json stream_req = req;
  stream_req["stream"] = true;
  auto streamed = cli.Post("/v1/chat/completions", stream_req.dump(), "application/json");
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->status, 200) << streamed->body;
  EXPECT_NE(streamed->body.find("data: {"), std::string::npos) << streamed->body;
  EXPECT_NE(streamed->body.find("data: [DONE]"), std::string::npos) << streamed->body;
  auto no_key = httplib::Client("127.0.0.1", http_port)
                    .Post("/v1/chat/completions", req.dump(), "application/json");
  ASSERT_TRUE(no_key);
  EXPECT_EQ(no_key->status, 401);

  if (epd::testing::RunCommand("command -v node >/dev/null 2>&1") != 0 ||
      !std::filesystem::exists(epd::testing::SourcePath("tests/clients") +
                               "/node_modules/openai/package.json")) {
    std::printf("node or tests/clients/node_modules missing: the SDK part is skipped\n");
  } else {
    std::string out;
    const int rc = epd::testing::RunCommand(
        "cd " + epd::testing::SourcePath("tests/clients") +
            " && EPD_BASE_URL=http://127.0.0.1:" + std::to_string(http_port) +
            "/v1 EPD_API_KEY=node-key EPD_REAL_MODEL=1 timeout 120 node openai_client_test.mjs "
            "2>&1",
        &out);
    std::printf("%s", out.c_str());
    EXPECT_EQ(rc, 0) << out << "\n--- epd serve ---\n" << serve.ReadLog();
    EXPECT_NE(out.find("ALL OK"), std::string::npos) << out;
  }

  // Ctrl-C stops everything: epd serve exits 0 and nothing answers on the API port any more.
  serve.Signal(SIGINT);
  auto rc = serve.Wait(std::chrono::seconds(60));
  ASSERT_TRUE(rc.has_value()) << serve.ReadLog();
  EXPECT_EQ(*rc, 0) << serve.ReadLog();
  EXPECT_FALSE(epd::testing::HttpGet(http_port, "/health").has_value());
}

}  // namespace
}  // namespace epd
