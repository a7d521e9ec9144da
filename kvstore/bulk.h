#pragma once

// The UCX bulk path of epd-kvstore (docs/kvstore.md "Bulk path"). gRPC stays the control plane;
// the value bytes move through the project's transfer engine (kvstore/transfer/: KvTransport over
// UCX, one-segment manifests with an xxHash3 checksum, the cluster-token handshake).
//
//  put: client Send(offer, request id R, n bytes) -> Put rpc {bulk: R, n} -> the daemon
//       Receive()s R into a private engine buffer, the engine checks length and checksum, the
//       daemon stores the verified bytes (for G3: through the WAL) and only then answers OK.
//  get: Get rpc {bulk: client address, R} -> the daemon copies the value into an engine buffer and
//       Send()s it to the client, answers {bulk, n}; the client Receive()s R (length from the
//       answer, checksum from the offer) before a byte is returned.
//
// Any failure (checksum, truncation, peer death, deadline, handshake) fails that one request with
// the engine's message, is counted in epd_kv_transfer_errors_total{reason,direction}, and frees
// the request's buffers; the process stays up.
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "epd/v1/transfer.pb.h"
#include "kvstore/transfer/kv_transport.h"
#include "kvstore/transfer/wire.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/registry.h"

namespace epd::transfer {
class TransferEngine;
}

namespace epd::kvstore {

// The handshake fingerprint of every kvstore bulk endpoint (daemon and clients). Values are opaque
// bytes here (block keys already carry the model config), so it names the protocol, not a model.
inline constexpr char kBulkFingerprint[] = "epd.kvstore.bulk.v1";

// The one-segment manifest of a value of `bytes` bytes (checksum unset: the sender fills it in).
epd::v1::Manifest BulkManifest(const std::string& request_id, uint64_t bytes);

// Bounded metric label of a failed transfer status: checksum, truncated, peer_down, deadline,
// rejected (manifest mismatch / refused), handshake, cancelled, other.
std::string TransferErrorReason(const absl::Status& status);

// epd_kv_transfer_errors_total{reason,direction}; direction is "put" or "get". Thread-safe.
class TransferErrorMetric {
 public:
  explicit TransferErrorMetric(prometheus::Registry& registry);
  void Count(const absl::Status& status, std::string_view direction);
  void Count(std::string_view reason, std::string_view direction);

 private:
  prometheus::Family<prometheus::Counter>* family_;
};

struct BulkEndpointOptions {
  std::string cluster_token = "epd-dev";  // must equal the clients'
  std::string net_devices;                // UCX_NET_DEVICES; empty = environment
  bool listener = false;                  // UCX listener (TCP) instead of worker address (shm)
  std::string listen_ip = "127.0.0.1";
  // Deadline of one transfer (and the lease of a get's offer). Default: 30 s.
  absl::Duration deadline = absl::Seconds(30);
  uint64_t max_value_bytes = 256ull << 20;  // larger bulk puts are refused before any allocation
  // TEST ONLY: wrap the UCX wire (fault injection on the daemon's sends).
  std::function<std::unique_ptr<transfer::Wire>(std::unique_ptr<transfer::Wire>)> wrap_wire;
};

// The daemon's side: owns a TransferEngine over UCX. Thread-safe.
class KvBulkEndpoint {
 public:
  // `registry` and `clock` must outlive the endpoint.
  static absl::StatusOr<std::unique_ptr<KvBulkEndpoint>> Create(const BulkEndpointOptions& options,
                                                                prometheus::Registry& registry,
                                                                const common::Clock& clock);
  ~KvBulkEndpoint();

  std::string address() const;
  uint64_t max_value_bytes() const { return options_.max_value_bytes; }

  // Put: waits for the client's offer `request_id` of exactly `bytes` bytes, receives and verifies
  // it. Returns the verified bytes (owned by the caller) or the transfer's error (counted).
  absl::StatusOr<std::unique_ptr<transfer::TransferBuffer>> ReceivePut(
      const std::string& request_id, uint64_t bytes);

  // Get: copies `value` into an engine buffer and offers it to the client at `client_address`
  // (connecting first if needed). Returns once offered; the outcome is collected in the background
  // (failures counted with direction "get").
  absl::Status StartGetSend(const std::string& client_address, const std::string& request_id,
                            std::span<const uint8_t> value);

  transfer::ResourceCounts Resources() const;

 private:
  KvBulkEndpoint(const BulkEndpointOptions& options, prometheus::Registry& registry);
  absl::StatusOr<transfer::PeerId> PeerFor(const std::string& address, bool reconnect);
  void DropPeer(transfer::PeerId peer);
  void ReapLoop();

  BulkEndpointOptions options_;
  TransferErrorMetric errors_;
  std::unique_ptr<transfer::TransferEngine> engine_;

  std::mutex connect_mu_;                                     // serializes Connect calls
  std::mutex mu_;                                             // guards everything below
  absl::flat_hash_map<std::string, transfer::PeerId> peers_;  // client address -> peer
  struct Send {
    transfer::TransferId id;
    transfer::PeerId peer;
  };
  std::vector<Send> sends_;  // gets still in flight
  bool stopping_ = false;
  std::condition_variable cv_;
  std::thread reaper_;
};

}  // namespace epd::kvstore
