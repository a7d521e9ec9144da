#pragma once

// Consistent-hash ring used to shard the G2 SWA pool over the kvstores of several nodes
// (client-side routing). Each node owns `virtual_nodes` points at xxHash3-64("node#i"); a key
// belongs to the first point clockwise from xxHash3-64(key). Adding or removing one node only
// moves the keys of the arcs it gains or loses (about 1/N of them). Deterministic across
// processes. Not thread-safe for mutation: build it, then share it as shared_ptr<const ...>.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace epd::kvstore {

class ConsistentHashRing {
 public:
  explicit ConsistentHashRing(int virtual_nodes = 256);  // Default: 256 points per node

  // Adds a node by name (e.g. "10.0.0.7:7070"). No-op if present.
  void AddNode(const std::string& node);
  // Removes a node. No-op if absent.
  void RemoveNode(const std::string& node);
  // The owner of `key`, or nullopt when the ring is empty.
  std::optional<std::string> NodeFor(std::string_view key) const;

  size_t size() const { return nodes_.size(); }
  const std::vector<std::string>& nodes() const { return nodes_; }

 private:
  int virtual_nodes_;
  std::vector<std::string> nodes_;
  std::map<uint64_t, std::string> points_;
};

}  // namespace epd::kvstore
