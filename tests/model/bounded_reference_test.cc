// Staged execution (encoder pass -> decoder replay -> decode steps) against the monolithic
// reference forward with bounded-replay semantics (Model::Prefill with
// PrefillOptions::decoder_tail_rows): bit-identical logits and state, for prompt lengths that are
// and are not multiples of 2, 8 (the candidate block), 64 (a kvstore block) and 128 (the window),
// and when resuming from a cached prefix (a store round trip of the state) at a block boundary.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/sequence_state.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"

namespace epd::model {
namespace {

using testing::BitEqual;

class BoundedReferenceTest : public testing::GoldenModelTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(GoldenModelTest::SetUp());
    kTail = DecoderTailRows(model_->config());  // window + DSpark block, as the encoder pool
    // The cases below need 262 tokens (p = 128 plus a full decoder tail before P - 1).
    prompt_ = testing::ExtendedPrompt(prompt_, 301);
    P = static_cast<int64_t>(prompt_.size());
    ASSERT_GE(P, 262);
  }
  int64_t kTail = 0, P = 0;
  std::span<const int32_t> Prompt(int64_t n) const {
    return std::span<const int32_t>(prompt_).subspan(0, n);
  }
  // The bounded monolithic reference over the first n prompt tokens (all rows' logits).
  std::unique_ptr<SequenceState> Reference(int64_t n, int64_t tail, ForwardResult& out) const {
    auto st = model_->NewSequence();
    PrefillOptions opt;
    opt.decoder_tail_rows = tail;
    auto r = model_->Prefill(*st, Prompt(n), /*all_logits=*/true, opt);
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) out = std::move(*r);
    return st;
  }
  std::span<const float> LastRow(const ForwardResult& r) const {
    const int64_t V = model_->config().vocab_size;
    return std::span<const float>(r.logits).subspan((r.rows - 1) * V, V);
  }
  // The whole state, field by field (what a hand-off to decode carries).
  void ExpectSameState(const SequenceState& a, const SequenceState& b, const std::string& what) {
    EXPECT_EQ(a.pos, b.pos) << what;
    EXPECT_EQ(a.published_keys, b.published_keys) << what;
    EXPECT_EQ(a.engram_history, b.engram_history) << what;
    EXPECT_TRUE(BitEqual(a.main_hidden, b.main_hidden)) << what;
    for (size_t l = 0; l < a.swa.size(); ++l)
      EXPECT_TRUE(BitEqual(a.swa[l], b.swa[l])) << what << l;
    for (const auto& [l, src] : a.sources) {
      const SequenceState::Source& o = b.sources.at(l);
      EXPECT_EQ(src.n, o.n) << what << l;
      EXPECT_TRUE(BitEqual(src.kv, o.kv)) << what << l;
      EXPECT_TRUE(BitEqual(src.keys, o.keys)) << what << l;
      EXPECT_TRUE(BitEqual(src.tail.Kv(), o.tail.Kv())) << what << l;
      EXPECT_TRUE(BitEqual(src.tail.Score(), o.tail.Score())) << what << l;
    }
  }
  // Decode steps (DecodeStep batch of one vs Model::Decode), then a DSpark draft: bit-identical.
  void ExpectSameContinuation(SequenceState& ref, SequenceState& staged, const std::string& what) {
    for (int32_t t : {7, 300, 41}) {
      auto a = model_->Decode(ref, t);
      std::vector<SequenceState*> batch = {&staged};
      std::vector<std::vector<int32_t>> toks = {{t}};
      auto b = DecodeStep(*model_, batch, toks);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_TRUE(BitEqual(a->logits, (*b)[0].logits)) << what << " decode " << t;
    }
    auto da = model_->Draft(ref, 9);
    auto db = model_->Draft(staged, 9);
    ASSERT_TRUE(da.ok() && db.ok());
    EXPECT_TRUE(BitEqual(da->logits, db->logits)) << what;
  }
};

INSTANTIATE_TEST_SUITE_P(Sets, BoundedReferenceTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

TEST_P(BoundedReferenceTest, StagedEqualsBoundedMonolithicBitForBit) {
  // n: 134 (even, not a multiple of 8), 137 (odd), 195 (192+3), 256 (multiple of 2, 8, 64, 128),
  // 257 (256+1). Encoder chunks end at odd, even and block-aligned positions; the tail spans
  // chunks.
  struct Case {
    int64_t n;
    std::vector<int64_t> cuts;  // encoder chunk boundaries
  };
  for (const Case& c : std::vector<Case>{
           {134, {}}, {137, {64}}, {195, {37, 128, 190}}, {256, {128}}, {257, {64, 191, 250}}}) {
    const std::string what = "n=" + std::to_string(c.n) + " ";
    ForwardResult want;
    auto ref = Reference(c.n, kTail, want);
    auto st = model_->NewSequence();
    std::optional<EncoderOutput> enc;
    int64_t from = 0;
    std::vector<int64_t> ends = c.cuts;
    ends.push_back(c.n);
    for (int64_t to : ends) {
      auto e = EncoderPass(*model_, *st, Prompt(to).subspan(from), kTail, enc ? &*enc : nullptr);
      ASSERT_TRUE(e.ok()) << e.status();
      enc = std::move(*e);
      from = to;
    }
    ASSERT_EQ(enc->tail_start, c.n - kTail);
    auto got = DecoderReplay(*model_, *st, *enc);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(BitEqual(got->logits, LastRow(want))) << what;
    ExpectSameState(*ref, *st, what);
    ExpectSameContinuation(*ref, *st, what);
  }
}

TEST_P(BoundedReferenceTest, BoundedSemanticsOnlyTouchTheDecoderTail) {
  // Rows below the floor are the exact reference's; rows above it differ from it (the floor
  // does something); with n <= tail the bounded reference is the exact one.
  const int64_t n = P - 1, V = model_->config().vocab_size;
  ForwardResult bounded;
  Reference(n, kTail, bounded);
  auto st = model_->NewSequence();
  auto exact = model_->Prefill(*st, Prompt(n), true);
  ASSERT_TRUE(exact.ok());
  const int64_t floor = n - kTail;
  EXPECT_TRUE(BitEqual(std::span<const float>(bounded.logits).subspan(0, floor * V),
                       std::span<const float>(exact->logits).subspan(0, floor * V)));
  EXPECT_FALSE(BitEqual(LastRow(bounded), LastRow(*exact)));
  ForwardResult short_bounded;
  Reference(120, kTail, short_bounded);
  auto st2 = model_->NewSequence();
  auto short_exact = model_->Prefill(*st2, Prompt(120), true);
  ASSERT_TRUE(short_exact.ok());
  EXPECT_TRUE(BitEqual(short_bounded.logits, short_exact->logits));
  PrefillOptions bad;
  bad.decoder_tail_rows = -1;
  auto st3 = model_->NewSequence();
  EXPECT_FALSE(model_->Prefill(*st3, Prompt(10), false, bad).ok());
}

TEST_P(BoundedReferenceTest, ResumeFromCachedPrefixAtBlockBoundary) {
  // The encoder runs [0, p), its state goes through the packed store format (what a kvstore
  // round trip does), a fresh state continues [p, n), then the decoder replay.
  struct Case {
    int64_t p, n;
  };
  for (const Case& c : std::vector<Case>{{64, 257}, {128, P - 1}}) {
    const std::string what = "p=" + std::to_string(c.p) + " n=" + std::to_string(c.n) + " ";
    ForwardResult want;
    auto ref = Reference(c.n, kTail, want);
    auto first = model_->NewSequence();
    ASSERT_TRUE(EncoderPass(*model_, *first, Prompt(c.p), kTail).ok());
    auto restored = DeserializeState(*model_, SerializeState(model_->config(), *first));
    ASSERT_TRUE(restored.ok()) << restored.status();
    SequenceState& st = **restored;
    auto enc = EncoderPass(*model_, st, Prompt(c.n).subspan(c.p), kTail);
    ASSERT_TRUE(enc.ok()) << enc.status();
    auto got = DecoderReplay(*model_, st, *enc);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(BitEqual(got->logits, LastRow(want))) << what;
    ExpectSameState(*ref, st, what);
    ExpectSameContinuation(*ref, st, what);
  }
  // A suffix shorter than the tail: the decoder replays n - p rows (floor at p); the reference is
  // bounded(n - p). (The decode steps after it would need the decoder rings below p, which the
  // prefix state does not hold, so only the prefill logits are compared.)
  const int64_t p = 128, n = 195;
  ForwardResult want;
  Reference(n, n - p, want);
  auto first = model_->NewSequence();
  ASSERT_TRUE(EncoderPass(*model_, *first, Prompt(p), kTail).ok());
  auto restored = DeserializeState(*model_, SerializeState(model_->config(), *first));
  ASSERT_TRUE(restored.ok());
  auto enc = EncoderPass(*model_, **restored, Prompt(n).subspan(p), kTail);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(enc->tail_start, p);
  auto got = DecoderReplay(*model_, **restored, *enc);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(BitEqual(got->logits, LastRow(want)));
}

TEST_P(BoundedReferenceTest, DecodeStepLogitsDoNotDependOnTheRestOfTheBatch) {
  // Three sequences at different positions (short and past the window), one with a
  // verification-shaped step; each sequence's logits are the same alone and in any batch.
  const std::vector<int64_t> lens = {40, 150, 201};
  const std::vector<std::vector<int32_t>> toks = {{5, 6, 7}, {8}, {9, 10}};
  auto fresh = [&](int i) {
    auto st = model_->NewSequence();
    EXPECT_TRUE(model_->Prefill(*st, Prompt(lens[i]), false).ok());
    return st;
  };
  std::vector<std::vector<float>> alone(3);
  for (int i = 0; i < 3; ++i) {
    auto st = fresh(i);
    std::vector<SequenceState*> b = {st.get()};
    std::vector<std::vector<int32_t>> t = {toks[i]};
    auto r = DecodeStep(*model_, b, t);
    ASSERT_TRUE(r.ok());
    alone[i] = (*r)[0].logits;
  }
  for (const std::vector<int>& order :
       std::vector<std::vector<int>>{{0, 1, 2}, {2, 0}, {1, 2, 0}}) {
    std::vector<std::unique_ptr<SequenceState>> owned;
    std::vector<SequenceState*> b;
    std::vector<std::vector<int32_t>> t;
    for (int i : order) {
      owned.push_back(fresh(i));
      b.push_back(owned.back().get());
      t.push_back(toks[i]);
    }
    auto r = DecodeStep(*model_, b, t);
    ASSERT_TRUE(r.ok());
    for (size_t j = 0; j < order.size(); ++j) {
      EXPECT_TRUE(BitEqual((*r)[j].logits, alone[order[j]])) << "sequence " << order[j];
    }
  }
}

}  // namespace
}  // namespace epd::model
