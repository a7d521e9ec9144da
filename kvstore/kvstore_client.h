#pragma once

// Client library of epd-kvstore for workers and the router: one gRPC channel per daemon, blocking
// calls with a deadline, errors as absl::Status (never exceptions). ShardedSwaClient routes G2
// SWA snapshots over several daemons by consistent hashing of the key (DESIGN §2 multi-node).
// Thread-safe: a client may be shared by many threads.
#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstore/hash_ring.h"
#include "kvstore/kvstore.h"
#include "kvstore/types.h"

namespace epd::v1 {
class StatsResponse;
}
namespace grpc {
class Channel;
}

namespace epd::kvstore {

struct KvClientOptions {
  int deadline_ms = 10000;            // Default: 10 s per call
  int max_message_bytes = 300 << 20;  // Default: 300 MiB (matches the daemon)
};

class KvStoreClient {
 public:
  // `target` is "host:port". The channel connects lazily; the first call reports an unreachable
  // daemon as Unavailable.
  static std::unique_ptr<KvStoreClient> Create(const std::string& target,
                                               KvClientOptions options = {});
  ~KvStoreClient();

  absl::StatusOr<LookupResult> Lookup(std::string_view config_fingerprint,
                                      std::span<const BlockHash> chain_hashes);
  absl::StatusOr<GetResult> Get(Tier tier, std::string_view key);
  // OK only once the daemon acknowledged the put (for G3: it is in the WAL).
  absl::Status Put(Tier tier, std::string_view key, std::string_view value);
  absl::StatusOr<bool> Pin(std::string_view key, bool pin);
  absl::StatusOr<std::vector<TierStats>> Stats();
  const std::string& target() const { return target_; }

 private:
  class Impl;
  KvStoreClient(std::string target, std::unique_ptr<Impl> impl);
  std::string target_;
  std::unique_ptr<Impl> impl_;
};

// Routes SWA snapshot puts/gets to the owning daemon of each key. Node names are the daemons'
// "host:port" targets; all clients of a cluster must use the same node list to agree on owners.
class ShardedSwaClient {
 public:
  explicit ShardedSwaClient(const std::vector<std::string>& targets, KvClientOptions options = {},
                            int virtual_nodes = 256);
  absl::Status Put(std::string_view key, std::string_view value);
  absl::StatusOr<GetResult> Get(std::string_view key);
  // The target that owns `key`.
  std::string OwnerOf(std::string_view key) const;

 private:
  KvStoreClient* ClientFor(std::string_view key) const;
  ConsistentHashRing ring_;
  std::vector<std::pair<std::string, std::unique_ptr<KvStoreClient>>> clients_;
};

}  // namespace epd::kvstore
