#pragma once

// TransferEngine: the KvTransport implementation shared by every wire. It owns the session state
// machine (offer -> claim -> data -> end), manifests, checksums, deadlines, leases, the handshake
// and the metrics; the Wire below it only moves bytes. See docs/transfer.md.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "common/clock.h"
#include "transfer/kv_transport.h"
#include "transfer/wire.h"

namespace prometheus {
class Registry;
}

namespace epd::transfer {

struct EngineOptions {
  std::string config_fingerprint;     // must match the peer's (handshake)
  // The cluster secret (common/cluster_secret.h): both sides of a connection prove they know it
  // (HMAC challenge-response, docs/security.md); it never crosses the wire and is never logged.
  std::string cluster_token;
  std::string node_name = "epd";      // for logs. Default: "epd"
  uint64_t chunk_bytes = 4ull << 20;  // data chunk size. Default: 4 MiB
  // After a transfer ends with wire operations still in flight, wait this long for them to finish
  // before force-closing the connection (which makes UCX complete them). Default: 500 ms.
  absl::Duration release_grace = absl::Milliseconds(500);
  // Unclaimed offers (arrived before the matching Receive) are kept at most this many. Default: 256
  int max_pending_offers = 256;
  // Terminal transfers not yet collected (Wait/TakeReceived/Forget). Default: 4096
  int max_terminal_records = 4096;
  absl::Duration tick = absl::Milliseconds(5);  // deadline/lease scan period. Default: 5 ms
  // Same-host peers (equal boot id and pid namespace) are checked for liveness this often; a dead
  // peer process fails its transfers at once instead of at their deadlines. Default: 100 ms.
  absl::Duration liveness_period = absl::Milliseconds(100);
  // Buffer pool: Allocate of at least pool_min_bytes returns a buffer (capacity: the next power
  // of two) that is registered with the wire once and, when its holder frees it, kept for the
  // next Allocate, up to pool_bytes of idle buffers in all; Send/Receive find its registration
  // instead of registering per transfer. Saves the page faults of fresh memory and the
  // registration of every transfer. 0: off (every Allocate is fresh memory). Default: 0.
  uint64_t pool_bytes = 0;
  uint64_t pool_min_bytes = 64ull << 10;  // Default: 64 KiB
  // Receiver: an offer that arrives before its Receive is received at once, into a buffer of the
  // offered size, instead of waiting for the Receive's claim, when the eager receives no Receive
  // has taken yet stay within eager_receive_bytes in all. The Receive/ReceiveAny of its request id
  // then takes it over (its expectation is compared with the offer then; every chunk and checksum
  // was checked as always); one that nobody takes is dropped when the sender's lease ends. Needs a
  // wire with posted receives. 0: off (an offer waits for its Receive). Default: 0.
  uint64_t eager_receive_bytes = 0;
  // Small transfers hash where they already are instead of on the hashing thread: a sender whose
  // payload is at most this hashes it in Send() and puts the checksums in the offer (no seal), and
  // a receive of at most this hashes each chunk on the wire thread as it lands, then confirms from
  // there. Each saves thread wake-ups (sender: hashing thread, then progress thread for the seal;
  // receiver: the waiter, then the progress thread for the END) at the price of hashing on the
  // caller's or the wire's thread (xxHash3, ~15 GB/s: 70 us per MiB). The checks are the same.
  // 0: off. Default: 0 (the workers' hand-off engines set kHandoffInlineHashBytes).
  uint64_t inline_hash_bytes = 0;

  absl::Status Validate() const;
};

// EngineOptions::pool_bytes of the workers' hand-off engines: up to 256 MiB of idle hand-off
// buffers stay allocated and registered for the next hand-off (a fresh 256 MiB buffer costs ~65k
// page faults and a UCX registration inside the hand-off: 256 MiB shm 2.6 -> 4.1 GiB/s on the
// 2-core dev VM, docs/transfer.md).
inline constexpr uint64_t kHandoffPoolBytes = 256ull << 20;
// EngineOptions::inline_hash_bytes of the workers' hand-off engines.
inline constexpr uint64_t kHandoffInlineHashBytes = 1ull << 20;

class TransferMetrics;
struct ResourceCounters;

class TransferEngine final : public KvTransport, private WireHandler {
 public:
  // Starts the wire. `registry` and `clock` must outlive the engine.
  static absl::StatusOr<std::unique_ptr<TransferEngine>> Create(std::unique_ptr<Wire> wire,
                                                                const EngineOptions& options,
                                                                prometheus::Registry& registry,
                                                                const common::Clock& clock);
  ~TransferEngine() override;

  TransportCapabilities Capabilities() const override;
  std::string LocalAddress() const override;
  absl::StatusOr<PeerId> Connect(absl::string_view address, absl::Duration timeout) override;
  void Disconnect(PeerId peer) override;
  absl::StatusOr<TransportKind> PeerTransport(PeerId peer) const override;
  absl::StatusOr<std::unique_ptr<TransferBuffer>> Allocate(uint64_t bytes) override;
  absl::StatusOr<uint64_t> RegisterMemory(void* addr, uint64_t length) override;
  void DeregisterMemory(uint64_t handle) override;
  absl::StatusOr<std::unique_ptr<TransferBuffer>> Borrow(
      uint8_t* data, uint64_t size, std::shared_ptr<const void> keepalive) override;
  absl::StatusOr<TransferId> Send(PeerId peer, epd::v1::Manifest manifest,
                                  std::unique_ptr<TransferBuffer> payload,
                                  const TransferOptions& options) override;
  absl::StatusOr<TransferId> Receive(epd::v1::Manifest expected,
                                     std::unique_ptr<TransferBuffer> into,
                                     const TransferOptions& options) override;
  // A receive whose length the offer decides (posted before the receiver knows it): like Receive,
  // but `expected`'s byte_lengths are not compared; the offer's segments must total at most
  // `max_bytes`, and the engine allocates the buffer (of the offered size) when it accepts the
  // offer. Every other manifest field, every chunk and the checksums are checked as for Receive;
  // the caller compares the length it learns elsewhere with the received buffer's size.
  // (kvstore bulk get: posted before the Get rpc, so the bytes move while the answer does.)
  absl::StatusOr<TransferId> ReceiveAny(epd::v1::Manifest expected, uint64_t max_bytes,
                                        const TransferOptions& options);
  // Ends a receive that is no longer wanted. One no offer has reached yet ends quietly (an unused
  // reservation: no failure counted, nothing sent; a late offer for it is refused); any other is
  // Cancel()ed. Either way the record is collected (as by Forget).
  void Withdraw(TransferId id);
  void Cancel(TransferId id, absl::string_view reason) override;
  absl::StatusOr<TransferStatus> Status(TransferId id) const override;
  absl::Status Wait(TransferId id, absl::Duration timeout) override;
  absl::StatusOr<ReceivedTransfer> TakeReceived(TransferId id) override;
  void Forget(TransferId id) override;
  void Detach(TransferId id) override;
  ResourceCounts Resources() const override;

  // Stops the wire (every transfer fails, every buffer is released). Called by the destructor.
  void Shutdown();

 private:
  struct Transfer;
  struct Peer;
  struct PendingOffer;
  class BufferPool;
  friend class BufferPool;

  TransferEngine(std::unique_ptr<Wire> wire, const EngineOptions& options,
                 prometheus::Registry& registry, const common::Clock& clock);

  // WireHandler (wire thread).
  void OnControl(PeerId peer, std::string bytes) override;
  DataSink OnDataBegin(PeerId peer, const DataHeader& header, uint64_t wire_length) override;
  void OnDataEnd(PeerId peer, const DataHeader& header, uint64_t wire_length,
                 absl::Status status) override;
  void OnPeerDown(PeerId peer, absl::Status why) override;

  // Receive and ReceiveAny (`into` null and open_max > 0: ReceiveAny).
  absl::StatusOr<TransferId> StartReceive(epd::v1::Manifest expected,
                                          std::unique_ptr<TransferBuffer> into, uint64_t open_max,
                                          const TransferOptions& options);
  // ReceiveAny's transfer meets its offer: sizes the manifest and the buffer from it. False (and
  // `t` failed) when the offer is too large or has a different number of segments.
  bool SizeOpenReceive(Transfer& t, PeerId peer, const epd::v1::TransferOffer& offer);
  // EngineOptions::eager_receive_bytes: receives an unexpected offer of `total` bytes now.
  void StartEagerReceive(PeerId peer, const epd::v1::TransferOffer& offer, uint64_t total);
  // An eager receive stops holding its bytes of the eager budget (taken over or dropped).
  void EndEager(Transfer& t);
  // Counts a new receive transfer live and files it under its id and request id (mu_ held).
  Transfer& AddReceive(std::unique_ptr<Transfer> t);
  // A Receive/ReceiveAny takes over the eager receive `t`: compares its expectation (byte_lengths
  // from the offer when open_max > 0, which bounds them) with what was offered.
  void AdoptEagerReceive(Transfer& t, const epd::v1::Manifest& expected, uint64_t open_max,
                         const TransferOptions& options);
  // Records that the receive of `request_id` ended before any offer came (a late one is refused).
  void RememberEndedReceive(const std::string& request_id, const absl::Status& error,
                            int64_t now_ns);

  // All below: mu_ held.
  void HandleHello(PeerId peer, const epd::v1::TransferHello& hello);
  void HandleHelloProof(PeerId peer, const epd::v1::TransferHelloProof& proof);
  void HandleOffer(PeerId peer, const epd::v1::TransferOffer& offer);
  void HandleClaim(PeerId peer, const epd::v1::TransferClaim& claim);
  void HandleEnd(PeerId peer, const epd::v1::TransferEnd& end);
  void AcceptOffer(Transfer& t, PeerId peer, const epd::v1::TransferOffer& offer);
  void StartSending(Transfer& t);
  void MaybeFinishReceive(Transfer& t);
  // Checksums while data moves (protocol 2): per-segment streaming xxHash3 state, the hashing
  // thread's queue, the sender's seal.
  void InitHashing(Transfer& t);
  // The chunks a sender sent with its offer, before any claim, for an offer refused here.
  void DiscardEarlyData(PeerId peer, const epd::v1::TransferOffer& offer);
  bool Overlaps(const Transfer& t, int segment, uint64_t offset, uint64_t length) const;
  void ScheduleHash(Transfer& t);
  // Whether a transfer of `bytes` is hashed by the thread at hand (EngineOptions::
  // inline_hash_bytes): the sender in Send(), the receiver on the wire thread.
  bool HashesInline(uint64_t bytes) const {
    return bytes > 0 && bytes <= options_.inline_hash_bytes;
  }
  // A small receive's landed chunk (EngineOptions::inline_hash_bytes): hashed here and now, with
  // `lock` (on mu_) released while hashing; the receive may be confirmed before it returns.
  void HashOnThisThread(std::unique_lock<std::mutex>& lock, Transfer& t);
  void HashLoop();  // the hashing thread (takes mu_ itself)
  // One hashing job of `t` (hash_busy set): hashes its landed bytes, releasing `lock` (on mu_)
  // while hashing, then seals (sender) or checks the receive. Run by the hashing thread or by a
  // thread waiting for `t` in Wait().
  void RunHashJob(std::unique_lock<std::mutex>& lock, Transfer& t);
  void MaybeSeal(Transfer& t);
  void HandleSeal(PeerId peer, const epd::v1::TransferSeal& seal);
  // Fails `t` locally; tells the peer unless `tell_peer` is false.
  void Fail(Transfer& t, absl::Status error, absl::string_view reason, bool tell_peer,
            int segment = -1, std::string field = "", bool accounting = false);
  void Complete(Transfer& t);
  void SendControl(PeerId peer, const epd::v1::TransferControl& msg);
  void TryRelease(Transfer& t);
  // A same-host peer's process as last probed outside mu_ (TickLoop).
  struct LivenessProbe {
    PeerId id = 0;
    int64_t pid = 0;
    int64_t start_ticks =
        0;                   // the process's start time when the peer was first probed (0: not yet)
    int64_t now_ticks = -1;  // its start time now; -1: no such live process
  };
  // The probes due now (every liveness_period), taken under mu_.
  std::vector<LivenessProbe> DueLivenessProbes();
  void Tick(const std::vector<LivenessProbe>& probes);
  void TickLoop();
  TransportKind KindOf(PeerId peer) const;
  // The registration of [p, p + n) for a transfer: a RegisterMemory region holding it (`owned`
  // false) or a new registration of its own (`owned` true).
  absl::StatusOr<uint64_t> RegistrationFor(uint8_t* p, uint64_t n, bool* owned);
  Transfer* Find(TransferId id);

  std::unique_ptr<Wire> wire_;
  EngineOptions options_;
  const common::Clock& clock_;
  std::unique_ptr<TransferMetrics> metrics_;
  std::shared_ptr<ResourceCounters> counters_;
  TransportCapabilities caps_;

  // RegisterMemory's regions: start address -> (length, wire handle). Own lock (taken alone).
  struct CallerRegion {
    uint64_t length = 0;
    uint64_t handle = 0;
  };
  mutable std::mutex regions_mu_;
  std::map<uintptr_t, CallerRegion> regions_;
  std::shared_ptr<BufferPool> pool_;  // null when EngineOptions::pool_bytes is 0

  mutable std::mutex mu_;
  std::condition_variable cv_;  // any transfer or peer changed state
  TransferId next_id_ = 1;
  std::map<TransferId, std::unique_ptr<Transfer>> transfers_;
  absl::flat_hash_map<std::string, TransferId> receiving_;  // request_id -> receive transfer
  // Eager receives (EngineOptions::eager_receive_bytes) no Receive has taken yet, by request_id,
  // and the bytes they hold.
  absl::flat_hash_map<std::string, TransferId> eager_;
  uint64_t eager_bytes_ = 0;
  absl::flat_hash_map<PeerId, std::unique_ptr<Peer>> peers_;
  std::map<std::string, std::unique_ptr<PendingOffer>> pending_offers_;  // by request_id
  // Receives that ended before any offer arrived (cancelled, deadline): an offer arriving later
  // is refused at once with that error instead of waiting out its lease. Kept for
  // kEndedReceiveTtlNs, at most kMaxEndedReceives (the oldest go first).
  struct EndedReceive {
    std::string error;
    int64_t expires_ns = 0;
  };
  absl::flat_hash_map<std::string, EndedReceive> ended_receives_;  // by request_id
  std::deque<std::string> ended_order_;                            // oldest first
  bool stopping_ = false;
  int64_t last_liveness_ns_ = 0;
  std::thread ticker_;
  std::condition_variable hash_cv_;    // hash_queue_ gained a job, or stopping_
  std::deque<TransferId> hash_queue_;  // transfers with bytes to hash (each at most once)
  int helpers_hashing_ = 0;            // threads running a hashing job inside Wait()
  std::thread hasher_;
};

}  // namespace epd::transfer
