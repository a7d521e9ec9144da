// `epd bench`: its pieces (percentiles, synthetic tool output, URL and /metrics parsing) and the
// real binary against a real epd-router with epd-fake-worker processes.
#include "services/cli/bench.h"

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/e2e/router_cluster.h"

namespace epd::services {
namespace {

using epd::testing::BinaryPath;
using epd::testing::RouterCluster;
using nlohmann::json;

TEST(BenchPiecesTest, PercentileIsNearestRankAndOrdered) {
  EXPECT_FALSE(Percentile({}, 0.5).has_value());
  EXPECT_EQ(*Percentile({7}, 0.99), 7);
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);  // unsorted input
  EXPECT_EQ(*Percentile(v, 0.50), 50);
  EXPECT_EQ(*Percentile(v, 0.90), 90);
  EXPECT_EQ(*Percentile(v, 0.99), 99);
  EXPECT_EQ(*Percentile(v, 1.0), 100);
  EXPECT_EQ(*Percentile(v, 0.0), 1);
}

TEST(BenchPiecesTest, SyntheticToolOutputIsDeterministicSizedAndVaried) {
  const std::string a = SyntheticToolOutput(1, 0, 0, 256);
  EXPECT_EQ(a, SyntheticToolOutput(1, 0, 0, 256));
  EXPECT_EQ(a.size(), 256u * 4);
  EXPECT_NE(a, SyntheticToolOutput(2, 0, 0, 256));  // seed
  EXPECT_NE(a, SyntheticToolOutput(1, 1, 0, 256));  // session
  // The kinds rotate with the turn: terminal, file, web page.
  EXPECT_NE(SyntheticToolOutput(1, 0, 0, 64).find("[tool: bash]"), std::string::npos);
  EXPECT_NE(SyntheticToolOutput(1, 0, 1, 64).find("[tool: read_file]"), std::string::npos);
  EXPECT_NE(SyntheticToolOutput(1, 0, 2, 64).find("[tool: fetch]"), std::string::npos);
  EXPECT_TRUE(SyntheticToolOutput(1, 0, 0, 0).empty());
  for (char c : SyntheticToolOutput(3, 2, 5, 2000)) {
    ASSERT_TRUE(c == '\n' || (c >= 0x20 && c < 0x7f)) << static_cast<int>(c);
  }
}

TEST(BenchPiecesTest, ParsesUrls) {
  auto u = ParseHttpUrl("http://127.0.0.1:8000");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->host, "127.0.0.1");
  EXPECT_EQ(u->port, 8000);
  EXPECT_EQ(u->path, "");
  u = ParseHttpUrl("localhost/v1/");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->port, 80);
  EXPECT_EQ(u->path, "/v1");
  u = ParseHttpUrl("https://api.example.org/v1");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->scheme, "https");
  EXPECT_EQ(u->port, 443);
  EXPECT_FALSE(ParseHttpUrl("ftp://x").ok());
  EXPECT_FALSE(ParseHttpUrl("http://x:99999").ok());
  EXPECT_FALSE(ParseHttpUrl("http://:80").ok());
}

TEST(BenchPiecesTest, ParsesPrometheusText) {
  auto s = ParsePrometheusText(
      "# HELP epd_swa_replay_total x\n# TYPE epd_swa_replay_total counter\n"
      "epd_swa_replay_total{stage=\"encoder\"} 3\n"
      "epd_swa_replay_total{stage=\"decoder\",model=\"a\\\"b\"} 4.5 1700000000\n"
      "epd_up 1\n"
      "epd_ttft_seconds_bucket{le=\"+Inf\"} 2\n");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->size(), 4u);
  EXPECT_EQ((*s)[0].labels.at("stage"), "encoder");
  EXPECT_EQ((*s)[0].value, 3);
  EXPECT_EQ((*s)[1].labels.at("model"), "a\"b");
  EXPECT_EQ((*s)[1].value, 4.5);
  EXPECT_EQ((*s)[2].name, "epd_up");
  EXPECT_TRUE((*s)[2].labels.empty());
  EXPECT_EQ((*s)[3].labels.at("le"), "+Inf");
  auto bad = ParsePrometheusText("epd_x{stage=\"a} 1\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 1"), std::string::npos);
  EXPECT_FALSE(ParsePrometheusText("epd_x notanumber\n").ok());
}

TEST(BenchPiecesTest, ValidateNamesTheFlag) {
  BenchOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.sessions = 0;
  EXPECT_NE(o.Validate().message().find("--sessions"), std::string::npos);
  o = BenchOptions();
  o.url = "gopher://x";
  EXPECT_NE(o.Validate().message().find("--url"), std::string::npos);
  o = BenchOptions();
  o.duration_s = 0;
  EXPECT_NE(o.Validate().message().find("--duration-s"), std::string::npos);
}

// The V4-style policy on the nano config, by hand: head_dim 128 -> a main entry is 64 + 8 = 72 B,
// an index key (128 dims) 64 + 4 = 68 B, an SWA slot 128 + 4 = 132 B. Layers 2-5 compress 2:1,
// 6-11 1:1; index sources 2, 4, 6, 8, 10. Per token: 4 x 72/2 + 2 x 68/2 + 6 x 72 + 3 x 68 = 848 B;
// a 64-token block: 54,272 B; every main layer's SWA window: 12 x 128 x 132 = 202,752 B.
TEST(BenchPiecesTest, V4StylePolicyPersistsEveryLayersKvAndSwaWindowPerBlock) {
  auto config =
      epd::model::LoadModelConfig(epd::testing::SourcePath("models/epd-nano/config.json"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_DOUBLE_EQ(V4StyleBytesPerBlock(*config, 64), 54272.0 + 202752.0);
  EXPECT_DOUBLE_EQ(V4StyleBytesPerBlock(*config, 128) - V4StyleBytesPerBlock(*config, 64), 54272.0);
  // Without CED every layer keeps its own KV: more than the shared sources (280 B/token here).
  EXPECT_GT(V4StyleBytesPerBlock(*config, 64) - 202752.0,
            64 * epd::model::ComputeKvLayout(*config).global_bytes_per_token);
}

// Runs build/epd bench; returns the exit code, fills *out with stdout+stderr.
int RunEpdBench(const std::string& args, std::string* out) {
  return epd::testing::RunCommand(BinaryPath("epd") + " bench " + args + " 2>&1", out);
}

json ReadJson(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f, nullptr, false);
}

void ExpectOrdered(const json& p, const std::string& what) {
  ASSERT_TRUE(p["p50"].is_number()) << what << " " << p;
  ASSERT_TRUE(p["p90"].is_number()) << what << " " << p;
  ASSERT_TRUE(p["p99"].is_number()) << what << " " << p;
  EXPECT_LE(p["p50"].get<double>(), p["p90"].get<double>()) << what;
  EXPECT_LE(p["p90"].get<double>(), p["p99"].get<double>()) << what;
}

TEST(BenchE2ETest, TwoSessionsThreeTurnsAgainstTheRealRouter) {
  RouterCluster c;
  ASSERT_GT(c.http_port(), 0);
  ASSERT_NE(c.AddWorker("encoder", "e0"), nullptr);
  ASSERT_NE(c.AddWorker("prefill", "p0"), nullptr);
  ASSERT_NE(c.AddWorker("decode", "d0", {"--token-interval-ms", "2"}), nullptr);
  const std::string json_path = c.dir().File("bench.json");
  std::string out;
  const int rc = RunEpdBench(
      "--url http://127.0.0.1:" + std::to_string(c.http_port()) +
          " --model epd-nano --sessions 2 --turns 3 --tool-tokens 64 --max-tokens 8 --seed 7"
          " --duration-s 60 --timeout-s 20 --metrics-url http://127.0.0.1:" +
          std::to_string(c.router().metrics) + "/metrics --json " + json_path,
      &out);
  ASSERT_EQ(rc, 0) << out;
  // The summary names every figure; stderr is a pipe here, so no bar escape codes.
  for (const char* s :
       {"TTFT ms", "ITL ms", "output tokens/s", "requests/s", "cached ratio", "SWA replays"}) {
    EXPECT_NE(out.find(s), std::string::npos) << s << "\n" << out;
  }
  EXPECT_EQ(out.find("\x1b["), std::string::npos) << out;

  json j = ReadJson(json_path);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["requests"], 6) << j.dump(2);
  EXPECT_EQ(j["ok"], 6) << j.dump(2);
  EXPECT_EQ(j["errors"], 0) << j.dump(2);
  EXPECT_EQ(j["incomplete"], 0) << j.dump(2);
  ExpectOrdered(j["ttft_ms"], "ttft");
  ExpectOrdered(j["itl_ms"], "itl");
  ExpectOrdered(j["e2e_ms"], "e2e");
  EXPECT_GT(j["ttft_ms"]["p50"].get<double>(), 0);
  EXPECT_LE(j["ttft_ms"]["p99"].get<double>(), j["e2e_ms"]["p99"].get<double>());
  EXPECT_EQ(j["ttft_ms"]["count"], 6);
  // 8 tokens per answer, at most one chunk each (the router may hold back bytes of an incomplete
  // UTF-8 sequence): at most 7 gaps per request.
  EXPECT_GT(j["itl_ms"]["count"].get<int>(), 0) << j.dump(2);
  EXPECT_LE(j["itl_ms"]["count"].get<int>(), 6 * 7) << j.dump(2);
  EXPECT_EQ(j["completion_tokens"], 6 * 8);
  // Each turn resends the whole conversation, so turn t carries t tool outputs of 256 characters;
  // even at 16 characters per token that is more than 2 x (1+2+3) x 16 prompt tokens.
  EXPECT_GT(j["prompt_tokens"].get<int64_t>(), 2 * (1 + 2 + 3) * 16);
  ASSERT_TRUE(j["cached_token_ratio"].is_number());
  EXPECT_GE(j["cached_token_ratio"].get<double>(), 0.0);
  EXPECT_LE(j["cached_token_ratio"].get<double>(), 1.0);
  EXPECT_GT(j["output_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["requests_per_s"].get<double>(), 0);
  // No process exposes epd_swa_replay_total yet: the figure is null, not a made-up zero.
  for (const char* stage : {"encoder", "decoder"}) {
    EXPECT_TRUE(j["swa_replays"][stage].is_null() || j["swa_replays"][stage].get<double>() >= 0)
        << j["swa_replays"];
  }
  // The router counted what the client counted.
  auto ok = epd::testing::ScrapeMetric(c.router().metrics, "epd_requests_total{outcome=\"ok\"}");
  ASSERT_TRUE(ok.has_value());
  EXPECT_EQ(*ok, 6);
}

TEST(BenchE2ETest, DurationCapStopsTheRunAndCountsAbandonedStreams) {
  RouterCluster c;
  ASSERT_GT(c.http_port(), 0);
  // 200 ms per token x 100 tokens: each stream would take 20 s.
  ASSERT_NE(c.AddWorker("decode", "d0", {"--token-interval-ms", "200"}), nullptr);
  const std::string json_path = c.dir().File("bench.json");
  std::string out;
  const auto start = std::chrono::steady_clock::now();
  const int rc = RunEpdBench("--url http://127.0.0.1:" + std::to_string(c.http_port()) +
                                 " --sessions 2 --turns 5 --tool-tokens 16 --max-tokens 100"
                                 " --duration-s 1 --json " +
                                 json_path,
                             &out);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(rc, 0) << out;  // abandoned streams are not errors
  EXPECT_LT(took, 10) << out;
  json j = ReadJson(json_path);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["requests"], 2) << j.dump(2);
  EXPECT_EQ(j["incomplete"], 2) << j.dump(2);
  EXPECT_EQ(j["errors"], 0) << j.dump(2);
  EXPECT_TRUE(j["ttft_ms"]["p50"].is_null());
}

TEST(BenchE2ETest, ClearErrorsForBadEndpointKeyModelAndFlags) {
  std::string out;
  EXPECT_EQ(RunEpdBench("--sessions 0", &out), 2);
  EXPECT_NE(out.find("--sessions"), std::string::npos) << out;

  out.clear();
  const int closed = epd::testing::PickFreePort();
  EXPECT_EQ(RunEpdBench("--url http://127.0.0.1:" + std::to_string(closed), &out), 2);
  EXPECT_NE(out.find("cannot reach"), std::string::npos) << out;

  RouterCluster c({"--api-key", "sekrit"});
  ASSERT_GT(c.http_port(), 0);
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  const std::string url = "--url http://127.0.0.1:" + std::to_string(c.http_port());
  out.clear();
  EXPECT_EQ(RunEpdBench(url + " --turns 1 --sessions 1", &out), 2);
  EXPECT_NE(out.find("API key"), std::string::npos) << out;
  out.clear();
  EXPECT_EQ(RunEpdBench(url + " --api-key sekrit --model nope --turns 1 --sessions 1", &out), 2);
  EXPECT_NE(out.find("does not serve model 'nope'"), std::string::npos) << out;
  EXPECT_NE(out.find("epd-nano"), std::string::npos) << out;
  out.clear();
  EXPECT_EQ(RunEpdBench(url + " --api-key sekrit --turns 1 --sessions 1 --max-tokens 4"
                              " --tool-tokens 8",
                        &out),
            0)
      << out;
}

}  // namespace
}  // namespace epd::services
