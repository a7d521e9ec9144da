#include "transfer/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/transfer/transfer_testing.h"
#include "tests/testing/handoff_layout.h"

namespace epd::transfer {
namespace {

using ::testing::HasSubstr;
using testing::NanoRequest;

int CountKind(const epd::v1::Manifest& m, epd::v1::SegmentKind kind) {
  int n = 0;
  for (const auto& s : m.segments()) n += s.kind() == kind;
  return n;
}

const epd::v1::Segment* FindSegment(const epd::v1::Manifest& m, epd::v1::SegmentKind kind,
                                    int layer) {
  for (const auto& s : m.segments())
    if (s.kind() == kind && s.layer_id() == layer) return &s;
  return nullptr;
}

TEST(Manifest, NanoDecodeHandoffHasEveryPieceOfState) {
  auto m =
      epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode), NanoRequest("r1", "fp"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_ENC_GLOBAL_KV), 2);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_DEC_GLOBAL_KV), 1);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_INDEX_K), 3);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_COMPRESSOR_STATE), 2);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_SWA_KV), 12);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_DSPARK_DRAFT_KV), 3);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_DSPARK_NOISE), 1);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_TARGET_HIDDEN), 3);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_ENGRAM_HISTORY), 1);
  EXPECT_EQ(m->segments_size(), 28);

  const auto* enc = FindSegment(*m, epd::v1::SEGMENT_ENC_GLOBAL_KV, 2);
  ASSERT_NE(enc, nullptr);
  EXPECT_EQ(enc->entry_count(), 500);  // 1000 tokens / m=2
  EXPECT_EQ(enc->byte_length(), 500u * 288);
  const auto* dec = FindSegment(*m, epd::v1::SEGMENT_DEC_GLOBAL_KV, 6);
  ASSERT_NE(dec, nullptr);
  EXPECT_EQ(dec->entry_count(), 1000);
  EXPECT_EQ(dec->pos_end(), 1000);
  const auto* swa = FindSegment(*m, epd::v1::SEGMENT_SWA_KV, 11);
  ASSERT_NE(swa, nullptr);
  EXPECT_EQ(swa->entry_count(), 128);
  EXPECT_EQ(swa->pos_begin(), 872);
  EXPECT_EQ(swa->byte_length(), 128u * 528);
  const auto* noise = FindSegment(*m, epd::v1::SEGMENT_DSPARK_NOISE, -1);
  ASSERT_NE(noise, nullptr);
  EXPECT_EQ(noise->entry_count(), 5);
  EXPECT_EQ(noise->pos_begin(), 1000);
  EXPECT_EQ(noise->pos_end(), 1005);
  EXPECT_NE(FindSegment(*m, epd::v1::SEGMENT_DSPARK_DRAFT_KV, 14), nullptr);
  EXPECT_NE(FindSegment(*m, epd::v1::SEGMENT_TARGET_HIDDEN, 9), nullptr);
  EXPECT_EQ(FindSegment(*m, epd::v1::SEGMENT_TARGET_HIDDEN, 9)->byte_length(), 256u * 2);
  EXPECT_EQ(TotalBytes(*m), 1743712u);
}

TEST(Manifest, DsparkOffCarriesNoDraftState) {
  epd::testing::HandoffLayout layout = epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode);
  layout.dspark = false;
  auto m = epd::testing::BuildExpectedManifest(layout, NanoRequest("r", "fp"));
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(m->dspark());
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_DSPARK_NOISE), 0);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_DSPARK_DRAFT_KV), 0);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_TARGET_HIDDEN), 0);
}

TEST(Manifest, OddPromptLeavesTheTailInCompressorState) {
  auto m = epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                 NanoRequest("r", "fp", 1001));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(FindSegment(*m, epd::v1::SEGMENT_ENC_GLOBAL_KV, 4)->entry_count(), 500);
  const auto* tail = FindSegment(*m, epd::v1::SEGMENT_COMPRESSOR_STATE, 4);
  EXPECT_EQ(tail->entry_count(), 1);
  EXPECT_EQ(tail->pos_begin(), 1000);
  EXPECT_EQ(tail->pos_end(), 1001);
  EXPECT_EQ(FindSegment(*m, epd::v1::SEGMENT_DEC_GLOBAL_KV, 6)->entry_count(), 1001);
}

TEST(Manifest, EncoderHandoffCarriesOnlyNewGlobalKvAndTheTail) {
  auto m = epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kEncoderToPrefill),
                                 NanoRequest("r", "fp", 1000, 512));
  ASSERT_TRUE(m.ok()) << m.status();
  const auto* enc = FindSegment(*m, epd::v1::SEGMENT_ENC_GLOBAL_KV, 2);
  EXPECT_EQ(enc->pos_begin(), 512);
  EXPECT_EQ(enc->entry_count(), 244);
  EXPECT_EQ(FindSegment(*m, epd::v1::SEGMENT_DEC_GLOBAL_KV, 6)->entry_count(), 488);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_SWA_KV), 6);  // encoder layers 0..5
  const auto* tail = FindSegment(*m, epd::v1::SEGMENT_ENC_OUTPUT_TAIL, 5);
  ASSERT_NE(tail, nullptr);
  EXPECT_EQ(tail->entry_count(), 128);
  EXPECT_EQ(tail->byte_length(), 128u * 4 * 256 * 2);
  EXPECT_EQ(CountKind(*m, epd::v1::SEGMENT_DSPARK_NOISE), 0);
  // A cached length that splits a ratio-2 group is impossible.
  EXPECT_FALSE(epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kEncoderToPrefill),
                                     NanoRequest("r", "fp", 1000, 511))
                   .ok());
  EXPECT_FALSE(epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kEncoderToPrefill),
                                     NanoRequest("r", "fp", 1000, 1001))
                   .ok());
}

TEST(Manifest, OfficialLayoutGives890BytesOfGlobalKvPerToken) {
  epd::testing::HandoffLayout l;
  l.num_layers = 40;
  l.first_decoder_layer = 20;
  l.sources = {{2, 2}, {8, 2}, {14, 2}, {20, 1}};
  l.hidden_size = 5120;
  auto m = epd::testing::BuildExpectedManifest(l, NanoRequest("r", "fp", 4096));
  ASSERT_TRUE(m.ok());
  uint64_t global = 0;
  for (const auto& s : m->segments())
    if (s.kind() == epd::v1::SEGMENT_ENC_GLOBAL_KV || s.kind() == epd::v1::SEGMENT_DEC_GLOBAL_KV ||
        s.kind() == epd::v1::SEGMENT_INDEX_K)
      global += s.byte_length();
  EXPECT_EQ(global, 890u * 4096);
  EXPECT_EQ(
      CountKind(*m, epd::v1::SEGMENT_SWA_KV) + CountKind(*m, epd::v1::SEGMENT_DSPARK_DRAFT_KV), 43);
}

// Found probing tests/fuzz/fuzz_handoff_manifest (corpus: regress-prompt-length-int64-max): a
// header of INT64_MAX tokens overflowed the DSpark noise segment's end position.
TEST(Manifest, AbsurdPromptLengthIsRefusedNotOverflowed) {
  for (const int64_t n : {INT64_MAX, (int64_t{1} << 40) + 1}) {
    auto m = epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                   {"r", "fp", n, 0});
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("exceeds the limit"));
  }
  EXPECT_TRUE(epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                    {"r", "fp", int64_t{1} << 40, 0})
                  .ok());
}

TEST(Manifest, IdenticalManifestsAgree) {
  auto m =
      epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode), NanoRequest("r", "fp"));
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(CompareManifests(*m, *m).has_value());
}

// Every numeric field of every segment, off by one in either direction, is caught and named.
TEST(Manifest, EveryOffByOneIsCaughtAndNamed) {
  auto expected =
      epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode), NanoRequest("r", "fp"));
  ASSERT_TRUE(expected.ok());
  const std::vector<std::string> fields = {"layer_id",    "pos_begin", "pos_end",
                                           "entry_count", "layout_id", "byte_length"};
  for (int i = 0; i < expected->segments_size(); ++i) {
    for (const std::string& field : fields) {
      for (int delta : {-1, 1}) {
        epd::v1::Manifest offered = *expected;
        auto* s = offered.mutable_segments(i);
        if (field == "layer_id") s->set_layer_id(s->layer_id() + delta);
        if (field == "pos_begin") s->set_pos_begin(s->pos_begin() + delta);
        if (field == "pos_end") s->set_pos_end(s->pos_end() + delta);
        if (field == "entry_count") s->set_entry_count(s->entry_count() + delta);
        if (field == "layout_id") s->set_layout_id(s->layout_id() + delta);
        if (field == "byte_length") s->set_byte_length(s->byte_length() + delta);
        auto mm = CompareManifests(*expected, offered);
        ASSERT_TRUE(mm.has_value()) << i << " " << field;
        EXPECT_EQ(mm->segment_index, i);
        EXPECT_EQ(mm->field, field);
        EXPECT_EQ(mm->segment_label, SegmentKindLabel(expected->segments(i).kind()));
        EXPECT_THAT(mm->message, HasSubstr(DescribeSegment(*expected, i)));
      }
    }
  }
}

TEST(Manifest, NamedOffByOnes) {
  const epd::testing::HandoffLayout layout = epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode);
  auto expected = epd::testing::BuildExpectedManifest(layout, NanoRequest("r", "fp"));
  ASSERT_TRUE(expected.ok());

  // 4 noise slots instead of 5: a sender configured with a 4-slot draft block.
  epd::testing::HandoffLayout four = layout;
  four.dspark_block_size = 4;
  auto offered = epd::testing::BuildExpectedManifest(four, NanoRequest("r", "fp"));
  auto mm = CompareManifests(*expected, *offered);
  ASSERT_TRUE(mm.has_value());
  EXPECT_EQ(mm->segment_label, "dspark_noise");
  EXPECT_THAT(mm->message, HasSubstr("dspark_noise"));
  EXPECT_THAT(mm->message, HasSubstr("expected 1005, got 1004"));

  // One SWA slot too few (window 127 at the sender).
  epd::testing::HandoffLayout short_ring = layout;
  short_ring.window = 127;
  mm = CompareManifests(*expected, *epd::testing::BuildExpectedManifest(short_ring, NanoRequest("r", "fp")));
  ASSERT_TRUE(mm.has_value());
  EXPECT_EQ(mm->segment_label, "swa_kv");
  EXPECT_THAT(mm->message, HasSubstr("swa_kv layer 0"));
  EXPECT_THAT(mm->message, HasSubstr("pos_begin expected 872, got 873"));

  // One token's global KV missing: the decoder source holds 999 entries.
  epd::v1::Manifest missing = *expected;
  for (auto& s : *missing.mutable_segments()) {
    if (s.kind() == epd::v1::SEGMENT_DEC_GLOBAL_KV) {
      s.set_entry_count(999);
      s.set_byte_length(999 * 288);
    }
  }
  mm = CompareManifests(*expected, missing);
  ASSERT_TRUE(mm.has_value());
  EXPECT_EQ(mm->field, "entry_count");
  EXPECT_THAT(mm->message, HasSubstr("dec_global_kv layer 6"));
  EXPECT_THAT(mm->message, HasSubstr("expected 1000, got 999"));

  // A whole segment missing, and header fields.
  epd::v1::Manifest fewer = *expected;
  fewer.mutable_segments()->RemoveLast();
  mm = CompareManifests(*expected, fewer);
  ASSERT_TRUE(mm.has_value());
  EXPECT_EQ(mm->field, "segment_count");
  EXPECT_THAT(mm->message, HasSubstr("engram_history"));
  epd::v1::Manifest other = *expected;
  other.set_cached_length(8);
  EXPECT_EQ(CompareManifests(*expected, other)->field, "cached_length");
  other = *expected;
  other.set_dspark(false);
  EXPECT_EQ(CompareManifests(*expected, other)->field, "dspark");
  other = *expected;
  other.set_config_fingerprint("other");
  EXPECT_EQ(CompareManifests(*expected, other)->field, "config_fingerprint");
}

}  // namespace
}  // namespace epd::transfer
