// Encoder / decoder stage runners vs the monolithic forward pass.
#include "model/stages.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "tests/testing/golden_model.h"

namespace epd::model {
namespace {

double RelRms(const std::vector<float>& x, const std::vector<float>& g) {
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    num += (double(x[i]) - g[i]) * (double(x[i]) - g[i]);
    den += double(g[i]) * g[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

class StagesTest : public testing::GoldenModelTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(GoldenModelTest::SetUp());
    kTail = DecoderTailRows(model_->config());  // window + DSpark block
    P = static_cast<int64_t>(prompt_.size());
  }
  int64_t kTail = 0, P = 0;
};

INSTANTIATE_TEST_SUITE_P(Sets, StagesTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

TEST_P(StagesTest, ShortPromptEncoderThenDecoderEqualsMonolithic) {
  std::vector<int32_t> ids(prompt_.begin(), prompt_.begin() + 100);
  auto mono = model_->NewSequence();
  auto want = model_->Prefill(*mono, ids, false);
  ASSERT_TRUE(want.ok());
  auto st = model_->NewSequence();
  auto enc = EncoderPass(*model_, *st, ids, kTail);
  ASSERT_TRUE(enc.ok()) << enc.status();
  EXPECT_EQ(enc->tail_start, 0);
  auto got = DecoderReplay(*model_, *st, *enc);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->logits, want->logits);
  for (int32_t t : {7, 8, 9}) {
    auto a = model_->Decode(*mono, t);
    auto b = model_->Decode(*st, t);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->logits, b->logits);
    auto da = model_->Draft(*mono, t);
    auto db = model_->Draft(*st, t);
    ASSERT_TRUE(da.ok() && db.ok());
    EXPECT_EQ(da->logits, db->logits);
  }
}

TEST_P(StagesTest, LongPromptBoundedReplayKeepsGlobalKvExact) {
  auto mono = model_->NewSequence();
  auto want = model_->Prefill(*mono, prompt_, false);
  ASSERT_TRUE(want.ok());
  // Encoder in two chunks (a prefix hit would start at the second), then the decoder tail.
  auto st = model_->NewSequence();
  std::span<const int32_t> p(prompt_);
  auto e1 = EncoderPass(*model_, *st, p.subspan(0, 160), kTail);
  ASSERT_TRUE(e1.ok());
  auto e2 = EncoderPass(*model_, *st, p.subspan(160), kTail, &*e1);
  ASSERT_TRUE(e2.ok());
  EXPECT_EQ(e2->tail_start, P - kTail);
  EXPECT_EQ(e2->tail.rows, kTail);
  // Global KV, index keys and tails: exact.
  for (const auto& [l, src] : mono->sources) {
    EXPECT_EQ(st->sources[l].n, src.n) << l;
    EXPECT_EQ(st->sources[l].kv, src.kv) << l;
    EXPECT_EQ(st->sources[l].keys, src.keys) << l;
    EXPECT_EQ(st->sources[l].tail.Kv(), src.tail.Kv()) << l;
  }
  // Encoder rings: exact.
  const int split = DecoderSplitLayer(model_->config());
  for (int l = 0; l < split; ++l) EXPECT_EQ(st->swa[l], mono->swa[l]) << l;
  auto got = DecoderReplay(*model_, *st, *e2);
  ASSERT_TRUE(got.ok()) << got.status();
  // Decoder: approximate (windows truncated at the tail start), but close.
  const double r = RelRms(got->logits, want->logits);
  std::printf("bounded replay: last-row logits rel_rms %.4g vs monolithic\n", r);
  EXPECT_LT(r, 0.05);
  const int V = static_cast<int>(model_->config().vocab_size);
  EXPECT_EQ(
      std::max_element(got->logits.begin(), got->logits.end()) - got->logits.begin(),
      std::max_element(want->logits.begin(), want->logits.begin() + V) - want->logits.begin());
  auto a = model_->Decode(*mono, 99);
  auto b = model_->Decode(*st, 99);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LT(RelRms(b->logits, a->logits), 0.05);
}

TEST_P(StagesTest, EncoderReplayRebuildsRings) {
  auto mono = model_->NewSequence();
  ASSERT_TRUE(model_->Prefill(*mono, prompt_, false).ok());
  auto st = model_->NewSequence();
  *st = *mono;
  const int split = DecoderSplitLayer(model_->config());
  for (int l = 0; l < split; ++l) st->swa[l].Clear();  // zeros
  std::span<const int32_t> p(prompt_);
  const int64_t hd = model_->config().head_dim, W = model_->config().window_size;
  ASSERT_TRUE(EncoderReplay(*model_, *st, p.subspan(P - W), p.subspan(P - W - 3, 3)).ok());
  EXPECT_EQ(st->swa[0], mono->swa[0]);  // layer 0 KV depends on the token alone
  // Deeper rings are approximate (the replayed rows near the replay start see truncated windows);
  // the newest positions, whose windows are nearly complete, are close.
  for (int l = 1; l < split; ++l) {
    const std::vector<float> got = st->swa[l].ToVector(), want = mono->swa[l].ToVector();
    std::vector<float> got_new, want_new;
    for (int64_t q = P - 16; q < P; ++q) {
      got_new.insert(got_new.end(), got.begin() + (q % W) * hd, got.begin() + (q % W + 1) * hd);
      want_new.insert(want_new.end(), want.begin() + (q % W) * hd, want.begin() + (q % W + 1) * hd);
    }
    const double all = RelRms(got, want), newest = RelRms(got_new, want_new);
    std::printf("encoder replay: ring %d rel_rms %.3g (newest 16 positions %.3g)\n", l, all,
                newest);
    EXPECT_LT(newest, 0.1) << l;
    EXPECT_LT(all, 0.3) << l;
    if (l == 1) {
      // Position 300's layer-0 window (173..300) lies wholly inside the replay: exact. (FP8 ring
      // values turn tiny upstream differences into whole quanta, hence the few-% figures above.)
      EXPECT_TRUE(std::equal(got.begin() + ((P - 1) % W) * hd, got.begin() + ((P - 1) % W + 1) * hd,
                             want.begin() + ((P - 1) % W) * hd));
    }
  }
  for (const auto& [l, src] : mono->sources) EXPECT_EQ(st->sources[l].kv, src.kv);
}

TEST_P(StagesTest, DecodeStepBatchEqualsPerSequenceDecode) {
  std::span<const int32_t> p(prompt_);
  auto a = model_->NewSequence(), b = model_->NewSequence();
  auto ra = model_->NewSequence(), rb = model_->NewSequence();
  ASSERT_TRUE(model_->Prefill(*a, p.subspan(0, 40), false).ok());
  ASSERT_TRUE(model_->Prefill(*b, p.subspan(0, 90), false).ok());
  ASSERT_TRUE(model_->Prefill(*ra, p.subspan(0, 40), false).ok());
  ASSERT_TRUE(model_->Prefill(*rb, p.subspan(0, 90), false).ok());
  std::vector<SequenceState*> batch = {a.get(), b.get()};
  std::vector<std::vector<int32_t>> toks = {{1, 2, 3}, {4}};
  auto out = DecodeStep(*model_, batch, toks);
  ASSERT_TRUE(out.ok());
  ASSERT_EQ(out->size(), 2u);
  std::vector<float> want;
  for (int32_t t : toks[0]) {
    auto r = model_->Decode(*ra, t);
    want.insert(want.end(), r->logits.begin(), r->logits.end());
  }
  EXPECT_EQ((*out)[0].logits, want);
  EXPECT_EQ((*out)[1].logits, model_->Decode(*rb, 4)->logits);
}

// The batched step's indexer scores every sequence's rows in one call over one page table
// (Model::StepIndexer: each row over its own keys, as wide as the widest) and gathers their top-k
// in one (StepGather). Sequences of many lengths (top-k shorter than index_topk, candidate masks
// ending mid-block, stale index keys at odd and even positions) and of one or three rows, over
// several steps: each sequence's logits equal its own decode bit for bit.
TEST_P(StagesTest, ABatchedStepOfSequencesOfManyLengthsEqualsEachAlone) {
  std::span<const int32_t> p(prompt_);
  const std::vector<int64_t> lengths = {9, 20, 33, 47, 90, std::min<int64_t>(P, 150), 61, 1, 2};
  std::vector<std::unique_ptr<SequenceState>> batched, alone;
  std::vector<SequenceState*> batch;
  for (int64_t n : lengths) {
    batched.push_back(model_->NewSequence());
    alone.push_back(model_->NewSequence());
    ASSERT_TRUE(model_->Prefill(*batched.back(), p.subspan(0, n), false).ok());
    ASSERT_TRUE(model_->Prefill(*alone.back(), p.subspan(0, n), false).ok());
    batch.push_back(batched.back().get());
  }
  for (int step = 0; step < 4; ++step) {
    std::vector<std::vector<int32_t>> toks;
    for (size_t b = 0; b < lengths.size(); ++b) {
      const auto t = static_cast<int32_t>(3 + (step * 7 + b * 5) % 90);
      toks.push_back((b + step) % 3 == 0 ? std::vector<int32_t>{t, t + 1, t + 2}
                                         : std::vector<int32_t>{t});
    }
    auto out = DecodeStep(*model_, batch, toks);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), lengths.size());
    for (size_t b = 0; b < lengths.size(); ++b) {
      std::vector<float> want;
      for (int32_t t : toks[b]) {
        auto r = model_->Decode(*alone[b], t);
        ASSERT_TRUE(r.ok()) << r.status();
        want.insert(want.end(), r->logits.begin(), r->logits.end());
      }
      EXPECT_EQ((*out)[b].logits, want) << "step " << step << ", sequence of " << lengths[b];
    }
  }
}

// A decode step's batch shares one forward (Model::ExtendBatch). A sequence that fails inside it
// (here its own KV pool is full, so its next compressed block cannot be allocated) fails alone,
// with ResourceExhausted named for it; its neighbour's logits equal its own decode at every step.
TEST_P(StagesTest, ASequenceFailingInsideABatchedStepFailsAlone) {
  std::span<const int32_t> p(prompt_);
  auto full = std::make_shared<KvPool>(0, model_->kv_pool().seed());
  auto bad = model_->NewSequence(full);
  auto good = model_->NewSequence(), ref = model_->NewSequence();
  ASSERT_TRUE(model_->Prefill(*bad, p.subspan(0, 40), false).ok());
  ASSERT_TRUE(model_->Prefill(*good, p.subspan(0, 90), false).ok());
  ASSERT_TRUE(model_->Prefill(*ref, p.subspan(0, 90), false).ok());
  full->SetCapacity(full->stats().used_bytes);  // no room for one more block
  bool failed_once = false;
  for (int step = 0; step < 80 && !failed_once; ++step) {
    std::vector<SequenceState*> batch = {bad.get(), good.get()};
    std::vector<std::vector<int32_t>> toks = {{int32_t(5 + step % 7)}, {int32_t(9 + step % 5)}};
    std::vector<absl::Status> failed;
    auto out = DecodeStep(*model_, batch, toks, &failed);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE(failed[1].ok()) << failed[1];
    EXPECT_EQ((*out)[1].logits, model_->Decode(*ref, toks[1][0])->logits) << "step " << step;
    if (!failed[0].ok()) {
      failed_once = true;
      EXPECT_EQ(failed[0].code(), absl::StatusCode::kResourceExhausted) << failed[0];
      EXPECT_NE(failed[0].message().find("sequence 0"), std::string::npos) << failed[0];
      EXPECT_TRUE((*out)[0].logits.empty());
    }
  }
  EXPECT_TRUE(failed_once) << "the full pool never refused a block";
  // The neighbour goes on alone.
  std::vector<SequenceState*> one = {good.get()};
  std::vector<std::vector<int32_t>> tok = {{3}};
  auto out = DecodeStep(*model_, one, tok);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].logits, model_->Decode(*ref, 3)->logits);
}

}  // namespace
}  // namespace epd::model
