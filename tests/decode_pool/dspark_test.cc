// DSpark verification on the nano model: greedy parity with plain decoding, byte-exact rollback,
// the speculative rejection sampler against its target distribution, the k policy and the
// DSpark config switch.
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <vector>

#include "decode_pool/dspark/k_policy.h"
#include "decode_pool/dspark/verifier.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/sampling_math.h"
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"
#include "model/stages.h"
#include "tests/testing/dspark_reference.h"
#include "tests/testing/dspark_rollback.h"
#include "tests/testing/dspark_target_scorer.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd::decode_pool {
namespace {

using model::Model;
using model::SamplingParams;
using model::SequenceState;
// The one-sequence reference loop (tests/testing/dspark_reference.h).
using testing::DiffStates;
using testing::ExtendTargetScorer;
using testing::Generate;
using testing::GenerateOptions;
using testing::SequentialTargetScorer;
using testing::SpeculativeDecoder;
using testing::StateBytes;
using testing::StepJournal;
using testing::StepStats;
using testing::TargetScorer;

class DSparkNanoTest : public testing::NanoModelTest {
 protected:
  // A deterministic prompt of `n` ordinary tokens (ids 3..258 are bytes, then merges).
  static std::vector<int32_t> Prompt(int n, int salt) {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = 3 + static_cast<int32_t>((i * 37 + salt * 101) % 1500);
    return p;
  }
  static std::unique_ptr<SequenceState> Prefilled(std::span<const int32_t> prompt) {
    auto s = model_->NewSequence();
    EXPECT_TRUE(model_->Prefill(*s, prompt, false).ok());
    return s;
  }
};

// Greedy output with DSpark equals output without it, for fixed k and the policy, over prompt
// lengths and generations that cross the 128-token window and 8-position candidate blocks.
TEST_F(DSparkNanoTest, GreedyOutputIdenticalWithAndWithoutDSpark) {
  SequentialTargetScorer scorer(*model_);
  // A time model under which drafting pays, so the policy does draft.
  StepTimeModel flat{.base_s = 1.0, .per_token_s = 0.01, .draft_s = 0.05};
  KPolicy policy(flat);
  struct Case {
    int prompt_len, gen, salt;
  };
  const Case cases[] = {{3, 40, 1}, {17, 30, 2}, {100, 45, 3}, {122, 20, 4}, {130, 24, 5}};
  int drafted = 0, accepted = 0;
  for (const Case& cs : cases) {
    const std::vector<int32_t> prompt = Prompt(cs.prompt_len, cs.salt);
    SamplingParams params;
    params.max_tokens = cs.gen;
    GenerateOptions plain{.dspark = false};
    auto ref = Generate(*model_, scorer, prompt, params, plain);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ASSERT_EQ(static_cast<int>(ref->tokens.size()), cs.gen);
    for (int k : {1, 5, -1}) {
      GenerateOptions opt{.dspark = true, .fixed_k = k, .policy = &policy};
      auto got = Generate(*model_, scorer, prompt, params, opt);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->tokens, ref->tokens) << "prompt " << cs.prompt_len << " k " << k;
      for (const StepStats& s : got->steps) {
        EXPECT_LE(s.accepted, s.k);
        EXPECT_EQ(s.emitted, s.accepted + 1);
        drafted += s.k;
        accepted += s.accepted;
      }
    }
  }
  EXPECT_GT(drafted, 0);
  EXPECT_GT(accepted, 0);  // the accept path ran too (OracleDrafts... covers full acceptance)
  std::printf("greedy parity: drafted %d accepted %d\n", drafted, accepted);
}

// The one-call target pass (Model::Extend + Checkpoint/Rollback) gives the same greedy output
// and the same rollback as the sequential scorer.
TEST_F(DSparkNanoTest, ExtendScorerMatchesSequential) {
  SequentialTargetScorer sequential(*model_);
  ExtendTargetScorer extend(*model_);
  for (auto [plen, gen] : {std::pair{100, 40}, std::pair{126, 12}}) {
    const std::vector<int32_t> prompt = Prompt(plen, plen);
    SamplingParams params;
    params.max_tokens = gen;
    auto ref = Generate(*model_, sequential, prompt, params, {.dspark = false});
    auto got = Generate(*model_, extend, prompt, params, {.dspark = true, .fixed_k = 5});
    ASSERT_TRUE(ref.ok() && got.ok()) << got.status();
    EXPECT_EQ(got->tokens, ref->tokens) << plen;
  }
  for (int plen : {124, 131}) {
    const std::unique_ptr<SequenceState> base = Prefilled(Prompt(plen, 3));
    const std::vector<int32_t> ids = {40, 1000, 7, 7, 300, 2001};
    for (int keep : {1, 3, 6}) {
      SequenceState a = *base, b = *base;
      ASSERT_TRUE(sequential.Score(a, ids).ok());
      ASSERT_TRUE(extend.Score(b, ids).ok());
      ASSERT_TRUE(sequential.Commit(a, keep).ok());
      ASSERT_TRUE(extend.Commit(b, keep).ok());
      EXPECT_EQ(DiffStates(a, b), "") << plen << " keep " << keep;
    }
  }
}

// Penalties make the verify rows depend on the accepted drafts: still identical.
TEST_F(DSparkNanoTest, GreedyWithPenaltiesIdentical) {
  SequentialTargetScorer scorer(*model_);
  const std::vector<int32_t> prompt = Prompt(20, 9);
  SamplingParams params;
  params.max_tokens = 30;
  params.repetition_penalty = 1.3f;
  params.frequency_penalty = 0.4f;
  params.presence_penalty = 0.2f;
  auto ref = Generate(*model_, scorer, prompt, params, {.dspark = false});
  ASSERT_TRUE(ref.ok());
  params.top_logprobs = 3;
  auto got = Generate(*model_, scorer, prompt, params, {.dspark = true, .fixed_k = 4});
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->tokens, ref->tokens);
  // Top logprobs per token, identical with and without DSpark (raw target logits per row).
  auto ref_lp = Generate(*model_, scorer, prompt, params, {.dspark = false});
  ASSERT_TRUE(ref_lp.ok());
  ASSERT_EQ(got->logprobs.size(), got->tokens.size());
  ASSERT_EQ(ref_lp->logprobs.size(), got->logprobs.size());
  for (size_t i = 0; i < got->logprobs.size(); ++i) {
    EXPECT_EQ(got->logprobs[i].chosen.token, got->tokens[i]);
    EXPECT_EQ(got->logprobs[i].chosen.logprob, ref_lp->logprobs[i].chosen.logprob) << i;
    ASSERT_EQ(got->logprobs[i].top.size(), 3u);
    EXPECT_EQ(got->logprobs[i].top[0].token, ref_lp->logprobs[i].top[0].token);
    EXPECT_LE(got->logprobs[i].chosen.logprob, got->logprobs[i].top[0].logprob);
  }
}

// Drafts equal to the true greedy continuation are accepted, a wrong one is rejected, and the
// state after the step equals the plain run's, byte for byte.
TEST_F(DSparkNanoTest, OracleDraftsAcceptedStateMatchesPlainRun) {
  const std::vector<int32_t> prompt = Prompt(125, 11);
  // Plain greedy run.
  std::vector<int32_t> toks;
  {
    auto s = model_->NewSequence();
    auto r = model_->Prefill(*s, prompt, false);
    ASSERT_TRUE(r.ok());
    toks.push_back(model::ArgMax(r->logits));
    for (int i = 0; i < 8; ++i) {
      auto d = model_->Decode(*s, toks.back());
      ASSERT_TRUE(d.ok());
      toks.push_back(model::ArgMax(d->logits));
    }
  }
  SequentialTargetScorer scorer(*model_);
  const std::unique_ptr<SequenceState> base = Prefilled(prompt);
  for (int wrong_at : {0, 2, 5, -1}) {  // -1: all five drafts right
    auto s = std::make_unique<SequenceState>(*base);
    std::vector<int32_t> ids = {toks[0]};
    for (int i = 1; i <= 5; ++i) ids.push_back(i - 1 == wrong_at ? (toks[i] + 1) % 2048 : toks[i]);
    auto logits = scorer.Score(*s, ids);
    ASSERT_TRUE(logits.ok());
    std::vector<int32_t> target;
    for (int i = 0; i <= 5; ++i) {
      target.push_back(model::ArgMax(std::span<const float>(logits->data() + i * 2048, 2048)));
    }
    VerifyOutcome o = VerifyGreedy(target, std::span<const int32_t>(ids).subspan(1));
    const int want = wrong_at < 0 ? 5 : wrong_at;
    EXPECT_EQ(o.accepted, want);
    EXPECT_EQ(o.token, toks[want + 1]);
    ASSERT_TRUE(scorer.Commit(*s, o.accepted + 1).ok());
    auto ref = std::make_unique<SequenceState>(*base);
    for (int i = 0; i <= want; ++i) ASSERT_TRUE(model_->Decode(*ref, toks[i]).ok());
    EXPECT_EQ(DiffStates(*s, *ref), "") << "wrong_at " << wrong_at;
  }
}

// After verifying and rejecting drafts, the state equals that of a run that never drafted them,
// byte for byte: every keep count, at both parities (ratio-2 tails), across the window wrap.
TEST_F(DSparkNanoTest, RollbackRestoresStateByteForByte) {
  SequentialTargetScorer sequential(*model_);
  ExtendTargetScorer extend(*model_);
  for (int plen : {124, 125, 131}) {
    TargetScorer& scorer = plen == 125 ? static_cast<TargetScorer&>(extend) : sequential;
    const std::vector<int32_t> prompt = Prompt(plen, plen);
    const std::unique_ptr<SequenceState> base = Prefilled(prompt);
    const std::vector<int32_t> ids = {40, 1000, 7, 7, 300, 2001};
    // refs[i]: the plain run after decoding ids[0 .. i].
    std::vector<SequenceState> refs;
    SequenceState plain = *base;
    for (int32_t id : ids) {
      ASSERT_TRUE(model_->Decode(plain, id).ok());
      refs.push_back(plain);
    }
    for (int keep = 1; keep <= 6; ++keep) {
      SequenceState s = *base;
      auto logits = scorer.Score(s, ids);
      ASSERT_TRUE(logits.ok());
      EXPECT_EQ(s.pos, plen + 6);
      ASSERT_TRUE(scorer.Commit(s, keep).ok());
      EXPECT_EQ(DiffStates(s, refs[keep - 1]), "") << "prompt " << plen << " keep " << keep;
    }
    // A restored state keeps decoding like the reference.
    SequenceState s = *base;
    ASSERT_TRUE(scorer.Score(s, ids).ok());
    ASSERT_TRUE(scorer.Commit(s, 2).ok());
    SequenceState ref = refs[1];
    auto a = model_->Decode(s, 55);
    auto b = model_->Decode(ref, 55);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->logits, b->logits);
    EXPECT_EQ(DiffStates(s, ref), "");
  }
}

TEST_F(DSparkNanoTest, ScorerRejectsBadInputAndKeepsState) {
  SequentialTargetScorer scorer(*model_);
  auto s = Prefilled(Prompt(10, 1));
  auto before = Prefilled(Prompt(10, 1));
  const std::vector<int32_t> bad = {5, 6, 99999};
  EXPECT_FALSE(scorer.Score(*s, bad).ok());
  EXPECT_EQ(DiffStates(*s, *before), "");
  EXPECT_FALSE(scorer.Score(*s, {}).ok());
  const std::vector<int32_t> ok = {5, 6};
  ASSERT_TRUE(scorer.Score(*s, ok).ok());
  EXPECT_FALSE(scorer.Commit(*s, 0).ok());
  EXPECT_FALSE(scorer.Commit(*s, 3).ok());
  EXPECT_TRUE(scorer.Commit(*s, 2).ok());
}

// End-to-end sanity at T > 0: reproducible per seed; with top_k = 1 the target distribution is
// one-hot, so speculative sampling must reproduce greedy output exactly.
TEST_F(DSparkNanoTest, SampledGenerationSanity) {
  SequentialTargetScorer scorer(*model_);
  const std::vector<int32_t> prompt = Prompt(30, 3);
  SamplingParams params;
  params.temperature = 0.9f;
  params.max_tokens = 24;
  params.seed = 77;
  auto a = Generate(*model_, scorer, prompt, params, {.dspark = true, .fixed_k = 3});
  auto b = Generate(*model_, scorer, prompt, params, {.dspark = true, .fixed_k = 3});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_EQ(static_cast<int>(a->tokens.size()), 24);
  params.seed = 78;
  auto c = Generate(*model_, scorer, prompt, params, {.dspark = true, .fixed_k = 3});
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->tokens, c->tokens);

  SamplingParams greedy;
  greedy.max_tokens = 24;
  auto g = Generate(*model_, scorer, prompt, greedy, {.dspark = false});
  params.top_k = 1;
  auto t = Generate(*model_, scorer, prompt, params, {.dspark = true, .fixed_k = 4});
  ASSERT_TRUE(g.ok() && t.ok());
  EXPECT_EQ(t->tokens, g->tokens);
}

TEST_F(DSparkNanoTest, StopTokenEndsGeneration) {
  SequentialTargetScorer scorer(*model_);
  const std::vector<int32_t> prompt = Prompt(12, 4);
  SamplingParams params;
  params.max_tokens = 20;
  auto ref = Generate(*model_, scorer, prompt, params, {.dspark = false});
  ASSERT_TRUE(ref.ok());
  params.stop_token_ids = {ref->tokens[5]};
  auto got = Generate(*model_, scorer, prompt, params, {.dspark = true, .fixed_k = 5});
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->finish_reason, "stop");
  const auto first = std::find(ref->tokens.begin(), ref->tokens.end(), ref->tokens[5]);
  EXPECT_EQ(got->tokens, std::vector<int32_t>(ref->tokens.begin(), first));
}

TEST_F(DSparkNanoTest, HandoffCheck) {
  auto s = Prefilled(Prompt(20, 2));
  std::vector<model::StateSegment> segs = model::SerializeState(model_->config(), *s);
  EXPECT_TRUE(HandoffHasDSparkState(model_->config(), segs));
  EXPECT_TRUE(CheckDSparkHandoff(true, true).ok());
  EXPECT_TRUE(CheckDSparkHandoff(false, false).ok());
  std::erase_if(segs, [&](const model::StateSegment& g) {
    if (g.name == "main_hidden") return true;
    for (int L = model_->config().n_layers; L < model_->config().total_layers(); ++L) {
      if (g.name == "swa." + std::to_string(L)) return true;
    }
    return false;
  });
  EXPECT_FALSE(HandoffHasDSparkState(model_->config(), segs));
  absl::Status a = CheckDSparkHandoff(true, false);
  EXPECT_EQ(a.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(a.message().find("no DSpark state"), std::string::npos);
  absl::Status b = CheckDSparkHandoff(false, true);
  EXPECT_EQ(b.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(b.message().find("DSpark off"), std::string::npos);
}

// ---- Rejection sampling on synthetic distributions ----

double ChiSquare(const std::vector<int>& obs, const std::vector<double>& prob, int n) {
  double c = 0;
  for (size_t i = 0; i < obs.size(); ++i) {
    const double e = n * prob[i];
    if (e == 0) {
      EXPECT_EQ(obs[i], 0) << "cell " << i << " has zero probability";
      continue;
    }
    c += (obs[i] - e) * (obs[i] - e) / e;
  }
  return c;
}

// Output of speculative sampling with drafts from q is distributed as sampling from p: the joint
// of the first two emitted tokens over 5x5 cells (p_j, q_j fixed per output position j, so the
// target joint is p_0 x p_1), with q far from p and q missing tokens p has.
TEST(DSparkRejectionTest, JointOfFirstTwoTokensMatchesTarget) {
  constexpr int V = 5;
  const std::vector<std::vector<float>> p = {{0.5f, 0.2f, 0.1f, 0.1f, 0.1f},
                                             {0.05f, 0.05f, 0.3f, 0.3f, 0.3f},
                                             {0.2f, 0.2f, 0.2f, 0.2f, 0.2f},
                                             {0.1f, 0.6f, 0.1f, 0.1f, 0.1f},
                                             {0.3f, 0.3f, 0.1f, 0.2f, 0.1f}};
  const std::vector<std::vector<float>> q = {{0.1f, 0.1f, 0.6f, 0.2f, 0.0f},
                                             {0.5f, 0.0f, 0.1f, 0.4f, 0.0f},
                                             {0.0f, 0.9f, 0.1f, 0.0f, 0.0f},
                                             {0.2f, 0.2f, 0.2f, 0.2f, 0.2f},
                                             {1.0f, 0.0f, 0.0f, 0.0f, 0.0f}};
  model::Rng rng(12345);
  const int n = 40000;
  std::vector<int> joint(V * V, 0);
  int steps = 0, drafted = 0, accepted = 0;
  for (int trial = 0; trial < n; ++trial) {
    std::vector<int32_t> out;
    while (out.size() < 2) {
      const int j = static_cast<int>(out.size());
      const int k = 3;
      std::vector<float> pr, qr;
      std::vector<int32_t> drafts;
      for (int i = 0; i <= k; ++i) pr.insert(pr.end(), p[j + i].begin(), p[j + i].end());
      for (int i = 0; i < k; ++i) {
        qr.insert(qr.end(), q[j + i].begin(), q[j + i].end());
        drafts.push_back(model::SampleFromProbs(q[j + i], rng.NextUniform()));
      }
      VerifyOutcome o = VerifyRejection(pr, qr, drafts, V, rng);
      for (int i = 0; i < o.accepted; ++i) out.push_back(drafts[i]);
      out.push_back(o.token);
      ++steps;
      drafted += k;
      accepted += o.accepted;
    }
    ++joint[out[0] * V + out[1]];
  }
  std::vector<double> want(V * V);
  for (int a = 0; a < V; ++a) {
    for (int b = 0; b < V; ++b) want[a * V + b] = double(p[0][a]) * p[1][b];
  }
  const double chi2 = ChiSquare(joint, want, n);
  EXPECT_LT(chi2, 51.18);  // 24 dof, p = 0.001
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

// The same property on the model, through the backend path a decode worker takes at T > 0: the
// draft chain drawn on the backend (Model::Draft, kSample: q in backend memory) and verified
// there (a kVerify step, Backend::VerifyDrafts). Over many independent seeds from one state, the
// first emitted token follows the target's distribution of that position (FilteredProbs of its
// values row with the same filters): a wrong acceptance ratio, residual or uniform would shift
// it toward the draft's q.
TEST_F(DSparkNanoTest, SampledFirstTokenOnTheBackendFollowsTheTarget) {
  const std::vector<int32_t> prompt = Prompt(48, 9);
  const std::unique_ptr<SequenceState> base = Prefilled(prompt);
  const int32_t last = 77;
  const int64_t V = model_->config().vocab_size, block = model_->config().dspark_block_size;
  kernels::SampleParams params{.temperature = 1.4f, .top_k = 5};
  // The target: the position's values row, filtered.
  std::vector<float> p0(static_cast<size_t>(V));
  {
    auto st = std::make_unique<SequenceState>(*base);
    SequenceState* states[] = {st.get()};
    const std::vector<std::vector<int32_t>> tokens = {{last}};
    auto r = model::DecodeStep(*model_, states, tokens);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<int32_t> order;
    kernels::sampling::FilteredProbs((*r)[0].logits.data(), V, params, p0.data(), order);
  }
  constexpr int kTrials = 500, kDrafts = 3;
  std::map<int32_t, int> first;
  int accepted = 0, bonus = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    model::Rng rng(1000 + static_cast<uint64_t>(trial));
    auto st = std::make_unique<SequenceState>(*base);
    model::SampleRequest draw{params, {}};
    for (int64_t i = 0; i < block; ++i) draw.uniforms.push_back(rng.NextUniform());
    auto d = model_->Draft(*st, last, {}, model::LogitsOut::kSample, nullptr, &draw);
    ASSERT_TRUE(d.ok()) << d.status();
    model::DraftVerification v{d->q, {d->ids.begin() + 1, d->ids.begin() + 1 + kDrafts}};
    model::SampleRequest check{params, {}};
    for (int i = 0; i <= kDrafts; ++i) check.uniforms.push_back(rng.NextUniform());
    const model::LogitsRequest out(model::LogitsOut::kVerify, nullptr, &check, &v);
    SequenceState* states[] = {st.get()};
    std::vector<std::vector<int32_t>> tokens = {{last}};
    tokens[0].insert(tokens[0].end(), v.drafts.begin(), v.drafts.end());
    auto r = model::DecodeStep(*model_, states, tokens, nullptr, std::span(&out, 1));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ((*r)[0].tokens.size(), 2u);
    const int32_t a = (*r)[0].tokens[0], token = (*r)[0].tokens[1];
    ASSERT_GE(a, 0);
    ASSERT_LE(a, kDrafts);
    ++first[a > 0 ? v.drafts[0] : token];
    accepted += a > 0;
    bonus += a == kDrafts;
  }
  std::vector<int> obs;
  std::vector<double> want;
  for (int64_t t = 0; t < V; ++t) {
    const auto it = first.find(static_cast<int32_t>(t));
    const int n = it == first.end() ? 0 : it->second;
    if (p0[t] == 0.f) {
      EXPECT_EQ(n, 0) << "token " << t << " has no target probability";
      continue;
    }
    obs.push_back(n);
    want.push_back(p0[t]);
  }
  ASSERT_EQ(obs.size(), 5u);
  EXPECT_LT(ChiSquare(obs, want, kTrials), 18.47);  // 4 dof, p = 0.001
  // Both paths were taken: drafts accepted and rejected.
  EXPECT_GT(accepted, kTrials / 10);
  EXPECT_LT(accepted, kTrials);
  std::printf("first draft accepted in %d of %d trials, all %d in %d\n", accepted, kTrials, kDrafts,
              bonus);
}

// Every draft accepted when q == p, and the bonus token comes from p[k].
TEST(DSparkRejectionTest, IdenticalDistributionsAcceptAll) {
  constexpr int V = 4;
  const std::vector<float> row = {0.1f, 0.2f, 0.3f, 0.4f};
  std::vector<float> p, q;
  for (int i = 0; i < 3; ++i) p.insert(p.end(), row.begin(), row.end());
  for (int i = 0; i < 2; ++i) q.insert(q.end(), row.begin(), row.end());
  model::Rng rng(9);
  std::vector<int> bonus(V, 0);
  const int n = 20000;
  for (int t = 0; t < n; ++t) {
    std::vector<int32_t> d = {model::SampleFromProbs(row, rng.NextUniform()),
                              model::SampleFromProbs(row, rng.NextUniform())};
    VerifyOutcome o = VerifyRejection(p, q, d, V, rng);
    ASSERT_EQ(o.accepted, 2);
    ++bonus[o.token];
  }
  EXPECT_LT(ChiSquare(bonus, {0.1, 0.2, 0.3, 0.4}, n), 16.27);  // 3 dof, p = 0.001
}

TEST(DSparkRejectionTest, GreedyVerifyLongestPrefix) {
  const std::vector<int32_t> target = {4, 5, 6, 7};
  EXPECT_EQ(VerifyGreedy(target, std::vector<int32_t>{4, 5, 6}).accepted, 3);
  EXPECT_EQ(VerifyGreedy(target, std::vector<int32_t>{4, 5, 6}).token, 7);
  EXPECT_EQ(VerifyGreedy(target, std::vector<int32_t>{4, 9, 6}).accepted, 1);
  EXPECT_EQ(VerifyGreedy(target, std::vector<int32_t>{4, 9, 6}).token, 5);
  EXPECT_EQ(VerifyGreedy(target, std::vector<int32_t>{1, 5, 6}).token, 4);
}

// ---- k policy ----

TEST(DSparkKPolicyTest, ExpectedEmitted) {
  const std::vector<float> c = {0.f, 0.f, 0.f};  // a = 0.5 each
  EXPECT_DOUBLE_EQ(ExpectedEmitted(c, 0), 1.0);
  EXPECT_DOUBLE_EQ(ExpectedEmitted(c, 1), 1.5);
  EXPECT_DOUBLE_EQ(ExpectedEmitted(c, 3), 1.875);
}

TEST(DSparkKPolicyTest, ChoosesByConfidenceAndBatch) {
  // Memory-bound regime: a verify position is cheap next to the fixed step cost.
  KPolicy cheap(StepTimeModel{.base_s = 1.0, .per_token_s = 0.02, .draft_s = 0.05});
  const std::vector<float> confident = {6.f, 6.f, 6.f, 6.f, 6.f};
  const std::vector<float> doubtful = {-6.f, -6.f, -6.f, -6.f, -6.f};
  EXPECT_EQ(cheap.Choose(confident, 1), 5);
  EXPECT_EQ(cheap.Choose(doubtful, 1), 0);
  // Confidence falls off after two drafts: stop there.
  const std::vector<float> two = {6.f, 6.f, -8.f, -8.f, -8.f};
  EXPECT_EQ(cheap.Choose(two, 1), 2);
  // Large batches make verify positions expensive relative to the fixed cost: k shrinks.
  const std::vector<float> medium = {1.f, 1.f, 1.f, 1.f, 1.f};
  const int k1 = cheap.Choose(medium, 1), k256 = cheap.Choose(medium, 256);
  EXPECT_GT(k1, k256);
  // Compute-bound (CPU, sequential verify): drafting never pays.
  KPolicy linear(StepTimeModel{.base_s = 0.0, .per_token_s = 1.0, .draft_s = 0.3});
  EXPECT_FALSE(linear.WorthDrafting(1));
  EXPECT_EQ(linear.Choose(confident, 1), 0);
  EXPECT_TRUE(cheap.WorthDrafting(1));
}

TEST(DSparkKPolicyTest, FitRecoversModel) {
  const StepTimeModel truth{.base_s = 0.003, .per_token_s = 0.0007, .draft_s = 0.002};
  std::vector<StepTimeSample> s;
  for (int b : {1, 4, 16}) {
    for (int k = 0; k <= 5; ++k) s.push_back({b, k, truth.Seconds(b, k)});
  }
  auto fit = StepTimeModel::Fit(s);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->base_s, truth.base_s, 1e-9);
  EXPECT_NEAR(fit->per_token_s, truth.per_token_s, 1e-9);
  EXPECT_NEAR(fit->draft_s, truth.draft_s, 1e-9);
  EXPECT_FALSE(StepTimeModel::Fit(std::vector<StepTimeSample>{{1, 1, 1.0}, {1, 2, 2.0}}).ok());
}

}  // namespace
}  // namespace epd::decode_pool
