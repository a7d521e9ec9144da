// Prefix sharing in the decode stage's KV pool (model/kv_pool.h): eight sequences whose prompts
// share a 1K-token prefix, handed over as a prefill worker sends them and decoded together in one
// stage, hold the prefix's blocks once (blocks in use = shared prefix blocks + each sequence's
// own suffix blocks), and each produces the tokens it produces when run alone.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "decode_pool/decode_stage.h"
#include "model/kv_pool.h"
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"
#include "model/stages.h"
#include "tests/testing/nano_model.h"

namespace epd::decode_pool {
namespace {

class KvPoolDecodeTest : public testing::NanoModelTest {
 protected:
  struct Handoff {
    std::vector<int32_t> prompt;
    std::vector<model::StateSegment> segs;
    std::vector<float> logits;
  };
  // What a prefill worker sends: the bounded-replay prefill of the prompt (the E/P/D semantics),
  // computed in the prefill worker's own pool.
  static Handoff Prefill(std::vector<int32_t> prompt) {
    auto st = model_->NewSequence(std::make_shared<model::KvPool>());
    model::PrefillOptions bounded;
    bounded.decoder_tail_rows = model::DecoderTailRows(model_->config());
    auto pre = model_->Prefill(*st, prompt, false, bounded);
    EXPECT_TRUE(pre.ok()) << pre.status();
    if (!pre.ok()) return {};
    return {std::move(prompt), model::SerializeState(model_->config(), *st), pre->logits};
  }
  static void RunToEnd(DecodeStage& stage, std::vector<DecodeSequence*> batch) {
    for (int step = 0; step < 100; ++step) {
      bool live = false;
      for (DecodeSequence* s : batch) live |= !s->done;
      if (!live) return;
      ASSERT_TRUE(stage.Step(batch).ok());
    }
    FAIL() << "decode did not finish";
  }
};

TEST_F(KvPoolDecodeTest, EightSequencesShareA1KPrefixAndDecodeAsAlone) {
  const int64_t kPrefix = 1024, kSuffix = 64, kSeqs = 8;
  model::KvPool& pool = model_->kv_pool();
  ASSERT_EQ(pool.stats().used_bytes, 0);
  std::vector<int32_t> prefix(kPrefix);
  for (int64_t i = 0; i < kPrefix; ++i) prefix[i] = 3 + static_cast<int32_t>((i * 37) % 1500);
  // The hand-offs of a prefill worker that computed the common prefix once (its own pool) and
  // each prompt's suffix as a prefill chunk after it (the monolithic prefill's numerics).
  auto base = model_->NewSequence(std::make_shared<model::KvPool>());
  ASSERT_TRUE(model_->Prefill(*base, prefix, false).ok());
  std::vector<Handoff> hs;
  for (int64_t s = 0; s < kSeqs; ++s) {
    std::vector<int32_t> suffix;
    for (int64_t i = 0; i < kSuffix; ++i)
      suffix.push_back(3 + static_cast<int32_t>((i * 53 + s * 211 + 7) % 1500));
    auto st = std::make_unique<model::SequenceState>(*base);
    auto r = model_->Extend(*st, suffix, false, nullptr, model::Model::ExtendMode::kPrefillChunk);
    ASSERT_TRUE(r.ok()) << r.status();
    Handoff h{prefix, model::SerializeState(model_->config(), *st), r->logits};
    h.prompt.insert(h.prompt.end(), suffix.begin(), suffix.end());
    hs.push_back(std::move(h));
  }
  base.reset();
  model::SamplingParams params;  // greedy
  params.max_tokens = 24;
  DecodeStage stage(*model_);
  const int64_t block = model_->KvBlockBytes();
  const int64_t shared_blocks = kPrefix / model::kKvBlockTokens;  // 16 blocks per stream

  // All eight in one stage (one pool), decoded as one batch.
  std::vector<std::unique_ptr<DecodeSequence>> together;
  for (const Handoff& h : hs) {
    auto q = stage.Start(h.segs, h.logits, params, h.prompt);
    ASSERT_TRUE(q.ok()) << q.status();
    together.push_back(std::move(*q));
  }
  // Each state ends at 1088 = 17 full blocks: 16 shared + 1 of its own, per stream; and its own
  // packed SWA rings.
  const int64_t rings = model_->FixedStateBytes();
  EXPECT_EQ(pool.stats().used_bytes, block * (shared_blocks + kSeqs * 1) + kSeqs * rings);
  EXPECT_GE(pool.stats().shared_hits, (kSeqs - 1) * shared_blocks);
  std::vector<DecodeSequence*> batch;
  for (auto& q : together) batch.push_back(q.get());
  RunToEnd(stage, batch);
  // Blocks in use = the shared prefix's once + what each sequence holds beyond it.
  int64_t own = 0;
  for (auto& q : together) own += model_->KvBytesFor(q->state->pos) - shared_blocks * block + rings;
  EXPECT_EQ(pool.stats().used_bytes, shared_blocks * block + own);
  EXPECT_LT(pool.stats().used_bytes, kSeqs * (model_->KvBytesFor(kPrefix + kSuffix) + rings));
  std::vector<std::vector<int32_t>> outputs;
  for (auto& q : together) outputs.push_back(q->output);
  together.clear();
  EXPECT_EQ(pool.stats().used_bytes, 0);
  EXPECT_GT(pool.stats().cached_blocks, 0);  // the sealed blocks stay cached for reuse

  // One at a time: the same tokens.
  for (int64_t s = 0; s < kSeqs; ++s) {
    auto q = stage.Start(hs[s].segs, hs[s].logits, params, hs[s].prompt);
    ASSERT_TRUE(q.ok()) << q.status();
    RunToEnd(stage, {q->get()});
    EXPECT_EQ((*q)->output, outputs[s]) << "sequence " << s;
    EXPECT_EQ((*q)->output.size(), 24u) << "sequence " << s;
  }
}

// An n > 1 fork: copies of one state share every block (the partial last one too) until a copy
// writes into it, and each copy decodes as the original alone.
TEST_F(KvPoolDecodeTest, ForkedStatesShareBlocksCopyOnWrite) {
  std::vector<int32_t> prompt(300);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 5 + static_cast<int32_t>((i * 29) % 1400);
  auto st = model_->NewSequence();
  ASSERT_TRUE(model_->Prefill(*st, prompt, false).ok());
  const int64_t held = model_->kv_pool().stats().used_bytes;
  EXPECT_EQ(held, model_->KvBytesFor(300) + model_->FixedStateBytes());  // global KV + rings
  auto fork = std::make_unique<model::SequenceState>(*st);
  EXPECT_EQ(model_->kv_pool().stats().used_bytes, held);  // nothing copied
  auto a = model_->Decode(*st, 42);
  auto b = model_->Decode(*fork, 42);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->logits, b->logits);
  // Each wrote its partial last blocks and its rings: those (only) are now separate.
  EXPECT_GT(model_->kv_pool().stats().used_bytes, held);
  EXPECT_LT(model_->kv_pool().stats().used_bytes, 2 * held);
}

// The decode worker's n > 1 path: choices started from copies of one received state hold its
// blocks once, and each decodes exactly as a sequence started from the hand-off alone.
TEST_F(KvPoolDecodeTest, NChoicesFromOneHandoffShareItsBlocks) {
  std::vector<int32_t> prompt(200);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 7 + static_cast<int32_t>((i * 41) % 1300);
  const Handoff h = Prefill(prompt);
  ASSERT_FALSE(h.segs.empty());
  model::KvPool& pool = model_->kv_pool();
  const int64_t before = pool.stats().used_bytes;
  DecodeStage stage(*model_);
  model::SamplingParams params;
  params.max_tokens = 16;
  auto proto = model::DeserializeState(*model_, h.segs);
  ASSERT_TRUE(proto.ok()) << proto.status();
  std::vector<std::unique_ptr<DecodeSequence>> forks;
  for (int i = 0; i < 3; ++i) {
    params.temperature = i == 0 ? 0.f : 0.8f;
    params.seed = 11 + i;
    auto q = stage.StartWithState(std::make_unique<model::SequenceState>(**proto), h.logits, params,
                                  prompt);
    ASSERT_TRUE(q.ok()) << q.status();
    forks.push_back(std::move(*q));
  }
  // Held once (the rings too, until a choice steps).
  EXPECT_EQ(pool.stats().used_bytes - before, model_->KvBytesFor(200) + model_->FixedStateBytes());
  proto->reset();
  std::vector<DecodeSequence*> batch;
  for (auto& q : forks) batch.push_back(q.get());
  RunToEnd(stage, batch);
  // Choice 0 (greedy) equals the sequence started from the hand-off alone.
  params.temperature = 0.f;
  params.seed = 11;
  auto alone = stage.Start(h.segs, h.logits, params, prompt);
  ASSERT_TRUE(alone.ok()) << alone.status();
  RunToEnd(stage, {alone->get()});
  EXPECT_EQ(forks[0]->output, (*alone)->output);
}

}  // namespace
}  // namespace epd::decode_pool
