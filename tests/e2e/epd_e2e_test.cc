// The real chain: epd-router + epd-encoder + epd-prefill + epd-decode processes on 127.0.0.1 (UCX
// over loopback) on the generated nano model. Disaggregation changes nothing: the greedy output
// equals Model::Prefill + Decode in this process. Failure behaviour: SIGKILL of decode fails only
// its request; SIGTERM drains (the running request finishes, exit 0).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <thread>

#include "epd/v1/inference.grpc.pb.h"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::Generate;
using epd::testing::Generation;
using epd::testing::Prompt;
using epd::testing::ScrapeMetric;

using Proc = testing::RealProc;

// Router + one worker per pool; workers drain for up to 20 s on SIGTERM.
class Cluster : public testing::RealCluster {
 public:
  Cluster()
      : RealCluster({.model_dir = testing::NanoModelDirTest::model_dir(),
                     .worker_args = {"--drain-timeout-ms", "20000"}}) {}
};

// The monolithic reference forward in this process (tests/testing/nano_model.h).
std::vector<int32_t> Reference(const std::vector<int32_t>& prompt, int max_tokens,
                               std::string* finish) {
  return testing::BoundedReferenceGreedy(testing::NanoModelDirTest::model_dir(), prompt,
                                         max_tokens, finish);
}

class EpdE2ETest : public testing::NanoModelDirTest {};

TEST_F(EpdE2ETest, DisaggregatedGreedyEqualsMonolithic) {
  Cluster c;
  // Prompts shorter than the tail (exact forward) and longer ones, not multiples of 2, 8, 64 or
  // 128 (bounded decoder replay).
  const std::map<int, int> lengths = {{1, 100}, {2, 120}, {3, 301}, {4, 450}};
  for (const auto& [salt, length] : lengths) {
    const std::vector<int32_t> prompt = Prompt(length, salt);
    std::string want_finish;
    const std::vector<int32_t> want = Reference(prompt, 16, &want_finish);
    Generation g = Generate(c.grpc_port(), prompt, 16);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
    EXPECT_FALSE(want.empty());
    EXPECT_EQ(g.ids, want) << c.Logs();
    EXPECT_EQ(g.finish, want_finish);
  }
  // Every stage ran and the prefill counted its decoder replay.
  EXPECT_EQ(ScrapeMetric(c.worker("encoder").metrics,
                         "epd_worker_requests_total{outcome=\"ok\",pool=\"encoder\"}"),
            4.0);
  EXPECT_EQ(ScrapeMetric(c.worker("prefill").metrics, "epd_swa_replay_total{stage=\"decoder\"}"),
            4.0);
  EXPECT_EQ(ScrapeMetric(c.worker("decode").metrics,
                         "epd_worker_requests_total{outcome=\"ok\",pool=\"decode\"}"),
            4.0);
}

// Several requests at once share the decode worker's batched steps; each output is unchanged.
TEST_F(EpdE2ETest, ConcurrentRequestsAreBatchedAndUnchanged) {
  Cluster c;
  std::vector<std::vector<int32_t>> prompts, want(3);
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(Prompt(80 + 10 * i, 10 + i));
    std::string finish;
    want[i] = Reference(prompts[i], 24, &finish);
  }
  std::vector<Generation> got(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i)
    threads.emplace_back([&, i] { got[i] = Generate(c.grpc_port(), prompts[i], 24); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message() << "\n" << c.Logs();
    EXPECT_EQ(got[i].ids, want[i]) << i;
  }
  EXPECT_EQ(ScrapeMetric(c.worker("decode").metrics,
                         "epd_worker_requests_total{outcome=\"ok\",pool=\"decode\"}"),
            3.0);
}

// Independent scaling: a second real encoder started against the running router takes work
// without a restart; SIGTERM drains it out of the rotation and the pool keeps serving.
TEST_F(EpdE2ETest, SecondEncoderTakesWorkAndAStoppedOneLeavesTheRotation) {
  Cluster c;
  Proc* first = &c.worker("encoder");
  Proc* second = c.Add("encoder", "encoder-1");
  const std::string ok_series = "epd_worker_requests_total{outcome=\"ok\",pool=\"encoder\"}";
  std::string finish;
  for (int i = 0; i < 4; ++i) {
    const std::vector<int32_t> prompt = Prompt(150 + i, 20 + i);
    Generation g = Generate(c.grpc_port(), prompt, 4);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
    EXPECT_EQ(g.ids, Reference(prompt, 4, &finish)) << i;
  }
  const double by_first = ScrapeMetric(first->metrics, ok_series).value_or(0);
  const double by_second = ScrapeMetric(second->metrics, ok_series).value_or(0);
  EXPECT_EQ(by_first + by_second, 4.0);
  EXPECT_GE(by_second, 1.0) << "the encoder started later never got a job";
  // Stop the second one: it drains, exits 0, and the router routes around it.
  second->proc.Signal(SIGTERM);
  auto rc = second->proc.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(rc.has_value());
  EXPECT_EQ(*rc, 0) << second->proc.ReadLog();
  for (int i = 0; i < 2; ++i) {
    Generation g = Generate(c.grpc_port(), Prompt(140, 30 + i), 4);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
  }
  EXPECT_EQ(ScrapeMetric(first->metrics, ok_series).value_or(0), by_first + 2.0);
}

TEST_F(EpdE2ETest, SigkillOfDecodeFailsItsRequestOnly) {
  Cluster c;
  Generation g = Generate(c.grpc_port(), Prompt(100, 3), 400,
                          {.on_first = [&] { c.worker("decode").proc.Signal(SIGKILL); }});
  EXPECT_TRUE(!g.status.ok() || g.finish == "error") << g.finish;
  EXPECT_LT(g.ids.size(), 400u);
  // The other workers stay up and idle (no job hangs in them).
  EXPECT_TRUE(c.worker("encoder").proc.running());
  EXPECT_TRUE(c.worker("prefill").proc.running());
  // A new decode worker serves the next request.
  c.Add("decode", "decode-1");
  std::string finish;
  const std::vector<int32_t> prompt = Prompt(90, 4);
  Generation ok = Generate(c.grpc_port(), prompt, 8);
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(ok.ids, Reference(prompt, 8, &finish));
}

TEST_F(EpdE2ETest, SigtermDrainsTheRunningRequest) {
  Cluster c;
  const std::vector<int32_t> prompt = Prompt(100, 5);
  std::string finish;
  Generation g = Generate(c.grpc_port(), prompt, 40,
                          {.on_first = [&] { c.worker("decode").proc.Signal(SIGTERM); }});
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g.ids, Reference(prompt, 40, &finish));
  auto rc = c.worker("decode").proc.Wait(std::chrono::seconds(20));
  ASSERT_TRUE(rc.has_value());
  EXPECT_EQ(*rc, 0) << c.worker("decode").proc.ReadLog();
}

}  // namespace
}  // namespace epd
