#include "transfer/transfer_engine.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/cluster_secret.h"
#include "common/hash.h"
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "transfer/manifest.h"
#include "transfer/transfer_error.h"
#include "transfer/transfer_metrics.h"
#include "spdlog/spdlog.h"

namespace epd::transfer {

// 2: checksums computed while the bytes move (TransferOffer.checksums_follow + TransferSeal).
// 3: the mutual HMAC handshake (the secret no longer travels in TransferHello).
constexpr uint32_t kProtocolVersion = 3;
constexpr size_t kNonceBytes = 32;

// What each side's proof covers (proto/epd/v1/transfer.proto, docs/security.md): the role keeps a
// reflected proof from passing as the other side's; both nonces make each proof single-use.
std::string HandshakeTranscript(absl::string_view role, absl::string_view nonce_c,
                                absl::string_view nonce_s, absl::string_view fingerprint) {
  return absl::StrCat("epd-transfer-v3\n", role, "\n", nonce_c, nonce_s, fingerprint);
}
// The checksum threads hash at most this many bytes per step (then look at the transfer again).
constexpr uint64_t kHashStep = 1ull << 20;

struct ResourceCounters {
  std::atomic<int64_t> registrations{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> allocated_bytes{0};
  std::atomic<int64_t> live_transfers{0};
  std::atomic<int64_t> wire_ops{0};
};

absl::string_view TransportLabel(TransportKind kind) {
  switch (kind) {
    case TransportKind::kLoopback:
      return "loopback";
    case TransportKind::kTcp:
      return "tcp";
    case TransportKind::kShm:
      return "shm";
    case TransportKind::kRdma:
      return "rdma";
  }
  return "unknown";
}

absl::string_view StateName(TransferState state) {
  switch (state) {
    case TransferState::kOffered:
      return "offered";
    case TransferState::kExpecting:
      return "expecting";
    case TransferState::kTransferring:
      return "transferring";
    case TransferState::kDone:
      return "done";
    case TransferState::kFailed:
      return "failed";
  }
  return "unknown";
}

// EngineOptions::pool_bytes. Idle slabs by capacity (a power of two), each registered with the
// wire and listed in the engine's regions_ (so RegistrationFor finds it). A buffer handed out
// holds a Lease whose destructor gives the slab back. The pool outlives the engine while buffers
// are out; Close (engine Shutdown, after the wire stopped) frees the idle slabs and makes later
// returns plain frees, so nothing touches the engine afterwards.
class TransferEngine::BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  struct Slab {
    uint8_t* data = nullptr;
    uint64_t capacity = 0;
    uint64_t mem = 0;       // wire registration (0: none)
    uint64_t returned = 0;  // when it was last returned (the pool's return count then)
  };
  class Lease {
   public:
    Lease(std::shared_ptr<BufferPool> pool, const Slab& slab)
        : pool_(std::move(pool)), slab_(slab) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { pool_->Return(slab_); }

   private:
    std::shared_ptr<BufferPool> pool_;
    Slab slab_;
  };

  BufferPool(TransferEngine* engine, uint64_t limit) : engine_(engine), limit_(limit) {}

  // A slab of at least `bytes` (reused or new), or nullopt when the pool is closed.
  std::optional<Slab> Take(uint64_t bytes) {
    const uint64_t capacity = std::bit_ceil(std::max<uint64_t>(bytes, 64));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return std::nullopt;
      auto it = idle_.find(capacity);
      if (it != idle_.end() && !it->second.empty()) {
        Slab slab = it->second.back();
        it->second.pop_back();
        idle_bytes_ -= capacity;
        return slab;
      }
    }
    void* p = std::aligned_alloc(64, capacity);
    if (p == nullptr) return std::nullopt;
    Slab slab{static_cast<uint8_t*>(p), capacity, 0};
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      std::free(p);
      return std::nullopt;
    }
    // Registered once, for its whole life; listed so that transfers over it register nothing.
    absl::StatusOr<uint64_t> reg = engine_->wire_->Register(slab.data, capacity);
    if (reg.ok()) {
      slab.mem = *reg;
      std::lock_guard<std::mutex> rlock(engine_->regions_mu_);
      engine_->regions_[reinterpret_cast<uintptr_t>(slab.data)] = {capacity, slab.mem};
    }
    slab_regions_.insert(reinterpret_cast<uintptr_t>(slab.data));
    return slab;
  }

  // Keeps `slab` for the next Take of its size. When the idle slabs would then exceed the limit,
  // the least recently returned ones go first (back to the system), so a run of hand-offs of a new
  // size is pooled even while slabs of an earlier size sit idle.
  void Return(Slab slab) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_ && slab.capacity <= limit_) {
      while (idle_bytes_ + slab.capacity > limit_) EvictOldestLocked();
      slab.returned = ++returns_;
      idle_[slab.capacity].push_back(slab);
      idle_bytes_ += slab.capacity;
      return;
    }
    if (!closed_) Unregister(slab);
    std::free(slab.data);
  }

  // Engine shutdown (the wire has stopped: no operation touches a slab any more).
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (auto& [capacity, slabs] : idle_) {
      for (const Slab& slab : slabs) {
        Unregister(slab);
        std::free(slab.data);
      }
    }
    idle_.clear();
    idle_bytes_ = 0;
    // Slabs still out are freed when returned; their registrations went with the wire.
    std::lock_guard<std::mutex> rlock(engine_->regions_mu_);
    for (auto it = engine_->regions_.begin(); it != engine_->regions_.end();) {
      it = slab_regions_.contains(it->first) ? engine_->regions_.erase(it) : std::next(it);
    }
  }

  void Count(ResourceCounts& c) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [capacity, slabs] : idle_)
      c.pooled_buffers += static_cast<int64_t>(slabs.size());
    c.pooled_bytes = static_cast<int64_t>(idle_bytes_);
  }

 private:
  // Frees the idle slab returned longest ago (mu_ held, not closed, some slab idle).
  void EvictOldestLocked() {
    auto oldest = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (!it->second.empty() &&
          (oldest == idle_.end() || it->second.front().returned < oldest->second.front().returned))
        oldest = it;
    }
    const Slab slab = oldest->second.front();
    oldest->second.erase(oldest->second.begin());
    if (oldest->second.empty()) idle_.erase(oldest);
    idle_bytes_ -= slab.capacity;
    Unregister(slab);
    std::free(slab.data);
  }

  void Unregister(const Slab& slab) {  // mu_ held, not closed
    slab_regions_.erase(reinterpret_cast<uintptr_t>(slab.data));
    if (slab.mem == 0) return;
    {
      std::lock_guard<std::mutex> rlock(engine_->regions_mu_);
      engine_->regions_.erase(reinterpret_cast<uintptr_t>(slab.data));
    }
    engine_->wire_->Deregister(slab.mem);
  }

  TransferEngine* engine_;  // valid until Close
  const uint64_t limit_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<uint64_t, std::vector<Slab>> idle_;  // by capacity
  uint64_t idle_bytes_ = 0;
  uint64_t returns_ = 0;
  absl::flat_hash_set<uintptr_t> slab_regions_;  // every live slab's start address
};

TransferBuffer::TransferBuffer(std::shared_ptr<ResourceCounters> counters, uint8_t* data,
                               uint64_t size, std::shared_ptr<const void> keepalive)
    : counters_(std::move(counters)), keepalive_(std::move(keepalive)), data_(data), size_(size) {}

TransferBuffer::~TransferBuffer() {
  if (keepalive_ == nullptr) std::free(data_);
  counters_->allocations.fetch_sub(1);
  counters_->allocated_bytes.fetch_sub(static_cast<int64_t>(size_));
}

absl::Status EngineOptions::Validate() const {
  if (config_fingerprint.empty())
    return absl::InvalidArgumentError("EngineOptions.config_fingerprint is empty");
  if (chunk_bytes == 0) return absl::InvalidArgumentError("EngineOptions.chunk_bytes is 0");
  return absl::OkStatus();
}

namespace {

// Boot id + pid namespace: two processes with the same host id can check each other's pid.
std::string HostId() {
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) boot = buf;
    std::fclose(f);
  }
  char ns[128] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  if (boot.empty() || n <= 0) return "";
  while (!boot.empty() && (boot.back() == '\n' || boot.back() == ' ')) boot.pop_back();
  return boot + "/" + std::string(ns, n);
}

// The start time of live process `pid` (field 22 of /proc/<pid>/stat, clock ticks since boot),
// which tells a reused PID from the process the peer said it was; -1 once `pid` has exited (also
// while it is an unreaped zombie); 0 when it is alive but /proc does not say (not ours to read).
int64_t ProcessStartTicks(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return -1;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return -1;
  char buf[1024] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* close = static_cast<const char*>(memrchr(buf, ')', n));
  if (close == nullptr || close + 2 >= buf + n) return 0;
  if (close[2] == 'Z' || close[2] == 'X') return -1;
  // After ") " come fields 3.. (state is field 3); starttime is field 22.
  const char* p = close + 2;
  for (int field = 3; field < 22 && p != nullptr; ++field) {
    p = static_cast<const char*>(std::memchr(p, ' ', buf + n - p));
    if (p != nullptr) ++p;
  }
  if (p == nullptr) return 0;
  const long long start = std::strtoll(p, nullptr, 10);
  return start > 0 ? start : 0;
}

}  // namespace

struct TransferEngine::Peer {
  enum class State { kHandshaking, kReady, kRefused, kDown };
  PeerId id = 0;
  int64_t pid = 0;         // nonzero when the peer runs on this host (same host id)
  int64_t pid_start = 0;   // that process's start ticks, from the first liveness probe
  int64_t refused_ns = 0;  // inbound handshake refused at (real monotonic ns)
  int64_t hello_ns = 0;    // inbound: our challenge sent at (real monotonic ns)
  bool outbound = false;
  bool awaiting_proof = false;  // inbound: challenge sent, the connecting side's proof not yet in
  std::string nonce_c, nonce_s;  // the handshake's nonces (connecting side, accepting side)
  State state = State::kHandshaking;
  std::string error;
  TransportKind kind = TransportKind::kLoopback;
};

struct TransferEngine::PendingOffer {
  PeerId peer = 0;
  epd::v1::TransferOffer offer;
  int64_t expires_ns = 0;
  std::optional<epd::v1::TransferSeal> seal;  // arrived before the Receive
};

struct XxhStateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

struct TransferEngine::Transfer {
  TransferId id = 0;
  bool sender = false;
  PeerId peer = 0;
  bool has_peer = false;
  std::string request_id;
  epd::v1::Manifest manifest;
  std::unique_ptr<TransferBuffer> buffer;
  uint64_t mem = 0;
  bool owns_mem = true;  // false: mem is a RegisterMemory region's (not deregistered here)
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> received;
  std::vector<int64_t> segment_done_ns;
  TransferState state = TransferState::kFailed;
  absl::Status error;
  int64_t deadline_ns = 0;
  int64_t lease_ns = 0;
  int64_t deadline_ms = 0;
  int64_t claim_ns = 0;
  int64_t ended_ns = 0;
  uint64_t remote_id = 0;
  int64_t ops = 0;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  bool released = false;
  bool forced_close = false;
  bool collected = false;
  TransportKind kind = TransportKind::kLoopback;

  // Checksums computed while data moves (protocol 2). Segment i is hashed in order, from 0 to
  // hashed[i]; ranges[i] holds the byte ranges accepted but not hashed yet (offset -> {length,
  // landed}): the sender's whole segments at Send, the receiver's chunks as OnDataBegin accepts
  // them (landed once OnDataEnd says so). One hashing job per transfer at a time reads the buffer
  // without mu_; hash_busy keeps the buffer from being released meanwhile.
  std::vector<uint64_t> hashed;
  std::vector<std::map<uint64_t, std::pair<uint64_t, bool>>> ranges;
  std::vector<std::unique_ptr<XXH3_state_t, XxhStateDeleter>> hash_states;
  std::vector<uint64_t> digests;
  int unhashed = 0;        // segments not fully hashed yet
  bool hash_busy = false;  // a hashing job for this transfer is queued or running
  // The job was handed to a thread blocked in Wait() on this transfer (it hashes instead of waking
  // the hashing thread and then being woken by it); waiters counts those threads.
  bool hash_for_waiter = false;
  int waiters = 0;
  bool checksums_known = false;  // receiver: the sender's checksums arrived (seal or offer)
  bool sealed = false;           // sender: the seal went out
  // Receiver over a wire with posted receives: every chunk's receive was posted before the claim;
  // receives_cancelled once the ones still unmatched were cancelled (after release_grace).
  bool posted = false;
  bool receives_cancelled = false;
  bool data_started = false;  // sender: its chunks are on their way (before the claim: posted wire)
  uint64_t open_max = 0;      // ReceiveAny: the offer decides the length (at most this); 0: Receive
  // EngineOptions::eager_receive_bytes: received before any Receive asked for it; until one takes
  // it over (or eager_expires_ns) it holds eager_bytes of the engine's eager budget.
  bool eager = false;
  uint64_t eager_bytes = 0;
  int64_t eager_expires_ns = 0;

  bool terminal() const { return state == TransferState::kDone || state == TransferState::kFailed; }
};

absl::StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(
    std::unique_ptr<Wire> wire, const EngineOptions& options, prometheus::Registry& registry,
    const common::Clock& clock) {
  if (absl::Status st = options.Validate(); !st.ok()) return st;
  if (!wire) return absl::InvalidArgumentError("TransferEngine needs a wire");
  std::unique_ptr<TransferEngine> engine(
      new TransferEngine(std::move(wire), options, registry, clock));
  if (absl::Status st = engine->wire_->Start(engine.get()); !st.ok()) return st;
  engine->caps_ = engine->wire_->Capabilities();
  engine->caps_.chunk_bytes = options.chunk_bytes;
  if (options.pool_bytes > 0)
    engine->pool_ = std::make_shared<BufferPool>(engine.get(), options.pool_bytes);
  engine->ticker_ = std::thread([e = engine.get()] { e->TickLoop(); });
  engine->hasher_ = std::thread([e = engine.get()] { e->HashLoop(); });
  return engine;
}

TransferEngine::TransferEngine(std::unique_ptr<Wire> wire, const EngineOptions& options,
                               prometheus::Registry& registry, const common::Clock& clock)
    : wire_(std::move(wire)),
      options_(options),
      clock_(clock),
      metrics_(std::make_unique<TransferMetrics>(registry)),
      counters_(std::make_shared<ResourceCounters>()) {}

TransferEngine::~TransferEngine() { Shutdown(); }

void TransferEngine::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [id, t] : transfers_)
      if (!t->terminal())
        Fail(*t, absl::CancelledError("transfer engine shutting down"), "shutdown", true);
  }
  cv_.notify_all();
  hash_cv_.notify_all();
  if (ticker_.joinable()) ticker_.join();
  // The hashing thread finishes its step (it reads a buffer) and exits; queued jobs are dropped.
  if (hasher_.joinable()) hasher_.join();
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Threads hashing inside Wait() finish their step too (stopping_ ends their job).
    cv_.wait(lock, [&] { return helpers_hashing_ == 0; });
    hash_queue_.clear();
    for (auto& [id, t] : transfers_) {
      t->hash_busy = false;
      t->hash_for_waiter = false;
    }
  }
  // Stop force-closes every connection and completes every pending operation, so afterwards no
  // UCX operation references a buffer.
  wire_->Stop();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, t] : transfers_) {
      t->ops = 0;
      TryRelease(*t);
    }
    transfers_.clear();
    pending_offers_.clear();
  }
  if (pool_ != nullptr) pool_->Close();
}

TransportCapabilities TransferEngine::Capabilities() const { return caps_; }
std::string TransferEngine::LocalAddress() const { return wire_->LocalAddress(); }

TransportKind TransferEngine::KindOf(PeerId peer) const {
  auto it = peers_.find(peer);
  return it == peers_.end() ? TransportKind::kTcp : it->second->kind;
}

void TransferEngine::SendControl(PeerId peer, const epd::v1::TransferControl& msg) {
  wire_->SendControl(peer, msg.SerializeAsString(), [](absl::Status) {});
}

absl::StatusOr<PeerId> TransferEngine::Connect(absl::string_view address, absl::Duration timeout) {
  const auto give_up = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  absl::StatusOr<PeerId> peer = wire_->Connect(address, timeout);
  if (!peer.ok()) return peer.status();
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) return absl::CancelledError("transfer engine shutting down");
  auto& p = peers_[*peer];
  if (!p) p = std::make_unique<Peer>();
  p->id = *peer;
  p->outbound = true;
  p->kind = wire_->PeerKind(*peer);
  p->nonce_c = common::RandomBytes(kNonceBytes);
  epd::v1::TransferControl hello;
  hello.mutable_hello()->set_protocol_version(kProtocolVersion);
  hello.mutable_hello()->set_config_fingerprint(options_.config_fingerprint);
  hello.mutable_hello()->set_nonce(p->nonce_c);
  hello.mutable_hello()->set_node_name(options_.node_name);
  hello.mutable_hello()->set_pid(getpid());
  hello.mutable_hello()->set_host_id(HostId());
  SendControl(*peer, hello);
  const PeerId id = *peer;
  const bool settled = cv_.wait_until(lock, give_up, [&] {
    auto it = peers_.find(id);
    return it == peers_.end() || it->second->state != Peer::State::kHandshaking;
  });
  auto it = peers_.find(id);
  absl::Status result;
  if (!settled) {
    result = absl::DeadlineExceededError(absl::StrCat(
        "connect to ", address, ": no handshake reply within ", absl::FormatDuration(timeout)));
  } else if (it == peers_.end() || it->second->state == Peer::State::kDown) {
    result = absl::UnavailableError(
        absl::StrCat("connect to ", address, ": connection lost during handshake",
                     it == peers_.end() ? "" : ": " + it->second->error));
  } else if (it->second->state == Peer::State::kRefused) {
    result = WithTransferError(
        absl::FailedPreconditionError(
            absl::StrCat("connect to ", address, " refused at handshake: ", it->second->error)),
        "handshake");
  } else {
    return id;
  }
  lock.unlock();
  wire_->ClosePeer(id, result);
  return result;
}

void TransferEngine::Disconnect(PeerId peer) {
  wire_->ClosePeer(peer, absl::CancelledError("disconnected locally"));
}

absl::StatusOr<TransportKind> TransferEngine::PeerTransport(PeerId peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  return wire_->PeerKind(peer);
}

absl::StatusOr<std::unique_ptr<TransferBuffer>> TransferEngine::Allocate(uint64_t bytes) {
  if (pool_ != nullptr && bytes >= options_.pool_min_bytes && bytes <= options_.pool_bytes) {
    if (std::optional<BufferPool::Slab> slab = pool_->Take(bytes)) {
      auto lease = std::make_shared<BufferPool::Lease>(pool_, *slab);
      counters_->allocations.fetch_add(1);
      counters_->allocated_bytes.fetch_add(static_cast<int64_t>(bytes));
      return std::unique_ptr<TransferBuffer>(
          new TransferBuffer(counters_, slab->data, bytes, std::move(lease)));
    }
  }
  const uint64_t rounded = std::max<uint64_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr)
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  counters_->allocations.fetch_add(1);
  counters_->allocated_bytes.fetch_add(static_cast<int64_t>(bytes));
  return std::unique_ptr<TransferBuffer>(
      new TransferBuffer(counters_, static_cast<uint8_t*>(p), bytes));
}

absl::StatusOr<std::unique_ptr<TransferBuffer>> TransferEngine::Borrow(
    uint8_t* data, uint64_t size, std::shared_ptr<const void> keepalive) {
  if (data == nullptr && size > 0) return absl::InvalidArgumentError("Borrow: null memory");
  if (keepalive == nullptr) keepalive = std::make_shared<int>(0);  // marks the buffer borrowed
  counters_->allocations.fetch_add(1);
  counters_->allocated_bytes.fetch_add(static_cast<int64_t>(size));
  return std::unique_ptr<TransferBuffer>(
      new TransferBuffer(counters_, data, size, std::move(keepalive)));
}

absl::StatusOr<uint64_t> TransferEngine::RegisterMemory(void* addr, uint64_t length) {
  if (addr == nullptr || length == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterMemory: empty region (", length, " bytes)"));
  }
  const auto start = reinterpret_cast<uintptr_t>(addr);
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    auto next = regions_.lower_bound(start);
    if ((next != regions_.end() && next->first < start + length) ||
        (next != regions_.begin() &&
         std::prev(next)->first + std::prev(next)->second.length > start)) {
      return absl::AlreadyExistsError(absl::StrCat("RegisterMemory: ", length, " bytes at ",
                                                   absl::Hex(start),
                                                   " overlap a region registered before"));
    }
  }
  absl::StatusOr<uint64_t> reg = wire_->Register(addr, length);
  if (!reg.ok()) return reg.status();
  counters_->registrations.fetch_add(1);
  metrics_->registrations().Increment();
  std::lock_guard<std::mutex> lock(regions_mu_);
  regions_[start] = {length, *reg};
  return *reg;
}

void TransferEngine::DeregisterMemory(uint64_t handle) {
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    auto it = std::find_if(regions_.begin(), regions_.end(),
                           [&](const auto& r) { return r.second.handle == handle; });
    if (it == regions_.end()) return;
    regions_.erase(it);
  }
  wire_->Deregister(handle);
  counters_->registrations.fetch_sub(1);
  metrics_->registrations().Decrement();
}

absl::StatusOr<uint64_t> TransferEngine::RegistrationFor(uint8_t* p, uint64_t n, bool* owned) {
  const auto start = reinterpret_cast<uintptr_t>(p);
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    auto it = regions_.upper_bound(start);
    if (it != regions_.begin()) {
      --it;
      if (start + n <= it->first + it->second.length) {
        *owned = false;
        return it->second.handle;
      }
    }
  }
  absl::StatusOr<uint64_t> reg = wire_->Register(p, n);
  if (!reg.ok()) return reg.status();
  *owned = true;
  counters_->registrations.fetch_add(1);
  metrics_->registrations().Increment();
  return *reg;
}

absl::StatusOr<TransferId> TransferEngine::Send(PeerId peer, epd::v1::Manifest manifest,
                                                std::unique_ptr<TransferBuffer> payload,
                                                const TransferOptions& options) {
  if (!payload) return absl::InvalidArgumentError("Send: no payload buffer");
  if (manifest.request_id().empty()) return absl::InvalidArgumentError("Send: empty request_id");
  const uint64_t total = TotalBytes(manifest);
  if (total != payload->size())
    return absl::InvalidArgumentError(absl::StrCat("Send: manifest segments sum to ", total,
                                                   " bytes but the payload holds ",
                                                   payload->size()));
  const std::vector<uint64_t> offsets = SegmentOffsets(manifest);
  // The checksums are computed by the hashing thread while the offer, the claim and the bytes
  // move; they follow in a TransferSeal (protocol 2).
  // (Or the caller computed them: options.checksums_in_manifest; or the payload is small and
  // they are computed here, EngineOptions::inline_hash_bytes.)
  bool in_manifest = options.checksums_in_manifest;
  if (!in_manifest && HashesInline(total)) {
    for (int i = 0; i < manifest.segments_size(); ++i) {
      auto* s = manifest.mutable_segments(i);
      s->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
      s->set_checksum(XXH3_64bits(payload->data() + offsets[i], s->byte_length()));
    }
    in_manifest = true;
  }
  for (int i = 0; i < manifest.segments_size(); ++i) {
    auto* s = manifest.mutable_segments(i);
    if (in_manifest) {
      if (s->checksum_kind() != epd::v1::CHECKSUM_XXH3_64)
        return absl::InvalidArgumentError(absl::StrCat("Send: checksums_in_manifest but ",
                                                       DescribeSegment(manifest, i),
                                                       " has no XXH3-64 checksum"));
      continue;
    }
    s->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
    s->set_checksum(0);
  }
  uint64_t mem = 0;
  bool owns_mem = false;
  if (total > 0) {
    absl::StatusOr<uint64_t> reg = RegistrationFor(payload->data(), total, &owns_mem);
    if (!reg.ok()) return reg.status();
    mem = *reg;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto pit = peers_.find(peer);
  absl::Status bad;
  if (stopping_) {
    bad = absl::CancelledError("transfer engine shutting down");
  } else if (pit == peers_.end() || pit->second->state != Peer::State::kReady) {
    // A peer that is gone (closed, failed, died) is a transient condition of the cluster, not of
    // the request: UNAVAILABLE, so the router re-dispatches the request elsewhere.
    bad = absl::UnavailableError(absl::StrCat("Send: peer ", peer, " is not connected"));
  }
  if (!bad.ok()) {
    if (mem != 0 && owns_mem) {
      wire_->Deregister(mem);
      counters_->registrations.fetch_sub(1);
      metrics_->registrations().Decrement();
    }
    return bad;
  }
  const int64_t now = clock_.NowMonoNs();
  auto t = std::make_unique<Transfer>();
  t->id = next_id_++;
  t->sender = true;
  t->peer = peer;
  t->has_peer = true;
  t->request_id = manifest.request_id();
  t->manifest = std::move(manifest);
  t->buffer = std::move(payload);
  t->mem = mem;
  t->owns_mem = owns_mem;
  t->offsets = offsets;
  t->state = TransferState::kOffered;
  t->deadline_ms = absl::ToInt64Milliseconds(options.deadline);
  t->deadline_ns = now + absl::ToInt64Nanoseconds(options.deadline);
  t->lease_ns = now + absl::ToInt64Nanoseconds(options.lease);
  t->bytes_total = total;
  t->kind = pit->second->kind;
  counters_->live_transfers.fetch_add(1);
  metrics_->live_transfers().Increment();
  epd::v1::TransferControl msg;
  auto* offer = msg.mutable_offer();
  offer->set_sender_transfer_id(t->id);
  *offer->mutable_manifest() = t->manifest;
  offer->set_lease_ms(absl::ToInt64Milliseconds(options.lease));
  offer->set_chunk_bytes(options_.chunk_bytes);
  offer->set_checksums_follow(!in_manifest);
  // With posted receives the chunks follow the offer at once: the receiver's wire holds them
  // (unexpected) until the manifest check posts their receives, or discards them if it refuses.
  const bool early_data = wire_->PostsReceives();
  offer->set_data_without_claim(early_data);
  SendControl(peer, msg);
  InitHashing(*t);
  if (in_manifest) {
    t->unhashed = 0;   // nothing to hash here
    t->sealed = true;  // and no seal to send: the offer carried the checksums
    for (int i = 0; i < t->manifest.segments_size(); ++i)
      t->digests[i] = t->manifest.segments(i).checksum();
  } else {
    for (int i = 0; i < t->manifest.segments_size(); ++i)
      if (const uint64_t len = t->manifest.segments(i).byte_length(); len > 0)
        t->ranges[i][0] = {len, true};
  }
  const TransferId id = t->id;
  Transfer& ref = *t;
  transfers_[id] = std::move(t);
  ScheduleHash(ref);
  if (early_data) StartSending(ref);
  return id;
}

absl::StatusOr<TransferId> TransferEngine::Receive(epd::v1::Manifest expected,
                                                   std::unique_ptr<TransferBuffer> into,
                                                   const TransferOptions& options) {
  if (!into) return absl::InvalidArgumentError("Receive: no destination buffer");
  return StartReceive(std::move(expected), std::move(into), 0, options);
}

absl::StatusOr<TransferId> TransferEngine::ReceiveAny(epd::v1::Manifest expected,
                                                      uint64_t max_bytes,
                                                      const TransferOptions& options) {
  if (max_bytes == 0) return absl::InvalidArgumentError("ReceiveAny: max_bytes must be > 0");
  if (expected.segments_size() == 0)
    return absl::InvalidArgumentError("ReceiveAny: the expected manifest has no segments");
  for (auto& s : *expected.mutable_segments()) s.set_byte_length(0);  // the offer decides
  return StartReceive(std::move(expected), nullptr, max_bytes, options);
}

absl::StatusOr<TransferId> TransferEngine::StartReceive(epd::v1::Manifest expected,
                                                        std::unique_ptr<TransferBuffer> into,
                                                        uint64_t open_max,
                                                        const TransferOptions& options) {
  if (expected.request_id().empty()) return absl::InvalidArgumentError("Receive: empty request_id");
  const uint64_t total = TotalBytes(expected);
  if (into && total != into->size())
    return absl::InvalidArgumentError(absl::StrCat("Receive: expected manifest sums to ", total,
                                                   " bytes but the buffer holds ", into->size()));
  uint64_t mem = 0;
  bool owns_mem = false;
  if (total > 0) {
    absl::StatusOr<uint64_t> reg = RegistrationFor(into->data(), total, &owns_mem);
    if (!reg.ok()) return reg.status();
    mem = *reg;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (auto e = eager_.find(expected.request_id()); e != eager_.end() && !stopping_) {
    // Its offer came first and is being (or was) received eagerly: take it over.
    const TransferId id = e->second;
    eager_.erase(e);
    if (Transfer* t = Find(id); t != nullptr) {
      if (mem != 0 && owns_mem) {
        wire_->Deregister(mem);
        counters_->registrations.fetch_sub(1);
        metrics_->registrations().Decrement();
      }
      AdoptEagerReceive(*t, expected, open_max, options);
      return id;
    }
  }
  if (stopping_ || receiving_.contains(expected.request_id())) {
    if (mem != 0 && owns_mem) {
      wire_->Deregister(mem);
      counters_->registrations.fetch_sub(1);
      metrics_->registrations().Decrement();
    }
    if (stopping_) return absl::CancelledError("transfer engine shutting down");
    return absl::AlreadyExistsError(
        absl::StrCat("Receive: request '", expected.request_id(), "' is already being received"));
  }
  const int64_t now = clock_.NowMonoNs();
  auto t = std::make_unique<Transfer>();
  t->id = next_id_++;
  t->request_id = expected.request_id();
  t->offsets = SegmentOffsets(expected);
  t->received.assign(expected.segments_size(), 0);
  t->segment_done_ns.assign(expected.segments_size(), 0);
  t->manifest = std::move(expected);
  t->buffer = std::move(into);
  t->mem = mem;
  t->owns_mem = owns_mem;
  t->state = TransferState::kExpecting;
  t->open_max = open_max;
  t->deadline_ms = absl::ToInt64Milliseconds(options.deadline);
  t->deadline_ns = now + absl::ToInt64Nanoseconds(options.deadline);
  t->bytes_total = total;
  Transfer& ref = AddReceive(std::move(t));
  const TransferId id = ref.id;
  ended_receives_.erase(ref.request_id);  // a new receive for the id: offers are welcome again
  auto pending = pending_offers_.find(ref.request_id);
  if (pending != pending_offers_.end()) {
    std::unique_ptr<PendingOffer> offer = std::move(pending->second);
    pending_offers_.erase(pending);
    AcceptOffer(ref, offer->peer, offer->offer);
    if (offer->seal.has_value()) HandleSeal(offer->peer, *offer->seal);
  }
  return id;
}

void TransferEngine::Withdraw(TransferId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Transfer* t = Find(id);
  if (t == nullptr) return;
  if (!t->sender && t->state == TransferState::kExpecting && !t->has_peer) {
    // No offer reached it: an unused reservation ends quietly (no failure metric, no message).
    t->state = TransferState::kFailed;
    t->error = absl::CancelledError(
        absl::StrCat("receive of request '", t->request_id, "' withdrawn before any offer"));
    t->ended_ns = clock_.NowMonoNs();
    auto it = receiving_.find(t->request_id);
    if (it != receiving_.end() && it->second == t->id) receiving_.erase(it);
    RememberEndedReceive(t->request_id, t->error, t->ended_ns);
    TryRelease(*t);
    cv_.notify_all();
  } else if (!t->terminal()) {
    Fail(*t,
         absl::CancelledError(
             absl::StrCat("transfer of request '", t->request_id, "' cancelled: withdrawn")),
         "cancelled", true);
  }
  if (!t->sender && t->released) t->buffer.reset();
  t->collected = true;
}

void TransferEngine::RememberEndedReceive(const std::string& request_id, const absl::Status& error,
                                          int64_t now_ns) {
  constexpr size_t kMaxEndedReceives = 4096;
  constexpr int64_t kEndedReceiveTtlNs = 60'000'000'000;
  if (ended_receives_.size() >= kMaxEndedReceives && !ended_order_.empty()) {
    ended_receives_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  ended_receives_[request_id] = {std::string(error.message()), now_ns + kEndedReceiveTtlNs};
  ended_order_.push_back(request_id);
}

void TransferEngine::Cancel(TransferId id, absl::string_view reason) {
  std::lock_guard<std::mutex> lock(mu_);
  Transfer* t = Find(id);
  if (t == nullptr || t->terminal()) return;
  Fail(*t,
       absl::CancelledError(
           absl::StrCat("transfer of request '", t->request_id, "' cancelled: ", reason)),
       "cancelled", true);
}

absl::StatusOr<TransferStatus> TransferEngine::Status(TransferId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = transfers_.find(id);
  if (it == transfers_.end()) return absl::NotFoundError(absl::StrCat("unknown transfer ", id));
  const Transfer& t = *it->second;
  TransferStatus s;
  s.state = t.state;
  s.error = t.error;
  s.bytes_done = t.bytes_done;
  s.bytes_total = t.bytes_total;
  s.released = t.released;
  s.transport = t.kind;
  return s;
}

absl::Status TransferEngine::Wait(TransferId id, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  Transfer* t = Find(id);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("unknown transfer ", id));
  ++t->waiters;
  bool ended = true;
  while (true) {
    t = Find(id);
    if (t == nullptr || t->terminal()) break;
    if (t->hash_for_waiter && !stopping_) {
      // Hash the landed bytes here, while we wait for them anyway (ScheduleHash).
      t->hash_for_waiter = false;
      ++helpers_hashing_;
      RunHashJob(lock, *t);
      --helpers_hashing_;
      cv_.notify_all();  // Shutdown may be waiting for helpers_hashing_ to reach 0
      continue;
    }
    if (cv_.wait_until(lock, until) == std::cv_status::timeout) {
      t = Find(id);
      ended = t == nullptr || t->terminal();
      break;
    }
  }
  t = Find(id);
  if (t != nullptr && --t->waiters == 0 && t->hash_for_waiter) {
    // A job handed to waiters that all left: the hashing thread does it.
    t->hash_for_waiter = false;
    hash_queue_.push_back(id);
    hash_cv_.notify_one();
  }
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("unknown transfer ", id));
  if (!ended)
    return absl::DeadlineExceededError(absl::StrCat("Wait: transfer ", id, " still ",
                                                    StateName(t->state), " after ",
                                                    absl::FormatDuration(timeout)));
  return t->state == TransferState::kDone ? absl::OkStatus() : t->error;
}

absl::StatusOr<ReceivedTransfer> TransferEngine::TakeReceived(TransferId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Transfer* t = Find(id);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("unknown transfer ", id));
  if (t->sender) return absl::FailedPreconditionError("TakeReceived on a send transfer");
  if (t->state != TransferState::kDone)
    return absl::FailedPreconditionError(
        absl::StrCat("TakeReceived: transfer ", id, " is ", StateName(t->state)));
  if (!t->buffer) return absl::FailedPreconditionError("TakeReceived: already taken");
  ReceivedTransfer out;
  out.manifest = t->manifest;
  out.buffer = std::move(t->buffer);
  out.segment_offsets = t->offsets;
  t->collected = true;
  return out;
}

void TransferEngine::Forget(TransferId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Transfer* t = Find(id);
  if (t == nullptr) return;
  if (!t->terminal()) Fail(*t, absl::CancelledError("forgotten by its owner"), "cancelled", true);
  // A completed receive nobody took: its bytes go now (the wire is done with them).
  if (!t->sender && t->released) t->buffer.reset();
  t->collected = true;
}

void TransferEngine::Detach(TransferId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Transfer* t = Find(id);
  if (t == nullptr) return;
  if (t->terminal() && !t->sender && t->released) t->buffer.reset();
  t->collected = true;  // Tick drops the record once it is terminal and released
}

ResourceCounts TransferEngine::Resources() const {
  ResourceCounts c;
  c.registrations = counters_->registrations.load();
  c.allocations = counters_->allocations.load();
  c.allocated_bytes = counters_->allocated_bytes.load();
  c.live_transfers = counters_->live_transfers.load();
  c.wire_ops = counters_->wire_ops.load();
  if (pool_ != nullptr) pool_->Count(c);
  return c;
}

TransferEngine::Transfer* TransferEngine::Find(TransferId id) {
  auto it = transfers_.find(id);
  return it == transfers_.end() ? nullptr : it->second.get();
}

// ---------------------------------------------------------------------------------------------
// Wire events.

void TransferEngine::OnControl(PeerId peer, std::string bytes) {
  epd::v1::TransferControl msg;
  std::lock_guard<std::mutex> lock(mu_);
  if (!msg.ParseFromString(bytes)) {
    spdlog::warn("transfer: unparsable control message from peer {}; closing it", peer);
    wire_->ClosePeer(peer, absl::DataLossError("unparsable control message"));
    return;
  }
  auto& p = peers_[peer];
  if (!p) {
    p = std::make_unique<Peer>();
    p->id = peer;
    p->kind = wire_->PeerKind(peer);
  }
  switch (msg.body_case()) {
    case epd::v1::TransferControl::kHello:
      HandleHello(peer, msg.hello());
      return;
    case epd::v1::TransferControl::kHelloReply:
      if (p->state == Peer::State::kHandshaking && p->outbound && p->nonce_s.empty()) {
        const auto& r = msg.hello_reply();
        if (!r.accepted()) {
          p->state = Peer::State::kRefused;
          p->error = r.error();
        } else if (r.nonce().size() != kNonceBytes ||
                   !common::ConstantTimeEquals(
                       r.proof(), common::HmacSha256(options_.cluster_token,
                                                     HandshakeTranscript("server", p->nonce_c,
                                                                         r.nonce(),
                                                                         options_.config_fingerprint)))) {
          // The accepting side does not know the cluster secret: it learns nothing from us.
          p->state = Peer::State::kRefused;
          p->error = "the peer could not prove the cluster secret (values not logged)";
          metrics_->AddHandshakeRefused("cluster_secret");
        } else {
          p->nonce_s = r.nonce();
          if (!r.host_id().empty() && r.host_id() == HostId() && r.pid() != getpid())
            p->pid = r.pid();
          epd::v1::TransferControl proof;
          proof.mutable_hello_proof()->set_proof(common::HmacSha256(
              options_.cluster_token, HandshakeTranscript("client", p->nonce_c, p->nonce_s,
                                                          options_.config_fingerprint)));
          SendControl(peer, proof);
          return;  // kHandshaking until TransferHelloDone
        }
        cv_.notify_all();
      }
      return;
    case epd::v1::TransferControl::kHelloProof:
      HandleHelloProof(peer, msg.hello_proof());
      return;
    case epd::v1::TransferControl::kHelloDone:
      if (p->state == Peer::State::kHandshaking && p->outbound && !p->nonce_s.empty()) {
        p->state = msg.hello_done().accepted() ? Peer::State::kReady : Peer::State::kRefused;
        p->error = msg.hello_done().error();
        cv_.notify_all();
      }
      return;
    default:
      break;
  }
  if (p->state != Peer::State::kReady) {
    spdlog::warn(
        "transfer: peer {} sent a transfer message before a successful handshake; "
        "closing it",
        peer);
    wire_->ClosePeer(peer, absl::PermissionDeniedError("message before handshake"));
    return;
  }
  switch (msg.body_case()) {
    case epd::v1::TransferControl::kOffer:
      HandleOffer(peer, msg.offer());
      break;
    case epd::v1::TransferControl::kClaim:
      HandleClaim(peer, msg.claim());
      break;
    case epd::v1::TransferControl::kEnd:
      HandleEnd(peer, msg.end());
      break;
    case epd::v1::TransferControl::kSeal:
      HandleSeal(peer, msg.seal());
      break;
    default:
      break;
  }
}

void TransferEngine::HandleHello(PeerId peer, const epd::v1::TransferHello& hello) {
  Peer& p = *peers_[peer];
  std::string error;
  std::string reason;
  if (hello.protocol_version() != kProtocolVersion) {
    error = absl::StrCat("protocol_version differs (ours ", kProtocolVersion, ", theirs ",
                         hello.protocol_version(), ")");
    reason = "protocol_version";
  } else if (hello.config_fingerprint() != options_.config_fingerprint) {
    error = absl::StrCat("config_fingerprint differs (ours ", options_.config_fingerprint,
                         ", theirs ", hello.config_fingerprint(), ")");
    reason = "config_fingerprint";
  } else if (hello.nonce().size() != kNonceBytes) {
    error = "nonce missing or of the wrong size";
    reason = "cluster_secret";
  } else if (p.outbound || p.state != Peer::State::kHandshaking || p.awaiting_proof) {
    error = "a second hello on one connection";
    reason = "cluster_secret";
  }
  epd::v1::TransferControl reply;
  reply.mutable_hello_reply()->set_accepted(error.empty());
  reply.mutable_hello_reply()->set_error(error);
  reply.mutable_hello_reply()->set_pid(getpid());
  reply.mutable_hello_reply()->set_host_id(HostId());
  if (error.empty()) {
    // Our challenge and our proof; the connection is only ready once theirs checks out.
    if (!hello.host_id().empty() && hello.host_id() == HostId() && hello.pid() != getpid())
      p.pid = hello.pid();
    p.nonce_c = hello.nonce();
    p.nonce_s = common::RandomBytes(kNonceBytes);
    p.awaiting_proof = true;
    p.hello_ns = common::SystemClock::Get().NowMonoNs();
    reply.mutable_hello_reply()->set_nonce(p.nonce_s);
    reply.mutable_hello_reply()->set_proof(common::HmacSha256(
        options_.cluster_token,
        HandshakeTranscript("server", p.nonce_c, p.nonce_s, options_.config_fingerprint)));
    SendControl(peer, reply);
    return;
  }
  p.state = Peer::State::kRefused;
  p.error = error;
  p.refused_ns = common::SystemClock::Get().NowMonoNs();
  metrics_->AddHandshakeRefused(reason);
  spdlog::warn("transfer: refusing connection from '{}' (peer {}): {}", hello.node_name(), peer,
               error);
  // The refused side closes the connection once it has read the reason; Tick closes it here if
  // it does not within a few seconds.
  SendControl(peer, reply);
}

void TransferEngine::HandleHelloProof(PeerId peer, const epd::v1::TransferHelloProof& proof) {
  Peer& p = *peers_[peer];
  epd::v1::TransferControl done;
  if (p.awaiting_proof && p.state == Peer::State::kHandshaking &&
      common::ConstantTimeEquals(
          proof.proof(), common::HmacSha256(options_.cluster_token,
                                            HandshakeTranscript("client", p.nonce_c, p.nonce_s,
                                                                options_.config_fingerprint)))) {
    p.awaiting_proof = false;
    p.state = Peer::State::kReady;
    done.mutable_hello_done()->set_accepted(true);
    SendControl(peer, done);
    return;
  }
  // A wrong secret, a proof replayed from another handshake (other nonces), or a proof out of turn.
  const std::string error = "cluster secret proof refused (values not logged)";
  p.awaiting_proof = false;
  p.state = Peer::State::kRefused;
  p.error = error;
  p.refused_ns = common::SystemClock::Get().NowMonoNs();
  metrics_->AddHandshakeRefused("cluster_secret");
  spdlog::warn("transfer: refusing connection (peer {}): {}", peer, error);
  done.mutable_hello_done()->set_accepted(false);
  done.mutable_hello_done()->set_error(error);
  SendControl(peer, done);
}

void TransferEngine::HandleOffer(PeerId peer, const epd::v1::TransferOffer& offer) {
  const std::string& rid = offer.manifest().request_id();
  auto it = receiving_.find(rid);
  if (it != receiving_.end()) {
    Transfer* t = Find(it->second);
    if (t != nullptr && t->state == TransferState::kExpecting) {
      AcceptOffer(*t, peer, offer);
      return;
    }
  }
  auto reject = [&](std::string error) {
    epd::v1::TransferControl msg;
    auto* end = msg.mutable_end();
    end->set_sender_transfer_id(offer.sender_transfer_id());
    end->set_request_id(rid);
    end->set_ok(false);
    end->set_error(std::move(error));
    end->set_segment_index(-1);
    SendControl(peer, msg);
    DiscardEarlyData(peer, offer);
  };
  if (it != receiving_.end() || pending_offers_.contains(rid)) {
    reject(absl::StrCat("duplicate offer for request '", rid, "'"));
    return;
  }
  if (auto ended = ended_receives_.find(rid); ended != ended_receives_.end()) {
    reject(ended->second.error);  // the receiver gave up before the offer came
    return;
  }
  if (static_cast<int>(pending_offers_.size()) >= options_.max_pending_offers) {
    reject(absl::StrCat("receiver holds too many unclaimed offers (", options_.max_pending_offers,
                        ")"));
    return;
  }
  if (options_.eager_receive_bytes > 0 && offer.data_without_claim() && wire_->PostsReceives()) {
    const std::optional<uint64_t> total = CheckedTotalBytes(offer.manifest());
    if (total.has_value() && *total > 0 && eager_bytes_ <= options_.eager_receive_bytes &&
        *total <= options_.eager_receive_bytes - eager_bytes_) {
      StartEagerReceive(peer, offer, *total);
      return;
    }
  }
  auto pending = std::make_unique<PendingOffer>();
  pending->peer = peer;
  pending->offer = offer;
  pending->expires_ns = clock_.NowMonoNs() + static_cast<int64_t>(offer.lease_ms()) * 1'000'000;
  pending_offers_[rid] = std::move(pending);
}

void TransferEngine::AcceptOffer(Transfer& t, PeerId peer, const epd::v1::TransferOffer& offer) {
  t.peer = peer;
  t.has_peer = true;
  t.remote_id = offer.sender_transfer_id();
  t.kind = KindOf(peer);
  if (t.open_max > 0 && !SizeOpenReceive(t, peer, offer)) return;
  if (std::optional<ManifestMismatch> mm = CompareManifests(t.manifest, offer.manifest())) {
    DiscardEarlyData(peer, offer);
    metrics_->AddAccountingError(mm->segment_label);
    spdlog::warn("transfer: {}", mm->message);
    Fail(t, absl::FailedPreconditionError(mm->message), "accounting", true, mm->segment_index,
         mm->field, true);
    return;
  }
  t.manifest = offer.manifest();  // the sender's checksums: here, or in its seal
  t.checksums_known = !offer.checksums_follow();
  InitHashing(t);
  if (wire_->PostsReceives()) {
    // Every chunk's receive is posted (into the registered buffer, where the chunk belongs)
    // before the claim goes out, so the sender's bytes never wait for a callback to find a home.
    const uint64_t chunk = offer.chunk_bytes();
    uint64_t chunks = 0;
    for (const auto& s : t.manifest.segments())
      chunks += chunk == 0 ? 1 : (s.byte_length() + chunk - 1) / chunk;
    constexpr uint64_t kMaxChunks = 1 << 20;
    if (chunk == 0 || chunks > kMaxChunks) {
      const std::string msg = absl::StrCat(
          "accounting error in request '", t.request_id, "': the offer's chunk_bytes ", chunk,
          " makes ", chunk == 0 ? 0 : chunks, " chunks (1 to ", kMaxChunks, " allowed)");
      metrics_->AddAccountingError("header");
      spdlog::warn("transfer: {}", msg);
      Fail(t, absl::FailedPreconditionError(msg), "accounting", true, -1, "chunk_bytes", true);
      return;
    }
    t.posted = true;
    for (int i = 0; i < t.manifest.segments_size(); ++i) {
      const uint64_t len = t.manifest.segments(i).byte_length();
      for (uint64_t off = 0; off < len; off += chunk) {
        DataHeader h;
        h.receiver_transfer_id = t.id;
        h.sender_transfer_id = t.remote_id;
        h.segment = static_cast<uint32_t>(i);
        h.offset = off;
        h.length = std::min(chunk, len - off);
        t.ranges[i][off] = {h.length, false};
        ++t.ops;
        counters_->wire_ops.fetch_add(1);
        wire_->PostReceive(peer, h, t.buffer->data() + t.offsets[i] + off, t.mem);
      }
    }
  }
  t.state = TransferState::kTransferring;
  t.claim_ns = clock_.NowMonoNs();
  epd::v1::TransferControl msg;
  msg.mutable_claim()->set_sender_transfer_id(t.remote_id);
  msg.mutable_claim()->set_receiver_transfer_id(t.id);
  SendControl(peer, msg);
  MaybeFinishReceive(t);
}

TransferEngine::Transfer& TransferEngine::AddReceive(std::unique_ptr<Transfer> t) {
  counters_->live_transfers.fetch_add(1);
  metrics_->live_transfers().Increment();
  Transfer& ref = *t;
  receiving_[ref.request_id] = ref.id;
  transfers_[ref.id] = std::move(t);
  return ref;
}

void TransferEngine::EndEager(Transfer& t) {
  t.eager = false;
  eager_bytes_ -= std::min(eager_bytes_, t.eager_bytes);
  t.eager_bytes = 0;
}

void TransferEngine::StartEagerReceive(PeerId peer, const epd::v1::TransferOffer& offer,
                                       uint64_t total) {
  const int64_t now = clock_.NowMonoNs();
  const int64_t lease_ns = static_cast<int64_t>(offer.lease_ms()) * 1'000'000;
  auto t = std::make_unique<Transfer>();
  t->id = next_id_++;
  t->request_id = offer.manifest().request_id();
  t->manifest = offer.manifest();  // sized and checked against itself; the Receive compares later
  t->state = TransferState::kExpecting;
  t->open_max = total;
  t->deadline_ms = static_cast<int64_t>(offer.lease_ms());
  t->deadline_ns = now + lease_ns;
  t->eager = true;
  t->eager_bytes = total;
  t->eager_expires_ns = now + lease_ns;
  Transfer& ref = AddReceive(std::move(t));
  eager_[ref.request_id] = ref.id;
  eager_bytes_ += total;
  AcceptOffer(ref, peer, offer);
}

void TransferEngine::AdoptEagerReceive(Transfer& t, const epd::v1::Manifest& expected,
                                       uint64_t open_max, const TransferOptions& options) {
  EndEager(t);
  if (!t.terminal()) {
    t.deadline_ms = absl::ToInt64Milliseconds(options.deadline);
    t.deadline_ns = clock_.NowMonoNs() + absl::ToInt64Nanoseconds(options.deadline);
  }
  if (t.state == TransferState::kFailed) return;  // the caller's Wait reports why
  epd::v1::Manifest want = expected;
  std::optional<ManifestMismatch> mm;
  if (open_max > 0 && want.segments_size() == t.manifest.segments_size()) {
    for (int i = 0; i < want.segments_size(); ++i)
      want.mutable_segments(i)->set_byte_length(t.manifest.segments(i).byte_length());
    if (t.bytes_total > open_max) {
      mm = ManifestMismatch{};
      mm->segment_label = "header";
      mm->field = "byte_length";
      mm->message =
          absl::StrCat("accounting error in request '", t.request_id, "': the offer carries ",
                       t.bytes_total, " bytes, over the receive's limit of ", open_max);
    }
  }
  if (!mm.has_value()) mm = CompareManifests(want, t.manifest);
  if (!mm.has_value()) return;
  metrics_->AddAccountingError(mm->segment_label);
  spdlog::warn("transfer: {}", mm->message);
  if (!t.terminal()) {
    Fail(t, absl::FailedPreconditionError(mm->message), "accounting", true, mm->segment_index,
         mm->field, true);
    return;
  }
  // Already received in full, but not what this receiver expects: it gets the error, not bytes.
  t.state = TransferState::kFailed;
  t.error = WithTransferError(absl::FailedPreconditionError(mm->message), "accounting", mm->field);
  metrics_->AddFailure("all", TransportLabel(t.kind), "accounting");
  if (t.released) t.buffer.reset();
  cv_.notify_all();
}

bool TransferEngine::SizeOpenReceive(Transfer& t, PeerId peer,
                                     const epd::v1::TransferOffer& offer) {
  const epd::v1::Manifest& m = offer.manifest();
  const std::optional<uint64_t> checked = CheckedTotalBytes(m);
  const uint64_t total = checked.value_or(TotalBytes(m));
  std::string problem;
  std::string field = "byte_length";
  if (m.segments_size() != t.manifest.segments_size()) {
    problem = absl::StrCat("the offer has ", m.segments_size(), " segments, ",
                           t.manifest.segments_size(), " expected");
    field = "segments";
  } else if (!checked.has_value() || total > t.open_max) {
    problem = absl::StrCat("the offer carries ", total, " bytes, over the receive's limit of ",
                           t.open_max);
  }
  if (!problem.empty()) {
    const std::string msg =
        absl::StrCat("accounting error in request '", t.request_id, "': ", problem);
    DiscardEarlyData(peer, offer);
    metrics_->AddAccountingError("header");
    spdlog::warn("transfer: {}", msg);
    Fail(t, absl::FailedPreconditionError(msg), "accounting", true, -1, field, true);
    return false;
  }
  for (int i = 0; i < m.segments_size(); ++i)
    t.manifest.mutable_segments(i)->set_byte_length(m.segments(i).byte_length());
  absl::StatusOr<std::unique_ptr<TransferBuffer>> buffer = Allocate(total);
  absl::StatusOr<uint64_t> reg = uint64_t{0};
  bool owns_mem = false;
  if (buffer.ok() && total > 0) reg = RegistrationFor((*buffer)->data(), total, &owns_mem);
  if (!buffer.ok() || !reg.ok()) {
    DiscardEarlyData(peer, offer);
    Fail(t, !buffer.ok() ? buffer.status() : reg.status(), "memory", true);
    return false;
  }
  t.buffer = std::move(*buffer);
  t.mem = *reg;
  t.owns_mem = owns_mem;
  t.offsets = SegmentOffsets(t.manifest);
  t.received.assign(m.segments_size(), 0);
  t.segment_done_ns.assign(m.segments_size(), 0);
  t.bytes_total = total;
  t.open_max = 0;  // sized: from here on an ordinary receive
  return true;
}

void TransferEngine::HandleClaim(PeerId peer, const epd::v1::TransferClaim& claim) {
  Transfer* t = Find(claim.sender_transfer_id());
  if (t == nullptr || !t->sender || t->peer != peer || t->state != TransferState::kOffered) {
    // Too late (lease expired, cancelled): tell the receiver so it fails now, not at deadline.
    epd::v1::TransferControl msg;
    auto* end = msg.mutable_end();
    end->set_sender_transfer_id(claim.sender_transfer_id());
    end->set_receiver_transfer_id(claim.receiver_transfer_id());
    end->set_from_sender(true);
    end->set_ok(false);
    end->set_error(t == nullptr ? "sender no longer holds this transfer"
                                : absl::StrCat("sender's transfer is ", StateName(t->state),
                                               t->error.ok() ? "" : ": " + t->error.ToString()));
    SendControl(peer, msg);
    return;
  }
  t->remote_id = claim.receiver_transfer_id();
  t->state = TransferState::kTransferring;
  t->claim_ns = clock_.NowMonoNs();
  if (!t->data_started) StartSending(*t);
  MaybeSeal(*t);
}

void TransferEngine::StartSending(Transfer& t) {
  t.data_started = true;
  const uint64_t chunk = options_.chunk_bytes;
  for (int i = 0; i < t.manifest.segments_size(); ++i) {
    const uint64_t len = t.manifest.segments(i).byte_length();
    for (uint64_t off = 0; off < len; off += chunk) {
      DataHeader h;
      h.receiver_transfer_id = t.remote_id;
      h.sender_transfer_id = t.id;
      h.segment = static_cast<uint32_t>(i);
      h.offset = off;
      h.length = std::min(chunk, len - off);
      ++t.ops;
      counters_->wire_ops.fetch_add(1);
      const TransferId id = t.id;
      const uint64_t n = h.length;
      wire_->SendData(t.peer, h, t.buffer->data() + t.offsets[i] + off, h.length, t.mem,
                      [this, id, n, i](absl::Status st) {
                        std::lock_guard<std::mutex> lock(mu_);
                        counters_->wire_ops.fetch_sub(1);
                        Transfer* tr = Find(id);
                        if (tr == nullptr) return;
                        --tr->ops;
                        if (st.ok()) {
                          tr->bytes_done += n;
                        } else if (tr->state == TransferState::kTransferring) {
                          // (Before the claim a failed chunk decides nothing: the receiver's
                          // refusal, the lease or the connection's end does.)
                          Fail(*tr,
                               absl::UnavailableError(absl::StrCat(
                                   "sending ", DescribeSegment(tr->manifest, i), " of request '",
                                   tr->request_id, "' failed: ", st.message())),
                               "wire", true, i);
                        }
                        TryRelease(*tr);
                        cv_.notify_all();
                      });
    }
  }
}

void TransferEngine::HandleEnd(PeerId peer, const epd::v1::TransferEnd& end) {
  Transfer* t = nullptr;
  if (end.from_sender()) {
    if (end.receiver_transfer_id() != 0) {
      t = Find(end.receiver_transfer_id());
    } else {
      auto pending = pending_offers_.find(end.request_id());
      if (pending != pending_offers_.end() && pending->second->peer == peer) {
        DiscardEarlyData(peer, pending->second->offer);
        pending_offers_.erase(pending);
        return;
      }
      auto it = receiving_.find(end.request_id());
      if (it != receiving_.end()) t = Find(it->second);
    }
    if (t == nullptr || t->sender || !t->has_peer || t->peer != peer ||
        t->remote_id != end.sender_transfer_id())
      return;
    Fail(*t,
         absl::AbortedError(absl::StrCat("sender ended the transfer of request '", t->request_id,
                                         "': ", end.error())),
         "peer_ended", false);
    return;
  }
  t = Find(end.sender_transfer_id());
  if (t == nullptr || !t->sender || t->peer != peer || t->terminal()) return;
  if (end.ok()) {
    Complete(*t);
    return;
  }
  const std::string msg =
      absl::StrCat("receiver rejected request '", t->request_id, "': ", end.error());
  Fail(*t, end.accounting_error() ? absl::FailedPreconditionError(msg) : absl::AbortedError(msg),
       end.accounting_error() ? "rejected_accounting" : "rejected", false, end.segment_index(),
       end.field());
}

DataSink TransferEngine::OnDataBegin(PeerId peer, const DataHeader& h, uint64_t wire_length) {
  std::lock_guard<std::mutex> lock(mu_);
  Transfer* t = Find(h.receiver_transfer_id);
  if (t == nullptr || t->sender || !t->has_peer || t->peer != peer ||
      t->state != TransferState::kTransferring)
    return {};
  if (h.segment >= static_cast<uint32_t>(t->manifest.segments_size())) {
    Fail(*t,
         absl::DataLossError(absl::StrCat("request '", t->request_id, "': chunk for segment ",
                                          h.segment, " but the manifest has ",
                                          t->manifest.segments_size())),
         "bad_chunk", true);
    return {};
  }
  const auto& seg = t->manifest.segments(h.segment);
  const int si = static_cast<int>(h.segment);
  std::string problem;
  if (wire_length != h.length) {
    problem = absl::StrCat("chunk at offset ", h.offset, " carries ", wire_length,
                           " bytes but its header says ", h.length, " (truncated)");
  } else if (h.offset + h.length > seg.byte_length() || h.offset + h.length < h.offset) {
    problem = absl::StrCat("chunk [", h.offset, ", ", h.offset + h.length,
                           ") lies beyond byte_length ", seg.byte_length());
  } else if (t->received[si] + h.length > seg.byte_length()) {
    problem = absl::StrCat("more bytes than byte_length ", seg.byte_length(), " (",
                           t->received[si] + h.length, ")");
  } else if (h.length > 0 && Overlaps(*t, si, h.offset, h.length)) {
    problem = absl::StrCat("chunk [", h.offset, ", ", h.offset + h.length,
                           ") overlaps bytes already received");
  }
  if (!problem.empty()) {
    const std::string msg = absl::StrCat("accounting error in request '", t->request_id,
                                         "': ", DescribeSegment(t->manifest, si), ": ", problem);
    metrics_->AddAccountingError(SegmentKindLabel(seg.kind()));
    spdlog::warn("transfer: {}", msg);
    Fail(*t, absl::DataLossError(msg), "truncated", true, si, "byte_length", true);
    return {};
  }
  ++t->ops;
  counters_->wire_ops.fetch_add(1);
  if (h.length > 0) t->ranges[si][h.offset] = {h.length, false};
  return {t->buffer->data() + t->offsets[si] + h.offset, t->mem};
}

void TransferEngine::OnDataEnd(PeerId peer, const DataHeader& h, uint64_t wire_length,
                               absl::Status status) {
  std::unique_lock<std::mutex> lock(mu_);
  counters_->wire_ops.fetch_sub(1);
  Transfer* t = Find(h.receiver_transfer_id);
  if (t == nullptr) return;
  --t->ops;
  if (t->state == TransferState::kTransferring && t->posted && h.segment < t->received.size() &&
      (wire_length != h.length || absl::IsDataLoss(status))) {
    // A posted receive that got fewer (or more) bytes than its chunk: the sender's accounting is
    // off. Named like the arrival check of OnDataBegin.
    const int si = static_cast<int>(h.segment);
    const std::string msg =
        absl::StrCat("accounting error in request '", t->request_id,
                     "': ", DescribeSegment(t->manifest, si), ": chunk at offset ", h.offset,
                     " carries ", status.ok() ? absl::StrCat(wire_length) : std::string("more"),
                     " bytes but its header says ", h.length, " (truncated)");
    metrics_->AddAccountingError(SegmentKindLabel(t->manifest.segments(si).kind()));
    spdlog::warn("transfer: {}", msg);
    Fail(*t, absl::DataLossError(msg), "truncated", true, si, "byte_length", true);
  }
  if (t->state == TransferState::kTransferring) {
    if (status.ok()) {
      t->received[h.segment] += h.length;
      t->bytes_done += h.length;
      if (t->received[h.segment] == t->manifest.segments(h.segment).byte_length())
        t->segment_done_ns[h.segment] = clock_.NowMonoNs();
      auto r = t->ranges[h.segment].find(h.offset);
      if (r != t->ranges[h.segment].end()) r->second.second = true;
      if (HashesInline(t->bytes_total)) {
        HashOnThisThread(lock, *t);
      } else {
        ScheduleHash(*t);  // the chunk is hashed while the next ones land
      }
      MaybeFinishReceive(*t);
    } else {
      Fail(*t,
           absl::UnavailableError(
               absl::StrCat("receiving ", DescribeSegment(t->manifest, h.segment), " of request '",
                            t->request_id, "' failed: ", status.message())),
           "wire", true, h.segment);
    }
  }
  TryRelease(*t);
  cv_.notify_all();
}

void TransferEngine::DiscardEarlyData(PeerId peer, const epd::v1::TransferOffer& offer) {
  if (!offer.data_without_claim() || !wire_->PostsReceives()) return;
  const uint64_t chunk = offer.chunk_bytes();
  if (chunk == 0) return;
  std::vector<DataHeader> chunks;
  for (int i = 0; i < offer.manifest().segments_size(); ++i) {
    const uint64_t len = offer.manifest().segments(i).byte_length();
    if (len / chunk + chunks.size() > (1u << 20)) return;  // not a sender of ours
    for (uint64_t off = 0; off < len; off += chunk) {
      DataHeader h;
      h.sender_transfer_id = offer.sender_transfer_id();
      h.segment = static_cast<uint32_t>(i);
      h.offset = off;
      h.length = std::min(chunk, len - off);
      chunks.push_back(h);
    }
  }
  wire_->DiscardChunks(peer, std::move(chunks));
}

void TransferEngine::InitHashing(Transfer& t) {
  const int n = t.manifest.segments_size();
  t.hashed.assign(n, 0);
  t.ranges.assign(n, {});
  t.digests.assign(n, 0);
  t.hash_states.clear();
  t.hash_states.reserve(n);
  t.unhashed = 0;
  for (int i = 0; i < n; ++i) {
    t.hash_states.emplace_back(XXH3_createState());
    XXH3_64bits_reset(t.hash_states.back().get());
    if (t.manifest.segments(i).byte_length() == 0) {
      t.digests[i] = XXH3_64bits_digest(t.hash_states.back().get());
    } else {
      ++t.unhashed;
    }
  }
}

bool TransferEngine::Overlaps(const Transfer& t, int si, uint64_t offset, uint64_t length) const {
  if (offset < t.hashed[si]) return true;
  const auto& r = t.ranges[si];
  auto next = r.upper_bound(offset);
  if (next != r.end() && next->first < offset + length) return true;
  if (next != r.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.first > offset) return true;
  }
  return false;
}

void TransferEngine::ScheduleHash(Transfer& t) {
  if (t.hash_busy || t.terminal() || t.unhashed == 0) return;
  t.hash_busy = true;
  if (t.waiters > 0) {
    t.hash_for_waiter = true;  // a thread in Wait() takes it (one thread hop fewer)
    cv_.notify_all();
    return;
  }
  hash_queue_.push_back(t.id);
  hash_cv_.notify_one();
}

void TransferEngine::HashOnThisThread(std::unique_lock<std::mutex>& lock, Transfer& t) {
  // A job already queued or running (a waiter's, the hashing thread's) takes this chunk too.
  if (t.hash_busy || t.terminal() || t.unhashed == 0) return;
  t.hash_busy = true;
  RunHashJob(lock, t);  // keeps `t` alive (hash_busy) while mu_ is released
}

void TransferEngine::HashLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    hash_cv_.wait(lock, [&] { return stopping_ || !hash_queue_.empty(); });
    if (stopping_) return;
    const TransferId id = hash_queue_.front();
    hash_queue_.pop_front();
    Transfer* t = Find(id);
    if (t == nullptr) continue;
    RunHashJob(lock, *t);
  }
}

void TransferEngine::RunHashJob(std::unique_lock<std::mutex>& lock, Transfer& t) {
  // Hash the landed bytes of each segment in order, a step at a time, without mu_ (the buffer
  // cannot be released while hash_busy is set).
  while (!t.terminal() && !stopping_) {
    int si = -1;
    for (int i = 0; i < static_cast<int>(t.ranges.size()) && si < 0; ++i) {
      const auto& r = t.ranges[i];
      if (!r.empty() && r.begin()->first == t.hashed[i] && r.begin()->second.second) si = i;
    }
    if (si < 0) break;
    auto first = t.ranges[si].begin();
    const uint64_t offset = first->first;
    const uint64_t n = std::min(first->second.first, kHashStep);
    if (n < first->second.first) t.ranges[si][offset + n] = {first->second.first - n, true};
    t.ranges[si].erase(first);
    const uint8_t* p = t.buffer->data() + t.offsets[si] + offset;
    XXH3_state_t* state = t.hash_states[si].get();
    lock.unlock();
    XXH3_64bits_update(state, p, n);
    lock.lock();
    t.hashed[si] += n;
    if (t.hashed[si] == t.manifest.segments(si).byte_length()) {
      t.digests[si] = XXH3_64bits_digest(state);
      --t.unhashed;
    }
  }
  t.hash_busy = false;
  if (stopping_) {
    cv_.notify_all();
    return;
  }
  if (!t.terminal()) {
    if (t.sender) {
      MaybeSeal(t);
    } else {
      MaybeFinishReceive(t);
    }
  }
  TryRelease(t);
  cv_.notify_all();
}

void TransferEngine::MaybeSeal(Transfer& t) {
  // Claimed or not: the receiver needs the checksums, not our knowledge of its transfer id, so the
  // seal does not wait for the claim's round trip.
  if (!t.sender || t.sealed || t.unhashed > 0 ||
      (t.state != TransferState::kTransferring && t.state != TransferState::kOffered))
    return;
  t.sealed = true;
  epd::v1::TransferControl msg;
  auto* seal = msg.mutable_seal();
  seal->set_sender_transfer_id(t.id);
  seal->set_receiver_transfer_id(t.remote_id);
  seal->set_request_id(t.request_id);
  for (int i = 0; i < t.manifest.segments_size(); ++i) {
    t.manifest.mutable_segments(i)->set_checksum(t.digests[i]);
    seal->add_checksums(t.digests[i]);
  }
  SendControl(t.peer, msg);
}

void TransferEngine::HandleSeal(PeerId peer, const epd::v1::TransferSeal& seal) {
  Transfer* t = seal.receiver_transfer_id() != 0 ? Find(seal.receiver_transfer_id()) : nullptr;
  if (seal.receiver_transfer_id() == 0) {
    // Sent before the sender saw our claim: the offer may still be held here (no Receive yet),
    // or already accepted.
    auto pending = pending_offers_.find(seal.request_id());
    if (pending != pending_offers_.end()) {
      if (pending->second->peer == peer &&
          pending->second->offer.sender_transfer_id() == seal.sender_transfer_id() &&
          !pending->second->seal.has_value())
        pending->second->seal = seal;
      return;
    }
    auto it = receiving_.find(seal.request_id());
    if (it != receiving_.end()) t = Find(it->second);
  }
  if (t == nullptr || t->sender || !t->has_peer || t->peer != peer ||
      t->remote_id != seal.sender_transfer_id() || t->state != TransferState::kTransferring)
    return;
  if (t->checksums_known || seal.checksums_size() != t->manifest.segments_size()) {
    const std::string msg = absl::StrCat("accounting error in request '", t->request_id,
                                         "': the sender's seal carries ", seal.checksums_size(),
                                         " checksums for ", t->manifest.segments_size(),
                                         " segments", t->checksums_known ? " (a second seal)" : "");
    metrics_->AddAccountingError("all");
    spdlog::warn("transfer: {}", msg);
    Fail(*t, absl::DataLossError(msg), "accounting", true, -1, "checksum", true);
    return;
  }
  for (int i = 0; i < seal.checksums_size(); ++i)
    t->manifest.mutable_segments(i)->set_checksum(seal.checksums(i));
  t->checksums_known = true;
  MaybeFinishReceive(*t);
}

void TransferEngine::MaybeFinishReceive(Transfer& t) {
  if (t.state != TransferState::kTransferring || t.ops != 0) return;
  for (int i = 0; i < t.manifest.segments_size(); ++i)
    if (t.received[i] != t.manifest.segments(i).byte_length()) return;
  // Every byte is in; the checksums are ready once the hashing thread has caught up and the
  // sender's seal has arrived.
  if (t.unhashed > 0 || !t.checksums_known) return;
  for (int i = 0; i < t.manifest.segments_size(); ++i) {
    const auto& s = t.manifest.segments(i);
    const uint64_t got = t.digests[i];
    if (got != s.checksum()) {
      const std::string msg = absl::StrCat(
          "accounting error in request '", t.request_id, "': ", DescribeSegment(t.manifest, i),
          " field checksum: manifest says ", s.checksum(), ", the received bytes hash to ", got);
      metrics_->AddAccountingError(SegmentKindLabel(s.kind()));
      spdlog::warn("transfer: {}", msg);
      Fail(t, absl::DataLossError(msg), "checksum", true, i, "checksum", true);
      return;
    }
  }
  epd::v1::TransferControl msg;
  auto* end = msg.mutable_end();
  end->set_sender_transfer_id(t.remote_id);
  end->set_receiver_transfer_id(t.id);
  end->set_request_id(t.request_id);
  end->set_ok(true);
  SendControl(t.peer, msg);
  Complete(t);
}

void TransferEngine::Complete(Transfer& t) {
  t.state = TransferState::kDone;
  if (t.has_peer) t.kind = wire_->PeerKind(t.peer);  // lanes are final once bytes moved
  t.ended_ns = clock_.NowMonoNs();
  if (t.sender) t.bytes_done = t.bytes_total;
  const absl::string_view transport = TransportLabel(t.kind);
  const absl::string_view dir = t.sender ? "send" : "recv";
  absl::flat_hash_map<absl::string_view, std::pair<uint64_t, int64_t>> per_kind;
  for (int i = 0; i < t.manifest.segments_size(); ++i) {
    auto& [bytes, done_ns] = per_kind[SegmentKindLabel(t.manifest.segments(i).kind())];
    bytes += t.manifest.segments(i).byte_length();
    const int64_t seg_done = t.sender ? t.ended_ns : std::max(t.segment_done_ns[i], t.claim_ns);
    done_ns = std::max(done_ns, seg_done);
  }
  for (const auto& [kind, v] : per_kind) {
    metrics_->AddBytes(kind, transport, dir, static_cast<double>(v.first));
    metrics_->ObserveDuration(
        kind, transport, dir,
        static_cast<double>(std::max<int64_t>(0, v.second - t.claim_ns)) / 1e9);
  }
  if (!t.sender) receiving_.erase(t.request_id);
  TryRelease(t);
  cv_.notify_all();
}

void TransferEngine::Fail(Transfer& t, absl::Status error, absl::string_view reason, bool tell_peer,
                          int segment, std::string field, bool accounting) {
  if (t.terminal()) return;
  t.state = TransferState::kFailed;
  if (t.has_peer) t.kind = wire_->PeerKind(t.peer);
  t.error = WithTransferError(std::move(error), reason, field);
  t.ended_ns = clock_.NowMonoNs();
  const absl::string_view seg_label = segment >= 0 && segment < t.manifest.segments_size()
                                          ? SegmentKindLabel(t.manifest.segments(segment).kind())
                                          : absl::string_view("all");
  metrics_->AddFailure(seg_label, TransportLabel(t.kind), reason);
  if (tell_peer && t.has_peer) {
    epd::v1::TransferControl msg;
    auto* end = msg.mutable_end();
    end->set_from_sender(t.sender);
    end->set_sender_transfer_id(t.sender ? t.id : t.remote_id);
    end->set_receiver_transfer_id(t.sender ? t.remote_id : t.id);
    end->set_request_id(t.request_id);
    end->set_ok(false);
    end->set_error(std::string(t.error.message()));
    end->set_segment_index(segment);
    end->set_field(field);
    end->set_accounting_error(accounting);
    SendControl(t.peer, msg);
  }
  if (!t.sender) {
    auto it = receiving_.find(t.request_id);
    if (it != receiving_.end() && it->second == t.id) receiving_.erase(it);
    if (!t.has_peer) RememberEndedReceive(t.request_id, t.error, t.ended_ns);
  }
  TryRelease(t);
  cv_.notify_all();
}

void TransferEngine::TryRelease(Transfer& t) {
  if (!t.terminal() || t.ops > 0 || t.hash_busy || t.released) return;
  if (t.mem != 0 && !t.owns_mem) {
    t.mem = 0;  // a RegisterMemory region: its owner deregisters it
  } else if (t.mem != 0) {
    wire_->Deregister(t.mem);
    t.mem = 0;
    counters_->registrations.fetch_sub(1);
    metrics_->registrations().Decrement();
  }
  // A successful receive keeps its bytes for TakeReceived; everything else frees them now.
  if (t.sender || t.state == TransferState::kFailed) t.buffer.reset();
  t.released = true;
  counters_->live_transfers.fetch_sub(1);
  metrics_->live_transfers().Decrement();
}

void TransferEngine::OnPeerDown(PeerId peer, absl::Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto pit = peers_.find(peer);
  if (pit != peers_.end()) {
    if (pit->second->state == Peer::State::kHandshaking) pit->second->error = why.ToString();
    if (pit->second->state != Peer::State::kRefused) pit->second->state = Peer::State::kDown;
  }
  for (auto& [id, t] : transfers_) {
    if (t->has_peer && t->peer == peer && !t->terminal())
      Fail(*t,
           absl::UnavailableError(
               absl::StrCat("peer of request '", t->request_id, "' disconnected: ", why.message())),
           "peer_down", false);
  }
  for (auto it = pending_offers_.begin(); it != pending_offers_.end();) {
    if (it->second->peer == peer) {
      it = pending_offers_.erase(it);
    } else {
      ++it;
    }
  }
  // A closed connection is never reused (a reconnect gets a new PeerId); a handshake still
  // waiting in Connect keeps its record so it can report why.
  if (pit != peers_.end() && !pit->second->outbound) peers_.erase(pit);
  cv_.notify_all();
}

void TransferEngine::TickLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.tick));
    if (stopping_) break;
    std::vector<LivenessProbe> probes = DueLivenessProbes();
    if (!probes.empty()) {
      // /proc is read without mu_: the wire callbacks wait on it.
      lock.unlock();
      for (LivenessProbe& probe : probes) probe.now_ticks = ProcessStartTicks(probe.pid);
      lock.lock();
      if (stopping_) break;
    }
    Tick(probes);
  }
}

std::vector<TransferEngine::LivenessProbe> TransferEngine::DueLivenessProbes() {
  std::vector<LivenessProbe> probes;
  // Same-host peers: a dead process is noticed within liveness_period (UCX shared memory has no
  // peer-failure handler in 1.13). Real time, not the injected clock: this is about processes.
  const int64_t real_now = common::SystemClock::Get().NowMonoNs();
  if (real_now - last_liveness_ns_ < absl::ToInt64Nanoseconds(options_.liveness_period)) {
    return probes;
  }
  last_liveness_ns_ = real_now;
  for (auto& [id, p] : peers_) {
    if (p->state == Peer::State::kRefused && p->refused_ns > 0 &&
        real_now - p->refused_ns > 3'000'000'000) {
      p->refused_ns = 0;
      wire_->ClosePeer(id, absl::FailedPreconditionError("handshake refused: " + p->error));
    }
    // A connection that took our challenge and never answered it (a stranger holding it open).
    if (p->awaiting_proof && p->hello_ns > 0 && real_now - p->hello_ns > 10'000'000'000) {
      p->hello_ns = 0;
      wire_->ClosePeer(id, absl::PermissionDeniedError("no handshake proof within 10 s"));
    }
    if (p->pid > 0 && p->state == Peer::State::kReady) {
      probes.push_back({.id = id, .pid = p->pid, .start_ticks = p->pid_start});
    }
  }
  return probes;
}

void TransferEngine::Tick(const std::vector<LivenessProbe>& probes) {
  const int64_t now = clock_.NowMonoNs();
  std::vector<PeerId> to_close;
  for (const LivenessProbe& probe : probes) {
    auto it = peers_.find(probe.id);
    if (it == peers_.end()) continue;
    Peer& p = *it->second;
    if (p.state != Peer::State::kReady || p.pid != probe.pid) continue;
    // A PID that now names another process (reused after the peer died) counts as exited.
    const bool exited = probe.now_ticks < 0 || (probe.start_ticks > 0 && probe.now_ticks > 0 &&
                                                probe.now_ticks != probe.start_ticks);
    if (!exited) {
      if (p.pid_start == 0) p.pid_start = probe.now_ticks;
      continue;
    }
    spdlog::warn("transfer: peer {} (pid {}) has exited; closing its connection", probe.id,
                 probe.pid);
    p.state = Peer::State::kDown;
    wire_->ClosePeer(probe.id,
                     absl::UnavailableError(absl::StrCat("peer process ", probe.pid, " exited")),
                     /*peer_dead=*/true);
  }
  for (auto& [id, tp] : transfers_) {
    Transfer& t = *tp;
    if (!t.terminal()) {
      if (t.sender && t.state == TransferState::kOffered && now >= t.lease_ns) {
        Fail(t,
             absl::DeadlineExceededError(
                 absl::StrCat("lease expired: the receiver never claimed request '", t.request_id,
                              "'; the sender's copy was released")),
             "lease_expired", true);
      } else if (now >= t.deadline_ns) {
        std::string detail;
        if (!t.sender && t.state == TransferState::kTransferring) {
          for (int i = 0; i < t.manifest.segments_size(); ++i) {
            if (t.received[i] != t.manifest.segments(i).byte_length()) {
              detail = absl::StrCat("; ", DescribeSegment(t.manifest, i), " has ", t.received[i],
                                    " of ", t.manifest.segments(i).byte_length(), " bytes");
              break;
            }
          }
        }
        Fail(t,
             absl::DeadlineExceededError(absl::StrCat("transfer of request '", t.request_id,
                                                      "' exceeded its deadline of ", t.deadline_ms,
                                                      " ms while ", StateName(t.state), detail)),
             "deadline", true);
      }
    }
    // Operations still in flight after the grace period: force-close the connection so the
    // wire completes them and the memory is provably no longer in use.
    if (t.terminal() && t.ops > 0 && !t.forced_close && t.has_peer &&
        now >= t.ended_ns + absl::ToInt64Nanoseconds(options_.release_grace)) {
      if (t.posted && !t.receives_cancelled) {
        // First the receives no chunk has matched (a stuck or failed sender): cancelling them
        // completes them without touching the connection. Whatever is still in flight after
        // another grace period gets the connection force-closed.
        t.receives_cancelled = true;
        t.ended_ns = now;
        wire_->CancelReceives(t.peer, t.id);
      } else {
        t.forced_close = true;
        to_close.push_back(t.peer);
      }
    }
  }
  for (PeerId peer : to_close) {
    spdlog::warn(
        "transfer: force-closing peer {}: a finished transfer still has operations in "
        "flight",
        peer);
    wire_->ClosePeer(peer, absl::AbortedError("transfer ended with operations in flight"));
  }
  for (auto it = pending_offers_.begin(); it != pending_offers_.end();) {
    if (now >= it->second->expires_ns) {
      DiscardEarlyData(it->second->peer, it->second->offer);
      it = pending_offers_.erase(it);
    } else {
      ++it;
    }
  }
  while (!ended_order_.empty()) {
    auto e = ended_receives_.find(ended_order_.front());
    if (e != ended_receives_.end() && now < e->second.expires_ns) break;
    if (e != ended_receives_.end()) ended_receives_.erase(e);
    ended_order_.pop_front();
  }
  // Eager receives no Receive took within the sender's lease: dropped.
  for (auto it = eager_.begin(); it != eager_.end();) {
    Transfer* t = Find(it->second);
    if (t != nullptr && now < t->eager_expires_ns) {
      ++it;
      continue;
    }
    if (t != nullptr) {
      EndEager(*t);
      if (!t->terminal())
        Fail(*t,
             absl::DeadlineExceededError(absl::StrCat("request '", t->request_id,
                                                      "' was received eagerly but no Receive took "
                                                      "it within the sender's lease")),
             "lease_expired", true);
      if (t->released) t->buffer.reset();
      t->collected = true;
    }
    eager_.erase(it++);
  }
  // Collect records nobody will ask about any more.
  int terminal = 0;
  for (auto it = transfers_.begin(); it != transfers_.end();) {
    Transfer& t = *it->second;
    if (t.terminal() && t.released && t.collected && t.ops == 0) {
      it = transfers_.erase(it);
      continue;
    }
    if (t.terminal()) ++terminal;
    ++it;
  }
  for (auto it = transfers_.begin();
       terminal > options_.max_terminal_records && it != transfers_.end(); ++it) {
    if (it->second->terminal() && !it->second->collected) {
      it->second->collected = true;
      --terminal;
    }
  }
}

}  // namespace epd::transfer
