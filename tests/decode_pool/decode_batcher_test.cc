// The decode pool's continuous batcher (decode_pool/decode_batcher.h) in process, on the nano
// model and a fake clock, without a thread or a network: the test steps the batcher itself
// (run_loop = false) and checks admission under a full KV pool, preemption with an exact resume,
// a request released while a step holds its sequence, the DSpark accept/reject bookkeeping in the
// metrics, and a failing sequence failing its request alone.
#include "decode_pool/decode_batcher.h"

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "decode_pool/decode_stage.h"
#include "gtest/gtest.h"
#include "model/kv_pool.h"
#include "model/model.h"
#include "model/sampling.h"
#include "prometheus/registry.h"
#include "tests/testing/nano_model.h"

namespace epd::decode_pool {
namespace {

using model::SamplingParams;
using Ticket = DecodeBatcher::Ticket;

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[i] = 3 + static_cast<int32_t>((i * 37 + salt * 101) % 1500);
  return p;
}

SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  return p;
}

// A counter's or gauge's value in `registry` (the series with label `label`=`value`, or the only
// series); -1 when absent.
double Metric(prometheus::Registry& registry, const std::string& name,
              const std::string& label = "", const std::string& value = "") {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      bool match = label.empty();
      for (const prometheus::ClientMetric::Label& l : m.label)
        match = match || (l.name == label && l.value == value);
      if (!match) continue;
      if (f.type == prometheus::MetricType::Counter) return m.counter.value;
      if (f.type == prometheus::MetricType::Gauge) return m.gauge.value;
      if (f.type == prometheus::MetricType::Histogram)
        return static_cast<double>(m.histogram.sample_count);
    }
  }
  return -1;
}

class DecodeBatcherTest : public testing::NanoModelTest {
 protected:
  void TearDown() override { model_->kv_pool().SetCapacity(0); }

  // A request's state bytes, as the decode server computes them.
  static int64_t NeedBytes(int prompt_tokens) {
    return model_->KvBytesFor(prompt_tokens) + model_->FixedStateBytes();
  }
  static int64_t Headroom() { return 2 * model_->KvBlockBytes(); }

  static DecodeBatcher::StartFn FromPrompt(DecodeStage& stage, std::vector<int32_t> prompt,
                                           SamplingParams params) {
    return [&stage, prompt = std::move(prompt), params] {
      return stage.StartFromPrompt(prompt, params);
    };
  }

  // The request decoded alone by the stage (no batcher): the output every batched run must give.
  static std::vector<int32_t> Alone(DecodeStage& stage, const std::vector<int32_t>& prompt,
                                    const SamplingParams& params) {
    auto s = stage.StartFromPrompt(prompt, params);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return {};
    while (!(*s)->done) {
      DecodeSequence* b[] = {s->get()};
      EXPECT_TRUE(stage.Step(b).ok());
    }
    std::vector<int32_t> out = (*s)->output;
    return out;
  }

  // What Collect returned of one single-choice request so far.
  struct Seen {
    std::vector<int32_t> tokens;
    std::string finish;
    absl::Status status;
  };
  static void Drain(DecodeBatcher& b, Ticket& t, Seen& seen) {
    if (!seen.status.ok() || DecodeBatcher::Finished(t)) return;
    std::vector<DecodeBatcher::Chunk> chunks;
    seen.status = b.Collect(t, std::chrono::milliseconds(0), &chunks);
    for (const DecodeBatcher::Chunk& c : chunks) {
      EXPECT_EQ(c.index, 0);
      seen.tokens.insert(seen.tokens.end(), c.tokens.begin(), c.tokens.end());
      if (c.finished) seen.finish = c.finish_reason;
    }
  }

  common::FakeClock clock_;
  prometheus::Registry registry_;
};

// A request that does not fit beside the live ones waits, in arrival order, until a finished
// request leaves the pool; one that needs more than the whole pool fails at once, alone.
TEST_F(DecodeBatcherTest, AdmissionUnderAFullPoolWaitsForRoomInArrivalOrder) {
  DecodeStage stage(*model_);
  const auto pa = Prompt(70, 1), pb = Prompt(40, 2);
  const SamplingParams params = Greedy(12);
  const auto alone_a = Alone(stage, pa, params), alone_b = Alone(stage, pb, params);
  // Room for A and its step headroom with one more block to spare, not for B beside it.
  model_->kv_pool().SetCapacity(NeedBytes(70) + 2 * Headroom());
  DecodeBatcher b(*model_, stage, registry_, nullptr, {.run_loop = false, .clock = &clock_});
  auto ta = b.Submit({FromPrompt(stage, pa, params)}, NeedBytes(70));
  auto tb = b.Submit({FromPrompt(stage, pb, params)}, NeedBytes(40));
  Seen a, bs;
  DecodeBatcher::StepReport r = b.RunOnce();
  EXPECT_EQ(r.admitted, 1);
  EXPECT_EQ(r.waiting, 1);
  EXPECT_EQ(r.stepped, 1);
  EXPECT_EQ(r.step_ns, 0) << "time is the injected clock's";
  for (int i = 0; i < 40 && !DecodeBatcher::Finished(*ta); ++i) {
    Drain(b, *ta, a);
    Drain(b, *tb, bs);
    if (DecodeBatcher::Finished(*ta)) break;
    r = b.RunOnce();
    EXPECT_EQ(r.waiting, 1) << "B waits while A holds the pool";
  }
  ASSERT_TRUE(DecodeBatcher::Finished(*ta));
  EXPECT_TRUE(bs.tokens.empty());
  // A is done but still holds its state until it leaves: B keeps waiting.
  r = b.RunOnce();
  EXPECT_EQ(r.admitted, 0);
  EXPECT_EQ(r.waiting, 1);
  b.Release(*ta);
  r = b.RunOnce();
  EXPECT_EQ(r.admitted, 1);
  EXPECT_EQ(r.waiting, 0);
  for (int i = 0; i < 40 && !DecodeBatcher::Finished(*tb); ++i) {
    Drain(b, *tb, bs);
    if (!DecodeBatcher::Finished(*tb)) b.RunOnce();
  }
  b.Release(*tb);
  EXPECT_EQ(a.tokens, alone_a);
  EXPECT_EQ(bs.tokens, alone_b);
  EXPECT_EQ(a.finish, "length");

  // More than the whole pool, with nothing live: a clear error, and the batcher goes on.
  auto tc = b.Submit({FromPrompt(stage, Prompt(700, 3), params)}, NeedBytes(700));
  auto td = b.Submit({FromPrompt(stage, pb, params)}, NeedBytes(40));
  r = b.RunOnce();
  EXPECT_EQ(r.failed, 1);
  Seen c, d;
  Drain(b, *tc, c);
  EXPECT_EQ(c.status.code(), absl::StatusCode::kResourceExhausted) << c.status;
  EXPECT_NE(std::string(c.status.message()).find("--kv-pool-bytes"), std::string::npos);
  b.Release(*tc);
  for (int i = 0; i < 40 && !DecodeBatcher::Finished(*td); ++i) {
    Drain(b, *td, d);
    if (!DecodeBatcher::Finished(*td)) b.RunOnce();
  }
  EXPECT_EQ(d.tokens, alone_b);
  b.Release(*td);
}

// When the pool shrinks under a running batch, the youngest sequence is swapped out to host
// memory and the oldest goes on; when room returns it resumes, and both outputs are bit for bit
// those of each request alone.
TEST_F(DecodeBatcherTest, PreemptionSwapsOutTheYoungestAndResumesExactly) {
  DecodeStage stage(*model_);
  const auto pa = Prompt(60, 4), pb = Prompt(60, 5);
  const SamplingParams params = Greedy(16);
  const auto alone_a = Alone(stage, pa, params), alone_b = Alone(stage, pb, params);
  DecodeBatcher b(*model_, stage, registry_, nullptr, {.run_loop = false, .clock = &clock_});
  auto ta = b.Submit({FromPrompt(stage, pa, params)}, NeedBytes(60));
  auto tb = b.Submit({FromPrompt(stage, pb, params)}, NeedBytes(60));
  Seen a, bs;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(b.RunOnce().stepped, 2);
  Drain(b, *ta, a);
  Drain(b, *tb, bs);
  const size_t b_before = bs.tokens.size();
  // One byte short of the headroom two live sequences need.
  model::KvPool& pool = model_->kv_pool();
  pool.SetCapacity(pool.stats().used_bytes + 2 * Headroom() - 1);
  DecodeBatcher::StepReport r = b.RunOnce();
  EXPECT_EQ(r.preempted, 1);
  EXPECT_EQ(r.stepped, 1);
  EXPECT_EQ(Metric(registry_, "epd_kv_pool_preemptions_total"), 1);
  for (int i = 0; i < 3; ++i) {
    r = b.RunOnce();
    EXPECT_EQ(r.stepped, 1);
    EXPECT_EQ(r.waiting, 1);
  }
  Drain(b, *ta, a);
  Drain(b, *tb, bs);
  EXPECT_EQ(bs.tokens.size(), b_before) << "the swapped-out sequence does not step";
  EXPECT_GT(a.tokens.size(), b_before);
  pool.SetCapacity(0);
  r = b.RunOnce();
  EXPECT_EQ(r.resumed, 1);
  EXPECT_EQ(r.stepped, 2);
  for (int i = 0; i < 40 && !(DecodeBatcher::Finished(*ta) && DecodeBatcher::Finished(*tb)); ++i) {
    Drain(b, *ta, a);
    Drain(b, *tb, bs);
    b.RunOnce();
  }
  EXPECT_TRUE(a.status.ok() && bs.status.ok());
  EXPECT_EQ(a.tokens, alone_a);
  EXPECT_EQ(bs.tokens, alone_b);
  b.Release(*ta);
  b.Release(*tb);
}

// A request released while a step holds its sequence (a client cancelling mid-step): the step
// finishes, the sequence's state leaves the pool when the step gives it back, it never steps
// again, and its neighbour's output is that of the neighbour alone.
TEST_F(DecodeBatcherTest, AReleaseMidStepFreesTheStateAfterTheStepAndTheBatchGoesOn) {
  DecodeStage stage(*model_);
  const auto pa = Prompt(50, 6), pb = Prompt(90, 7);
  const SamplingParams params = Greedy(14);
  const auto alone_a = Alone(stage, pa, params);
  model::KvPool& pool = model_->kv_pool();
  const int64_t used_at_start = pool.stats().used_bytes;
  DecodeBatcher b(*model_, stage, registry_, nullptr, {.run_loop = false, .clock = &clock_});
  auto ta = b.Submit({FromPrompt(stage, pa, params)}, NeedBytes(50));
  auto tb = b.Submit({FromPrompt(stage, pb, params)}, NeedBytes(90));
  for (int i = 0; i < 2; ++i) EXPECT_EQ(b.RunOnce().stepped, 2);
  const int64_t used_both = pool.stats().used_bytes;
  DecodeBatcher::IterationPtr it = b.Prepare();
  b.Release(*tb);  // the request's thread gives up while the loop holds B
  EXPECT_EQ(pool.stats().used_bytes, used_both) << "held by the step until it gives B back";
  b.Step(*it);
  EXPECT_EQ(b.Publish(std::move(it)).stepped, 2);
  EXPECT_LT(pool.stats().used_bytes, used_both) << "B's state left with the step";
  Seen a;
  for (int i = 0; i < 40 && !DecodeBatcher::Finished(*ta); ++i) {
    Drain(b, *ta, a);
    if (DecodeBatcher::Finished(*ta)) break;
    EXPECT_EQ(b.RunOnce().stepped, 1) << "B never steps again";
  }
  EXPECT_EQ(a.tokens, alone_a);
  b.Release(*ta);
  EXPECT_EQ(pool.stats().used_bytes, used_at_start) << "every state left the pool";
}

// DSpark's bookkeeping: the drafted / accepted counters and the per-position series add up to
// what the steps reported, acceptance never exceeds drafting, and the greedy outputs equal DSpark
// off (lossless).
TEST_F(DecodeBatcherTest, DSparkAcceptAndRejectBookkeepingAddsUp) {
  std::vector<std::vector<int32_t>> prompts = {Prompt(30, 8), Prompt(75, 9), Prompt(120, 10)};
  const SamplingParams params = Greedy(20);
  std::vector<std::vector<int32_t>> plain, spec;
  for (int on = 0; on < 2; ++on) {
    prometheus::Registry registry;
    DecodeStage stage(*model_, {.dspark = on == 1, .fixed_k = on == 1 ? 3 : -1});
    DecodeBatcher b(*model_, stage, registry, nullptr, {.run_loop = false, .clock = &clock_});
    std::vector<std::shared_ptr<Ticket>> tickets;
    for (const auto& p : prompts)
      tickets.push_back(
          b.Submit({FromPrompt(stage, p, params)}, NeedBytes(static_cast<int>(p.size()))));
    std::vector<Seen> seen(prompts.size());
    int64_t drafted = 0, accepted = 0, verified_rows = 0;
    std::vector<int64_t> at_position(4, 0), accepted_at(4, 0);
    for (int step = 0; step < 60; ++step) {
      bool all = true;
      for (size_t i = 0; i < tickets.size(); ++i) {
        Drain(b, *tickets[i], seen[i]);
        all = all && DecodeBatcher::Finished(*tickets[i]);
      }
      if (all) break;
      const DecodeBatcher::StepReport r = b.RunOnce();
      ASSERT_TRUE(r.step_status.ok()) << r.step_status;
      drafted += r.stats.drafted;
      accepted += r.stats.accepted;
      verified_rows += static_cast<int64_t>(r.stats.k.size());
      ASSERT_EQ(r.stats.k.size(), r.stats.accepted_k.size());
      for (size_t i = 0; i < r.stats.k.size(); ++i) {
        EXPECT_LE(r.stats.accepted_k[i], r.stats.k[i]);
        for (int j = 1; j <= r.stats.k[i] && j <= 3; ++j) {
          ++at_position[j];
          if (j <= r.stats.accepted_k[i]) ++accepted_at[j];
        }
      }
    }
    std::vector<std::vector<int32_t>>& out = on == 1 ? spec : plain;
    for (size_t i = 0; i < tickets.size(); ++i) {
      EXPECT_TRUE(DecodeBatcher::Finished(*tickets[i]));
      out.push_back(seen[i].tokens);
      b.Release(*tickets[i]);
    }
    EXPECT_EQ(Metric(registry, "epd_dspark_drafted_tokens_total"), static_cast<double>(drafted));
    EXPECT_EQ(Metric(registry, "epd_dspark_accepted_tokens_total"), static_cast<double>(accepted));
    EXPECT_EQ(Metric(registry, "epd_dspark_verify_length_tokens"),
              static_cast<double>(verified_rows));
    if (on == 0) {
      EXPECT_EQ(drafted, 0);
      continue;
    }
    EXPECT_GT(drafted, 0);
    EXPECT_LT(accepted, drafted) << "the random nano model's drafts are mostly rejected";
    double sum_drafted = 0, sum_accepted = 0;
    for (int j = 1; j <= 3; ++j) {
      const std::string pos = std::to_string(j);
      const double d =
          Metric(registry, "epd_dspark_position_drafted_tokens_total", "position", pos);
      const double a =
          Metric(registry, "epd_dspark_position_accepted_tokens_total", "position", pos);
      EXPECT_EQ(d, static_cast<double>(at_position[j])) << pos;
      EXPECT_EQ(a, static_cast<double>(accepted_at[j])) << pos;
      EXPECT_LE(a, d);
      sum_drafted += d;
      sum_accepted += a;
    }
    EXPECT_EQ(sum_drafted, static_cast<double>(drafted));
    EXPECT_EQ(sum_accepted, static_cast<double>(accepted));
  }
  EXPECT_EQ(spec, plain);
}

// A sequence that fails in a step (a token the model refuses) fails its request alone, and so
// does a request whose start fails; the batch's other request gives its alone output.
TEST_F(DecodeBatcherTest, AFailingSequenceFailsItsRequestAloneAndTheBatchGoesOn) {
  const int32_t vocab = static_cast<int32_t>(model_->config().vocab_size);
  for (int on = 0; on < 2; ++on) {
    SCOPED_TRACE(on == 1 ? "dspark" : "plain");
    DecodeStage stage(*model_, {.dspark = on == 1, .fixed_k = 3});
    const auto pg = Prompt(60, 11), pbad = Prompt(25, 12);
    const SamplingParams params = Greedy(10);
    const auto alone = Alone(stage, pg, params);
    prometheus::Registry registry;
    DecodeBatcher b(*model_, stage, registry, nullptr, {.run_loop = false, .clock = &clock_});
    auto bad = b.Submit({[&]() -> absl::StatusOr<std::unique_ptr<DecodeSequence>> {
                          auto s = stage.StartFromPrompt(pbad, params);
                          if (s.ok()) (*s)->pending = vocab + 7;
                          return s;
                        }},
                        NeedBytes(25));
    auto refused = b.Submit({[]() -> absl::StatusOr<std::unique_ptr<DecodeSequence>> {
                              return absl::DataLossError("hand-off checksum mismatch");
                            }},
                            NeedBytes(25));
    auto good = b.Submit({FromPrompt(stage, pg, params)}, NeedBytes(60));
    DecodeBatcher::StepReport r = b.RunOnce();
    EXPECT_EQ(r.admitted, 2);
    EXPECT_EQ(r.failed, 2) << "the refused start and the bad step";
    EXPECT_TRUE(r.step_status.ok()) << "the step itself goes on";
    Seen sb, sr, sg;
    Drain(b, *bad, sb);
    Drain(b, *refused, sr);
    EXPECT_EQ(sb.status.code(), absl::StatusCode::kInvalidArgument) << sb.status;
    EXPECT_EQ(sr.status.code(), absl::StatusCode::kDataLoss) << sr.status;
    b.Release(*bad);
    b.Release(*refused);
    for (int i = 0; i < 40 && !DecodeBatcher::Finished(*good); ++i) {
      Drain(b, *good, sg);
      if (!DecodeBatcher::Finished(*good)) b.RunOnce();
    }
    EXPECT_TRUE(sg.status.ok()) << sg.status;
    EXPECT_EQ(sg.tokens, alone);
    b.Release(*good);
  }
}

// n > 1: a request's choices are one ticket; each choice streams under its own index and all
// finish; a greedy fork gives the same output under every index.
TEST_F(DecodeBatcherTest, ChoicesOfOneRequestStreamUnderTheirIndex) {
  DecodeStage stage(*model_);
  const auto p = Prompt(45, 13);
  const SamplingParams params = Greedy(9);
  const auto alone = Alone(stage, p, params);
  DecodeBatcher b(*model_, stage, registry_, nullptr, {.run_loop = false, .clock = &clock_});
  auto t = b.Submit(
      {FromPrompt(stage, p, params), FromPrompt(stage, p, params), FromPrompt(stage, p, params)},
      NeedBytes(45));
  std::vector<std::vector<int32_t>> out(3);
  std::vector<int> finished(3, 0);
  for (int i = 0; i < 40 && !DecodeBatcher::Finished(*t); ++i) {
    std::vector<DecodeBatcher::Chunk> chunks;
    ASSERT_TRUE(b.Collect(*t, std::chrono::milliseconds(0), &chunks).ok());
    for (const auto& c : chunks) {
      ASSERT_GE(c.index, 0);
      ASSERT_LT(c.index, 3);
      out[c.index].insert(out[c.index].end(), c.tokens.begin(), c.tokens.end());
      finished[c.index] += c.finished ? 1 : 0;
    }
    if (!DecodeBatcher::Finished(*t)) b.RunOnce();
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out[i], alone) << i;
    EXPECT_EQ(finished[i], 1) << i;
  }
  b.Release(*t);
}

}  // namespace
}  // namespace epd::decode_pool
