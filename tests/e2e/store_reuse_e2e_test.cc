// Store reuse end to end (DESIGN.md §3 steps 1-2, §5; docs/workers.md "Store reuse"): real
// epd-kvstore + epd-router + epd-encoder/prefill/decode processes on 127.0.0.1 with the nano model.
// An agent's turn 2 (turn 1's prompt + its reply + a long new message) reuses turn 1's blocks:
// usage reports them cached, the kvstore served them, and the greedy output equals a cluster
// without a store token for token, also when the prefix ends where no SWA snapshot was taken
// (the encoder replays the rings, exactly). With a 1 ms SWA TTL the snapshot is expired at turn
// 2: the encoder replays once and the request still succeeds; with the kvstore killed, requests
// run with no prefix.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epd/v1/inference.grpc.pb.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::Generation;
using epd::testing::ScrapeMetric;

double Metric(int port, const std::string& series) {
  return ScrapeMetric(port, series).value_or(0.0);
}

// Router + encoder + prefill + decode; with `store`, an epd-kvstore (extra flags `kv_args`) that
// the router and every worker use.
class Cluster : public testing::RealCluster {
 public:
  Cluster(bool store, std::vector<std::string> kv_args = {})
      : RealCluster({.model_dir = testing::NanoModelDirTest::model_dir(),
                     .store = store,
                     .kv_args = std::move(kv_args)}) {}
  // Hits of the kvstore over every tier (gets and lookups).
  double KvHits() const {
    double sum = 0;
    for (const char* t : {"g1", "g2", "g3"})
      sum += Metric(kv_metrics(), std::string("epd_kv_hits_total{tier=\"") + t + "\"}");
    return sum;
  }
};

Generation Generate(int port, const std::vector<int32_t>& prompt, int max_tokens) {
  return testing::Generate(port, prompt, max_tokens, {.deadline = std::chrono::seconds(90)});
}

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 10 + (i * 31 + salt * 7 + i / 5) % 400;
  return p;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

constexpr int kTurn1 = 300;      // 4 whole blocks of 64 (256) + 44
constexpr int kNewTokens = 200;  // > tail rows (133) + a block (64)
constexpr int kMaxTokens = 12;

class StoreReuseE2ETest : public testing::NanoModelDirTest {};

TEST_F(StoreReuseE2ETest, SecondTurnReusesTheFirstTurnsBlocksAndOutputIsUnchanged) {
  const std::vector<int32_t> turn1 = Tokens(kTurn1, 1);
  std::vector<int32_t> turn2, turn2_short;
  std::vector<int32_t> want2, want2_short;
  {
    // Baseline: the same two turns on a cluster without a store.
    Cluster plain(/*store=*/false);
    Generation g1 = Generate(plain.grpc_port(), turn1, kMaxTokens);
    ASSERT_TRUE(g1.status.ok()) << g1.status.error_message() << "\n" << plain.Logs();
    ASSERT_FALSE(g1.ids.empty());
    turn2 = Concat(Concat(turn1, g1.ids), Tokens(kNewTokens, 2));
    turn2_short = Concat(Concat(turn1, g1.ids), Tokens(20, 3));
    Generation g2 = Generate(plain.grpc_port(), turn2, kMaxTokens);
    ASSERT_TRUE(g2.status.ok()) << g2.status.error_message() << "\n" << plain.Logs();
    EXPECT_EQ(g2.cached, 0);
    want2 = g2.ids;
    Generation g3 = Generate(plain.grpc_port(), turn2_short, kMaxTokens);
    ASSERT_TRUE(g3.status.ok()) << g3.status.error_message();
    want2_short = g3.ids;
  }

  Cluster c(/*store=*/true);
  Generation g1 = Generate(c.grpc_port(), turn1, kMaxTokens);
  ASSERT_TRUE(g1.status.ok()) << g1.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g1.cached, 0);
  // Turn 1 stored its 4 whole blocks and the SWA snapshot at 256.
  EXPECT_EQ(
      Metric(c.metrics("encoder"), "epd_kv_worker_writes_total{pool=\"encoder\",tier=\"g3\"}"),
      kTurn1 / 64);
  EXPECT_EQ(
      Metric(c.metrics("encoder"), "epd_kv_worker_writes_total{pool=\"encoder\",tier=\"g2\"}"),
      1.0);
  ASSERT_EQ(turn2, Concat(Concat(turn1, g1.ids), Tokens(kNewTokens, 2)))
      << "turn 1 differs between the clusters";

  const double hits_before = c.KvHits();
  Generation g2 = Generate(c.grpc_port(), turn2, kMaxTokens);
  ASSERT_TRUE(g2.status.ok()) << g2.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g2.prompt_tokens, static_cast<int>(turn2.size()));
  EXPECT_EQ(g2.cached, kTurn1 / 64 * 64) << c.Logs();
  EXPECT_GT(c.KvHits(), hits_before);
  EXPECT_EQ(g2.ids, want2) << "turn 2 with the store differs from the run without\n" << c.Logs();
  EXPECT_EQ(Metric(c.metrics("encoder"), "epd_kv_worker_prefix_tokens_total{pool=\"encoder\"}"),
            kTurn1 / 64 * 64);
  // The snapshot was live: no encoder replay; the prefill replayed its tail once per request.
  EXPECT_EQ(Metric(c.metrics("encoder"), "epd_swa_replay_total{stage=\"encoder\"}"), 0.0);
  EXPECT_EQ(Metric(c.metrics("prefill"), "epd_swa_replay_total{stage=\"decoder\"}"), 2.0);

  // A short turn 2 (new tokens < tail rows): the hint is capped to the largest block boundary
  // <= N - 133 (192, not 256). No snapshot was taken there (only at each prompt's last block
  // boundary), so the encoder replays the rings (exactly: docs/workers.md): the same output.
  const int n = static_cast<int>(turn2_short.size());
  Generation g3 = Generate(c.grpc_port(), turn2_short, kMaxTokens);
  ASSERT_TRUE(g3.status.ok()) << g3.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g3.cached, (n - 133) / 64 * 64);
  EXPECT_GT(g3.cached, 0);
  EXPECT_LT(g3.cached, kTurn1 / 64 * 64);
  EXPECT_EQ(g3.ids, want2_short) << "a replayed prefix differs from the run without a store";
  EXPECT_EQ(Metric(c.metrics("encoder"), "epd_swa_replay_total{stage=\"encoder\"}"), 1.0);
  EXPECT_EQ(
      Metric(c.metrics("encoder"), "epd_kv_worker_store_errors_total{op=\"get\",pool=\"encoder\"}"),
      0.0);
}

// The same flow as an agent client sends it: OpenAI chat completions over HTTP, turn 2 = turn 1's
// messages + the assistant's reply + a long tool-output-like user message. The chat format
// renders turn 1's prompt as a prefix of turn 2's, so `usage.prompt_tokens_details.cached_tokens`
// covers turn 1's prompt in whole blocks, and the reply equals that of a cluster without a store.
struct Chat {
  int status = 0;
  std::string content;
  int prompt_tokens = -1;
  int cached = -1;
  std::string body;
};

Chat PostChat(int http_port, const nlohmann::json& messages) {
  httplib::Client cli("127.0.0.1", http_port);
  cli.set_read_timeout(120, 0);
  nlohmann::json req = {{"model", "epd-nano"},
                        {"messages", messages},
                        {"max_tokens", kMaxTokens},
                        {"temperature", 0}};
  auto res = cli.Post("/v1/chat/completions", req.dump(), "application/json");
  Chat c;
  if (!res) return c;
  c.status = res->status;
  c.body = res->body;
  auto j = nlohmann::json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.contains("usage")) return c;
  c.content = j["choices"][0]["message"].value("content", "");
  c.prompt_tokens = j["usage"]["prompt_tokens"].get<int>();
  c.cached = j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  return c;
}

std::string Words(int n, int salt) {
  static const char* kWords[] = {"build",  "passed", "error", "file", "line",   "cache", "token",
                                 "worker", "store",  "agent", "tool", "output", "page",  "json"};
  std::string out;
  for (int i = 0; i < n; ++i) {
    out += kWords[(i * 7 + salt * 3 + i / 4) % 14];
    out += (i % 11 == 10) ? ".\n" : " ";
  }
  return out;
}

TEST_F(StoreReuseE2ETest, OpenAiChatTurnTwoReportsTurnOnesBlocksCachedWithUnchangedOutput) {
  const nlohmann::json turn1 = nlohmann::json::array(
      {{{"role", "system"}, {"content", "You are a coding agent."}},
       {{"role", "user"}, {"content", "Fix the failing build. Log:\n" + Words(160, 1)}}});
  auto turn2_of = [](nlohmann::json messages, const std::string& reply) {
    messages.push_back({{"role", "assistant"}, {"content", reply}});
    messages.push_back({{"role", "user"}, {"content", "Tool output:\n" + Words(180, 2)}});
    return messages;
  };
  Chat want1, want2;
  {
    Cluster plain(/*store=*/false);
    want1 = PostChat(plain.http_port(), turn1);
    ASSERT_EQ(want1.status, 200) << want1.body << plain.Logs();
    want2 = PostChat(plain.http_port(), turn2_of(turn1, want1.content));
    ASSERT_EQ(want2.status, 200) << want2.body;
    EXPECT_EQ(want2.cached, 0);
  }
  Cluster c(/*store=*/true);
  const Chat got1 = PostChat(c.http_port(), turn1);
  ASSERT_EQ(got1.status, 200) << got1.body << c.Logs();
  EXPECT_EQ(got1.cached, 0);
  EXPECT_EQ(got1.content, want1.content);
  const int whole_blocks = got1.prompt_tokens / 64 * 64;
  ASSERT_GE(whole_blocks, 128) << "turn 1 is too short to test reuse: " << got1.prompt_tokens;
  const double hits_before = c.KvHits();
  const Chat got2 = PostChat(c.http_port(), turn2_of(turn1, got1.content));
  ASSERT_EQ(got2.status, 200) << got2.body << c.Logs();
  ASSERT_GE(got2.prompt_tokens - 133, whole_blocks) << "turn 2's new message is too short";
  EXPECT_EQ(got2.cached, whole_blocks) << got2.body;
  EXPECT_GT(c.KvHits(), hits_before);
  EXPECT_EQ(got2.content, want2.content) << "turn 2 with the store differs from the run without";
  EXPECT_EQ(got2.prompt_tokens, want2.prompt_tokens);
}

TEST_F(StoreReuseE2ETest, ExpiredSnapshotReplaysOnceAndADeadStoreFailsNoRequest) {
  Cluster c(/*store=*/true, {"--swa-ttl-ms", "1"});
  const std::vector<int32_t> turn1 = Tokens(kTurn1, 4);
  Generation g1 = Generate(c.grpc_port(), turn1, kMaxTokens);
  ASSERT_TRUE(g1.status.ok()) << g1.status.error_message() << "\n" << c.Logs();
  const double enc_before = Metric(c.metrics("encoder"), "epd_swa_replay_total{stage=\"encoder\"}");
  const double dec_before = Metric(c.metrics("prefill"), "epd_swa_replay_total{stage=\"decoder\"}");
  EXPECT_EQ(enc_before, 0.0);
  EXPECT_EQ(dec_before, 1.0);

  const std::vector<int32_t> turn2 = Concat(Concat(turn1, g1.ids), Tokens(kNewTokens, 5));
  Generation g2 = Generate(c.grpc_port(), turn2, kMaxTokens);
  ASSERT_TRUE(g2.status.ok()) << g2.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g2.cached, kTurn1 / 64 * 64);
  EXPECT_EQ(static_cast<int>(g2.ids.size()), kMaxTokens);
  EXPECT_EQ(Metric(c.metrics("encoder"), "epd_swa_replay_total{stage=\"encoder\"}"),
            enc_before + 1);
  // The whole prefix (256 < split x window): the rings are rebuilt exactly.
  EXPECT_EQ(Metric(c.metrics("encoder"), "epd_swa_replay_tokens_total{stage=\"encoder\"}"),
            kTurn1 / 64 * 64);
  EXPECT_EQ(Metric(c.metrics("prefill"), "epd_swa_replay_total{stage=\"decoder\"}"),
            dec_before + 1);
  EXPECT_GT(Metric(c.kv_metrics(), "epd_kv_misses_total{reason=\"expired\",tier=\"g2\"}") +
                Metric(c.kv_metrics(), "epd_kv_ttl_expiries_total{tier=\"g2\"}"),
            0.0)
      << c.Logs();

  // The kvstore dies: the next request still succeeds, with no prefix, and the encoder counts
  // the failed store call.
  c.KillKvStore();
  Generation g3 = Generate(c.grpc_port(), Concat(turn2, Tokens(70, 6)), 4);
  ASSERT_TRUE(g3.status.ok()) << g3.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g3.cached, 0);
  EXPECT_EQ(static_cast<int>(g3.ids.size()), 4);
  EXPECT_GT(Metric(c.metrics("encoder"),
                   "epd_kv_worker_store_errors_total{op=\"lookup\",pool=\"encoder\"}"),
            0.0)
      << c.Logs();
}

}  // namespace
}  // namespace epd
