#pragma once

// The byte-moving layer under the transfer engine: connections, small control messages and large
// data chunks that land in memory the engine points to. UCX (ucx_wire.h) and an in-process
// loopback (tests/testing/loopback_wire.h) implement it; FaultWire decorates one to inject failures.
//
// Threading contract: every WireHandler call and every Done callback runs on the wire's own
// thread, never inside a Wire method called by the engine (so the engine may hold its lock while
// calling Send*/ClosePeer). Connect blocks the caller and must not be called with that lock held.
// Memory passed to SendData, and a DataSink's destination, must stay valid until the matching
// Done / OnDataEnd has run: that is the "provably stopped" point.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transfer/kv_transport.h"

namespace epd::transfer {

// Naturally aligned (no packing): it is memcpy'd to and from the wire.
struct DataHeader {
  uint64_t receiver_transfer_id = 0;
  uint64_t offset = 0;  // within the segment
  uint64_t length = 0;  // bytes the sender put in this chunk
  uint32_t segment = 0;
  uint32_t reserved = 0;
  uint64_t sender_transfer_id = 0;  // with posted receives, chunks are named by the sender's id
};

struct DataSink {
  uint8_t* dst = nullptr;  // null: refuse the chunk (the engine has already failed the transfer)
  uint64_t mem = 0;        // registration handle of dst's region (0: none)
};

class WireHandler {
 public:
  virtual ~WireHandler() = default;
  virtual void OnControl(PeerId peer, std::string bytes) = 0;
  // A data chunk of `wire_length` bytes is arriving; say where it goes.
  virtual DataSink OnDataBegin(PeerId peer, const DataHeader& header, uint64_t wire_length) = 0;
  // It has landed (or failed). Called exactly once per accepted OnDataBegin.
  virtual void OnDataEnd(PeerId peer, const DataHeader& header, uint64_t wire_length,
                         absl::Status status) = 0;
  // The connection is gone (peer death, local close). Called once per peer.
  virtual void OnPeerDown(PeerId peer, absl::Status why) = 0;
};

class Wire {
 public:
  using Done = std::function<void(absl::Status)>;
  virtual ~Wire() = default;

  virtual absl::Status Start(WireHandler* handler) = 0;
  // Force-closes every connection, completes every pending operation (with an error) and joins the
  // wire's thread. Idempotent.
  virtual void Stop() = 0;

  virtual TransportCapabilities Capabilities() const = 0;
  virtual std::string LocalAddress() const = 0;
  virtual absl::StatusOr<PeerId> Connect(absl::string_view address, absl::Duration timeout) = 0;
  virtual TransportKind PeerKind(PeerId peer) const = 0;

  virtual void SendControl(PeerId peer, std::string bytes, Done done) = 0;
  // Sends `wire_length` bytes at `data` (normally header.length; a fault decorator may differ).
  virtual void SendData(PeerId peer, const DataHeader& header, const uint8_t* data,
                        uint64_t wire_length, uint64_t mem, Done done) = 0;
  // Force-close: pending operations with this peer complete with an error, then OnPeerDown.
  // `peer_dead`: the caller knows the peer process is gone, so operations the transport cannot
  // cancel by itself (UCX shared memory without peer-failure handling) may be abandoned: nothing
  // can touch their memory any more.
  virtual void ClosePeer(PeerId peer, absl::Status why, bool peer_dead = false) = 0;

  // Pre-posted receives (UCX tag matching, what ucx_perftest's tag_bw does): before claiming a
  // transfer the receiver posts where every chunk goes, and the sender's chunks land there without
  // an arrival callback (no OnDataBegin). A wire that returns false delivers chunks through
  // OnDataBegin/OnDataEnd instead, and its SendData must then not expect posted receives.
  virtual bool PostsReceives() const { return false; }
  // Posts the receive of chunk `expected` (receiver_transfer_id, segment, offset, length) from
  // `peer` into `dst` (registration `mem`). Completes exactly once with OnDataEnd(peer, expected,
  // bytes that arrived, status): a shorter message completes OK with its length, a longer one with
  // DataLoss. Must be called before the sender can send the chunk (i.e. before the claim).
  virtual void PostReceive(PeerId /*peer*/, const DataHeader& /*expected*/, uint8_t* /*dst*/,
                           uint64_t /*mem*/) {}
  // Cancels the receives posted for `receiver_transfer_id` that no data has matched yet: they
  // complete with an error. Matched ones complete normally (or with the connection).
  virtual void CancelReceives(PeerId /*peer*/, uint64_t /*receiver_transfer_id*/) {}
  // Discards the chunks `chunks` (sender_transfer_id, segment, offset) of an offer from `peer` the
  // receiver refused, which the sender sent before any claim: their bytes are not received, and
  // the sender's sends complete. Nothing is reported back.
  virtual void DiscardChunks(PeerId /*peer*/, std::vector<DataHeader> /*chunks*/) {}

  // Registers memory for zero-copy use; returns a nonzero handle.
  virtual absl::StatusOr<uint64_t> Register(void* addr, uint64_t length) = 0;
  virtual void Deregister(uint64_t handle) = 0;
};

}  // namespace epd::transfer
