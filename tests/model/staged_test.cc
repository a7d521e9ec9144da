// Staged execution (chunked prefill, multi-token decode) equals the monolithic forward bit for bit
// (the bodies: tests/testing/staged_checks.h, shared with the GPU run).
#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "model/model.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/staged_checks.h"

namespace epd::model {
namespace {

class StagedTest : public testing::GoldenModelTest {};

INSTANTIATE_TEST_SUITE_P(Sets, StagedTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

TEST_P(StagedTest, ChunkedPrefillEqualsMonolithic) {
  testing::ExpectChunkedPrefillEqualsMonolithic(*model_, testing::ExtendedPrompt(prompt_, 301));
}

TEST_P(StagedTest, MultiTokenDecodeEqualsSequentialDecode) {
  testing::ExpectMultiTokenDecodeEqualsSequentialDecode(*model_,
                                                        testing::ExtendedPrompt(prompt_, 301));
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
