#pragma once

// One interface for the kvstore (shared/STYLE.md "One interface for the store") and the value
// types every implementation returns. Implementations: KvStore (kvstore/kvstore.h, in process),
// KvStoreClient (kvstore/kvstore_client.h, one daemon over gRPC), ShardedKvClient
// (kvstore/sharded_kv_client.h, several daemons).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstore/types.h"

namespace epd::kvstore {

struct LookupResult {
  int cached_blocks = 0;              // longest prefix of the given hashes held in G1 or G3
  std::vector<Tier> tiers;            // where each cached block was found (G1 preferred)
  bool swa_snapshot_present = false;  // G2 holds a live snapshot at the last cached block
};

struct GetResult {
  bool found = false;
  std::string value;
  MissReason miss = MissReason::kAbsent;
  Tier tier = Tier::kAuto;  // the tier that served it
  bool in_dest = false;     // the value went to the caller's ValueDest (value is empty)
  // in_dest, when the tier has a stored checksum of the value (G3: verified over dest's copy;
  // G1: the checksum of the bytes put, for the reader to check its copy against): that checksum,
  // XXH3-64 seeded by checksum_seed, so a daemon need not hash the copy again.
  bool has_checksum = false;
  uint64_t checksum = 0;
  uint64_t checksum_seed = 0;
};

struct TierStats {
  Tier tier = Tier::kAuto;
  uint64_t entries = 0;
  uint64_t bytes = 0;
  uint64_t capacity_bytes = 0;
};

// One put of a batch.
struct KvPut {
  std::string_view key;
  std::string_view value;
};

// "The kvstore" as a worker, the router or a test sees it: the in-process store (KvStore), one
// daemon (KvStoreClient) or several on a consistent-hash ring (ShardedKvClient) — the RocksDB
// DB/StackableDB pattern, so a stage takes any of them (or a wrapper) through this interface.
// Failures are absl::Status codes; callers decide on the code, never on message text.
// Thread-safe: every implementation may be called from many threads.
class KvStoreApi {
 public:
  virtual ~KvStoreApi() = default;
  virtual absl::StatusOr<LookupResult> Lookup(std::string_view config_fingerprint,
                                              std::span<const BlockHash> chain_hashes) = 0;
  virtual absl::StatusOr<GetResult> Get(Tier tier, std::string_view key) = 0;
  virtual absl::Status Put(Tier tier, std::string_view key, std::string_view value) = 0;
  // Pins (pin=true) or unpins a global-KV block in G1; a block only in G3 is loaded first.
  // Returns whether the block was found (and, for unpin, was pinned).
  virtual absl::StatusOr<bool> Pin(std::string_view key, bool pin) = 0;
  // Gets `keys` (a prefix's blocks) with one status per key, in order. The outer status fails
  // only when the call as a whole failed. With stop_at_first_miss the keys after the first miss
  // or failed key are not read (reported as misses). This default calls Get per key.
  virtual absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> BatchGet(
      Tier tier, std::span<const std::string> keys, bool stop_at_first_miss);
  // Puts `items` with one status per item, in order (OK once stored). This default calls Put
  // per item.
  virtual absl::StatusOr<std::vector<absl::Status>> BatchPut(Tier tier,
                                                             std::span<const KvPut> items);
};

}  // namespace epd::kvstore
