// The G1 hot tier over the device (HBM) arena: byte-exact round trips, LRU eviction that demotes
// the evicted block's bytes, and a referenced block never evicted — the same properties the host
// arena has (tests/kvstore/g1_hot_tier_test.cc). On a machine without a GPU the arena must refuse
// with FailedPrecondition naming the cause (callers fall back to the host arena); the pool checks
// skip there, saying so.
#include "tests/gpu/kvstore_device_arena.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "kernels/cuda/cuda_device.h"
#include "kvstore/g1_hot_tier.h"
#include "tests/kvstore/test_util.h"

namespace epd::kvstore {
namespace {

using testing::Bytes;
using testing::Key;
using testing::Payload;

bool HaveGpu(std::string* why) { return epd::kernels::cuda::DeviceCount(why) > 0; }

TEST(DeviceArenaTest, WithoutAGpuTheArenaRefusesAndSaysWhy) {
  std::string why;
  if (HaveGpu(&why)) GTEST_SKIP() << "a GPU is present: " << epd::kernels::cuda::DeviceSummary();
  auto arena = MakeDeviceArena(1024, 4);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(arena.status().message().find("no CUDA device"), std::string_view::npos)
      << arena.status();
}

TEST(DeviceArenaTest, RejectsZeroSizes) {
  EXPECT_EQ(MakeDeviceArena(0, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeDeviceArena(1024, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceArenaTest, BlocksRoundTripThroughHbm) {
  std::string why;
  if (!HaveGpu(&why)) GTEST_SKIP() << "skipped: no GPU (" << why << ")";
  auto arena = MakeDeviceArena(4096, 8);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->kind(), ArenaKind::kDevice);
  for (uint32_t i = 0; i < 8; ++i) {
    const std::string v = Payload(i + 1, 1000 + 300 * i);
    ASSERT_TRUE((*arena)->CopyIn(i, Bytes(v)).ok());
  }
  for (uint32_t i = 0; i < 8; ++i) {
    const std::string want = Payload(i + 1, 1000 + 300 * i);
    std::string got(want.size(), '\0');
    ASSERT_TRUE(
        (*arena)
            ->CopyOut(i, std::span<uint8_t>(reinterpret_cast<uint8_t*>(got.data()), got.size()))
            .ok());
    EXPECT_EQ(got, want) << "block " << i;
  }
  const std::string big = Payload(9, 4097);
  EXPECT_EQ((*arena)->CopyIn(0, Bytes(big)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*arena)->CopyIn(8, Bytes(Payload(1, 10))).code(), absl::StatusCode::kOutOfRange);
}

TEST(DeviceArenaTest, G1PoolOnHbmEvictsLruDemotesBytesAndKeepsReferencedBlocks) {
  std::string why;
  if (!HaveGpu(&why)) GTEST_SKIP() << "skipped: no GPU (" << why << ")";
  auto arena = MakeDeviceArena(1024, 2);
  ASSERT_TRUE(arena.ok()) << arena.status();
  prometheus::Registry registry;
  KvMetrics metrics{registry};
  std::map<BlockHash, std::string> demoted;
  G1HotTier pool(std::move(*arena), metrics,
                 [&](const BlockHash& k, std::string bytes) { demoted[k] = std::move(bytes); });
  ASSERT_TRUE(pool.Put(Key(1), Bytes(Payload(1, 900))).ok());
  ASSERT_TRUE(pool.Put(Key(2), Bytes(Payload(2, 800))).ok());
  auto held = pool.Acquire(Key(2));  // block 2 is referenced: it must survive
  ASSERT_TRUE(held.has_value());
  ASSERT_TRUE(pool.Put(Key(3), Bytes(Payload(3, 700))).ok());  // evicts block 1 (LRU, free)
  EXPECT_FALSE(pool.Contains(Key(1)));
  ASSERT_EQ(demoted.count(Key(1)), 1u);
  EXPECT_EQ(demoted[Key(1)], Payload(1, 900));
  EXPECT_EQ(pool.Read(Key(2)).value(), Payload(2, 800));
  EXPECT_EQ(pool.Read(Key(3)).value(), Payload(3, 700));
  // Every page referenced or just written and referenced: a fourth put cannot evict block 2.
  auto held3 = pool.Acquire(Key(3));
  EXPECT_EQ(pool.Put(Key(4), Bytes(Payload(4, 10))).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.Read(Key(2)).value(), Payload(2, 800));
}

}  // namespace
}  // namespace epd::kvstore
