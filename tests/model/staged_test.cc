// Staged execution (chunked prefill, multi-token decode) equals the monolithic forward bit for bit.
#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "model/model.h"
#include "tests/testing/golden_model.h"

namespace epd::model {
namespace {

class StagedTest : public testing::GoldenModelTest {
 protected:
  std::vector<float> Rows(const ForwardResult& r, int64_t from, int64_t to) {
    const int64_t V = model_->config().vocab_size;
    return std::vector<float>(r.logits.begin() + from * V, r.logits.begin() + to * V);
  }
};

INSTANTIATE_TEST_SUITE_P(Sets, StagedTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

TEST_P(StagedTest, ChunkedPrefillEqualsMonolithic) {
  auto mono = model_->NewSequence();
  auto full = model_->Prefill(*mono, prompt_, true);
  ASSERT_TRUE(full.ok());
  // Chunks of 150 (odd split point for the ratio-2 tails: 150 even, then 77, then 74).
  auto staged = model_->NewSequence();
  std::span<const int32_t> p(prompt_);
  auto a = model_->Prefill(*staged, p.subspan(0, 150), true);
  auto b =
      model_->Extend(*staged, p.subspan(150, 77), true, nullptr, Model::ExtendMode::kPrefillChunk);
  auto c = model_->Extend(*staged, p.subspan(227), true, nullptr, Model::ExtendMode::kPrefillChunk);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->logits, Rows(*full, 0, 150));
  EXPECT_EQ(b->logits, Rows(*full, 150, 227));
  EXPECT_EQ(c->logits, Rows(*full, 227, static_cast<int64_t>(prompt_.size())));
  // The states continue identically, incl. DSpark.
  for (int32_t t : {99, 143, 448}) {
    auto x = model_->Decode(*mono, t);
    auto y = model_->Decode(*staged, t);
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(x->logits, y->logits);
    auto dx = model_->Draft(*mono, t);
    auto dy = model_->Draft(*staged, t);
    ASSERT_TRUE(dx.ok() && dy.ok());
    EXPECT_EQ(dx->logits, dy->logits);
  }
}

TEST_P(StagedTest, MultiTokenDecodeEqualsSequentialDecode) {
  std::span<const int32_t> p(prompt_);
  auto seq = model_->NewSequence();
  auto multi = model_->NewSequence();
  ASSERT_TRUE(model_->Prefill(*seq, p.subspan(0, 260), false).ok());
  ASSERT_TRUE(model_->Prefill(*multi, p.subspan(0, 260), false).ok());
  // A verification-shaped step: last token + 4 drafts at positions 260..264 (ratio-2 groups
  // complete inside the call), then again at 265..270.
  for (auto [from, n] : {std::pair<int, int>{260, 5}, {265, 6}}) {
    std::vector<float> want;
    for (int i = 0; i < n; ++i) {
      auto r = model_->Decode(*seq, prompt_[from + i]);
      ASSERT_TRUE(r.ok());
      want.insert(want.end(), r->logits.begin(), r->logits.end());
    }
    auto got = model_->Extend(*multi, p.subspan(from, n), true);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->logits, want) << "step at " << from;
  }
  auto dx = model_->Draft(*seq, 7);
  auto dy = model_->Draft(*multi, 7);
  ASSERT_TRUE(dx.ok() && dy.ok());
  EXPECT_EQ(dx->logits, dy->logits);
}

}  // namespace
}  // namespace epd::model

namespace epd::model {
namespace {

TEST_P(StagedTest, RollbackEqualsDecodingOnlyTheAcceptedTokens) {
  std::span<const int32_t> p(prompt_);
  for (int start : {200, 201}) {  // both parities of the ratio-2 tails
    auto base = model_->NewSequence();
    ASSERT_TRUE(model_->Prefill(*base, p.subspan(0, start), false).ok());
    for (int keep : {1, 2, 3, 5}) {
      auto ver = std::make_unique<SequenceState>(*base);
      auto ref = std::make_unique<SequenceState>(*base);
      // Verify 5 positions (last token + 4 drafts), accept `keep`.
      std::vector<int32_t> block = {11, 12, 13, 14, 15};
      StepCheckpoint cp = model_->Checkpoint(*ver, 5);
      auto step = model_->Extend(*ver, block, true);
      ASSERT_TRUE(step.ok());
      std::span<const int32_t> acc(block.data(), keep);
      ASSERT_TRUE(model_->Rollback(*ver, cp, acc, *step).ok());
      for (int32_t t : acc) ASSERT_TRUE(model_->Decode(*ref, t).ok());
      // Identical state, byte for byte in every serialized segment that matters.
      EXPECT_EQ(ver->pos, ref->pos);
      EXPECT_EQ(ver->published_keys, ref->published_keys);
      EXPECT_EQ(ver->swa, ref->swa) << start << "/" << keep;
      EXPECT_EQ(ver->engram_history, ref->engram_history);
      EXPECT_EQ(ver->main_hidden, ref->main_hidden);
      for (const auto& [l, src] : ref->sources) {
        EXPECT_EQ(ver->sources[l].kv, src.kv) << l;
        EXPECT_EQ(ver->sources[l].keys, src.keys) << l;
        EXPECT_EQ(ver->sources[l].tail.Kv(), src.tail.Kv()) << l << " " << start << "/" << keep;
        EXPECT_EQ(ver->sources[l].tail.Score(), src.tail.Score()) << l;
      }
      auto a = model_->Decode(*ver, 77);
      auto b = model_->Decode(*ref, 77);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->logits, b->logits);
      auto da = model_->Draft(*ver, 77);
      auto db = model_->Draft(*ref, 77);
      EXPECT_EQ(da->logits, db->logits);
    }
  }
}

}  // namespace
}  // namespace epd::model
