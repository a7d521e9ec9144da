// model/prefix_state.h on the nano model: an encoder state cut into G3 block values + a G2 SWA
// snapshot and assembled again is the same state bit for bit; an EncoderPass split into chunks at
// a block boundary is bit-identical to one pass (the property the encoder's store path relies
// on); wrong values are errors naming the field.
#include "model/prefix_state.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <span>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/sequence_state.h"
#include "model/stages.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using model::kPrefixBlockTokens;

class PrefixStateTest : public testing::NanoModelTest {
 protected:
  static std::vector<int32_t> Prompt(int n) {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = 10 + (i * 37 + i / 7) % 500;
    return p;
  }
  static int64_t Tail() { return model::DecoderTailRows(model_->config()); }
};

void ExpectSameState(const model::ModelConfig& c, const model::SequenceState& a,
                     const model::SequenceState& b) {
  const auto sa = model::SerializeState(c, a), sb = model::SerializeState(c, b);
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].name, sb[i].name);
    EXPECT_TRUE(sa[i].bytes == sb[i].bytes) << "segment " << sa[i].name << " differs";
  }
}

void ExpectSameOutput(const model::EncoderOutput& a, const model::EncoderOutput& b) {
  EXPECT_EQ(a.tail_start, b.tail_start);
  EXPECT_EQ(a.tail_ids, b.tail_ids);
  EXPECT_EQ(a.tail.rows, b.tail.rows);
  EXPECT_TRUE(a.tail.h == b.tail.h) << "tail residual differs";
  EXPECT_TRUE(a.tail.pre == b.tail.pre) << "tail pre-mix differs";
}

TEST_F(PrefixStateTest, ChunkedEncoderPassAtABlockBoundaryIsBitIdentical) {
  const auto& c = model_->config();
  for (int n : {300, 256, 213}) {
    const std::vector<int32_t> p = Prompt(n);
    auto one = model_->NewSequence();
    auto o1 = model::EncoderPass(*model_, *one, p, Tail());
    ASSERT_TRUE(o1.ok()) << o1.status();
    for (int64_t cut : {int64_t{64}, int64_t{128}, (n / 64) * int64_t{64}}) {
      if (cut >= n) continue;
      SCOPED_TRACE(::testing::Message() << "n=" << n << " cut=" << cut);
      auto two = model_->NewSequence();
      std::span<const int32_t> all(p);
      auto a = model::EncoderPass(*model_, *two, all.first(cut), Tail());
      ASSERT_TRUE(a.ok());
      auto b = model::EncoderPass(*model_, *two, all.subspan(cut), Tail(), &*a);
      ASSERT_TRUE(b.ok());
      ExpectSameState(c, *one, *two);
      ExpectSameOutput(*o1, *b);
    }
  }
}

TEST_F(PrefixStateTest, CutAndAssembleRoundTripIsBitExact) {
  const auto& c = model_->config();
  const std::vector<int32_t> p = Prompt(320);
  // Two chunks split at 192: blocks 0..2 cut after the first, the snapshot at 192.
  auto st = model_->NewSequence();
  std::span<const int32_t> all(p);
  auto a = model::EncoderPass(*model_, *st, all.first(192), Tail());
  ASSERT_TRUE(a.ok());
  auto blocks = model::CutPrefixBlocks(*model_, *st, p, 0, 3);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  ASSERT_EQ(blocks->size(), 3u);
  auto snap = model::CutSwaSnapshot(*model_, *st);
  ASSERT_TRUE(snap.ok()) << snap.status();
  auto back = model::AssemblePrefixState(*model_, *blocks, &*snap);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameState(c, *st, **back);

  // A prefix of the blocks (tails rebuilt from the compressor log) equals a pass that stopped
  // there; so does its continuation to the end.
  auto ref = model_->NewSequence();
  auto r1 = model::EncoderPass(*model_, *ref, all.first(128), Tail());
  ASSERT_TRUE(r1.ok());
  auto at128 = model::AssemblePrefixState(*model_, std::span(*blocks).first(2), nullptr);
  ASSERT_TRUE(at128.ok()) << at128.status();
  auto ref_blocks = model::CutPrefixBlocks(*model_, *ref, p, 0, 2);
  ASSERT_TRUE(ref_blocks.ok());
  EXPECT_EQ((*ref_blocks)[0], (*blocks)[0]);
  EXPECT_EQ((*ref_blocks)[1], (*blocks)[1]);
  auto ref_snap = model::CutSwaSnapshot(*model_, *ref);
  ASSERT_TRUE(ref_snap.ok());
  auto full128 = model::AssemblePrefixState(*model_, std::span(*blocks).first(2), &*ref_snap);
  ASSERT_TRUE(full128.ok());
  ExpectSameState(c, *ref, **full128);

  // Continue the assembled states to 320: the same as one pass over all 320 tokens. From 128
  // (N - P >= tail rows, the tail rule) the encoder output is the same too.
  auto mono = model_->NewSequence();
  auto m = model::EncoderPass(*model_, *mono, p, Tail());
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(model::EncoderPass(*model_, **back, all.subspan(192), Tail()).ok());
  ExpectSameState(c, *mono, **back);
  auto b = model::EncoderPass(*model_, **full128, all.subspan(128), Tail());
  ASSERT_TRUE(b.ok());
  ExpectSameState(c, *mono, **full128);
  ExpectSameOutput(*m, *b);

  // Blocks 3..4 cut at 320 continue the chain (first_block > 0).
  auto more = model::CutPrefixBlocks(*model_, *mono, p, 3, 5);
  ASSERT_TRUE(more.ok()) << more.status();
  std::vector<std::string> chain = *blocks;
  chain.insert(chain.end(), more->begin(), more->end());
  auto mono_snap = model::CutSwaSnapshot(*model_, *mono);
  ASSERT_TRUE(mono_snap.ok());
  auto at320 = model::AssemblePrefixState(*model_, chain, &*mono_snap);
  ASSERT_TRUE(at320.ok()) << at320.status();
  ExpectSameState(c, *mono, **at320);
}

// A state assembled from blocks without a snapshot, after PrefixReplay, is the state of a pass
// over [0, P) bit for bit: from 0 when P <= split x window, else from P - split x window with
// windows truncated there. A replay of one window only (the bounded replay DESIGN.md describes)
// is not: the rings of the later encoder layers depend on more than one window before P, and
// with them greedy outputs departed from the no-store run (docs/chaos.md).
// A store write takes the pool's blocks as they are: every G3 block value holds, for each KV
// source, the bytes of that source's pool blocks for the block's tokens verbatim (the store's
// 64-token block is the pool's block). A store read lands in pool blocks, and where an identical
// block is already in the pool (here: the state it was cut from) it shares that block.
// The compressor log keeps the tail rows before each multiple of the state's cut_block_tokens
// (and a call's last 64 rows), not every row: a state told of a 32-token store block cuts
// 32-token blocks whose tails equal a pass that stopped there; a state left at the default (64)
// refuses a 32-token cut inside a long pass with a message naming the log.
TEST_F(PrefixStateTest, TheLogKeepsTheTailsOfTheStatesCutBlock) {
  const std::vector<int32_t> p = Prompt(256);
  std::span<const int32_t> all(p);
  auto st = model_->NewSequence();
  st->cut_block_tokens = 32;
  ASSERT_TRUE(model::EncoderPass(*model_, *st, all.first(256), Tail()).ok());
  auto blocks = model::CutPrefixBlocks(*model_, *st, p, 0, 8, 32);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  ASSERT_EQ(blocks->size(), 8u);
  for (int64_t end : {int64_t{96}, int64_t{160}}) {
    auto ref = model_->NewSequence();
    ref->cut_block_tokens = 32;
    ASSERT_TRUE(model::EncoderPass(*model_, *ref, all.first(end), Tail()).ok());
    auto ref_blocks = model::CutPrefixBlocks(*model_, *ref, p, 0, end / 32, 32);
    ASSERT_TRUE(ref_blocks.ok()) << ref_blocks.status();
    EXPECT_EQ(ref_blocks->back(), (*blocks)[end / 32 - 1]) << end;
  }
  auto plain = model_->NewSequence();
  ASSERT_TRUE(model::EncoderPass(*model_, *plain, all.first(256), Tail()).ok());
  auto refused = model::CutPrefixBlocks(*model_, *plain, p, 0, 8, 32);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("compressor log"), std::string::npos)
      << refused.status();
}

TEST_F(PrefixStateTest, StoreBlocksAreThePoolBlocksBytes) {
  const std::vector<int32_t> p = Prompt(192);
  auto st = model_->NewSequence();
  auto a = model::EncoderPass(*model_, *st, p, Tail());
  ASSERT_TRUE(a.ok());
  auto blocks = model::CutPrefixBlocks(*model_, *st, p, 0, 3);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  int checked = 0;
  for (const auto& [l, src] : st->sources) {
    for (const model::KvRows* rows : {&src.kv, &src.keys}) {
      ASSERT_EQ(rows->rows_per_block() * std::max(1, src.ratio), kPrefixBlockTokens);
      for (size_t b = 0; b < 3; ++b) {
        const std::string bytes(reinterpret_cast<const char*>(rows->blocks()[b].data),
                                static_cast<size_t>(rows->rows_per_block() * rows->row_bytes()));
        EXPECT_NE((*blocks)[b].find(bytes), std::string::npos)
            << "source " << l << " block " << b << ": the pool block's bytes are not in the value";
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 3 * 2 * static_cast<int>(st->sources.size()));
  auto snap = model::CutSwaSnapshot(*model_, *st);
  ASSERT_TRUE(snap.ok()) << snap.status();
  const int64_t used = model_->kv_pool().stats().used_bytes;
  auto back = model::AssemblePrefixState(*model_, *blocks, &*snap);
  ASSERT_TRUE(back.ok()) << back.status();
  for (const auto& [l, src] : st->sources) {
    const auto& got = (*back)->sources.at(l);
    for (size_t b = 0; b < 3; ++b) {
      EXPECT_EQ(got.kv.blocks()[b].id, src.kv.blocks()[b].id) << "source " << l << " block " << b;
      EXPECT_EQ(got.keys.blocks()[b].id, src.keys.blocks()[b].id) << "source " << l;
    }
  }
  // Shared: no new global KV block held; the assembled state's own rings only.
  EXPECT_EQ(model_->kv_pool().stats().used_bytes, used + model_->FixedStateBytes());
}

TEST_F(PrefixStateTest, WithoutASnapshotTheReplayRebuildsTheEncoderRingsExactly) {
  const auto& c = model_->config();
  const int split = model::DecoderSplitLayer(c);
  const int64_t deep = int64_t{split} * c.window_size;
  const std::vector<int32_t> p = Prompt(static_cast<int>(deep + 2 * kPrefixBlockTokens));
  const std::span<const int32_t> all(p);
  for (int64_t P : {int64_t{256}, deep + 2 * kPrefixBlockTokens}) {
    SCOPED_TRACE(::testing::Message() << "P=" << P);
    auto st = model_->NewSequence();
    ASSERT_TRUE(model::EncoderPass(*model_, *st, all.first(P), Tail()).ok());
    auto blocks = model::CutPrefixBlocks(*model_, *st, p, 0, P / kPrefixBlockTokens);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    auto bare = model::AssemblePrefixState(*model_, *blocks, nullptr);
    ASSERT_TRUE(bare.ok());
    EXPECT_EQ(model::PrefixReplayTokens(c, P), std::min(P, deep));
    ASSERT_TRUE(model::PrefixReplay(*model_, **bare, p).ok());
    ExpectSameState(c, *st, **bare);

    // One window only: the first layer's ring is exact (embeddings feed it), the last encoder
    // layer's is not.
    auto shallow = model::AssemblePrefixState(*model_, *blocks, nullptr);
    ASSERT_TRUE(shallow.ok());
    const int64_t w = c.window_size;
    ASSERT_TRUE(model::EncoderReplay(*model_, **shallow, all.subspan(P - w, w),
                                     all.subspan(P - w - 3, 3))
                    .ok());
    EXPECT_TRUE((*shallow)->swa[0] == st->swa[0]);
    EXPECT_FALSE((*shallow)->swa[split - 1] == st->swa[split - 1]);
    // More than split x window tokens is refused (the replay stays bounded).
    if (P > deep) {
      EXPECT_FALSE(model::EncoderReplay(*model_, **shallow, all.subspan(P - deep - 1, deep + 1),
                                        all.subspan(P - deep - 4, 3))
                       .ok());
    }
  }
}

TEST_F(PrefixStateTest, WrongValuesAreErrorsNamingTheField) {
  const std::vector<int32_t> p = Prompt(192);
  auto st = model_->NewSequence();
  ASSERT_TRUE(model::EncoderPass(*model_, *st, p, Tail()).ok());
  auto blocks = model::CutPrefixBlocks(*model_, *st, p, 0, 3);
  ASSERT_TRUE(blocks.ok());
  auto snap = model::CutSwaSnapshot(*model_, *st);
  ASSERT_TRUE(snap.ok());
  // Blocks out of order: the header's block index disagrees.
  std::vector<std::string> swapped = {(*blocks)[1], (*blocks)[0], (*blocks)[2]};
  auto r = model::AssemblePrefixState(*model_, swapped, &*snap);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("block 0"), std::string::npos) << r.status();
  // A snapshot of another position.
  auto r2 = model::AssemblePrefixState(*model_, std::span(*blocks).first(2), &*snap);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("snapshot"), std::string::npos) << r2.status();
  // Another version, truncated bytes, a block value used as a snapshot.
  std::string v2 = (*blocks)[0];
  v2[4] = 9;
  auto r3 = model::AssemblePrefixState(*model_, std::vector<std::string>{v2}, nullptr);
  ASSERT_FALSE(r3.ok());
  EXPECT_NE(r3.status().message().find("version"), std::string::npos) << r3.status();
  std::string cut = (*blocks)[0].substr(0, (*blocks)[0].size() - 10);
  EXPECT_FALSE(model::AssemblePrefixState(*model_, std::vector<std::string>{cut}, nullptr).ok());
  EXPECT_FALSE(
      model::AssemblePrefixState(*model_, std::span(*blocks).first(1), &(*blocks)[0]).ok());
  // Cutting at a position that is not the state's, or past a compressor log.
  EXPECT_FALSE(model::CutPrefixBlocks(*model_, *st, p, 0, 2).ok());
  EXPECT_FALSE(model::CutPrefixBlocks(*model_, *st, std::span(p).first(100), 0, 3).ok());
  auto st2 = model_->NewSequence();
  std::span<const int32_t> all(p);
  ASSERT_TRUE(model::EncoderPass(*model_, *st2, all.first(64), Tail()).ok());
  ASSERT_TRUE(model::EncoderPass(*model_, *st2, all.subspan(64), Tail()).ok());
  EXPECT_FALSE(model::CutPrefixBlocks(*model_, *st2, p, 0, 3).ok());  // log starts at 64
  EXPECT_TRUE(model::CutPrefixBlocks(*model_, *st2, p, 1, 3).ok());
}

}  // namespace
}  // namespace epd
