#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/penalty.h"
#include "model/nano/nano_generator.h"
#include "tokenizer/tokenizer.h"

namespace epd::model {
namespace {

std::vector<float> Logits() { return {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 0.5f}; }

TEST(SamplingParamsTest, ValidateNamesField) {
  SamplingParams p;
  EXPECT_TRUE(p.Validate().ok());
  p.top_p = 0.f;
  EXPECT_NE(p.Validate().message().find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1.f;
  EXPECT_NE(p.Validate().message().find("temperature"), std::string::npos);
  p = {};
  p.max_tokens = 0;
  EXPECT_NE(p.Validate().message().find("max_tokens"), std::string::npos);
  p = {};
  p.top_logprobs = 21;
  EXPECT_NE(p.Validate().message().find("top_logprobs"), std::string::npos);
  p = {};
  p.stop_strings = {""};
  EXPECT_FALSE(p.Validate().ok());
}

TEST(SamplerTest, GreedyIsFirstArgmax) {
  Sampler s({}, 6);
  EXPECT_EQ(s.Sample(Logits()), 1);  // 3.0 at 1 and 3: first index wins
  EXPECT_EQ(ArgMax(std::vector<float>{0.f, 0.f}), 0);
}

TEST(RngTest, CounterBasedAndSeeded) {
  Rng a(42), b(42), c(43);
  std::vector<uint64_t> va, vb, vc;
  for (int i = 0; i < 100; ++i) {
    va.push_back(a.NextU64());
    vb.push_back(b.NextU64());
    vc.push_back(c.NextU64());
  }
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, vc);
  double u = Rng(7).NextUniform();
  EXPECT_GE(u, 0.0);
  EXPECT_LT(u, 1.0);
}

TEST(SamplerTest, SameSeedSameOutputDifferentSeedDiffers) {
  SamplingParams p;
  p.temperature = 1.f;
  auto run = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p, 6);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.Sample(Logits()));
    return out;
  };
  EXPECT_EQ(run(5), run(5));
  EXPECT_NE(run(5), run(6));
}

TEST(SamplerTest, TemperatureSamplingMatchesSoftmax) {
  SamplingParams p;
  p.temperature = 0.7f;
  p.seed = 1;
  Sampler s(p, 6);
  const std::vector<float> l = Logits();
  std::vector<double> want(6);
  double z = 0;
  for (int i = 0; i < 6; ++i) z += want[i] = std::exp(l[i] / 0.7);
  std::vector<int> hist(6, 0);
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++hist[s.Sample(l)];
  double chi2 = 0;
  for (int i = 0; i < 6; ++i) {
    const double e = n * want[i] / z;
    chi2 += (hist[i] - e) * (hist[i] - e) / e;
  }
  EXPECT_LT(chi2, 20.5);  // 5 dof, p = 0.001
}

TEST(SamplerTest, TopKMask) {
  SamplingParams p;
  p.temperature = 1.f;
  p.top_k = 2;
  Sampler s(p, 6);
  std::vector<float> probs;
  s.Probabilities(Logits(), {}, probs);
  EXPECT_GT(probs[1], 0.f);
  EXPECT_GT(probs[3], 0.f);
  for (int i : {0, 2, 4, 5}) EXPECT_EQ(probs[i], 0.f) << i;
  EXPECT_NEAR(probs[1], 0.5f, 1e-6);
  // Ties at the cut keep the lower index.
  p.top_k = 1;
  Sampler s1(p, 6);
  s1.Probabilities(Logits(), {}, probs);
  EXPECT_EQ(probs[1], 1.f);
  EXPECT_EQ(probs[3], 0.f);
}

TEST(SamplerTest, TopPMask) {
  SamplingParams p;
  p.temperature = 1.f;
  // softmax of {0, log 4, log 3, log 2} ~ {0.1, 0.4, 0.3, 0.2}
  std::vector<float> l = {0.f, std::log(4.f), std::log(3.f), std::log(2.f)};
  p.top_p = 0.65f;
  Sampler s(p, 4);
  std::vector<float> probs;
  s.Probabilities(l, {}, probs);
  EXPECT_EQ(probs[0], 0.f);
  EXPECT_EQ(probs[3], 0.f);
  EXPECT_NEAR(probs[1], 4.f / 7.f, 1e-5);
  EXPECT_NEAR(probs[2], 3.f / 7.f, 1e-5);
  // Tiny p keeps exactly one token.
  p.top_p = 0.01f;
  Sampler s2(p, 4);
  s2.Probabilities(l, {}, probs);
  EXPECT_EQ(probs[1], 1.f);
}

TEST(SamplerTest, MinPMask) {
  SamplingParams p;
  p.temperature = 1.f;
  p.min_p = 0.6f;  // keep probs >= 0.6 * 0.4 = 0.24
  std::vector<float> l = {0.f, std::log(4.f), std::log(3.f), std::log(2.f)};
  Sampler s(p, 4);
  std::vector<float> probs;
  s.Probabilities(l, {}, probs);
  EXPECT_EQ(probs[0], 0.f);
  EXPECT_EQ(probs[3], 0.f);
  EXPECT_GT(probs[1], 0.f);
  EXPECT_GT(probs[2], 0.f);
}

// A vocabulary of many sum blocks (kernels/sampling_math.h sums in blocks of 256): top-p keeps
// the shortest prefix of the descending order whose mass reaches p (the mass computed here in
// long double, independently), the kept probabilities are the softmax's renormalized, and the
// inverse CDF gives each token a share of [0, 1) equal to its probability.
TEST(SamplerTest, FiltersAndDrawAcrossManySumBlocks) {
  const int64_t n = 5000;
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.f, 0.5f);
  std::vector<float> l(n);
  for (float& x : l) x = d(rng);
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.5f;
  Sampler s(p, n);
  std::vector<float> probs;
  s.Probabilities(l, {}, probs);
  std::vector<long double> soft(n);
  long double z = 0;
  const float mx = *std::max_element(l.begin(), l.end());
  for (int64_t i = 0; i < n; ++i) z += soft[i] = std::exp(static_cast<long double>(l[i] - mx) / 0.8L);
  for (long double& x : soft) x /= z;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return soft[a] > soft[b]; });
  int64_t keep = 0;
  long double mass = 0;
  while (mass < 0.5L) mass += soft[order[keep++]];
  ASSERT_GT(keep, 256) << "the kept prefix should span sum blocks";
  int64_t kept = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float got = probs[order[j]];
    if (j < keep) {
      EXPECT_NEAR(got, static_cast<double>(soft[order[j]] / mass), 1e-6) << j;
      ++kept;
    } else {
      EXPECT_EQ(got, 0.f) << "sorted position " << j << " of " << keep << " kept";
    }
  }
  EXPECT_EQ(kept, keep);
  // The inverse CDF: G evenly spread uniforms; token i takes p_i * G of them, +-2.
  const int64_t G = 100000;
  std::vector<int64_t> hits(n, 0);
  for (int64_t c = 0; c < G; ++c) ++hits[SampleFromProbs(probs, (c + 0.5) / G)];
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(static_cast<double>(hits[i]), static_cast<double>(probs[i]) * G, 2.0) << i;
    if (probs[i] == 0.f) {
      EXPECT_EQ(hits[i], 0) << i;
    }
  }
}

TEST(SamplerTest, RepetitionPenaltyCoversPromptAndOutput) {
  SamplingParams p;
  p.repetition_penalty = 2.f;
  const std::vector<int32_t> prompt = {1};
  Sampler s(p, 6, prompt);
  std::vector<float> l = Logits();
  s.ApplyPenalties(l);
  EXPECT_FLOAT_EQ(l[1], 1.5f);  // positive: divided
  EXPECT_FLOAT_EQ(l[3], 3.f);
  EXPECT_EQ(s.Sample(Logits()), 3);
  s.Accept(4);
  l = Logits();
  s.ApplyPenalties(l);
  EXPECT_FLOAT_EQ(l[4], -2.f);  // negative: multiplied
}

TEST(SamplerTest, FrequencyAndPresencePenalties) {
  SamplingParams p;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  Sampler s(p, 6);
  s.Accept(1);
  s.Accept(1);
  std::vector<float> l = Logits();
  const std::vector<int32_t> pending = {3};
  s.ApplyPenalties(l, pending);
  EXPECT_FLOAT_EQ(l[1], 3.f - 1.f - 0.25f);
  EXPECT_FLOAT_EQ(l[3], 3.f - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(l[2], 2.f);
  // Greedy honours penalties: 3 (2.25) now beats 1 (1.75); with 3 pending twice, 2 wins.
  EXPECT_EQ(s.Greedy(Logits(), pending), 3);
  EXPECT_EQ(s.Greedy(Logits(), std::vector<int32_t>{3, 3}), 2);
}

// PenaltyEntries lists what ApplyPenalties changes, row by row (row j after drafts[0, j)), each
// logit once: applied with the shared arithmetic (kernels/penalty.h, Backend::PenalizeLogits),
// every row equals ApplyPenalties' bit for bit; with no repetition penalty the prompt's tokens are
// not listed.
TEST(SamplerTest, PenaltyEntriesGiveApplyPenaltiesRows) {
  const int64_t V = 64;
  const std::vector<int32_t> prompt = {1, 2, 3, 40, 41, 2};
  const std::vector<int32_t> drafts = {3, 9, 3, 50};
  std::vector<float> logits(5 * V);
  for (size_t i = 0; i < logits.size(); ++i)
    logits[i] = std::sin(static_cast<float>(i) * 0.37f) * 4.f;
  for (float repetition : {1.f, 1.25f}) {
    SamplingParams p;
    p.repetition_penalty = repetition;
    p.frequency_penalty = 0.6f;
    p.presence_penalty = -0.3f;
    Sampler s(p, V, prompt);
    for (int32_t t : {9, 12, 9, 63}) s.Accept(t);
    std::vector<int64_t> at;
    std::vector<int32_t> counts;
    s.PenaltyEntries(drafts, 5, at, counts);
    ASSERT_EQ(at.size(), counts.size());
    std::vector<float> got = logits;
    std::map<int64_t, int> seen;
    for (size_t e = 0; e < at.size(); ++e) {
      ASSERT_GE(at[e], 0);
      ASSERT_LT(at[e], 5 * V);
      EXPECT_EQ(++seen[at[e]], 1) << "entry " << at[e] << " listed twice";
      got[at[e]] = kernels::Penalized(got[at[e]], counts[e], repetition, p.frequency_penalty,
                                      p.presence_penalty);
      if (repetition == 1.f) {
        EXPECT_GT(counts[e], 0);
      }
    }
    for (int64_t j = 0; j < 5; ++j) {
      std::vector<float> want(logits.begin() + j * V, logits.begin() + (j + 1) * V);
      s.ApplyPenalties(want, std::span<const int32_t>(drafts).first(j));
      const std::vector<float> row(got.begin() + j * V, got.begin() + (j + 1) * V);
      EXPECT_EQ(row, want) << "row " << j << " repetition " << repetition;
    }
    // Row 0: the generated tokens (9, 12, 63), and with repetition the prompt's (1, 2, 3, 40, 41).
    EXPECT_EQ(std::count_if(at.begin(), at.end(), [&](int64_t a) { return a < V; }),
              repetition == 1.f ? 3 : 8);
  }
  Sampler none(SamplingParams{}, V);
  std::vector<int64_t> at;
  std::vector<int32_t> counts;
  none.PenaltyEntries(drafts, 5, at, counts);
  EXPECT_TRUE(at.empty());
}

TEST(SamplerTest, StopTokens) {
  SamplingParams p;
  p.stop_token_ids = {1, 7};
  Sampler s(p, 8);
  EXPECT_TRUE(s.IsStopToken(7));
  EXPECT_FALSE(s.IsStopToken(2));
}

TEST(LogprobsTest, TopAndChosen) {
  Logprobs lp = ComputeLogprobs(Logits(), 2, 3);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].token, 1);
  EXPECT_EQ(lp.top[1].token, 3);
  EXPECT_EQ(lp.top[2].token, 2);
  EXPECT_FLOAT_EQ(lp.top[0].logprob, lp.top[1].logprob);
  EXPECT_EQ(lp.chosen.token, 2);
  double z = 0;
  for (float l : Logits()) z += std::exp(l);
  EXPECT_NEAR(lp.chosen.logprob, 2.0 - std::log(z), 1e-5);
}

TEST(StopMatcherTest, AcrossTokenBoundaries) {
  StopMatcher m({"STOP", "\n\n"});
  std::string out;
  auto r = m.Feed("hello S");
  out += r.emit;
  EXPECT_EQ(r.emit, "hello ");
  EXPECT_EQ(r.held_bytes, 1u);
  r = m.Feed("T");
  EXPECT_EQ(r.emit, "");
  EXPECT_EQ(r.held_bytes, 2u);
  r = m.Feed("OP and more");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.emit, "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.Feed("x").emit, "");
}

TEST(StopMatcherTest, FalseStartReleasesText) {
  StopMatcher m({"STOP"});
  std::string out;
  out += m.Feed("ST").emit;
  EXPECT_EQ(out, "");
  out += m.Feed("ART S").emit;
  EXPECT_EQ(out, "START ");
  out += m.Feed("TO").emit;
  EXPECT_EQ(out, "START ");
  out += m.Flush();
  EXPECT_EQ(out, "START STO");
}

TEST(StopMatcherTest, EarliestOfSeveralStops) {
  StopMatcher m({"cd", "b"});
  auto r = m.Feed("abcd");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.emit, "a");
}

TEST(StopMatcherTest, OverlappingPrefixHeld) {
  StopMatcher m({"aab"});
  std::string out;
  out += m.Feed("a").emit;
  out += m.Feed("a").emit;
  out += m.Feed("a").emit;  // "aaa": the last two may still start "aab"
  EXPECT_EQ(out, "a");
  auto r = m.Feed("b");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(out + r.emit, "a");
}

// Real token stream: the nano tokenizer splits the stop string over several tokens; the text fed
// through IncrementalDetokenizer then StopMatcher ends exactly before it.
TEST(StopMatcherTest, WithIncrementalDetokenizer) {
  auto json = NanoTokenizerJson();
  ASSERT_TRUE(json.ok());
  auto tok = Tokenizer::FromJson(*json);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "The cat sat. ###END### and then more text";
  const std::vector<int32_t> ids = (*tok)->Encode(text);
  IncrementalDetokenizer detok(**tok);
  StopMatcher m({"###END###"});
  std::string out;
  size_t fed = 0, max_held = 0;
  for (int32_t id : ids) {
    auto piece = detok.Add(id);
    ASSERT_TRUE(piece.ok());
    auto r = m.Feed(*piece);
    out += r.emit;
    ++fed;
    max_held = std::max(max_held, r.held_bytes);
    if (r.stopped) break;
  }
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(out, "The cat sat. ");
  EXPECT_LT(fed, ids.size());  // stopped before the stream ended
  EXPECT_GT(max_held, 0u);     // some text was held back across token boundaries
}

}  // namespace
}  // namespace epd::model
