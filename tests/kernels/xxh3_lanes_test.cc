// kernels/xxh3_lanes.h (the CUDA backend's XXH3-64, compiled here for the host) against libxxhash,
// bit for bit, over every length class of the algorithm and the pool's block sizes.
#include "kernels/xxh3_lanes.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <random>
#include <vector>

namespace epd::kernels {
namespace {

constexpr uint8_t kSecret[xxh3::kSecretBytes] = EPD_XXH3_DEFAULT_SECRET;

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(Xxh3LanesTest, EveryLengthUpToFourBlocksEqualsTheLibrary) {
  // 0 (empty), 1-3, 4-8, 9-16, 17-128, 129-240, then the long path: one stripe short of a block,
  // exactly one, two and three blocks (the last block left to the end), and a partial last stripe.
  std::mt19937_64 rng(7);
  const std::vector<uint8_t> data = RandomBytes(rng, 4 * xxh3::kBlock + 3);
  for (size_t len = 0; len <= data.size(); ++len) {
    // Read from an odd offset too: the device reads pool blocks at 64-byte alignment, but the
    // function must not depend on it.
    ASSERT_EQ(xxh3::Digest(data.data(), len, kSecret), XXH3_64bits(data.data(), len))
        << "length " << len;
    if (len + 1 <= data.size()) {
      ASSERT_EQ(xxh3::Digest(data.data() + 1, len, kSecret), XXH3_64bits(data.data() + 1, len))
          << "length " << len << " at offset 1";
    }
  }
}

TEST(Xxh3LanesTest, PoolBlockSizesEqualTheLibrary) {
  // 64-row blocks of the nano and release rows (packed KV and SWA slots), and a few odd sizes.
  std::mt19937_64 rng(11);
  for (size_t len : {size_t{64 * 280}, size_t{64 * 528}, size_t{64 * 890}, size_t{57'344},
                     size_t{100'003}, size_t{1 << 20}}) {
    const std::vector<uint8_t> data = RandomBytes(rng, len);
    EXPECT_EQ(xxh3::Digest(data.data(), len, kSecret), XXH3_64bits(data.data(), len))
        << "length " << len;
  }
}

TEST(Xxh3LanesTest, TheLanesMeetOnlyInTheMerge) {
  // The kernel computes each lane in its own thread: the lanes' accumulators, merged, are the
  // digest, and changing one byte of a stripe changes exactly the lanes that read it (its own and
  // its pair), which is what lets eight threads work on one input without talking.
  std::mt19937_64 rng(13);
  std::vector<uint8_t> data = RandomBytes(rng, 3000);
  uint64_t before[xxh3::kLanes];
  for (int lane = 0; lane < xxh3::kLanes; ++lane) {
    before[lane] = xxh3::LongLane(data.data(), data.size(), kSecret, lane);
  }
  EXPECT_EQ(xxh3::MergeLanes(before, data.size(), kSecret), XXH3_64bits(data.data(), data.size()));
  data[64 * 3 + 8 * 5 + 2] ^= 1;  // lane 5's word of stripe 3
  for (int lane = 0; lane < xxh3::kLanes; ++lane) {
    const uint64_t after = xxh3::LongLane(data.data(), data.size(), kSecret, lane);
    if (lane == 5 || lane == 4) {
      EXPECT_NE(after, before[lane]) << "lane " << lane;
    } else {
      EXPECT_EQ(after, before[lane]) << "lane " << lane;
    }
  }
}

}  // namespace
}  // namespace epd::kernels
