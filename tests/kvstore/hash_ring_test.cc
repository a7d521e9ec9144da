// Consistent-hash ring: balanced ownership, minimal remapping on membership change, determinism.
#include "kvstore/hash_ring.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace epd::kvstore {
namespace {

constexpr int kKeys = 40000;

std::vector<std::string> Keys() {
  std::vector<std::string> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(absl::StrCat("swa-key-", i));
  return keys;
}

ConsistentHashRing Ring(int nodes) {
  ConsistentHashRing ring;
  for (int i = 0; i < nodes; ++i) ring.AddNode(absl::StrCat("10.0.0.", i, ":7070"));
  return ring;
}

TEST(HashRingTest, EmptyRingOwnsNothing) {
  ConsistentHashRing ring;
  EXPECT_FALSE(ring.NodeFor("k").has_value());
}

TEST(HashRingTest, LoadIsBalanced) {
  const auto ring = Ring(8);
  std::map<std::string, int> load;
  for (const auto& k : Keys()) ++load[*ring.NodeFor(k)];
  ASSERT_EQ(load.size(), 8u);
  const double mean = static_cast<double>(kKeys) / 8;
  for (const auto& [node, n] : load) {
    EXPECT_GT(n, mean * 0.75) << node;
    EXPECT_LT(n, mean * 1.25) << node;
  }
}

TEST(HashRingTest, AddingANodeOnlyMovesKeysToIt) {
  const auto before = Ring(8);
  auto after = Ring(8);
  after.AddNode("10.0.0.99:7070");
  int moved = 0;
  for (const auto& k : Keys()) {
    const auto a = *before.NodeFor(k);
    const auto b = *after.NodeFor(k);
    if (a != b) {
      ++moved;
      EXPECT_EQ(b, "10.0.0.99:7070") << "key moved between two old nodes";
    }
  }
  // Ideal share is 1/9 of the keys.
  EXPECT_GT(moved, kKeys / 9 * 0.7);
  EXPECT_LT(moved, kKeys / 9 * 1.3);
}

TEST(HashRingTest, RemovingANodeOnlyMovesItsKeys) {
  const auto before = Ring(8);
  auto after = Ring(8);
  const std::string gone = "10.0.0.3:7070";
  after.RemoveNode(gone);
  EXPECT_EQ(after.size(), 7u);
  for (const auto& k : Keys()) {
    const auto a = *before.NodeFor(k);
    const auto b = *after.NodeFor(k);
    if (a != gone) {
      EXPECT_EQ(a, b);
    } else {
      EXPECT_NE(b, gone);
    }
  }
}

TEST(HashRingTest, OwnershipDoesNotDependOnInsertionOrder) {
  ConsistentHashRing a, b;
  for (int i = 0; i < 5; ++i) a.AddNode(absl::StrCat("n", i));
  for (int i = 4; i >= 0; --i) b.AddNode(absl::StrCat("n", i));
  for (const auto& k : Keys()) ASSERT_EQ(*a.NodeFor(k), *b.NodeFor(k));
}

}  // namespace
}  // namespace epd::kvstore
