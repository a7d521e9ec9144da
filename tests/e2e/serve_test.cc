// The README's first command as a new user meets it: `epd serve` (kvstore, router and one real
// encoder, prefill and decode worker on 127.0.0.1, serving the trained demo model models/epd-nano
// by default). The README's curl gets an answer in dictionary words (the words of the model's
// training text; tests/model/trained_nano_test.cc shows random weights fail this check). Plain
// HTTP requests answer 200 streaming and not, the official OpenAI
// Node SDK (tests/clients) completes, streams, lists models and gets proper error objects, and
// Ctrl-C (SIGINT) stops every process.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/serve_cluster.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::BinaryPath;
using epd::testing::ServeCluster;
using epd::testing::Subprocess;

// The README's curl prompt (README.md, docs/demo.md, tests/model/trained_nano_test.cc).
constexpr char kReadmePrompt[] = "Tell me about files.";

// (dictionary words, words) of `text`: words are runs of >= 2 ASCII letters, lowercased.
std::pair<int, int> DictionaryWords(const std::string& text) {
  std::set<std::string> dict;
  std::ifstream in(epd::testing::SourcePath("tests/data/trained_nano_parity/words.txt"));
  for (std::string w; std::getline(in, w);) dict.insert(w);
  int hits = 0, total = 0;
  std::string w;
  for (size_t i = 0; i <= text.size(); ++i) {
    const char ch = i < text.size() ? text[i] : ' ';
    if (std::isalpha(static_cast<unsigned char>(ch))) {
      w += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      continue;
    }
    if (w.size() >= 2) {
      ++total;
      hits += dict.contains(w) ? 1 : 0;
    }
    w.clear();
  }
  return {hits, total};
}

TEST(ServeTest, EpdServeAnswersCurlAndTheOfficialOpenAiClient) {
  ServeCluster cluster({"--api-key", "node-key"});
  Subprocess& serve = cluster.serve();
  ASSERT_TRUE(cluster.WaitReady()) << serve.ReadLog();
  const int http_port = cluster.http_port();
  // The ready message names the ports the router took.
  EXPECT_NE(serve.ReadLog().find("http://127.0.0.1:" + std::to_string(http_port) + "/v1"),
            std::string::npos)
      << serve.ReadLog();
  // Default model: the committed trained checkpoint, not a generated random one.
  EXPECT_NE(serve.ReadLog().find("epd serve: model "), std::string::npos) << serve.ReadLog();
  EXPECT_NE(serve.ReadLog().find("models/epd-nano"), std::string::npos) << serve.ReadLog();
  EXPECT_FALSE(std::filesystem::exists(cluster.data_dir() + "/models/nano/config.json"));

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
  // The README's curl: readable words.
  const nlohmann::json readme = {{"model", "epd-nano"},
                                 {"messages", {{{"role", "user"}, {"content", kReadmePrompt}}}},
                                 {"max_tokens", 32},
                                 {"temperature", 0},
                                 {"frequency_penalty", 1.0}};
  auto answer = cli.Post("/v1/chat/completions", readme.dump(), "application/json");
  ASSERT_TRUE(answer) << serve.ReadLog();
  ASSERT_EQ(answer->status, 200) << answer->body;
  const std::string text =
      nlohmann::json::parse(answer->body)["choices"][0]["message"]["content"].get<std::string>();
  const auto [hits, words] = DictionaryWords(text);
  EXPECT_GE(words, 8) << text;
  EXPECT_GE(hits, words * 0.8) << text;

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

// `epd bench` with its default workload flags (--url: the test's free port; plus the kvstore's
// /metrics and the model's config for the persisted-bytes figures) against `epd serve` with its
// defaults: no errors. The conversations reach ~8.3K tokens on the fourth turn, past the
// router's own default of 8192; `epd serve` passes --context-length 32768 (docs/demo.md). The
// encoder stored blocks, so the persisted bytes per prompt token are measured, and they are
// below the V4-style policy's on the same blocks.
TEST(ServeTest, BenchDefaultsFitServeDefaults) {
  ServeCluster cluster;
  Subprocess& serve = cluster.serve();
  ASSERT_TRUE(cluster.WaitReady()) << serve.ReadLog();
  const int http_port = cluster.http_port();
  auto kv_metrics = cluster.Published("epd-kvstore", "metrics");
  ASSERT_TRUE(kv_metrics.has_value()) << serve.ReadLog();
  const std::string json_path = cluster.data_dir() + "/bench.json";
  std::string out;
  const int rc = epd::testing::RunCommand(
      BinaryPath("epd") + " bench --url http://127.0.0.1:" + std::to_string(http_port) +
          " --metrics-url http://127.0.0.1:" + std::to_string(*kv_metrics) +
          "/metrics --model-config " + epd::testing::SourcePath("models/epd-nano/config.json") +
          " --json " + json_path + " 2>&1",
      &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("requests        16 (16 ok, 0 errors, 0 incomplete)"), std::string::npos)
      << out;
  std::ifstream f(json_path);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  ASSERT_TRUE(j.is_object()) << out;
  const auto& p = j["persisted"];
  ASSERT_TRUE(p["g3_blocks"].is_number()) << out;
  EXPECT_GT(p["g3_blocks"].get<double>(), 0) << out;
  EXPECT_GT(p["g3_bytes"].get<double>(), 0) << out;
  ASSERT_TRUE(p["bytes_per_prompt_token"].is_number()) << out;
  EXPECT_GT(p["bytes_per_prompt_token"].get<double>(), 0) << out;
  ASSERT_TRUE(p["ours_vs_v4_style"].is_number()) << out;
  EXPECT_GT(p["ours_vs_v4_style"].get<double>(), 0) << out;
  EXPECT_LT(p["ours_vs_v4_style"].get<double>(), 1) << out;
  EXPECT_NE(out.find("persisted       "), std::string::npos) << out;
  serve.Signal(SIGINT);
  EXPECT_TRUE(serve.Wait(std::chrono::seconds(60)).has_value());
}

// Decode workers on one host (or one GPU) split its default KV pool instead of each taking it all
// (docs/serve.md, Devices): `--decodes 2` on the CPU gives each a capacity of half of a quarter
// of the host's memory, which each exports as epd_kv_pool_bytes{state="capacity"}.
TEST(ServeTest, DecodeWorkersOnOneHostSplitItsDefaultKvPool) {
  ServeCluster cluster({"--decodes", "2"});
  Subprocess& serve = cluster.serve();
  ASSERT_TRUE(cluster.WaitReady()) << cluster.Logs();
  const int64_t quarter =
      static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE) / 4;  // one worker's
  for (const char* name : {"epd-decode-0", "epd-decode-1"}) {
    const auto port = cluster.Published(name, "metrics");
    ASSERT_TRUE(port.has_value()) << name;
    double capacity = -1;
    EXPECT_TRUE(epd::testing::WaitForMetricValue(*port, "epd_kv_pool_bytes{state=\"capacity\"}",
                                                 static_cast<double>(quarter / 2),
                                                 std::chrono::seconds(10), &capacity))
        << name << " capacity " << capacity << ", want " << quarter / 2;
  }
  serve.Signal(SIGINT);
  auto rc = serve.Wait(std::chrono::seconds(60));
  ASSERT_TRUE(rc.has_value());
  EXPECT_EQ(*rc, 0);
}

}  // namespace
}  // namespace epd
