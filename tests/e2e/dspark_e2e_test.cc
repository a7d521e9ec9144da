// DSpark in the real chain: epd-router + epd-encoder + epd-prefill + epd-decode processes on
// 127.0.0.1 (UCX over loopback) on the generated nano model. With DSpark on (the default) the
// decode worker drafts and verifies every step; greedy completions equal the monolithic
// Model::Prefill + Decode in this process and a cluster with --dspark off, and the decode
// worker's /metrics count drafted and accepted tokens (accepted <= drafted). On the trained demo
// model (models/epd-nano, trained DSpark heads) the drafts are accepted far more often than the
// random heads' ~5%, and the greedy answers to chat prompts still equal the plain loop's.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "epd/v1/inference.grpc.pb.h"
#include "kernels/backend.h"
#include "tokenizer/chat_format.h"
#include "model/model.h"
#include "model/sampling.h"
#include "tokenizer/tokenizer.h"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::BinaryPath;
using epd::testing::Generate;
using epd::testing::Generation;
using epd::testing::Prompt;
using epd::testing::ScrapeMetric;

// Router + one worker per pool, every worker with `--dspark on|off` (the router pairs only
// workers with the same config fingerprint, which covers the switch).
class Cluster : public testing::RealCluster {
 public:
  explicit Cluster(bool dspark, std::vector<std::string> decode_args = {},
                   std::string model_dir = testing::NanoModelDirTest::model_dir())
      : RealCluster({.model_dir = std::move(model_dir),
                     .dspark = dspark,
                     .decode_args = std::move(decode_args)}) {}
  int decode_metrics() const { return metrics("decode"); }
};

// Model::Prefill + Decode in this process (greedy; EOS ends it and is not emitted).
std::vector<int32_t> Reference(const model::Model& m, const std::vector<int32_t>& prompt,
                               int max_tokens) {
  auto st = m.NewSequence();
  auto r = m.Prefill(*st, prompt, false);
  EXPECT_TRUE(r.ok());
  std::vector<int32_t> out;
  int32_t tok = model::ArgMax(r->logits);
  const int32_t eos = static_cast<int32_t>(m.config().eos_token_id);
  while (static_cast<int>(out.size()) < max_tokens && tok != eos) {
    out.push_back(tok);
    if (static_cast<int>(out.size()) == max_tokens) break;
    auto d = m.Decode(*st, tok);
    EXPECT_TRUE(d.ok());
    tok = model::ArgMax(d->logits);
  }
  return out;
}

class DSparkE2ETest : public testing::NanoModelDirTest {
 protected:
  // Prompt lengths and token counts: generations cross the 128-token window (100 + 40).
  static std::vector<std::pair<std::vector<int32_t>, int>> Requests() {
    return {{Prompt(100, 1), 40}, {Prompt(120, 2), 24}, {Prompt(30, 3), 33}};
  }
  // The requests at once (they share the decode worker's batched steps).
  static std::vector<Generation> RunAll(const Cluster& c) {
    const auto reqs = Requests();
    std::vector<Generation> got(reqs.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < reqs.size(); ++i)
      threads.emplace_back(
          [&, i] { got[i] = Generate(c.grpc_port(), reqs[i].first, reqs[i].second); });
    for (auto& t : threads) t.join();
    return got;
  }
};

TEST_F(DSparkE2ETest, DSparkOnEqualsMonolithicAndOffAndCountsDrafts) {
  auto backend = kernels::MakeCpuBackend();
  auto model = model::Model::Load(model_dir(), *backend);
  ASSERT_TRUE(model.ok()) << model.status();
  const auto reqs = Requests();
  std::vector<std::vector<int32_t>> want;
  for (const auto& [prompt, n] : reqs) want.push_back(Reference(**model, prompt, n));

  std::vector<Generation> on, off;
  double drafted = 0, accepted = 0, verify_steps = 0;
  {
    // The k policy with an accelerator's step-time model, under which it drafts (the worker's
    // default is the CPU fit, under which drafting rarely pays off on the random nano model).
    Cluster c(/*dspark=*/true, {"--dspark-time-model", "1,0.02,0.05"});
    on = RunAll(c);
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_TRUE(on[i].status.ok()) << on[i].status.error_message() << "\n" << c.Logs();
      EXPECT_EQ(on[i].ids, want[i]) << "request " << i;
    }
    drafted = ScrapeMetric(c.decode_metrics(), "epd_dspark_drafted_tokens_total").value_or(-1);
    accepted = ScrapeMetric(c.decode_metrics(), "epd_dspark_accepted_tokens_total").value_or(-1);
    verify_steps =
        ScrapeMetric(c.decode_metrics(), "epd_dspark_verify_length_tokens_count").value_or(-1);
    EXPECT_EQ(ScrapeMetric(c.decode_metrics(), "epd_dspark_handoff_mismatch_total"), 0.0);
    // Per draft position (epd_dspark_position_*{position="1".."5"}): position j counts the drafts
    // verified / accepted there, so summed over positions they are the totals, and acceptance
    // never rises with the position (an accepted draft j needs drafts 1..j-1 accepted).
    double pos_drafted = 0, pos_accepted = 0, prev_accepted = 1e18;
    for (int j = 1; j <= 5; ++j) {
      const std::string label = "{position=\"" + std::to_string(j) + "\"}";
      const double d =
          ScrapeMetric(c.decode_metrics(), "epd_dspark_position_drafted_tokens_total" + label)
              .value_or(-1);
      const double a =
          ScrapeMetric(c.decode_metrics(), "epd_dspark_position_accepted_tokens_total" + label)
              .value_or(-1);
      ASSERT_GE(d, 0) << "position " << j << " is not exposed";
      EXPECT_LE(a, d) << "position " << j;
      EXPECT_LE(a, prev_accepted) << "position " << j;
      prev_accepted = a;
      pos_drafted += d;
      pos_accepted += a;
    }
    EXPECT_EQ(pos_drafted, drafted);
    EXPECT_EQ(pos_accepted, accepted);
    // Seeded sampling reaches the decode worker's sampler: the same seed reproduces the
    // completion through the whole chain, another seed changes it.
    const Generation s1 =
        Generate(c.grpc_port(), reqs[0].first, 24, {.temperature = 0.9f, .seed = 77});
    const Generation s2 =
        Generate(c.grpc_port(), reqs[0].first, 24, {.temperature = 0.9f, .seed = 77});
    const Generation s3 =
        Generate(c.grpc_port(), reqs[0].first, 24, {.temperature = 0.9f, .seed = 78});
    ASSERT_TRUE(s1.status.ok() && s2.status.ok() && s3.status.ok()) << c.Logs();
    EXPECT_EQ(s1.ids, s2.ids);
    EXPECT_NE(s1.ids, s3.ids);
    EXPECT_NE(s1.ids, std::vector<int32_t>(want[0].begin(), want[0].begin() + 24));  // T > 0
  }
  EXPECT_GT(drafted, 0);
  EXPECT_GE(accepted, 0);
  EXPECT_LE(accepted, drafted);
  EXPECT_GT(verify_steps, 0);
  std::printf("decode worker: drafted %.0f accepted %.0f over %.0f sequence-steps\n", drafted,
              accepted, verify_steps);
  {
    Cluster c(/*dspark=*/false);
    off = RunAll(c);
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_TRUE(off[i].status.ok()) << off[i].status.error_message() << "\n" << c.Logs();
      EXPECT_EQ(off[i].ids, on[i].ids) << "request " << i;
      EXPECT_EQ(off[i].finish, on[i].finish) << "request " << i;
    }
    EXPECT_EQ(ScrapeMetric(c.decode_metrics(), "epd_dspark_drafted_tokens_total"), 0.0);
  }
  {
    // The decode-only flag: a fixed k verifies drafts on every step (no policy).
    Cluster c(/*dspark=*/true, {"--dspark-k", "3"});
    const std::vector<Generation> fixed = RunAll(c);
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_TRUE(fixed[i].status.ok()) << fixed[i].status.error_message() << "\n" << c.Logs();
      EXPECT_EQ(fixed[i].ids, want[i]) << "request " << i;
    }
    const double d =
        ScrapeMetric(c.decode_metrics(), "epd_dspark_drafted_tokens_total").value_or(-1);
    const double a =
        ScrapeMetric(c.decode_metrics(), "epd_dspark_accepted_tokens_total").value_or(-1);
    EXPECT_GT(d, drafted);  // k = 3 on every step (but the last ones) drafts more
    EXPECT_LE(a, d);
  }
}

// The trained demo model: its DSpark heads were trained on the main model's hidden states
// (tools/train/train_dspark.py). Three chat questions, greedy, at once through the real chain:
// with a fixed k = 5 (every step verifies 5 drafts) the answers equal the in-process monolithic
// reference, and the decode worker accepts at least 30% of the first drafts (random heads: ~5%,
// docs/dspark.md); with the worker's default policy (the CPU step-time model `epd serve` runs)
// and with --dspark off the answers are the same.
TEST_F(DSparkE2ETest, TrainedHeadsAcceptDraftsAndKeepGreedyOutputs) {
  const std::string dir = testing::SourcePath("models/epd-nano");
  auto backend = kernels::MakeCpuBackend();
  auto model = model::Model::Load(dir, *backend);
  ASSERT_TRUE(model.ok()) << model.status();
  auto tok = model::Tokenizer::FromFile(dir + "/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<std::string> questions = {"Tell me about files.", "What is a list?",
                                              "Explain regular expressions."};
  std::vector<std::vector<int32_t>> prompts, want;
  for (const std::string& q : questions) {
    auto text = model::RenderChat({{"user", q}}, {}, model::ChatRenderOptions{});
    ASSERT_TRUE(text.ok()) << text.status();
    prompts.push_back((*tok)->Encode(*text));
    want.push_back(Reference(**model, prompts.back(), 48));
    ASSERT_GE(want.back().size(), 8u) << q;
  }
  auto run = [&](Cluster& c) {
    std::vector<Generation> got(prompts.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < prompts.size(); ++i)
      threads.emplace_back([&, i] { got[i] = Generate(c.grpc_port(), prompts[i], 48); });
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_TRUE(got[i].status.ok()) << got[i].status.error_message() << "\n" << c.Logs();
      EXPECT_EQ(got[i].ids, want[i]) << questions[i];
    }
  };
  {
    Cluster c(/*dspark=*/true, {"--dspark-k", "5"}, dir);
    run(c);
    const auto metric = [&](const std::string& name) {
      return ScrapeMetric(c.decode_metrics(), name).value_or(-1);
    };
    const double d1 = metric("epd_dspark_position_drafted_tokens_total{position=\"1\"}");
    const double a1 = metric("epd_dspark_position_accepted_tokens_total{position=\"1\"}");
    ASSERT_GT(d1, 0);
    EXPECT_GE(a1, 0.3 * d1) << "first-draft acceptance " << a1 << "/" << d1;
    std::printf("trained heads, k = 5: first drafts accepted %.0f/%.0f; all drafts %.0f/%.0f\n", a1,
                d1, metric("epd_dspark_accepted_tokens_total"),
                metric("epd_dspark_drafted_tokens_total"));
  }
  {
    Cluster c(/*dspark=*/true, {}, dir);
    run(c);
  }
  {
    Cluster c(/*dspark=*/false, {}, dir);
    run(c);
  }
}

// A bad decode-only flag value stops the binary at startup with a message naming it.
TEST_F(DSparkE2ETest, BadDSparkKIsRefused) {
  std::string out;
  const int rc = testing::RunCommand(
      BinaryPath("epd-decode") + " --dspark-k 9 --router 127.0.0.1:1 --model /nonexistent 2>&1",
      &out);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("--dspark-k"), std::string::npos) << out;
  EXPECT_NE(out.find("9"), std::string::npos) << out;
}

}  // namespace
}  // namespace epd
