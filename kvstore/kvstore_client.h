#pragma once

// Client library of epd-kvstore for workers and the router: one gRPC channel per daemon, blocking
// calls with a deadline, errors as absl::Status (never exceptions). With
// KvClientOptions::bulk = kUcx, values of at least bulk_min_bytes move over UCX through one
// transfer engine shared by all clients of the process (kvstore/bulk.h, docs/kvstore.md).
// ShardedSwaClient routes G2 SWA snapshots over several daemons by consistent hashing of the key
// (DESIGN §2 multi-node).
// Thread-safe: a client may be shared by many threads.
#include <chrono>
#include <cstdint>
#include <functional>
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
#include "kvstore/store_api.h"
#include "kvstore/types.h"

namespace epd::v1 {
class StatsResponse;
}
namespace grpc {
class Channel;
}
namespace prometheus {
class Registry;
}
namespace epd::transfer {
class TransferEngine;
class Wire;
}  // namespace epd::transfer

namespace epd::kvstore {

// How Get/Put move value bytes (docs/kvstore.md "Bulk path").
enum class BulkTransport {
  kInline,  // inside the gRPC messages
  kUcx,     // values of at least bulk_min_bytes over UCX (the daemon's transfer engine); gRPC
            // carries only the control messages. Falls back to inline when the daemon has no
            // bulk endpoint.
  kShm,     // every Get/Put as a one-key BatchGet/BatchPut: through the client's shared-memory
            // segment on the same host (needs shared_memory), inline otherwise.
};

struct KvClientOptions {
  int deadline_ms = 10000;            // Default: 10 s per call (and per bulk transfer)
  int max_message_bytes = 300 << 20;  // Default: 300 MiB (matches the daemon)
  // Default: kUcx (values of at least bulk_min_bytes over UCX where the daemon has a bulk
  // endpoint, inline otherwise: at 1 MiB it is at least as fast as inline, docs/kvstore.md).
  BulkTransport bulk = BulkTransport::kUcx;
  // BatchGet/BatchPut against a daemon on the same host (same boot id and pid namespace): values
  // move through a memfd segment of this client that the daemon maps for the call, instead of
  // inside the gRPC messages (docs/kvstore.md "Shared memory"). Falls back to inline across hosts
  // or when the daemon cannot map it. Default: on
  bool shared_memory = true;
  uint64_t bulk_min_bytes = 64 << 10;  // kUcx: smaller values stay inline. Default: 64 KiB
  // The cluster secret: every gRPC call and the UCX handshake prove it (docs/security.md).
  // Empty = the environment's (common/cluster_secret.h); no default.
  std::string cluster_token;
  std::string ucx_net_devices;  // kUcx: UCX_NET_DEVICES; empty = environment
  // kUcx against a daemon started with --ucx-listener: the IP this client's UCX listener binds
  // (the daemon connects back to it for gets; use an address the daemon can reach).
  // Default: 127.0.0.1
  std::string ucx_listen_ip = "127.0.0.1";
  // kUcx: the owning process's registry (must outlive the client and the engine it creates):
  // epd_kv_transfer_errors_total{reason,direction} of this client is counted there, and so are
  // the epd_transfer_* families of the engine the client creates (one per process and registry;
  // they merge with other engines' series of the same labels), so the process's /metrics shows
  // them. Null: a private registry (read the errors with transfer_errors()).
  prometheus::Registry* registry = nullptr;
  // kUcx: a transfer engine the owning process created and owns (its handshake fingerprint must
  // be kBulkFingerprint, kvstore/bulk.h, and its cluster token the daemon's); must outlive the
  // client. Null: the client creates or shares one (above).
  transfer::TransferEngine* bulk_engine = nullptr;
  // TEST ONLY (kUcx): wraps the client's UCX wire, e.g. with transfer::MakeFaultWire.
  std::function<std::unique_ptr<transfer::Wire>(std::unique_ptr<transfer::Wire>)> debug_wrap_wire;
};

class KvStoreClient final : public KvStoreApi {
 public:
  // `target` is "host:port". The channel connects lazily; the first call reports an unreachable
  // daemon as Unavailable.
  static std::unique_ptr<KvStoreClient> Create(const std::string& target,
                                               KvClientOptions options = {});
  ~KvStoreClient();

  absl::StatusOr<LookupResult> Lookup(std::string_view config_fingerprint,
                                      std::span<const BlockHash> chain_hashes) override;
  absl::StatusOr<GetResult> Get(Tier tier, std::string_view key) override;
  // OK only once the daemon acknowledged the put (for G3: it is in the WAL).
  absl::Status Put(Tier tier, std::string_view key, std::string_view value) override;
  // One RPC for all keys (values through shared memory on the same host, else inline).
  absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> BatchGet(Tier tier,
                                                                  std::span<const std::string> keys,
                                                                  bool stop_at_first_miss) override;
  absl::StatusOr<std::vector<absl::Status>> BatchPut(Tier tier,
                                                     std::span<const KvPut> items) override;
  // Whether this client's batched calls use shared memory right now (same host, accepted).
  bool shared_memory_active();
  absl::StatusOr<bool> Pin(std::string_view key, bool pin) override;
  absl::StatusOr<std::vector<TierStats>> Stats();
  const std::string& target() const { return target_; }
  // Bulk transfers of this client that failed (all reasons, both directions).
  double transfer_errors() const;

 private:
  class Impl;
  KvStoreClient(std::string target, std::unique_ptr<Impl> impl);
  absl::Status BulkPut(Tier tier, std::string_view key, std::string_view value);
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
