#pragma once

// The UCX bulk path of epd-kvstore (docs/kvstore.md "Bulk path"). gRPC stays the control plane;
// the value bytes move through the project's transfer engine (transfer/: KvTransport over
// UCX, one-segment manifests with an xxHash3 checksum, the cluster-secret handshake).
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
#include <string_view>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "epd/v1/transfer.pb.h"
#include "transfer/kv_transport.h"
#include "transfer/manifest.h"
#include "transfer/wire.h"
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

// The UCX progress threads of the kvstore's engines (daemon and clients) sleep on their event fd as
// soon as UCX makes no progress (UcxOptions::spin = 0): a kvstore transfer is one value between
// two gRPC messages, and threads spinning after it take the cores the gRPC threads of both sides
// need next (on the 2-core dev VM 1 MiB bulk gets were ~1.6x faster than with the 200 us default;
// docs/kvstore.md "Bulk path").
inline constexpr absl::Duration kBulkProgressSpin = absl::ZeroDuration();
// Idle engine buffers the kvstore's engines keep registered for reuse (EngineOptions::pool_bytes):
// a value's buffer is registered with UCX once, not per transfer, and its pages are not faulted
// in again.
inline constexpr uint64_t kBulkPoolBytes = 64ull << 20;

// The one-segment manifest of a value of `bytes` bytes (checksum unset: the sender fills it in).
epd::v1::Manifest BulkManifest(const std::string& request_id, uint64_t bytes);
// The same with the value's XXH3-64 checksum set (for TransferOptions::checksums_in_manifest).
epd::v1::Manifest BulkManifest(const std::string& request_id, uint64_t bytes, uint64_t checksum);

// CopyAndChecksum (copy + transfer checksum in one pass): transfer/manifest.h.
using transfer::CopyAndChecksum;
// The transfer checksum (XXH3-64) of `bytes`.
uint64_t BulkChecksum(std::span<const uint8_t> bytes);
// The accounting error of a value whose offer carried `carried` bytes where `who` (the put, the
// daemon) announced `announced` (DataLoss, reason "truncated", field byte_length).
absl::Status BulkLengthMismatch(const std::string& request_id, std::string_view who,
                                uint64_t announced, uint64_t carried);

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
  std::string cluster_token;  // the cluster secret (the clients' must equal it; docs/security.md)
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
  // The same for a value already in an engine buffer (AllocateValue; the store copied the hit
  // straight into it): no copy here. The buffer stays the caller's too (for an inline fallback).
  absl::Status StartGetSend(const std::string& client_address, const std::string& request_id,
                            std::shared_ptr<transfer::TransferBuffer> value);
  // An engine buffer for a value of `bytes` bytes (a get's destination).
  absl::StatusOr<std::unique_ptr<transfer::TransferBuffer>> AllocateValue(uint64_t bytes);

  transfer::ResourceCounts Resources() const;

 private:
  KvBulkEndpoint(const BulkEndpointOptions& options, prometheus::Registry& registry);
  absl::StatusOr<transfer::PeerId> PeerFor(const std::string& address, bool reconnect);
  // Sends `value` (whose XXH3-64 is `checksum`) to the client; reconnects once if needed.
  absl::Status Offer(const std::string& client_address, const std::string& request_id,
                     std::shared_ptr<transfer::TransferBuffer> value, uint64_t checksum);
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
