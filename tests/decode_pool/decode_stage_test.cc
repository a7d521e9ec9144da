// The decode stage's continuous-batching loop with DSpark draft + verify (decode_pool/
// decode_stage.h) on the nano model: greedy output with DSpark on equals DSpark off token for
// token (batched, ragged k, sequences joining mid-run, generations crossing the 128-token window),
// max_tokens is never exceeded, stop ids end generation, logprobs follow the emitted tokens, seeded
// sampling is reproducible, and the hand-off's DSpark switch error is recognized.
#include "decode_pool/decode_stage.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "decode_pool/dspark/verifier.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"
#include "model/stages.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_cpu_backend.h"
#include "transfer/transfer_error.h"

namespace epd::decode_pool {
namespace {

using model::SamplingParams;

class DecodeStageDSparkTest : public testing::NanoModelTest {
 protected:
  static std::vector<int32_t> Prompt(int n, int salt) {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = 3 + static_cast<int32_t>((i * 37 + salt * 101) % 1500);
    return p;
  }

  struct Request {
    std::vector<int32_t> prompt;
    SamplingParams params;
    int join_step = 0;  // the loop step at which the request joins the batch
  };
  struct Run {
    std::vector<std::unique_ptr<DecodeSequence>> seqs;
    int64_t drafted = 0, accepted = 0, emitted = 0, steps = 0, draft_passes = 0, sequence_steps = 0;
    int max_k_seen = 0;
    bool ragged = false;  // some step had different k across its sequences
  };
  // Continuous batching as the worker does it: requests join between steps, every step advances
  // all live sequences with one Step call.
  static Run Serve(DecodeStage& stage, const std::vector<Request>& reqs) {
    Run run;
    run.seqs.resize(reqs.size());
    for (int step = 0;; ++step) {
      bool pending_join = false;
      for (size_t i = 0; i < reqs.size(); ++i) {
        if (reqs[i].join_step == step) {
          auto s = stage.StartFromPrompt(reqs[i].prompt, reqs[i].params);
          EXPECT_TRUE(s.ok()) << s.status();
          if (!s.ok()) return run;
          run.seqs[i] = std::move(*s);
        } else if (reqs[i].join_step > step) {
          pending_join = true;
        }
      }
      std::vector<DecodeSequence*> batch;
      for (auto& s : run.seqs)
        if (s != nullptr && !s->done) batch.push_back(s.get());
      if (batch.empty() && !pending_join) break;
      DecodeStepStats st;
      const absl::Status status = stage.Step(batch, &st);
      EXPECT_TRUE(status.ok()) << status;
      if (!status.ok()) return run;
      EXPECT_EQ(st.sequences, static_cast<int>(batch.size()));
      EXPECT_LE(st.accepted, st.drafted);
      // Every sequence gets >= 1 target token per step; only a stop id (excluded) emits nothing.
      bool stopped = false;
      for (DecodeSequence* s : batch) stopped |= s->finish_reason == "stop";
      if (!batch.empty() && !stopped) {
        EXPECT_GE(st.emitted, static_cast<int64_t>(batch.size()));
      }
      run.drafted += st.drafted;
      run.accepted += st.accepted;
      run.emitted += st.emitted;
      run.draft_passes += st.draft_passes;
      run.sequence_steps += st.sequences;
      ++run.steps;
      for (int k : st.k) {
        run.max_k_seen = std::max(run.max_k_seen, k);
        if (k != st.k.front()) run.ragged = true;
      }
    }
    return run;
  }
};

// Greedy parity over many prompts and lengths (3..130 tokens; generations crossing the 128-token
// window, the 8-position blocks and the 5-token draft blocks), in one continuous batch with
// requests joining at different steps, for a fixed k = 5 and for the k policy.
TEST_F(DecodeStageDSparkTest, GreedyOutputIdenticalToPlainLoop) {
  std::vector<Request> reqs;
  const int lens[][3] = {{3, 40, 0},  {17, 31, 0},  {100, 45, 1}, {122, 20, 2},
                         {125, 9, 0}, {130, 24, 4}, {64, 13, 3},  {1, 7, 5}};
  for (int i = 0; i < 8; ++i) {
    Request r;
    r.prompt = Prompt(lens[i][0], i + 1);
    r.params.max_tokens = lens[i][1];
    r.join_step = lens[i][2];
    reqs.push_back(std::move(r));
  }
  DecodeStage plain(*model_);
  const Run ref = Serve(plain, reqs);
  ASSERT_EQ(ref.seqs.size(), reqs.size());
  EXPECT_EQ(ref.drafted, 0);
  int64_t uncalibrated_drafted = 0;
  for (int variant = 0; variant < 3; ++variant) {
    // 0: fixed k = 5; 1: the policy on the raw confidences; 2: the policy, calibrated online.
    const int fixed_k = variant == 0 ? 5 : -1;
    DecodeStageOptions o;
    o.dspark = true;
    o.fixed_k = fixed_k;
    o.calibrate = variant == 2;
    DecodeStage spec(*model_, o);
    const Run got = Serve(spec, reqs);
    ASSERT_EQ(got.seqs.size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_NE(got.seqs[i], nullptr);
      EXPECT_EQ(got.seqs[i]->output, ref.seqs[i]->output) << "request " << i << " k " << fixed_k;
      EXPECT_EQ(got.seqs[i]->finish_reason, ref.seqs[i]->finish_reason) << i;
      EXPECT_LE(got.seqs[i]->output.size(), static_cast<size_t>(reqs[i].params.max_tokens));
      EXPECT_LE(got.seqs[i]->accepted, got.seqs[i]->drafted);
    }
    EXPECT_GT(got.drafted, 0) << variant;
    EXPECT_LE(got.accepted, got.drafted);
    EXPECT_LE(got.max_k_seen, 5);
    EXPECT_LE(got.steps, ref.steps);  // accepted drafts save steps
    if (variant < 2) {
      EXPECT_GT(got.accepted, 0) << variant;
      EXPECT_TRUE(got.ragged) << "k is capped per sequence near max_tokens";
    }
    if (variant == 1) uncalibrated_drafted = got.drafted;
    if (variant == 2) {
      // The nano head overestimates acceptance (~5% observed): calibrated, the policy drafts
      // less and skips draft passes.
      EXPECT_LT(got.drafted, uncalibrated_drafted);
      EXPECT_LT(got.draft_passes, got.sequence_steps);
      const AcceptanceCalibration cal = spec.calibration();
      EXPECT_GT(cal.predicted[0], cal.accepted[0]);
      EXPECT_LT(cal.Factor(0), 1.0);
    }
    std::printf(
        "variant %d: %lld steps (plain %lld), drafted %lld accepted %lld, draft passes %lld of "
        "%lld sequence-steps\n",
        variant, static_cast<long long>(got.steps), static_cast<long long>(ref.steps),
        static_cast<long long>(got.drafted), static_cast<long long>(got.accepted),
        static_cast<long long>(got.draft_passes), static_cast<long long>(got.sequence_steps));
  }
}

// Penalties (the verify rows see the accepted drafts as generated), stop ids and logprobs.
TEST_F(DecodeStageDSparkTest, PenaltiesStopIdsAndLogprobsMatchPlainLoop) {
  Request a;
  a.prompt = Prompt(20, 9);
  a.params.max_tokens = 30;
  a.params.repetition_penalty = 1.3f;
  a.params.frequency_penalty = 0.4f;
  a.params.presence_penalty = 0.2f;
  a.params.top_logprobs = 3;
  DecodeStage plain(*model_);
  DecodeStageOptions o{.dspark = true, .fixed_k = 4};
  DecodeStage spec(*model_, o);
  const Run ref = Serve(plain, {a});
  const Run got = Serve(spec, {a});
  ASSERT_EQ(got.seqs[0]->output, ref.seqs[0]->output);
  ASSERT_EQ(got.seqs[0]->logprobs.size(), got.seqs[0]->output.size());
  ASSERT_EQ(ref.seqs[0]->logprobs.size(), ref.seqs[0]->output.size());
  for (size_t i = 0; i < got.seqs[0]->output.size(); ++i) {
    EXPECT_EQ(got.seqs[0]->logprobs[i].chosen.token, got.seqs[0]->output[i]);
    EXPECT_EQ(got.seqs[0]->logprobs[i].chosen.logprob, ref.seqs[0]->logprobs[i].chosen.logprob);
    ASSERT_EQ(got.seqs[0]->logprobs[i].top.size(), 3u);
  }
  // A stop id: the first occurrence of the 8th token ends both runs there (excluded).
  Request b;
  b.prompt = Prompt(40, 3);
  b.params.max_tokens = 40;
  const Run full = Serve(plain, {b});
  ASSERT_GE(full.seqs[0]->output.size(), 8u);
  const int32_t stop = full.seqs[0]->output[7];
  b.params.stop_token_ids = {stop};
  std::vector<int32_t> want;
  for (int32_t t : full.seqs[0]->output) {
    if (t == stop) break;
    want.push_back(t);
  }
  for (DecodeStage* s : {&plain, &spec}) {
    const Run r = Serve(*s, {b});
    EXPECT_EQ(r.seqs[0]->output, want);
    EXPECT_EQ(r.seqs[0]->finish_reason, "stop");
  }
}

// Sequences without grammar take their tokens from the backend, after their penalties applied
// there: a greedy one its rows' Argmax (DecodeStageOptions::greedy_on_backend), a T > 0 one in a
// step that verifies no drafts of it its draw (sample_on_backend, with the uniform its Rng
// gives); one with logprobs gets them from the backend too (Backend::TopLogprobs). In a mixed
// batch (greedy ones joining at different steps, one greedy with penalties, one with logprobs,
// two seeded T > 0, one of them with penalties, every filter and logprobs), with DSpark off and
// on, every output, finish reason and logprob (chosen and top) equals the run where every
// sequence downloads its logits. And the steps download no logits row for them: on a
// device-labelled backend, the steps of a batch of greedy sequences (one with penalties) and a
// filtered T > 0 one download one token instead of each such row.
TEST_F(DecodeStageDSparkTest, TokensFromTheBackendEqualTheHostsAndDownloadNoLogitsRows) {
  std::vector<Request> mixed;
  for (int i = 0; i < 3; ++i) {
    Request r;
    r.prompt = Prompt(30 + 41 * i, 20 + i);
    r.params.max_tokens = 24 + 5 * i;
    r.join_step = i;
    mixed.push_back(std::move(r));
  }
  Request pen;
  pen.prompt = Prompt(50, 31);
  pen.params.max_tokens = 20;
  pen.params.frequency_penalty = 0.7f;
  pen.params.presence_penalty = 0.3f;
  pen.params.repetition_penalty = 1.4f;
  Request lp;
  lp.prompt = Prompt(45, 32);
  lp.params.max_tokens = 18;
  lp.params.top_logprobs = 2;
  Request hot;
  hot.prompt = Prompt(38, 33);
  hot.params.max_tokens = 22;
  hot.params.temperature = 0.8f;
  hot.params.seed = 77;
  Request filtered;
  filtered.prompt = Prompt(41, 34);
  filtered.params.max_tokens = 21;
  filtered.params.temperature = 1.2f;
  filtered.params.top_k = 30;
  filtered.params.top_p = 0.9f;
  filtered.params.min_p = 0.02f;
  filtered.params.presence_penalty = 0.6f;
  filtered.params.seed = 78;
  filtered.params.top_logprobs = 3;
  filtered.join_step = 2;
  for (Request* r : {&pen, &lp, &hot, &filtered}) mixed.push_back(*r);
  for (bool dspark : {false, true}) {
    Run runs[2];
    for (int on = 0; on < 2; ++on) {
      DecodeStage stage(*model_, {.dspark = dspark, .fixed_k = dspark ? 3 : -1,
                                  .greedy_on_backend = on == 1,
                                  .sample_on_backend = on == 1});
      runs[on] = Serve(stage, mixed);
      ASSERT_EQ(runs[on].seqs.size(), mixed.size());
    }
    for (size_t i = 0; i < mixed.size(); ++i) {
      const DecodeSequence& a = *runs[0].seqs[i];
      const DecodeSequence& b = *runs[1].seqs[i];
      EXPECT_FALSE(b.output.empty()) << i;
      EXPECT_EQ(b.output, a.output) << "dspark " << dspark << " request " << i;
      EXPECT_EQ(b.finish_reason, a.finish_reason) << i;
      ASSERT_EQ(b.logprobs.size(), a.logprobs.size()) << i;
      for (size_t t = 0; t < a.logprobs.size(); ++t) {
        EXPECT_EQ(b.logprobs[t].chosen.token, a.logprobs[t].chosen.token) << i;
        EXPECT_EQ(b.logprobs[t].chosen.logprob, a.logprobs[t].chosen.logprob) << i;
        ASSERT_EQ(b.logprobs[t].top.size(), a.logprobs[t].top.size()) << i;
        for (size_t e = 0; e < a.logprobs[t].top.size(); ++e) {
          EXPECT_EQ(b.logprobs[t].top[e].token, a.logprobs[t].top[e].token) << i;
          EXPECT_EQ(b.logprobs[t].top[e].logprob, a.logprobs[t].top[e].logprob) << i;
        }
      }
    }
  }
  // The bytes: three greedy sequences and a filtered T > 0 one, started first, then counted over
  // the steps alone. Both runs make the same steps (same outputs, same k), so they differ by
  // exactly the logits rows that stay on the backend, each a vocabulary row of fp32 against one
  // int32: every row of every sequence (its last token, plus its drafts; a T > 0 sequence's
  // drafts are verified on the backend, Backend::VerifyDrafts). The host's verification of T > 0
  // drafts also brings down the k distributions they were drawn from, one row each. A step with
  // any row on the backend downloads every row's token (a verification: its verdict) once.
  const int64_t row = model_->config().vocab_size * static_cast<int64_t>(sizeof(float));
  for (bool dspark : {false, true}) {
    int64_t downloaded[2] = {0, 0}, rows[2] = {0, 0}, emitted[2] = {0, 0}, on_backend[2] = {0, 0},
            token_rows[2] = {0, 0}, q_rows[2] = {0, 0};
    for (int on = 0; on < 2; ++on) {
      // A model of its own for each run (its KV pool's sealed blocks would serve the next run).
      int64_t bytes = 0;
      auto backend =
          testing::MakeTestCpuBackend({.report_device_memory = true, .download_bytes = &bytes});
      auto m = model::Model::Load(model_dir(), *backend);
      ASSERT_TRUE(m.ok()) << m.status();
      DecodeStage stage(**m, {.dspark = dspark, .fixed_k = dspark ? 3 : -1,
                              .greedy_on_backend = on == 1,
                              .sample_on_backend = on == 1});
      std::vector<std::unique_ptr<DecodeSequence>> seqs;
      std::vector<DecodeSequence*> batch;
      for (int i = 0; i < 4; ++i) {
        SamplingParams p;
        p.max_tokens = 20;
        if (i == 2) {  // penalties, applied on the backend
          p.repetition_penalty = 1.2f;
          p.frequency_penalty = 0.5f;
        }
        if (i == 3) {  // drawn on the backend
          p.temperature = 0.9f;
          p.top_p = 0.95f;
          p.top_k = 50;
          p.frequency_penalty = 0.3f;
          p.seed = 9;
        }
        auto s = stage.StartFromPrompt(Prompt(40 + 9 * i, 50 + i), p);
        ASSERT_TRUE(s.ok()) << s.status();
        batch.push_back(s->get());
        seqs.push_back(std::move(*s));
      }
      bytes = 0;
      while (std::any_of(batch.begin(), batch.end(), [](auto* s) { return !s->done; })) {
        std::vector<bool> greedy;  // the step's live sequences, in batch order
        for (DecodeSequence* s : batch) {
          if (!s->done) greedy.push_back(s->sampler->params().greedy());
        }
        DecodeStepStats st;
        ASSERT_TRUE(stage.Step(batch, &st).ok());
        emitted[on] += st.emitted;
        rows[on] += st.sequences + st.drafted;
        int64_t step_on = 0;
        for (size_t j = 0; j < greedy.size(); ++j) {
          const int k = dspark ? st.k.at(j) : 0;
          step_on += k + 1;
          if (!greedy[j]) q_rows[on] += k;
        }
        on_backend[on] += step_on;
        // A step with any such row brings every row's token down in one download.
        if (step_on > 0) token_rows[on] += st.sequences + st.drafted;
      }
      downloaded[on] = bytes;
      ASSERT_GT(emitted[on], 0);
      std::printf("dspark %d, tokens on backend %d: %lld logits rows (%lld of them can stay on "
                  "the backend), %.0f bytes downloaded per emitted token (a logits row is %lld)\n",
                  dspark, on, static_cast<long long>(rows[on]),
                  static_cast<long long>(on_backend[on]),
                  static_cast<double>(bytes) / static_cast<double>(emitted[on]),
                  static_cast<long long>(row));
    }
    ASSERT_EQ(rows[1], rows[0]);
    ASSERT_EQ(emitted[1], emitted[0]);
    ASSERT_EQ(on_backend[1], on_backend[0]);
    ASSERT_EQ(q_rows[1], q_rows[0]);
    EXPECT_EQ(on_backend[0], rows[0]);
    if (dspark) {
      EXPECT_GT(q_rows[0], 0) << "no T > 0 drafts were verified";
    }
    EXPECT_GE(downloaded[0], rows[0] * row) << dspark;
    EXPECT_EQ(downloaded[0] - downloaded[1],
              (on_backend[0] + q_rows[0]) * row - token_rows[0] * int64_t{sizeof(int32_t)})
        << dspark;
    // On the backend, an emitted token costs less than a quarter of one logits row.
    EXPECT_LT(downloaded[1] * 4, emitted[1] * row) << dspark;
  }
}

// A sequence started from a serialized hand-off state (as epd-decode receives it from prefill)
// drafts from the deserialized DSpark input and gives the plain loop's output.
TEST_F(DecodeStageDSparkTest, HandoffStateDSparkEqualsPlain) {
  const std::vector<int32_t> prompt = Prompt(110, 6);
  auto st = model_->NewSequence();
  auto pre = model_->Prefill(*st, prompt, /*all_logits=*/false);
  ASSERT_TRUE(pre.ok()) << pre.status();
  const std::vector<model::StateSegment> segs = model::SerializeState(model_->config(), *st);
  ASSERT_TRUE(HandoffHasDSparkState(model_->config(), segs));
  SamplingParams params;
  params.max_tokens = 30;
  std::vector<int32_t> outs[2];
  int64_t drafted = 0;
  for (int on = 0; on < 2; ++on) {
    DecodeStage stage(*model_, {.dspark = on == 1, .fixed_k = 5});
    auto seq = stage.Start(segs, pre->logits, params, prompt);
    ASSERT_TRUE(seq.ok()) << seq.status();
    while (!(*seq)->done) {
      DecodeSequence* b[] = {seq->get()};
      ASSERT_TRUE(stage.Step(b).ok());
    }
    outs[on] = (*seq)->output;
    drafted += (*seq)->drafted;
  }
  EXPECT_EQ(outs[1], outs[0]);
  EXPECT_EQ(outs[0].size(), 30u);
  EXPECT_GT(drafted, 0);
}

// A request the router gives decode alone (no encoder/prefill) computes what the E/P/D chain
// computes: for a prompt longer than the tail rows (window + DSpark block), StartFromPrompt's
// local prefill and a hand-off of EncoderPass + DecoderReplay give the same tokens.
TEST_F(DecodeStageDSparkTest, DecodeAloneEqualsTheStagedChainOnLongPrompts) {
  const std::vector<int32_t> prompt = Prompt(301, 9);
  const int64_t tail = model::DecoderTailRows(model_->config());
  auto st = model_->NewSequence();
  auto enc = model::EncoderPass(*model_, *st, prompt, tail);
  ASSERT_TRUE(enc.ok()) << enc.status();
  auto dec = model::DecoderReplay(*model_, *st, *enc);
  ASSERT_TRUE(dec.ok()) << dec.status();
  const std::vector<model::StateSegment> segs = model::SerializeState(model_->config(), *st);
  SamplingParams params;
  params.max_tokens = 12;
  DecodeStage stage(*model_, {.dspark = true, .fixed_k = 3});
  auto chained = stage.Start(segs, dec->logits, params, prompt);
  auto alone = stage.StartFromPrompt(prompt, params);
  ASSERT_TRUE(chained.ok()) << chained.status();
  ASSERT_TRUE(alone.ok()) << alone.status();
  while (!(*chained)->done || !(*alone)->done) {
    std::vector<DecodeSequence*> b;
    if (!(*chained)->done) b.push_back(chained->get());
    if (!(*alone)->done) b.push_back(alone->get());
    ASSERT_TRUE(stage.Step(b).ok());
  }
  EXPECT_EQ((*alone)->output, (*chained)->output);
  EXPECT_EQ((*alone)->output.size(), 12u);
}

// One request that fails inside a batched step (here a token the model refuses) fails alone: it
// is done with its error, and its neighbour's output equals its output run alone (shared/REVIEW.md:
// one bad request used to fail its whole batch). DSpark off (the model refuses the token) and on
// (the draft pass refuses it).
TEST_F(DecodeStageDSparkTest, ASequenceThatFailsInAStepFailsAloneAndTheBatchGoesOn) {
  const int32_t vocab = static_cast<int32_t>(model_->config().vocab_size);
  SamplingParams params;
  params.max_tokens = 10;
  for (int on = 0; on < 2; ++on) {
    SCOPED_TRACE(on == 1 ? "dspark" : "plain");
    DecodeStage stage(*model_, {.dspark = on == 1, .fixed_k = 3});
    auto alone = stage.StartFromPrompt(Prompt(60, 3), params);
    ASSERT_TRUE(alone.ok()) << alone.status();
    while (!(*alone)->done) {
      DecodeSequence* b[] = {alone->get()};
      ASSERT_TRUE(stage.Step(b).ok());
    }
    auto good = stage.StartFromPrompt(Prompt(60, 3), params);
    auto bad = stage.StartFromPrompt(Prompt(25, 4), params);
    ASSERT_TRUE(good.ok() && bad.ok());
    for (int step = 0; !(*good)->done; ++step) {
      if (step == 1) (*bad)->pending = vocab + 7;
      std::vector<DecodeSequence*> b;
      if (!(*bad)->done) b.push_back(bad->get());  // the bad one first in the batch
      b.push_back(good->get());
      ASSERT_TRUE(stage.Step(b).ok());
    }
    EXPECT_TRUE((*bad)->done);
    EXPECT_EQ((*bad)->finish_reason, "error");
    EXPECT_EQ((*bad)->error.code(), absl::StatusCode::kInvalidArgument) << (*bad)->error;
    EXPECT_EQ((*good)->output, (*alone)->output);
    EXPECT_TRUE((*good)->error.ok());
  }
}

// max_tokens caps the output even when a step accepts several drafts.
TEST_F(DecodeStageDSparkTest, NeverEmitsPastMaxTokens) {
  DecodeStage spec(*model_, {.dspark = true, .fixed_k = 5});
  for (int max_tokens : {1, 2, 3, 6, 11}) {
    Request r;
    r.prompt = Prompt(30, max_tokens);
    r.params.max_tokens = max_tokens;
    const Run got = Serve(spec, {r});
    EXPECT_LE(got.seqs[0]->output.size(), static_cast<size_t>(max_tokens));
    if (got.seqs[0]->finish_reason == "length") {
      EXPECT_EQ(got.seqs[0]->output.size(), static_cast<size_t>(max_tokens));
    }
  }
}

// Seeded sampling through the DSpark loop: the same seed gives the same output (alone and inside
// a batch), top_k = 1 at T > 0 equals greedy, and another seed gives another output.
TEST_F(DecodeStageDSparkTest, SeededSamplingReproducible) {
  DecodeStage spec(*model_, {.dspark = true, .fixed_k = 3});
  Request r;
  r.prompt = Prompt(50, 7);
  r.params.max_tokens = 24;
  r.params.temperature = 0.9f;
  r.params.top_p = 0.95f;
  r.params.seed = 1234;
  Request other;
  other.prompt = Prompt(90, 2);
  other.params.max_tokens = 30;
  other.params.temperature = 1.0f;
  other.params.seed = 99;
  const Run a = Serve(spec, {r});
  const Run b = Serve(spec, {r, other});
  EXPECT_EQ(a.seqs[0]->output, b.seqs[0]->output);
  EXPECT_EQ(a.seqs[0]->output.size(), 24u);
  EXPECT_GT(b.drafted, 0);
  Request r2 = r;
  r2.params.seed = 4321;
  EXPECT_NE(Serve(spec, {r2}).seqs[0]->output, a.seqs[0]->output);
  // With the k policy too: k of a T > 0 request ignores the batch size, so a seed reproduces
  // the output alone and next to other requests.
  DecodeStage policy(*model_, {.dspark = true});
  const Run pa = Serve(policy, {r});
  const Run pb = Serve(policy, {other, r, other, other});
  EXPECT_EQ(pa.seqs[0]->output, pb.seqs[1]->output);
  EXPECT_GT(pa.drafted, 0);
  Request g = r;
  g.params.top_k = 1;
  Request greedy = r;
  greedy.params.temperature = 0.f;
  EXPECT_EQ(Serve(spec, {g}).seqs[0]->output, Serve(spec, {greedy}).seqs[0]->output);
}

// Figures, not a check (run by hand: --gtest_also_run_disabled_tests): decode tokens/s of the
// stage's loop with DSpark off, on with the default (memory-bound) time model, on with the CPU
// fit from docs/dspark.md, and a fixed k = 5; batch 1 and 4, prompt 100, 48 tokens each.
TEST_F(DecodeStageDSparkTest, DISABLED_ThroughputFigures) {
  struct Mode {
    const char* name;
    DecodeStageOptions o;
  };
  DecodeStageOptions cpu{.dspark = true};
  cpu.time_model = {.base_s = 2.54, .per_token_s = 2.71, .draft_s = 4.22};
  const Mode modes[] = {{"off", {}},
                        {"on, default, raw conf.", {.dspark = true, .calibrate = false}},
                        {"on, default time model", {.dspark = true}},
                        {"on, CPU-fit time model", cpu},
                        {"on, k = 5", {.dspark = true, .fixed_k = 5}}};
  for (int b : {1, 4}) {
    double base = 0;
    for (const Mode& m : modes) {
      DecodeStage stage(*model_, m.o);
      std::vector<std::unique_ptr<DecodeSequence>> seqs;
      for (int i = 0; i < b; ++i) {
        SamplingParams p;
        p.max_tokens = 48;
        auto s = stage.StartFromPrompt(Prompt(100, 20 + i), p);
        ASSERT_TRUE(s.ok());
        seqs.push_back(std::move(*s));
      }
      std::vector<DecodeSequence*> batch;
      for (auto& s : seqs) batch.push_back(s.get());
      int64_t tokens = 0, steps = 0, drafted = 0, accepted = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (;;) {
        DecodeStepStats st;
        ASSERT_TRUE(stage.Step(batch, &st).ok());
        if (st.sequences == 0) break;
        tokens += st.emitted;
        drafted += st.drafted;
        accepted += st.accepted;
        ++steps;
      }
      const double sec =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double tps = static_cast<double>(tokens) / sec;
      if (base == 0) base = tps;
      std::printf(
          "batch %d  %-24s steps %3lld  drafted %4lld  accepted %3lld  %7.1f tok/s  %.2fx\n", b,
          m.name, static_cast<long long>(steps), static_cast<long long>(drafted),
          static_cast<long long>(accepted), tps, tps / base);
    }
  }
}

// The transfer engine refuses an offer whose manifest header `dspark` differs; the decode worker
// reports it as the DSpark switch error. Other errors pass through unchanged.
TEST(DecodeDSparkHandoffTest, ReceiveErrorNamesTheSwitch) {
  bool mismatch = true;
  const absl::Status other = absl::DeadlineExceededError("hand-off deadline passed");
  EXPECT_EQ(DSparkHandoffReceiveError(true, other, &mismatch), other);
  EXPECT_FALSE(mismatch);
  // As the transfer engine fails it: the message for people, the field as a payload.
  const absl::Status engine = transfer::WithTransferError(
      absl::FailedPreconditionError(
          "accounting error in request 'r1': manifest field dspark expected on, got off"),
      "accounting", "dspark");
  // The same words without the engine's field are not taken for the switch.
  const absl::Status text_only = absl::FailedPreconditionError(engine.message());
  EXPECT_EQ(DSparkHandoffReceiveError(true, text_only, &mismatch), text_only);
  EXPECT_FALSE(mismatch);
  const absl::Status e = DSparkHandoffReceiveError(true, engine, &mismatch);
  EXPECT_TRUE(mismatch);
  EXPECT_EQ(e.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(e.message().find("runs DSpark"), std::string::npos) << e;
  EXPECT_NE(e.message().find("no DSpark state"), std::string::npos) << e;
  EXPECT_NE(e.message().find("expected on, got off"), std::string::npos) << e;
  const absl::Status off = DSparkHandoffReceiveError(false, engine, &mismatch);
  EXPECT_TRUE(mismatch);
  EXPECT_NE(off.message().find("DSpark off"), std::string::npos) << off;
}

}  // namespace
}  // namespace epd::decode_pool
