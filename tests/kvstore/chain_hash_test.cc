// Prefix-chain hashes: deterministic across processes (golden value), sensitive to every input,
// whole blocks only, and prefix-shaped (a shared prefix gives shared leading hashes).
#include "kvstore/chain_hash.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "common/hash.h"

namespace epd::kvstore {
namespace {

std::vector<int32_t> Iota(int n, int start = 0) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(ChainHashTest, GoldenValueIsStableAcrossProcessesAndBuilds) {
  // If this changes, every stored block becomes unreachable: bump the domain string on purpose.
  const auto tokens = Iota(64);
  const BlockHash h = ChainHash(kRootParent, tokens, "fp-demo");
  EXPECT_EQ(common::ToHex(h), "3e66cc7dd1aa0b62c482034485ccb28d");
}

TEST(ChainHashTest, EveryInputChangesTheHash) {
  const auto tokens = Iota(64);
  const BlockHash base = ChainHash(kRootParent, tokens, "fp");
  auto other_tokens = tokens;
  other_tokens[63] += 1;
  EXPECT_NE(base, ChainHash(kRootParent, other_tokens, "fp"));
  EXPECT_NE(base, ChainHash(kRootParent, tokens, "fq"));
  BlockHash parent = kRootParent;
  parent[15] = 1;
  EXPECT_NE(base, ChainHash(parent, tokens, "fp"));
  // Token boundaries matter: one fewer token is a different block.
  EXPECT_NE(base, ChainHash(kRootParent, std::span(tokens).first(63), "fp"));
  EXPECT_EQ(base, ChainHash(kRootParent, tokens, "fp"));
}

TEST(ChainHashTest, WholeBlocksOnlyAndSharedPrefixesShareHashes) {
  const auto a = Iota(64 * 3 + 10);
  auto b = a;
  b[64 * 2 + 5] = -7;  // differs inside the third block
  const auto ha = ChainHashes(a, 64, "fp");
  const auto hb = ChainHashes(b, 64, "fp");
  ASSERT_EQ(ha.size(), 3u);
  ASSERT_EQ(hb.size(), 3u);
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_EQ(ha[1], hb[1]);
  EXPECT_NE(ha[2], hb[2]);
  // Chain: block i's hash is ChainHash(hash of i-1, tokens of block i).
  EXPECT_EQ(ha[1], ChainHash(ha[0], std::span(a).subspan(64, 64), "fp"));
  // Same tokens at a different position (other parent) hash differently.
  EXPECT_NE(ChainHash(kRootParent, std::span(a).subspan(64, 64), "fp"), ha[1]);
  EXPECT_TRUE(ChainHashes(a, 0, "fp").empty());
  EXPECT_TRUE(ChainHashes(std::span(a).first(63), 64, "fp").empty());
}

TEST(ChainHashTest, WireKeyParsing) {
  const BlockHash h = ChainHash(kRootParent, Iota(8), "fp");
  auto parsed = BlockHashFromBytes(AsBytes(h));
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*parsed, h);
  auto bad = BlockHashFromBytes("short");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("got 5"), std::string::npos);
}

}  // namespace
}  // namespace epd::kvstore
