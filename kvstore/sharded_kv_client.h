#pragma once

// Several kvstore daemons as one store (DESIGN §2 multi-node, docs/kvstore.md "Several
// kvstores"): every key (a G3/G1 block's chain hash, a G2 SWA snapshot key) lives on the daemon
// that owns it on a consistent-hash ring over the daemons' "host:port" names, so adding or losing
// a daemon moves or loses only its share. All clients of a cluster must use the same list.
//
// A daemon that fails with Unavailable or DeadlineExceeded is marked down for retry_after_ms:
// calls for its keys then fail at once (Unavailable) instead of waiting for a deadline each, and
// Lookup ends the cached prefix at its first block. Callers treat such a failure as a miss (the
// encoder replays what it could not read); nothing fails a request. With one target the client
// behaves exactly like KvStoreClient.
// Thread-safe.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvstore/hash_ring.h"
#include "kvstore/kvstore_client.h"

namespace epd::kvstore {

struct ShardOptions {
  int retry_after_ms = 3000;  // how long a failed daemon is skipped. Default: 3 s
  int virtual_nodes = 256;    // ring points per daemon (ConsistentHashRing). Default: 256
};

class ShardedKvClient final : public KvStoreApi {
 public:
  // `targets`: one or more "host:port" (duplicates and empty entries are refused).
  static absl::StatusOr<std::unique_ptr<ShardedKvClient>> Create(
      const std::vector<std::string>& targets, KvClientOptions options = {},
      ShardOptions shard_options = {});
  // Splits "a:1,b:2" (spaces allowed) into targets; empty input gives an empty list.
  static std::vector<std::string> ParseTargets(std::string_view list);

  // The longest cached prefix over all daemons: each daemon is asked once for the blocks it owns
  // (in chain order); the prefix ends at the first block a daemon lacks or could not answer for.
  // An error only when the first block's daemon failed. swa_snapshot_present is reported only
  // with one daemon (with several the snapshot may live elsewhere; read it to know).
  absl::StatusOr<LookupResult> Lookup(std::string_view config_fingerprint,
                                      std::span<const BlockHash> chain_hashes) override;
  absl::StatusOr<GetResult> Get(Tier tier, std::string_view key) override;
  absl::Status Put(Tier tier, std::string_view key, std::string_view value) override;
  absl::StatusOr<bool> Pin(std::string_view key, bool pin) override;
  // One BatchGet/BatchPut per daemon that owns some of the keys; a down daemon's keys fail with
  // its status, the others are served. stop_at_first_miss is applied to the merged result.
  absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> BatchGet(Tier tier,
                                                                  std::span<const std::string> keys,
                                                                  bool stop_at_first_miss) override;
  absl::StatusOr<std::vector<absl::Status>> BatchPut(Tier tier,
                                                     std::span<const KvPut> items) override;

  // The target that owns `key`.
  std::string OwnerOf(std::string_view key) const;
  const std::vector<std::string>& targets() const { return ring_.nodes(); }
  // Calls answered at once because their daemon was marked down.
  uint64_t skipped_calls() const { return skipped_.load(); }

 private:
  struct Shard {
    std::string target;
    std::unique_ptr<KvStoreClient> client;
    std::atomic<int64_t> down_until_ms{0};  // steady-clock ms; 0 = up
  };
  explicit ShardedKvClient(ShardOptions options)
      : options_(options), ring_(options.virtual_nodes) {}
  size_t ShardIndex(std::string_view key) const;  // index into shards_ of the owner
  // Unavailable when the shard is marked down, else OK.
  absl::Status CheckUp(Shard& shard);
  // Marks the shard down after a transport-level failure; returns `s`.
  absl::Status Note(Shard& shard, absl::Status s);

  ShardOptions options_;
  ConsistentHashRing ring_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::atomic<uint64_t> skipped_{0};
};

}  // namespace epd::kvstore
