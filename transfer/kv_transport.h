#pragma once

// The KV-transfer interface every worker uses to hand state to the next stage (DESIGN.md §4).
//
// A transfer is one manifest (epd.v1.Manifest) plus its segments laid out back to back, in manifest
// order, in one TransferBuffer. The sender offers it; the receiver, which has derived the manifest
// it expects on its own (manifest.h), compares the offer field by field before any byte is used,
// claims it, receives the bytes straight into its own pre-allocated buffer, checks every segment's
// xxHash3 and confirms. Every transfer has a deadline and an owner (the transport instance that
// started it); cancel, deadline and peer death end it on both sides.
//
// Memory rules: a buffer handed to Send/Receive belongs to the transport until the transfer has
// provably stopped (no UCX operation can still read or write it); only then is it deregistered and
// freed (or, for a successful receive, handed back by TakeReceived). Resources() counts what is
// outstanding so tests can check that nothing leaks.
//
// Thread-safety: every method may be called from any thread.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "epd/v1/transfer.pb.h"

namespace epd::transfer {

using PeerId = uint64_t;
using TransferId = uint64_t;

// How the bytes of one connection actually move (the `transport` metric label).
enum class TransportKind { kLoopback, kTcp, kShm, kRdma };
absl::string_view TransportLabel(TransportKind kind);

struct TransportCapabilities {
  std::string name;                // "ucx" or "loopback"
  bool zero_copy_receive = false;  // large chunks land in the receive buffer without a bounce copy
  bool rma = false;                // one-sided get/put used for large chunks (UCX rendezvous)
  bool shared_memory = false;      // can reach same-host peers without a network stack
  bool remote_hosts = false;       // can reach other hosts
  uint64_t chunk_bytes = 0;        // segments are sent in chunks of at most this many bytes
};

// Outstanding resources of one transport instance. All zero when idle and nothing is held.
struct ResourceCounts {
  int64_t registrations = 0;    // memory regions registered with the wire (UCX mem_map), the
                                // transfers' own and RegisterMemory's
  int64_t allocations = 0;      // live TransferBuffers made by Allocate(), wherever they are
  int64_t allocated_bytes = 0;  // their total size
  int64_t live_transfers = 0;   // transfers not yet provably stopped
  int64_t wire_ops = 0;         // wire operations (sends/receives) still in flight
  // Idle buffers the engine keeps registered for Allocate to reuse (EngineOptions::pool_bytes;
  // not counted above: no transfer holds them). Freed by Shutdown.
  int64_t pooled_buffers = 0;
  int64_t pooled_bytes = 0;
};

// Counters shared by a transport and the buffers it allocated (buffers may outlive the transport).
struct ResourceCounters;

// Owned, 64-byte aligned host memory made by KvTransport::Allocate. Move-only.
class TransferBuffer {
 public:
  ~TransferBuffer();
  TransferBuffer(const TransferBuffer&) = delete;
  TransferBuffer& operator=(const TransferBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  friend class TransferEngine;
  TransferBuffer(std::shared_ptr<ResourceCounters> counters, uint8_t* data, uint64_t size,
                 std::shared_ptr<const void> keepalive = nullptr);
  std::shared_ptr<ResourceCounters> counters_;
  // Borrowed memory (KvTransport::Borrow): not freed here; the owner's keepalive is dropped.
  std::shared_ptr<const void> keepalive_;
  uint8_t* data_;
  uint64_t size_;
};

struct TransferOptions {
  // The whole transfer must end by now + deadline, or it fails on this side. Default: 30 s.
  absl::Duration deadline = absl::Seconds(30);
  // Sender only: how long an offer waits to be claimed before the sender drops its copy.
  // Default: 10 s.
  absl::Duration lease = absl::Seconds(10);
  // Sender only: the manifest already carries every segment's checksum (checksum_kind
  // CHECKSUM_XXH3_64, computed by the caller, e.g. while it copied the bytes into the buffer). The
  // offer carries them: no hashing pass over the payload here and no seal message; the receiver
  // checks the bytes against them as always. Default: false (the engine hashes while data moves).
  bool checksums_in_manifest = false;
};

enum class TransferState {
  kOffered,       // sender: offer sent, waiting for the receiver's claim
  kExpecting,     // receiver: buffer ready, waiting for a matching offer
  kTransferring,  // bytes are moving
  kDone,          // sender: receiver confirmed all checksums; receiver: all bytes verified
  kFailed,        // deadline, mismatch, checksum, peer death, cancel (error says which)
};
absl::string_view StateName(TransferState state);

struct TransferStatus {
  TransferState state = TransferState::kFailed;
  absl::Status error;       // OK unless kFailed
  uint64_t bytes_done = 0;  // bytes received (receiver) or acknowledged by UCX (sender)
  uint64_t bytes_total = 0;
  bool released = false;  // the transport no longer holds the buffer or its registration
  TransportKind transport = TransportKind::kLoopback;
};

// A completed receive: the sender's manifest (with checksums) and the bytes, segment i at
// segment_offsets[i].
struct ReceivedTransfer {
  epd::v1::Manifest manifest;
  std::unique_ptr<TransferBuffer> buffer;
  std::vector<uint64_t> segment_offsets;
};

class KvTransport {
 public:
  virtual ~KvTransport() = default;

  virtual TransportCapabilities Capabilities() const = 0;
  // What a peer passes to Connect (e.g. "ucx+tcp://127.0.0.1:4242" or "ucx+addr:<hex>").
  virtual std::string LocalAddress() const = 0;

  // Connects and runs the handshake (config fingerprint + cluster token, both ways). A mismatch
  // fails here with FailedPrecondition naming the field; the peer refuses it too.
  virtual absl::StatusOr<PeerId> Connect(absl::string_view address, absl::Duration timeout) = 0;
  // Closes the connection; transfers on it fail on both sides.
  virtual void Disconnect(PeerId peer) = 0;
  virtual absl::StatusOr<TransportKind> PeerTransport(PeerId peer) const = 0;

  // Registered memory for Send (fill it with the segments) or Receive (size it from the expected
  // manifest). Counted in Resources() until destroyed.
  virtual absl::StatusOr<std::unique_ptr<TransferBuffer>> Allocate(uint64_t bytes) = 0;

  // Registers the caller's memory [addr, addr + length) with the wire once (UCX ucp_mem_map): a
  // Send or Receive whose buffer lies inside it uses this registration instead of registering
  // the buffer per transfer. Counted in Resources().registrations until DeregisterMemory. The
  // memory must stay valid, and no transfer may still use it, until DeregisterMemory.
  virtual absl::StatusOr<uint64_t> RegisterMemory(void* addr, uint64_t length) = 0;
  virtual void DeregisterMemory(uint64_t handle) = 0;
  // A TransferBuffer over the caller's memory [data, data + size), without a copy (a payload
  // sent straight from, e.g., the KV pool's registered slabs). `keepalive` is held until the
  // transport releases the buffer (the caller's memory must live that long). Counted in
  // Resources().allocations like Allocate's buffers.
  virtual absl::StatusOr<std::unique_ptr<TransferBuffer>> Borrow(
      uint8_t* data, uint64_t size, std::shared_ptr<const void> keepalive) = 0;

  // Offers `manifest` (checksums are filled in here unless options.checksums_in_manifest) with
  // `payload` holding its segments back to back. The transport owns `payload` from now on. Fails
  // fast if the sizes disagree.
  virtual absl::StatusOr<TransferId> Send(PeerId peer, epd::v1::Manifest manifest,
                                          std::unique_ptr<TransferBuffer> payload,
                                          const TransferOptions& options) = 0;
  // Waits for an offer with expected.request_id() from any connected peer and receives it into
  // `into`, which must be exactly the sum of the expected byte lengths.
  virtual absl::StatusOr<TransferId> Receive(epd::v1::Manifest expected,
                                             std::unique_ptr<TransferBuffer> into,
                                             const TransferOptions& options) = 0;

  // Ends the transfer on both sides (the peer is told). No-op once terminal.
  virtual void Cancel(TransferId id, absl::string_view reason) = 0;
  virtual absl::StatusOr<TransferStatus> Status(TransferId id) const = 0;
  // Blocks until the transfer is terminal or `timeout` passes (then DeadlineExceeded; the transfer
  // goes on). Returns the transfer's outcome.
  virtual absl::Status Wait(TransferId id, absl::Duration timeout) = 0;
  // Receiver, after a successful Wait: hands over the bytes and forgets the transfer.
  virtual absl::StatusOr<ReceivedTransfer> TakeReceived(TransferId id) = 0;
  // Drops the record of a terminal transfer (its buffers are released once provably stopped).
  virtual void Forget(TransferId id) = 0;
  // The owner stops following a transfer it no longer needs the outcome of (e.g. the peer already
  // confirmed over another channel): unlike Forget, a live transfer is not failed; it runs to its
  // end (its deadline bounds it) and its record is dropped then.
  virtual void Detach(TransferId id) { Forget(id); }

  virtual ResourceCounts Resources() const = 0;
};

}  // namespace epd::transfer
