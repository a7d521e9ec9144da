// The paged, packed KV pool (model/kv_pool.h): blocks, reference counts, copy-on-write, sharing by
// content hash, the LRU cache of freed sealed blocks and capacity errors; a sequence's global KV
// held in it at exactly the packed bytes `epd kv-layout` accounts (StateByteAccounting), and so are
// its SWA rings (SwaRing: one packed block per ring, copy-on-write).
#include "model/kv_pool.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/memory_limit.h"
#include "kernels/backend.h"
#include "kernels/format.h"
#include "model/model.h"
#include "model/sequence_state.h"
#include "tests/testing/backend_buffer.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;

// Rows that `quant_dequant` leaves unchanged (each row quantize-dequantized once), distinct per
// `salt`: what a packed format holds exactly.
std::vector<float> ExactRows(int64_t n, int64_t dim, int salt, int mul, int mod, float step,
                             void (*quant_dequant)(float*, int64_t)) {
  std::vector<float> v(n * dim);
  for (int64_t i = 0; i < n * dim; ++i)
    v[i] = static_cast<float>(((i * mul + salt * 13) % mod) - mod / 2) * step;
  for (int64_t r = 0; r < n; ++r) quant_dequant(v.data() + r * dim, dim);
  return v;
}

// Rows the packed index-key format holds exactly (FP4 quantize-dequantized).
std::vector<float> KeyRows(int64_t n, int64_t dim, int salt) {
  return ExactRows(n, dim, salt, 7, 23, 0.25f, kf::Fp4IndexQuantDequantRow);
}

// Rows the packed SWA slot holds exactly (FP8-window quantize-dequantized).
std::vector<float> WindowRows(int64_t n, int64_t dim, int salt) {
  return ExactRows(n, dim, salt, 5, 29, 0.37f, kf::Fp8QuantDequantRow);
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
      for (int64_t i = 0; i < dim / 2; ++i)
        packed[i] = static_cast<uint8_t>((i * 37 + scale) % 256);
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

// The blocks live in slabs taken from the backend (Backend::Allocate, host memory on the CPU
// backend), carved into slots of the block size: every block pointer is a slot of a slab, a slab
// holds `slab_bytes` worth of slots, and a new slab comes only when every slot is taken.
TEST(KvPoolTest, BlocksAreSlotsOfTheBackendsSlabs) {
  auto backend = kernels::MakeCpuBackend();
  const int64_t dim = 128;
  const int64_t key_block = 32 * kf::PackedIndexKeyBytes(dim);
  const int64_t kv_block = 64 * kf::PackedKvEntryBytes(dim);
  auto pool = std::make_shared<KvPool>(0, 0, backend.get(), 4 * key_block);
  std::vector<std::pair<int64_t, int>> events;  // (slab id, +1 added / -1 freed)
  const int listener = pool->AddSlabListener(
      [&](const KvPool::Slab& s, bool added) { events.emplace_back(s.id, added ? 1 : -1); });
  KvRows keys(pool, KvRowFormat::kPackedKey, dim, 2, 1);
  KvRows kv(pool, KvRowFormat::kPackedKv, dim, 1, 0);
  const std::vector<float> x = KeyRows(32 * 6, dim, 11);
  ASSERT_TRUE(keys.Append(x.data(), 32 * 5 + 3).ok());  // 6 key blocks: 2 slabs of 4
  std::vector<float> e(dim * 70);
  for (size_t i = 0; i < e.size(); ++i) e[i] = static_cast<float>(static_cast<int>(i % 9) - 4);
  for (int64_t r = 0; r < 70; ++r) kf::Fp4KvQuantDequantRow(e.data() + r * dim, dim);
  ASSERT_TRUE(kv.Append(e.data(), 70).ok());  // 2 kv blocks: one slab of 1 slot each
  KvPool::Stats s = pool->stats();
  EXPECT_EQ(s.slabs, 4);
  EXPECT_EQ(s.slab_bytes, 2 * 4 * key_block + 2 * kv_block);
  EXPECT_EQ(s.free_slots, 2);
  int64_t listed = 0;
  pool->ForEachSlab([&](const KvPool::Slab& slab) {
    EXPECT_EQ(slab.kind, kernels::MemoryKind::kHost);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(slab.data) % 64, 0u);  // the backend's alignment
    listed += slab.bytes;
  });
  EXPECT_EQ(listed, s.slab_bytes);
  auto check = [&](const KvRows& rows, int64_t block_bytes) {
    for (const KvPool::Block& b : rows.blocks()) {
      const KvPool::Slab slab = pool->FindSlab(b.data, block_bytes);
      ASSERT_GE(slab.id, 0) << "block " << b.id << " is not inside a slab";
      EXPECT_EQ(slab.slot_bytes, block_bytes);
      EXPECT_EQ((b.data - slab.data) % block_bytes, 0) << "block " << b.id << " is not a slot";
    }
  };
  check(keys, key_block);
  check(kv, kv_block);
  EXPECT_EQ(keys.ToVector(), std::vector<float>(x.begin(), x.begin() + (32 * 5 + 3) * dim));
  EXPECT_EQ(kv.ToVector(), e);
  EXPECT_EQ(pool->FindSlab(x.data(), 1).id, -1);  // memory that is not the pool's
  ASSERT_EQ(events.size(), 4u);
  for (const auto& [id, sign] : events) EXPECT_EQ(sign, 1);
  // Released: the unsealed blocks' slots are free, the sealed ones' cached; the slabs stay until
  // Trim, which gives back the slabs with no block in them (the partial key block's and kv block's
  // slab stays if a cached block lives there).
  keys.Truncate(0);
  kv.Truncate(0);
  s = pool->stats();
  EXPECT_EQ(s.used_blocks, 0);
  EXPECT_EQ(s.cached_blocks, 6);  // 5 full key blocks + 1 full kv block
  EXPECT_EQ(s.slab_bytes, 2 * 4 * key_block + 2 * kv_block);
  EXPECT_EQ(pool->Trim(), kv_block);  // the partial kv block's slab: nothing in it
  EXPECT_EQ(pool->stats().slabs, 3);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events.back().second, -1);
  pool->SetCapacity(1);  // evicts every cached block
  pool->SetCapacity(0);
  EXPECT_EQ(pool->Trim(), 2 * 4 * key_block + kv_block);
  s = pool->stats();
  EXPECT_EQ(s.slabs, 0);
  EXPECT_EQ(s.slab_bytes, 0);
  EXPECT_EQ(s.free_slots, 0);
  pool->RemoveSlabListener(listener);
  // After a trim the pool grows again from the backend.
  ASSERT_TRUE(keys.Append(x.data(), 40).ok());
  check(keys, key_block);
  EXPECT_EQ(keys.ToVector(), std::vector<float>(x.begin(), x.begin() + 40 * dim));
  EXPECT_EQ(events.size(), 8u);  // the listener is gone: nothing more recorded
}

// Churn does not grow the pool: a pool released in full and refilled (other content, so nothing
// is shared) takes the same slots again; with a capacity, cached blocks are evicted into their
// slots rather than new slabs taken, and the slab memory stays at the capacity.
TEST(KvPoolTest, ChurnReusesTheSameSlots) {
  const int64_t dim = 128;
  const int64_t block = 32 * kf::PackedIndexKeyBytes(dim);
  for (const int64_t capacity : {int64_t{0}, 8 * block}) {
    SCOPED_TRACE(capacity);
    auto pool = std::make_shared<KvPool>(capacity, 0, nullptr, 8 * block);
    std::set<const uint8_t*> first;
    int64_t first_slab_bytes = 0;
    for (int round = 0; round < 6; ++round) {
      std::vector<KvRows> seqs;
      for (int q = 0; q < 6; ++q) {
        seqs.emplace_back(pool, KvRowFormat::kPackedKey, dim, 2, 1);
        // A full block when bounded (sealed: cached on release, then evicted); a partial one when
        // unbounded (freed at once: an unbounded cache would keep sealed ones, by design).
        const int64_t n = capacity > 0 ? 32 : 30;
        const std::vector<float> x = KeyRows(n, dim, 100 * round + q);
        ASSERT_TRUE(seqs.back().Append(x.data(), n).ok());
        ASSERT_EQ(seqs.back().ToVector(), x);
      }
      std::set<const uint8_t*> now;
      for (const KvRows& r : seqs)
        for (const KvPool::Block& b : r.blocks()) now.insert(b.data);
      EXPECT_EQ(now.size(), 6u);
      // Unbounded: one slab of 8 slots from the start. Bounded (a slab is at most 1/16 of the
      // capacity: one slot here): the slabs reach the capacity's 8 slots in round 1 (6 used + 6
      // cached do not fit; cached ones are evicted into their slots) and stay there.
      const int settle = capacity > 0 ? 1 : 0;
      if (round == settle) {
        first = now;
        first_slab_bytes = pool->stats().slab_bytes;
        EXPECT_EQ(first_slab_bytes, 8 * block);
        EXPECT_EQ(pool->stats().slabs, capacity > 0 ? 8 : 1);
      }
      if (round < settle) continue;
      if (capacity == 0) {
        for (const uint8_t* p : now) EXPECT_TRUE(first.count(p)) << "round " << round;
      }
      EXPECT_EQ(pool->stats().slab_bytes, first_slab_bytes) << "round " << round;
      EXPECT_LE(pool->stats().slab_bytes, std::max<int64_t>(capacity, 8 * block));
    }
  }
}

TEST(KvPoolTest, Fp32RowsForTheUnquantizedBenchmarkSwitch) {
  auto pool = std::make_shared<KvPool>();
  KvRows r(pool, KvRowFormat::kF32, 4, 1, 0);
  const std::vector<float> v = {0.1f, -2.3f, 1e-7f, 5.f};
  ASSERT_TRUE(r.Append(v.data(), 1).ok());
  EXPECT_EQ(r.ToVector(), v);
  std::vector<uint8_t> packed;
  ASSERT_TRUE(r.CopyPacked(0, 1, packed, KvRowFormat::kF32).ok());
  EXPECT_EQ(packed.size(), 16u);
}

TEST(SwaRingTest, PackedSlotsRoundTripBitForBit) {
  auto pool = std::make_shared<KvPool>();
  const int64_t W = 8, dim = 64, sb = kf::PackedSwaSlotBytes(dim);
  SwaRing ring(pool, W, dim);
  // Never written: no pool bytes, zeros, and the bytes of packed zero rows (what the float ring
  // serialized to).
  EXPECT_FALSE(ring.allocated());
  EXPECT_EQ(ring.held_bytes(), 0);
  EXPECT_EQ(ring.ToVector(), std::vector<float>(W * dim, 0.f));
  std::vector<uint8_t> zeros(W * sb), want(W * sb);
  ASSERT_TRUE(ring.CopyPacked(zeros.data()).ok());
  const std::vector<float> z(dim, 0.f);
  for (int64_t w = 0; w < W; ++w) kf::PackSwaSlot(z.data(), dim, want.data() + w * sb);
  EXPECT_EQ(zeros, want);
  EXPECT_EQ(pool->stats().used_bytes, 0);

  // Positions 3..13 (11 rows, window 8): the last 8 land in slots p % 8, as the float ring did.
  const std::vector<float> x = WindowRows(11, dim, 1);
  ASSERT_TRUE(ring.WritePositions(3, 11, x.data()).ok());
  EXPECT_EQ(ring.held_bytes(), W * sb);
  EXPECT_EQ(pool->stats().used_bytes, W * sb);
  std::vector<float> got(W * dim);
  ring.ReadWindow(got.data());
  for (int64_t i = 3; i < 11; ++i) {
    const int64_t slot = (3 + i) % W;
    EXPECT_EQ(0, std::memcmp(got.data() + slot * dim, x.data() + i * dim, dim * sizeof(float)))
        << "position " << 3 + i;
    std::vector<uint8_t> packed(sb);
    kf::PackSwaSlot(x.data() + i * dim, dim, packed.data());  // the hand-off's bytes
    EXPECT_EQ(0, std::memcmp(ring.block().data + slot * sb, packed.data(), sb));
    std::vector<float> one(dim);
    ring.ReadSlot(slot, one.data());
    EXPECT_EQ(0, std::memcmp(one.data(), x.data() + i * dim, dim * sizeof(float)));
  }
  ring.Clear();
  EXPECT_EQ(pool->stats().used_bytes, 0);
}

TEST(SwaRingTest, CopySharesTheBlockUntilOneSideWrites) {
  auto pool = std::make_shared<KvPool>();
  const int64_t W = 4, dim = 32, sb = kf::PackedSwaSlotBytes(dim);
  SwaRing a(pool, W, dim);
  const std::vector<float> x = WindowRows(W, dim, 2), y = WindowRows(1, dim, 3);
  ASSERT_TRUE(a.WritePositions(0, W, x.data()).ok());
  SwaRing b = a;
  EXPECT_EQ(b.block().id, a.block().id);
  EXPECT_EQ(pool->refs(a.block().id), 2);
  EXPECT_EQ(pool->stats().used_bytes, W * sb);  // held once
  ASSERT_TRUE(b.WriteSlot(1, y.data()).ok());   // copy on write
  EXPECT_NE(b.block().id, a.block().id);
  EXPECT_EQ(pool->refs(a.block().id), 1);
  EXPECT_EQ(pool->stats().used_bytes, 2 * W * sb);
  EXPECT_EQ(a.ToVector(), x);  // the other side is unchanged
  std::vector<float> want = x;
  std::copy(y.begin(), y.end(), want.begin() + dim);
  EXPECT_EQ(b.ToVector(), want);
  ASSERT_TRUE(a.WriteSlot(2, y.data()).ok());  // a holds the only reference: written in place
  EXPECT_EQ(pool->stats().used_bytes, 2 * W * sb);
  SwaRing moved = std::move(b);
  EXPECT_EQ(pool->stats().used_bytes, 2 * W * sb);
}

TEST(SwaRingTest, FullPoolFailsTheWriteAndLeavesTheRing) {
  const int64_t W = 4, dim = 32, sb = kf::PackedSwaSlotBytes(dim);
  auto pool = std::make_shared<KvPool>(W * sb);  // room for one ring
  SwaRing a(pool, W, dim), b(pool, W, dim);
  const std::vector<float> x = WindowRows(1, dim, 4);
  ASSERT_TRUE(a.WriteSlot(0, x.data()).ok());
  absl::Status s = b.WriteSlot(0, x.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_FALSE(b.allocated());
  SwaRing c = a;  // shared: its copy on write does not fit either
  EXPECT_EQ(c.WriteSlot(1, x.data()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c.block().id, a.block().id);
  EXPECT_EQ(c.ToVector(), a.ToVector());
}

// The release config's rings (total_layers(): every layer and the DSpark stages), written
// whole: the pool holds exactly `epd kv-layout`'s swa_bytes_per_sequence, 528 B per slot.
// What a pool of a device backend does, on a CPU backend labelled as one (report_device_memory)
// that refuses every operand it did not allocate (check_operands): the rows, rings, their page
// tables and zeros live in that backend's memory, the model's paths (AppendFrom, UnpackTo,
// GatherTo, WritePositionsFrom, ReadWindowTo) are one backend op each on it, the host paths
// stage through Upload / Download, and every read, fork, seal, share and truncation gives what a
// host pool gives.
TEST(KvPoolTest, ADevicePoolKeepsItsRowsInBackendMemoryAndReadsAsAHostPool) {
  std::map<std::string, int64_t> calls;
  auto checked = testing::MakeTestCpuBackend(
      {.report_device_memory = true, .check_operands = true, .op_calls = &calls});
  auto host = std::make_shared<KvPool>();
  auto dev = std::make_shared<KvPool>(0, 0, checked.get());
  EXPECT_TRUE(host->host_memory());
  EXPECT_FALSE(dev->host_memory());
  const int64_t dim = 128, W = 8, hd = 64;
  const std::vector<float> x = KeyRows(50, dim, 4), win = WindowRows(13, hd, 2);
  // Backend copies of the inputs, for the model's paths.
  kernels::Buffer x_dev = testing::OnBackend(*checked, x),
                  win_dev = testing::OnBackend(*checked, win);
  struct Seen {
    std::vector<float> rows, fork, gathered, window, fresh_window;
    std::vector<uint8_t> packed, ring;
    int64_t shared_hits = 0;
  };
  auto run = [&](const std::shared_ptr<KvPool>& pool) {
    Seen seen;
    const bool on_dev = !pool->host_memory();
    KvRows a(pool, KvRowFormat::kPackedKey, dim, /*ratio=*/4, /*stream=*/1);  // 16 rows a block
    // 20 rows from the host (staged on the device pool), 30 through the model's path.
    EXPECT_TRUE(a.Append(x.data(), 20).ok());
    if (on_dev) {
      EXPECT_TRUE(a.AppendFrom(x_dev.as<float>() + 20 * dim, 30).ok());
      // A host pointer is not backend memory: refused, nothing appended.
      absl::Status bad = a.AppendFrom(x.data(), 1);
      EXPECT_NE(bad.message().find("operand x"), std::string::npos) << bad;
    } else {
      EXPECT_TRUE(a.AppendFrom(x.data() + 20 * dim, 30).ok());
    }
    EXPECT_EQ(a.rows(), 50);
    seen.rows = a.ToVector();
    // A fork writes into the shared partial block (copy on write) after a rollback.
    KvRows b = a;
    b.Truncate(40);
    EXPECT_TRUE(b.Append(x.data(), 3).ok());
    seen.fork = b.ToVector();
    EXPECT_EQ(a.ToVector(), seen.rows);
    // The same first block in another stream-1 sequence is held once.
    KvRows c(pool, KvRowFormat::kPackedKey, dim, 4, 1);
    EXPECT_TRUE(c.Append(x.data(), 16).ok());
    EXPECT_EQ(c.blocks()[0].id, a.blocks()[0].id);
    seen.shared_hits = pool->stats().shared_hits;
    const int32_t idx[4] = {49, 0, 17, 17};
    seen.gathered.resize(4 * dim);
    a.Gather(idx, 4, seen.gathered.data());
    // Rows 5..34 lie in three blocks (partial, whole, partial): one Download on a device pool.
    const int64_t downloads = calls["Download"];
    EXPECT_TRUE(a.CopyPacked(5, 30, seen.packed, KvRowFormat::kPackedKey).ok());
    if (on_dev) {
      EXPECT_EQ(calls["Download"] - downloads, 1);
    }
    // A ring: positions 2..14 from the host path would be the same as through the model's path.
    SwaRing ring(pool, W, hd), fresh(pool, W, hd);
    if (on_dev) {
      EXPECT_TRUE(ring.WritePositionsFrom(2, 13, win_dev.as<float>()).ok());
    } else {
      EXPECT_TRUE(ring.WritePositions(2, 13, win.data()).ok());
    }
    seen.window.resize(W * hd);
    ring.ReadWindow(seen.window.data());
    seen.ring.resize(ring.ring_bytes());
    EXPECT_TRUE(ring.CopyPacked(seen.ring.data()).ok());
    // ReadWindowTo into backend memory: the window, and zeros for a ring never written.
    auto out = on_dev ? checked->Allocate(2 * W * hd * 4) : kernels::MakeCpuBackend()->Allocate(0);
    std::vector<float> host_out(2 * W * hd);
    float* o = on_dev ? out->as<float>() : host_out.data();
    EXPECT_TRUE(ring.ReadWindowTo(o).ok());
    EXPECT_TRUE(fresh.ReadWindowTo(o + W * hd).ok());
    EXPECT_FALSE(fresh.allocated());
    if (on_dev) {
      EXPECT_TRUE(checked->Download(*out, 0, 2 * W * hd * 4, host_out.data()).ok());
    }
    EXPECT_TRUE(std::equal(host_out.begin(), host_out.begin() + W * hd, seen.window.begin()));
    seen.fresh_window.assign(host_out.begin() + W * hd, host_out.end());
    int slabs = 0;
    pool->ForEachSlab([&](const KvPool::Slab& slab) {
      ++slabs;
      EXPECT_EQ(slab.kind, on_dev ? kernels::MemoryKind::kDevice : kernels::MemoryKind::kHost);
    });
    EXPECT_GT(slabs, 0);
    return seen;
  };
  const Seen want = run(host), got = run(dev);
  EXPECT_EQ(got.rows, want.rows);
  EXPECT_EQ(want.rows, x);
  EXPECT_EQ(got.fork, want.fork);
  EXPECT_EQ(got.gathered, want.gathered);
  EXPECT_EQ(got.packed, want.packed);
  EXPECT_EQ(got.window, want.window);
  EXPECT_EQ(got.ring, want.ring);
  EXPECT_EQ(got.fresh_window, std::vector<float>(W * hd, 0.f));
  EXPECT_EQ(want.fresh_window, got.fresh_window);
  EXPECT_EQ(got.shared_hits, want.shared_hits);
  EXPECT_EQ(got.shared_hits, 1);
}

// Sealing on a device pool brings no block down (SealPending): one DigestBlocks for all the
// call's full blocks (8 bytes each), then one BlocksEqual for the blocks whose hash is taken
// (4 bytes each). Two streams of one call that fill equal blocks share one (the second compared
// with the first, which registers first); a different block is not compared with anything; a
// host surface's block (a staged Append, a hand-off's AppendPacked of host bytes, whole or
// completed by a second call) is sealed the same way and shares the registered block.
TEST(KvPoolTest, ADevicePoolSealsItsBlocksWithoutReadingThem) {
  std::map<std::string, int64_t> calls;
  int64_t down = 0;
  auto checked = testing::MakeTestCpuBackend({.report_device_memory = true,
                                              .check_operands = true,
                                              .op_calls = &calls,
                                              .download_bytes = &down});
  auto pool = std::make_shared<KvPool>(0, 0, checked.get());
  const int64_t dim = 128;
  const std::vector<float> x = KeyRows(16, dim, 4), y = KeyRows(16, dim, 9);
  kernels::Buffer x_dev = testing::OnBackend(*checked, x), y_dev = testing::OnBackend(*checked, y);
  // ratio 4: 16 rows a block.
  KvRows a(pool, KvRowFormat::kPackedKey, dim, 4, 1), b(pool, KvRowFormat::kPackedKey, dim, 4, 1);
  KvRows c(pool, KvRowFormat::kPackedKey, dim, 4, 1);
  ASSERT_TRUE(a.AppendFrom(x_dev.as<float>(), 16).ok());
  ASSERT_TRUE(b.AppendFrom(x_dev.as<float>(), 16).ok());
  ASSERT_TRUE(c.AppendFrom(y_dev.as<float>(), 16).ok());
  ASSERT_TRUE(a.has_pending_seals() && b.has_pending_seals() && c.has_pending_seals());
  EXPECT_NE(a.blocks()[0].id, b.blocks()[0].id);
  calls.clear();
  down = 0;
  KvRows* streams[] = {&a, &b, &c};
  ASSERT_TRUE(SealPending(streams).ok());
  EXPECT_EQ(calls["DigestBlocks"], 1);
  EXPECT_EQ(calls["BlocksEqual"], 1);
  EXPECT_EQ(calls["Download"], 2);
  EXPECT_EQ(down, 3 * 8 + 1 * 4);
  EXPECT_EQ(b.blocks()[0].id, a.blocks()[0].id);
  EXPECT_NE(c.blocks()[0].id, a.blocks()[0].id);
  EXPECT_TRUE(pool->sealed(a.blocks()[0].id));
  EXPECT_TRUE(pool->sealed(c.blocks()[0].id));
  EXPECT_EQ(pool->stats().shared_hits, 1);
  EXPECT_EQ(b.ToVector(), x);
  EXPECT_EQ(c.ToVector(), y);
  // A host surface's rows, staged and sealed through the same path: a registered hit.
  KvRows d(pool, KvRowFormat::kPackedKey, dim, 4, 1);
  ASSERT_TRUE(d.Append(y.data(), 16).ok());
  EXPECT_EQ(d.blocks()[0].id, c.blocks()[0].id);
  // A whole block of host bytes (a hand-off's): digested and compared on the backend, nothing of
  // it read back.
  std::vector<uint8_t> packed;
  ASSERT_TRUE(a.CopyPacked(0, 16, packed, KvRowFormat::kPackedKey).ok());
  KvRows e(pool, KvRowFormat::kPackedKey, dim, 4, 1);
  calls.clear();
  down = 0;
  ASSERT_TRUE(e.AppendPacked(packed.data(), 16).ok());
  EXPECT_EQ(e.blocks()[0].id, a.blocks()[0].id);
  EXPECT_EQ(pool->stats().shared_hits, 3);
  EXPECT_EQ(calls["DigestBlocks"], 1);
  EXPECT_EQ(down, 8 + 4);
  // A block completed by its second part of host bytes is sealed on the backend, without a read.
  KvRows f(pool, KvRowFormat::kPackedKey, dim, 4, 1);
  ASSERT_TRUE(f.AppendPacked(packed.data(), 8).ok());
  calls.clear();
  down = 0;
  ASSERT_TRUE(f.AppendPacked(packed.data() + 8 * (packed.size() / 16), 8).ok());
  EXPECT_EQ(f.blocks()[0].id, a.blocks()[0].id);
  EXPECT_EQ(calls["DigestBlocks"], 1);
  EXPECT_EQ(down, 8 + 4);
  EXPECT_EQ(f.ToVector(), x);
}

// ReadBlocks on a device pool: ranges of blocks (any offset) in one CopyBlocks and one Download
// per 16 MiB of staging, a range split across two fills, the bytes as a host read gives them;
// WriteBlocks the same way back (one Upload of the bytes and one CopyBlocks a fill).
TEST(KvPoolTest, ReadBlocksAndWriteBlocksMoveRangesThroughOneStagingBuffer) {
  std::map<std::string, int64_t> calls;
  int64_t down = 0;
  auto backend = testing::MakeTestCpuBackend({.report_device_memory = true,
                                              .check_operands = true,
                                              .op_calls = &calls,
                                              .download_bytes = &down});
  KvPool pool(0, 0, backend.get());
  const int64_t block = int64_t{3} << 20;  // 3 MiB blocks; 7 ranges of ~3 MiB: 2 fills
  std::vector<KvPool::Block> blocks(7);
  std::vector<KvPool::BlockRange> reads;
  std::vector<uint8_t> want;
  for (size_t i = 0; i < blocks.size(); ++i) {
    ASSERT_TRUE(pool.Allocate(block, &blocks[i]).ok());
    std::vector<uint8_t> bytes(static_cast<size_t>(block));
    for (size_t j = 0; j < bytes.size(); ++j) bytes[j] = static_cast<uint8_t>(j * 31 + i * 7);
    ASSERT_TRUE(pool.Write(blocks[i], 0, bytes.data(), block).ok());
    const int64_t offset = static_cast<int64_t>(i) * 1000;
    reads.push_back({blocks[i], block - offset - 5, offset});
    want.insert(want.end(), bytes.begin() + offset, bytes.end() - 5);
  }
  calls.clear();
  std::vector<uint8_t> got(want.size(), 0);
  ASSERT_TRUE(pool.ReadBlocks(reads, got.data()).ok());
  EXPECT_EQ(got, want);
  EXPECT_EQ(calls["Download"], 2);  // ~21 MiB through a 16 MiB staging buffer
  EXPECT_EQ(calls["CopyBlocks"], 2);
  EXPECT_EQ(calls["Copy"], 0);
  EXPECT_EQ(down, static_cast<int64_t>(want.size()));
  // The same ranges of fresh blocks written from the host bytes, then read back.
  std::vector<KvPool::Block> fresh(blocks.size());
  std::vector<KvPool::BlockRange> writes = reads;
  for (size_t i = 0; i < fresh.size(); ++i) {
    ASSERT_TRUE(pool.Allocate(block, &fresh[i]).ok());
    writes[i].block = fresh[i];
  }
  calls.clear();
  ASSERT_TRUE(pool.WriteBlocks(writes, want.data()).ok());
  EXPECT_EQ(calls["CopyBlocks"], 2);
  EXPECT_EQ(calls["Upload"], 4);  // per fill: the bytes and the copy's table
  std::vector<uint8_t> back(want.size(), 0);
  ASSERT_TRUE(pool.ReadBlocks(writes, back.data()).ok());
  EXPECT_EQ(back, want);
  for (const KvPool::Block& b : blocks) pool.Unref(b.id);
  for (const KvPool::Block& b : fresh) pool.Unref(b.id);
}

// A received hand-off (AppendPacked of host bytes on a device pool) makes the same calls for any
// number of blocks: one Upload of its bytes and one CopyBlocks (before: one Upload a block), then
// the seal's. The rows read back as sent.
TEST(KvPoolTest, AReceivedHandOffsCallsDoNotGrowWithItsBlocks) {
  std::map<std::string, int64_t> calls;
  auto backend = testing::MakeTestCpuBackend(
      {.report_device_memory = true, .check_operands = true, .op_calls = &calls});
  auto pool = std::make_shared<KvPool>(0, 0, backend.get());
  const int64_t dim = 128;
  auto receive = [&](int64_t rows) {
    const std::vector<float> x = KeyRows(rows, dim, static_cast<int>(rows));
    KvRows sent(pool, KvRowFormat::kPackedKey, dim, 4, 1);  // 16 rows a block
    EXPECT_TRUE(sent.Append(x.data(), rows).ok());
    std::vector<uint8_t> packed;
    EXPECT_TRUE(sent.CopyPacked(0, rows, packed, KvRowFormat::kPackedKey).ok());
    KvRows got(pool, KvRowFormat::kPackedKey, dim, 4, 2);  // another stream: no shared blocks
    calls.clear();
    EXPECT_TRUE(got.AppendPacked(packed.data(), rows).ok());
    std::map<std::string, int64_t> seen = calls;
    EXPECT_EQ(got.ToVector(), sent.ToVector());
    EXPECT_EQ(seen["CopyBlocks"], 1);
    EXPECT_EQ(seen["Copy"], 0);
    return seen;
  };
  const std::map<std::string, int64_t> few = receive(40), many = receive(400);  // 3 and 25 blocks
  EXPECT_EQ(few, many);
  EXPECT_LE(many.at("Upload"), 4) << "the bytes, the copy's table, the seal's tables";
}

// Seal on a device pool takes the caller's comparison: equal shares the registered block, unequal
// (a hash collision) or no comparison at all (the bytes were not read) keeps the caller's block.
TEST(KvPoolTest, ADevicePoolSharesABlockOnlyOnTheCallersComparison) {
  auto backend = testing::MakeTestCpuBackend({.report_device_memory = true});
  KvPool pool(0, 0, backend.get());
  KvPool::Block x, y;
  ASSERT_TRUE(pool.Allocate(256, &x).ok());
  ASSERT_TRUE(pool.Allocate(256, &y).ok());
  EXPECT_EQ(pool.Seal(x, 42).id, x.id);  // nothing under 42 yet: x registers
  EXPECT_TRUE(pool.sealed(x.id));
  EXPECT_EQ(pool.Seal(y, 42).id, y.id);
  EXPECT_EQ(pool.Seal(y, 42, {x.id, false}).id, y.id);
  EXPECT_FALSE(pool.sealed(y.id));
  EXPECT_EQ(pool.stats().shared_hits, 0);
  const KvPool::Block got = pool.Seal(y, 42, {x.id, true});
  EXPECT_EQ(got.id, x.id);  // y's reference moved to x
  EXPECT_EQ(pool.refs(x.id), 2);
  EXPECT_EQ(pool.stats().shared_hits, 1);
  pool.Unref(x.id);
  pool.Unref(x.id);
}

// A worker's default pool capacity: from the device's free memory on a device backend (less the
// scratch reserve and a tenth), else a quarter of the host's memory.
TEST(KvPoolTest, TheDefaultCapacityComesFromTheBackendsMemory) {
  const int64_t host_quarter = common::UsableMemoryBytes() / 4;  // the host's, or the cgroup's
  auto host = kernels::MakeCpuBackend();
  EXPECT_EQ(DefaultKvPoolCapacity(*host, 256 << 20), host_quarter);
  const int64_t free = int64_t{100} << 30, reserve = int64_t{256} << 20;
  auto device =
      testing::MakeTestCpuBackend({.report_device_memory = true, .free_memory_bytes = free});
  EXPECT_EQ(DefaultKvPoolCapacity(*device, reserve), (free - reserve) / 10 * 9);
  auto nearly_full =
      testing::MakeTestCpuBackend({.report_device_memory = true, .free_memory_bytes = 1000});
  EXPECT_EQ(DefaultKvPoolCapacity(*nearly_full, reserve), 1);  // bounded, never 0 (unbounded)
  auto unknown = testing::MakeTestCpuBackend({.report_device_memory = true});
  EXPECT_EQ(DefaultKvPoolCapacity(*unknown, reserve), host_quarter);
}

TEST(KvPoolTest, ReleaseConfigRingsHoldThePackedSlotBytes) {
  auto config =
      LoadModelConfig(testing::SourcePath("tests/data/configs/deepseek-v4.1-flash/config.json"));
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& c = *config;
  auto pool = std::make_shared<KvPool>();
  auto st = NewSequenceState(c, pool);
  ASSERT_EQ(st->swa.size(), static_cast<size_t>(c.total_layers()));
  const std::vector<float> x = WindowRows(c.window_size, c.head_dim, 5);
  for (SwaRing& r : st->swa) ASSERT_TRUE(r.WritePositions(0, c.window_size, x.data()).ok());
  int64_t swa = -1;
  for (const auto& [name, bytes] : StateByteAccounting(c, 4096))
    if (name == "swa") swa = bytes;
  EXPECT_EQ(kf::PackedSwaSlotBytes(c.head_dim), 528);
  EXPECT_EQ(swa, int64_t{c.total_layers()} * c.window_size * 528);
  EXPECT_EQ(SwaRingBytes(c), swa);
  EXPECT_EQ(pool->stats().used_bytes, swa);
  EXPECT_EQ(st->swa.back().ToVector(), x);
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
  int64_t global = -1, swa = -1, tails = -1;
  for (const auto& [name, bytes] : StateByteAccounting(c, 256)) {
    if (name == "global_kv") global = bytes;
    if (name == "swa") swa = bytes;
    if (name == "compressor_tails") tails = bytes;
  }
  // Global KV + every layer's packed ring (the prefill seeds the DSpark stages' rings too) + the
  // compressor tails.
  EXPECT_GT(tails, 0);
  EXPECT_EQ(pool->stats().used_bytes, global + swa + tails);
  EXPECT_EQ(CompressorTailBytes(c), tails);
  EXPECT_EQ(model_->KvBytesFor(256), global);
  EXPECT_EQ(model_->KvBlockBytes() * 4, global);
  EXPECT_EQ(model_->SwaRingBytes(), swa);
  EXPECT_EQ(model_->FixedStateBytes(), swa + tails);
  int64_t held = 0, rings = 0;
  for (const auto& [l, src] : st->sources) held += src.kv.held_bytes() + src.keys.held_bytes();
  for (const SwaRing& r : st->swa) rings += r.held_bytes();
  EXPECT_EQ(held, global);
  EXPECT_EQ(rings, swa);
  // The hand-off's swa segments are the rings' blocks as they are.
  for (const StateSegment& seg : SerializeState(c, *st)) {
    if (seg.name.rfind("swa.", 0) != 0) continue;
    const SwaRing& r = st->swa.at(std::stoi(seg.name.substr(4)));
    ASSERT_EQ(seg.bytes.size(), static_cast<size_t>(r.ring_bytes()));
    EXPECT_EQ(0, std::memcmp(seg.bytes.data(), r.block().data, seg.bytes.size())) << seg.name;
  }
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

// A copied state (n > 1) shares its rings' blocks with the original until one side steps; the
// step copies them (copy-on-write), and both sides then compute what they would alone.
TEST_F(KvPoolModelTest, CopiedStateSharesItsRingsUntilOneSideSteps) {
  auto pool = std::make_shared<KvPool>();
  auto a = model_->NewSequence(pool);
  std::vector<int32_t> ids(100);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = 5 + static_cast<int32_t>((i * 17) % 900);
  ASSERT_TRUE(model_->Prefill(*a, ids, false).ok());
  const int64_t before = pool->stats().used_bytes;
  const std::vector<float> ring0 = a->swa[0].ToVector();
  auto b = std::make_unique<SequenceState>(*a);
  EXPECT_EQ(pool->stats().used_bytes, before);  // the copy holds nothing of its own
  for (size_t l = 0; l < a->swa.size(); ++l) {
    ASSERT_TRUE(a->swa[l].allocated()) << l;
    EXPECT_EQ(a->swa[l].block().id, b->swa[l].block().id) << l;
  }
  auto rb = model_->Decode(*b, 42);
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_GE(pool->stats().used_bytes, before + model_->SwaRingBytes());
  for (size_t l = 0; l < a->swa.size(); ++l)
    EXPECT_NE(a->swa[l].block().id, b->swa[l].block().id) << l;
  EXPECT_EQ(a->swa[0].ToVector(), ring0);  // the original's rings are untouched
  auto ra = model_->Decode(*a, 42);
  ASSERT_TRUE(ra.ok()) << ra.status();
  EXPECT_EQ(ra->logits, rb->logits);
  for (size_t l = 0; l < a->swa.size(); ++l) EXPECT_EQ(a->swa[l], b->swa[l]) << l;
  // And both equal a state that never shared: prefill + the same decode on its own.
  auto alone = model_->NewSequence(pool);
  ASSERT_TRUE(model_->Prefill(*alone, ids, false).ok());
  auto r = model_->Decode(*alone, 42);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->logits, ra->logits);
  a.reset();
  b.reset();
  alone.reset();
  EXPECT_EQ(pool->stats().used_bytes, 0);
}

}  // namespace
}  // namespace epd::model
