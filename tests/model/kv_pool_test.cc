// The paged, packed KV pool (model/kv_pool.h): blocks, reference counts, copy-on-write, sharing by
// content hash, the LRU cache of freed sealed blocks and capacity errors; a sequence's global KV
// held in it at exactly the packed bytes `epd kv-layout` accounts (StateByteAccounting).
#include "model/kv_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "kernels/format.h"
#include "model/model.h"
#include "model/sequence_state.h"
#include "tests/testing/nano_model.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;

// Rows the packed index-key format holds exactly (FP4 quantize-dequantized), distinct per `salt`.
std::vector<float> KeyRows(int64_t n, int64_t dim, int salt) {
  std::vector<float> v(n * dim);
  for (int64_t i = 0; i < n * dim; ++i)
    v[i] = static_cast<float>(((i * 7 + salt * 13) % 23) - 11) * 0.25f;
  for (int64_t r = 0; r < n; ++r) kf::Fp4IndexQuantDequantRow(v.data() + r * dim, dim);
  return v;
}

// The unpack every pool read goes through (kernels/format.cc, SIMD when the CPU has AVX2) gives
// the bits of the element-wise definition, RoundBf16(E2M1 value x scale), for every scale code
// (NaN ones included) and every code byte.
TEST(KvPoolTest, UnpackMatchesTheElementwiseDefinition) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  for (bool keys : {true, false}) {
    const int64_t dim = keys ? 128 : 512;
    const int block = keys ? 32 : 16;
    const int64_t row = keys ? kf::PackedIndexKeyBytes(dim) : kf::PackedKvEntryBytes(dim);
    std::vector<uint8_t> packed(row);
    std::vector<float> out(dim);
    for (int scale = 0; scale < 256; ++scale) {
      for (int64_t i = 0; i < dim / 2; ++i) packed[i] = static_cast<uint8_t>((i * 37 + scale) % 256);
      for (int64_t b = 0; b < dim / block; ++b)
        packed[dim / 2 + b] = static_cast<uint8_t>((scale + b * 61) % 256);
      if (keys) {
        kf::UnpackIndexKey(packed.data(), dim, out.data());
      } else {
        kf::UnpackKvEntry(packed.data(), dim, out.data());
      }
      for (int64_t i = 0; i < dim; ++i) {
        const uint8_t sc = packed[dim / 2 + i / block];
        const float s = keys ? kf::DecodeE8M0(sc) : kf::DecodeE4M3(sc);
        const uint8_t code = i % 2 == 0 ? packed[i / 2] & 0xf : packed[i / 2] >> 4;
        const float want = kf::RoundBf16(kf::DecodeE2M1(code) * s);
        ASSERT_EQ(bits(out[i]), bits(want)) << (keys ? "key" : "kv") << " scale " << int{sc}
                                            << " code " << int{code} << " at " << i;
      }
    }
  }
}

TEST(KvPoolTest, RowsRoundTripThroughPackedBlocks) {
  auto pool = std::make_shared<KvPool>();
  const int64_t dim = 128;
  KvRows rows(pool, KvRowFormat::kPackedKey, dim, /*ratio=*/2, /*stream=*/1);
  EXPECT_EQ(rows.rows_per_block(), 32);
  EXPECT_EQ(rows.row_bytes(), kf::PackedIndexKeyBytes(dim));
  const std::vector<float> x = KeyRows(70, dim, 1);
  ASSERT_TRUE(rows.Append(x.data(), 30).ok());
  ASSERT_TRUE(rows.Append(x.data() + 30 * dim, 40).ok());
  EXPECT_EQ(rows.rows(), 70);
  EXPECT_EQ(rows.blocks().size(), 3u);  // 32 + 32 + 6 rows
  EXPECT_EQ(pool->stats().used_bytes, 3 * 32 * rows.row_bytes());
  EXPECT_EQ(rows.ToVector(), x);
  // Gather in any order gives the same rows.
  const int32_t idx[3] = {69, 0, 33};
  std::vector<float> g(3 * dim);
  rows.Gather(idx, 3, g.data());
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(0, std::memcmp(g.data() + i * dim, x.data() + idx[i] * dim, dim * 4)) << i;
  // Truncate releases whole blocks only.
  rows.Truncate(33);
  EXPECT_EQ(rows.blocks().size(), 2u);
  rows.Truncate(0);
  EXPECT_EQ(pool->stats().used_bytes, 0);
}

TEST(KvPoolTest, CopiesShareBlocksAndCopyOnWrite) {
  auto pool = std::make_shared<KvPool>();
  const int64_t dim = 128;
  KvRows a(pool, KvRowFormat::kPackedKey, dim, 2, 1);
  const std::vector<float> x = KeyRows(40, dim, 2);
  ASSERT_TRUE(a.Append(x.data(), 40).ok());  // one full (sealed) block + 8 rows
  const int64_t block = 32 * a.row_bytes();
  KvRows b = a;  // a fork: shares both blocks
  EXPECT_EQ(pool->stats().used_blocks, 2);
  EXPECT_EQ(pool->refs(a.blocks()[1].id), 2);
  // b writes into the shared partial block: it gets its own copy; a is unchanged.
  const std::vector<float> y = KeyRows(1, dim, 3);
  ASSERT_TRUE(b.Append(y.data(), 1).ok());
  EXPECT_EQ(pool->stats().used_blocks, 3);
  EXPECT_EQ(pool->stats().used_bytes, 3 * block);
  EXPECT_EQ(a.blocks()[0].id, b.blocks()[0].id);
  EXPECT_NE(a.blocks()[1].id, b.blocks()[1].id);
  EXPECT_EQ(a.ToVector(), x);
  std::vector<float> xb = x;
  xb.insert(xb.end(), y.begin(), y.end());
  EXPECT_EQ(b.ToVector(), xb);
  // Rolling b back into its shared sealed block and writing again copies that block too.
  b.Truncate(20);
  ASSERT_TRUE(b.Append(y.data(), 1).ok());
  EXPECT_NE(a.blocks()[0].id, b.blocks()[0].id);
  EXPECT_EQ(a.ToVector(), x);
}

TEST(KvPoolTest, IdenticalFullBlocksAreHeldOnceAndCachedAfterRelease) {
  auto pool = std::make_shared<KvPool>();
  const int64_t dim = 128;
  const std::vector<float> x = KeyRows(64, dim, 4);
  auto a = std::make_unique<KvRows>(pool, KvRowFormat::kPackedKey, dim, 2, 1);
  KvRows b(pool, KvRowFormat::kPackedKey, dim, 2, 1);
  ASSERT_TRUE(a->Append(x.data(), 64).ok());
  ASSERT_TRUE(b.Append(x.data(), 64).ok());  // computed separately, same content
  EXPECT_EQ(a->blocks()[0].id, b.blocks()[0].id);
  EXPECT_EQ(a->blocks()[1].id, b.blocks()[1].id);
  EXPECT_EQ(pool->stats().used_blocks, 2);
  EXPECT_EQ(pool->stats().shared_hits, 2);
  // Another stream (or a different prefix) with the same bytes is not the same block: the hash
  // chain covers the stream and every earlier block.
  KvRows other_stream(pool, KvRowFormat::kPackedKey, dim, 2, 3);
  ASSERT_TRUE(other_stream.Append(x.data(), 32).ok());
  EXPECT_NE(other_stream.blocks()[0].id, a->blocks()[0].id);
  KvRows shifted(pool, KvRowFormat::kPackedKey, dim, 2, 1);
  ASSERT_TRUE(shifted.Append(x.data() + 32 * dim, 32).ok());
  EXPECT_NE(shifted.blocks()[0].id, a->blocks()[1].id);
  other_stream.Truncate(0);
  shifted.Truncate(0);
  // Released by everyone: the sealed blocks stay cached and come back for the same content.
  a.reset();
  b.Truncate(0);
  KvPool::Stats s = pool->stats();
  EXPECT_EQ(s.used_blocks, 0);
  EXPECT_EQ(s.cached_blocks, 4);
  KvRows c(pool, KvRowFormat::kPackedKey, dim, 2, 1);
  ASSERT_TRUE(c.Append(x.data(), 64).ok());
  s = pool->stats();
  EXPECT_EQ(s.used_blocks, 2);
  EXPECT_EQ(s.cached_blocks, 2);
  EXPECT_EQ(c.ToVector(), x);
}

TEST(KvPoolTest, CapacityEvictsCachedBlocksThenFails) {
  const int64_t dim = 128;
  const int64_t block = 32 * kf::PackedIndexKeyBytes(dim);
  auto pool = std::make_shared<KvPool>(3 * block);
  const std::vector<float> x = KeyRows(96, dim, 5);
  {
    KvRows a(pool, KvRowFormat::kPackedKey, dim, 2, 1);
    ASSERT_TRUE(a.Append(x.data(), 64).ok());
  }
  EXPECT_EQ(pool->stats().cached_blocks, 2);
  EXPECT_EQ(pool->available_bytes(), 3 * block);  // cached blocks are evictable
  KvRows b(pool, KvRowFormat::kPackedKey, dim, 2, 7);
  ASSERT_TRUE(b.Append(x.data(), 96).ok());  // evicts both cached blocks (LRU)
  KvPool::Stats s = pool->stats();
  EXPECT_EQ(s.evictions, 2);
  EXPECT_EQ(s.used_blocks, 3);
  EXPECT_EQ(s.cached_blocks, 0);
  const absl::Status full = b.Append(x.data(), 1);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("kv pool: full"), std::string::npos) << full;
  EXPECT_EQ(b.rows(), 96);  // nothing appended
  EXPECT_EQ(pool->stats().alloc_failures, 1);
}

TEST(KvPoolTest, Fp32RowsForTheUnquantizedBenchmarkSwitch) {
  auto pool = std::make_shared<KvPool>();
  KvRows r(pool, KvRowFormat::kF32, 4, 1, 0);
  const std::vector<float> v = {0.1f, -2.3f, 1e-7f, 5.f};
  ASSERT_TRUE(r.Append(v.data(), 1).ok());
  EXPECT_EQ(r.ToVector(), v);
  std::vector<uint8_t> packed;
  r.CopyPacked(0, 1, packed, KvRowFormat::kF32);
  EXPECT_EQ(packed.size(), 16u);
}

// The release config (no weights needed): a synthesized 4096-token state holds 890 B per token of
// global KV in the pool (MODEL.md §4: 3 x 178 + 356), the accounting figure of `epd kv-layout`.
TEST(KvPoolTest, ReleaseConfigHolds890BytesPerToken) {
  auto config =
      LoadModelConfig(testing::SourcePath("tests/data/configs/deepseek-v4.1-flash/config.json"));
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& c = *config;
  auto pool = std::make_shared<KvPool>();
  auto st = NewSequenceState(c, pool);
  const int64_t T = 4096;
  std::vector<float> kv(c.head_dim), key(c.index_head_dim);
  for (auto& [l, src] : st->sources) {
    for (int64_t j = 0; j < T / src.ratio; ++j) {
      for (int64_t e = 0; e < c.head_dim; ++e)
        kv[e] = static_cast<float>((j * 3 + e * 5 + l) % 17 - 8) * 0.125f;
      for (int64_t e = 0; e < c.index_head_dim; ++e)
        key[e] = static_cast<float>((j * 7 + e * 3 + l) % 13 - 6) * 0.25f;
      kf::Fp4KvQuantDequantRow(kv.data(), c.head_dim);
      kf::Fp4IndexQuantDequantRow(key.data(), c.index_head_dim);
      ASSERT_TRUE(src.kv.Append(kv.data(), 1).ok());
      ASSERT_TRUE(src.keys.Append(key.data(), 1).ok());
    }
    src.n = T / src.ratio;
  }
  int64_t global = -1;
  for (const auto& [name, bytes] : StateByteAccounting(c, T))
    if (name == "global_kv") global = bytes;
  EXPECT_EQ(global, 890 * T);
  EXPECT_EQ(pool->stats().used_bytes, global);
  EXPECT_EQ(KvBytesFor(c, T), global);
  EXPECT_EQ(KvBlockBytes(c), 890 * kKvBlockTokens);
}

class KvPoolModelTest : public testing::NanoModelTest {};

// A nano sequence holds its global KV in the pool at the packed bytes the accounting gives (whole
// blocks: at a multiple of the block the two agree exactly).
TEST_F(KvPoolModelTest, HeldBytesEqualTheAccounting) {
  const ModelConfig& c = model_->config();
  auto pool = std::make_shared<KvPool>();
  auto st = model_->NewSequence(pool);
  std::vector<int32_t> ids(256);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = 3 + static_cast<int32_t>((i * 31) % 1000);
  ASSERT_TRUE(model_->Prefill(*st, ids, false).ok());
  int64_t global = -1;
  for (const auto& [name, bytes] : StateByteAccounting(c, 256))
    if (name == "global_kv") global = bytes;
  EXPECT_EQ(pool->stats().used_bytes, global);
  EXPECT_EQ(model_->KvBytesFor(256), global);
  EXPECT_EQ(model_->KvBlockBytes() * 4, global);
  int64_t held = 0;
  for (const auto& [l, src] : st->sources) held += src.kv.held_bytes() + src.keys.held_bytes();
  EXPECT_EQ(held, global);
  // The hand-off's kv/keys segments are the blocks' bytes as they are.
  for (const StateSegment& seg : SerializeState(c, *st)) {
    if (seg.name.rfind("kv.", 0) != 0) continue;
    const int l = std::stoi(seg.name.substr(3));
    const KvRows& kv = st->sources.at(l).kv;
    ASSERT_EQ(seg.bytes.size(), static_cast<size_t>(kv.rows() * kv.row_bytes()));
    EXPECT_EQ(0, std::memcmp(seg.bytes.data(), kv.blocks()[0].data,
                             static_cast<size_t>(kv.rows_per_block() * kv.row_bytes())));
  }
  st.reset();
  EXPECT_EQ(pool->stats().used_bytes, 0);
}

}  // namespace
}  // namespace epd::model
