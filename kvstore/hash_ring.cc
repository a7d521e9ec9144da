#include "kvstore/hash_ring.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/hash.h"

namespace epd::kvstore {

ConsistentHashRing::ConsistentHashRing(int virtual_nodes)
    : virtual_nodes_(virtual_nodes > 0 ? virtual_nodes : 1) {}

void ConsistentHashRing::AddNode(const std::string& node) {
  if (std::find(nodes_.begin(), nodes_.end(), node) != nodes_.end()) return;
  nodes_.push_back(node);
  for (int i = 0; i < virtual_nodes_; ++i) {
    // On a (2^-64-unlikely) point collision the earlier owner keeps the point, so the mapping
    // stays independent of insertion order only up to that event; harmless for a cache.
    points_.emplace(common::Xxh3_64(absl::StrCat(node, "#", i)), node);
  }
}

void ConsistentHashRing::RemoveNode(const std::string& node) {
  auto it = std::find(nodes_.begin(), nodes_.end(), node);
  if (it == nodes_.end()) return;
  nodes_.erase(it);
  for (auto p = points_.begin(); p != points_.end();) {
    p = (p->second == node) ? points_.erase(p) : std::next(p);
  }
}

std::optional<std::string> ConsistentHashRing::NodeFor(std::string_view key) const {
  if (points_.empty()) return std::nullopt;
  auto it = points_.lower_bound(common::Xxh3_64(key));
  if (it == points_.end()) it = points_.begin();
  return it->second;
}

}  // namespace epd::kvstore
