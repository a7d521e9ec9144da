#include "transfer/ucx_wire.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "transfer/transfer_metrics.h"
#include "prometheus/registry.h"
#include "spdlog/spdlog.h"

namespace epd::transfer {
namespace {

constexpr unsigned kAmControl = 17;
constexpr unsigned kAmData = 18;

enum CtlType : uint32_t { kWireHello = 1, kWireHelloAck = 2, kEngineMsg = 3 };

struct CtlHeader {
  uint64_t dest_peer;  // receiver's id for this connection (0 in kWireHello)
  uint64_t src_peer;   // sender's id for it
  uint32_t type;
  uint32_t reserved;
};
struct DataWireHeader {
  uint64_t dest_peer;
  DataHeader h;
};

// The UCX tag of one data chunk: (connection, sender transfer, segment, offset) hashed, where the
// connection is the receiver's id for it (the sender's remote_id). Sender transfer ids are never
// reused by a sending engine, so a tag names one chunk of one transfer; it is known to both sides
// before any claim, so chunks may travel ahead of it (they wait, unexpected, for their receive).
ucp_tag_t ChunkTag(uint64_t connection, const DataHeader& h) {
  uint64_t key[4] = {connection, h.sender_transfer_id, h.segment, h.offset};
  return common::Xxh3_64(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(key), sizeof(key)),
      /*seed=*/0x6570642d78666572ull);
}

absl::Status UcsError(absl::string_view what, ucs_status_t st) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(st)));
}

class UcxWire;

// One in-flight UCX operation (send, rendezvous receive or endpoint close).
struct OpCtx {
  enum class Kind { kSend, kRecv } kind = Kind::kSend;
  UcxWire* wire = nullptr;
  PeerId peer = 0;
  Wire::Done done;
  std::string payload;  // control messages own their bytes
  CtlHeader ctl{};
  DataWireHeader data{};
  uint64_t length = 0;
  bool abandoned = false;   // completed towards the engine; UCX may still hold the request
  void* request = nullptr;  // posted tag receive (to cancel it)
};

struct EpArg {
  UcxWire* wire;
  PeerId peer;
};

class UcxWire final : public Wire {
 public:
  explicit UcxWire(const UcxOptions& options)
      : options_(options), spin_(absl::ToChronoMicroseconds(EffectiveSpin(options))) {}
  ~UcxWire() override { Stop(); }

  absl::Status Start(WireHandler* handler) override {
    handler_ = handler;
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return UcsError("ucp_config_read", st);
    if (!options_.tls.empty()) ucp_config_modify(config, "TLS", options_.tls.c_str());
    if (!options_.net_devices.empty())
      ucp_config_modify(config, "NET_DEVICES", options_.net_devices.c_str());
    const std::string ka = absl::StrCat(absl::ToInt64Milliseconds(options_.keepalive), "ms");
    ucp_config_modify(config, "KEEPALIVE_INTERVAL", ka.c_str());
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_TAG;
    if (options_.event_wakeup) params.features |= UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return UcsError("ucp_init", st);

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) return UcsError("ucp_worker_create", st);
    if (options_.event_wakeup) {
      // The progress thread sleeps in poll() on the worker's event fd and an eventfd that Post
      // and Stop write: a message or a command wakes it at once instead of after a nap.
      int efd = -1;
      st = ucp_worker_get_efd(worker_, &efd);
      wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (st == UCS_OK && wake_fd_ >= 0) {
        worker_efd_ = efd;
      } else {
        spdlog::warn("UCX wire: no event wakeup ({}); the progress thread naps instead",
                     st != UCS_OK ? ucs_status_string(st) : "eventfd failed");
      }
    }

    for (unsigned id : {kAmControl, kAmData}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = id;
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      hp.cb = id == kAmControl ? &UcxWire::OnControlAm : &UcxWire::OnDataAm;
      hp.arg = this;
      st = ucp_worker_set_am_recv_handler(worker_, &hp);
      if (st != UCS_OK) return UcsError("ucp_worker_set_am_recv_handler", st);
    }

    if (options_.mode == UcxOptions::Mode::kListener) {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(options_.listen_port));
      if (inet_pton(AF_INET, options_.listen_ip.c_str(), &addr.sin_addr) != 1)
        return absl::InvalidArgumentError(absl::StrCat("bad listen ip ", options_.listen_ip));
      ucp_listener_params_t lp{};
      lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
      lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
      lp.sockaddr.addrlen = sizeof(addr);
      lp.conn_handler.cb = &UcxWire::OnConnRequest;
      lp.conn_handler.arg = this;
      st = ucp_listener_create(worker_, &lp, &listener_);
      if (st != UCS_OK)
        return UcsError(absl::StrCat("ucp_listener_create on ", options_.listen_ip), st);
      ucp_listener_attr_t la{};
      la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
      st = ucp_listener_query(listener_, &la);
      if (st != UCS_OK) return UcsError("ucp_listener_query", st);
      const auto* bound = reinterpret_cast<const sockaddr_in*>(&la.sockaddr);
      local_address_ = absl::StrCat("ucx+tcp://", options_.listen_ip, ":", ntohs(bound->sin_port));
    } else {
      ucp_address_t* a = nullptr;
      size_t len = 0;
      st = ucp_worker_get_address(worker_, &a, &len);
      if (st != UCS_OK) return UcsError("ucp_worker_get_address", st);
      my_worker_address_.assign(reinterpret_cast<const char*>(a), len);
      ucp_worker_release_address(worker_, a);
      local_address_ = "ucx+addr:" + absl::BytesToHexString(my_worker_address_);
    }
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  void Stop() override {
    {
      std::lock_guard<std::mutex> lock(qmu_);
      if (!thread_.joinable() || stop_requested_) {
        if (!thread_.joinable()) Cleanup();
        return;
      }
      stop_requested_ = true;
    }
    qcv_.notify_all();
    Wake();
    thread_.join();
    Cleanup();
  }

  TransportCapabilities Capabilities() const override {
    TransportCapabilities c;
    c.name = "ucx";
    c.zero_copy_receive = true;
    c.rma = true;
    c.shared_memory = options_.mode == UcxOptions::Mode::kWorkerAddress;
    c.remote_hosts = true;
    return c;
  }
  std::string LocalAddress() const override { return local_address_; }

  bool PostsReceives() const override { return true; }

  void PostReceive(PeerId peer, const DataHeader& expected, uint8_t* dst, uint64_t mem) override {
    auto* ctx = new OpCtx;
    ctx->kind = OpCtx::Kind::kRecv;
    ctx->wire = this;
    ctx->peer = peer;
    ctx->data.h = expected;
    ctx->length = expected.length;
    Post([this, ctx, dst, mem] { DoPostReceive(ctx, dst, mem); });
  }

  void CancelReceives(PeerId peer, uint64_t receiver_transfer_id) override {
    Post([this, peer, receiver_transfer_id] { CancelPosted(peer, receiver_transfer_id); });
  }

  void DiscardChunks(PeerId peer, std::vector<DataHeader> chunks) override {
    Post([this, peer, chunks = std::move(chunks)] { PostDiscards(peer, chunks); });
  }

  // Zero-length receives for `chunks`: UCX completes each MESSAGE_TRUNCATED, drops eager bytes and
  // acknowledges a rendezvous without fetching it, so the sender's send completes. One that
  // nothing matches goes with the connection, or after kDiscardTtl.
  void PostDiscards(PeerId peer, const std::vector<DataHeader>& chunks) {
    Peer* p = LivePeer(peer);
    if (p == nullptr) return;  // the connection is gone: so are the sender's sends
    const auto expires = std::chrono::steady_clock::now() + kDiscardTtl;
    {
      for (const DataHeader& h : chunks) {
        auto* d = new Discard{this, peer, nullptr, expires};
        ucp_request_param_t rp{};
        rp.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        rp.cb.recv = &UcxWire::OnDiscardDone;
        rp.user_data = d;
        // With NO_IMM_CMPL the callback runs inside ucp_tag_recv_nbx when the chunk is already
        // there (unexpected): it erases and deletes d, so d is registered first and looked up
        // after.
        discards_.insert(d);
        ucs_status_ptr_t r =
            ucp_tag_recv_nbx(worker_, &discard_byte_, 0, ChunkTag(p->id, h), ~ucp_tag_t{0}, &rp);
        if (UCS_PTR_IS_ERR(r)) {
          discards_.erase(d);
          delete d;
          continue;
        }
        if (discards_.contains(d)) d->request = r;
      }
    }
  }

  void ExpireDiscards() {
    if (discards_.empty()) return;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_discard_scan_) return;
    next_discard_scan_ = now + std::chrono::seconds(1);
    std::vector<Discard*> old;
    for (Discard* d : discards_)
      if (now >= d->expires) old.push_back(d);
    for (Discard* d : old)
      if (discards_.contains(d)) ucp_request_cancel(worker_, d->request);
  }

  absl::StatusOr<PeerId> Connect(absl::string_view address, absl::Duration timeout) override {
    auto waiter = std::make_shared<ConnectWaiter>();
    std::string addr(address);
    const PeerId id = next_peer_.fetch_add(1);
    Post([this, addr, id, waiter] { StartConnect(addr, id, waiter); });
    std::unique_lock<std::mutex> lock(waiter->mu);
    if (!waiter->cv.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                             [&] { return waiter->result.has_value(); })) {
      lock.unlock();
      ClosePeer(id, absl::DeadlineExceededError("connect timed out"));
      return absl::DeadlineExceededError(absl::StrCat("UCX connect to ", address.substr(0, 64),
                                                      " timed out after ",
                                                      absl::FormatDuration(timeout)));
    }
    return *waiter->result;
  }

  TransportKind PeerKind(PeerId peer) const override {
    std::lock_guard<std::mutex> lock(kinds_mu_);
    auto it = kinds_.find(peer);
    return it == kinds_.end() ? TransportKind::kTcp : it->second;
  }

  void SendControl(PeerId peer, std::string bytes, Done done) override {
    auto* ctx = new OpCtx;
    ctx->wire = this;
    ctx->peer = peer;
    ctx->done = std::move(done);
    ctx->payload = std::move(bytes);
    Post([this, ctx] { DoSendControl(ctx, kEngineMsg); });
  }

  void SendData(PeerId peer, const DataHeader& header, const uint8_t* data, uint64_t wire_length,
                uint64_t mem, Done done) override {
    auto* ctx = new OpCtx;
    ctx->wire = this;
    ctx->peer = peer;
    ctx->done = std::move(done);
    ctx->data.h = header;
    ctx->length = wire_length;
    Post([this, ctx, data, mem] { DoSendData(ctx, data, mem); });
  }

  void ClosePeer(PeerId peer, absl::Status why, bool peer_dead = false) override {
    Post([this, peer, why, peer_dead] { ClosePeerNow(peer, why, peer_dead); });
  }

  absl::StatusOr<uint64_t> Register(void* addr, uint64_t length) override {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = addr;
    mp.length = length;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
    if (st != UCS_OK) return UcsError("ucp_mem_map", st);
    std::lock_guard<std::mutex> lock(mem_mu_);
    const uint64_t handle = next_mem_++;
    mems_[handle] = memh;
    return handle;
  }

  void Deregister(uint64_t handle) override {
    ucp_mem_h memh = nullptr;
    {
      std::lock_guard<std::mutex> lock(mem_mu_);
      auto it = mems_.find(handle);
      if (it == mems_.end()) return;
      memh = it->second;
      mems_.erase(it);
    }
    ucp_mem_unmap(context_, memh);
  }

 private:
  struct ConnectWaiter {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<absl::StatusOr<PeerId>> result;
    void Set(absl::StatusOr<PeerId> r) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (result.has_value()) return;
        result = std::move(r);
      }
      cv.notify_all();
    }
  };

  // A zero-length receive that swallows one chunk of a refused offer.
  struct Discard {
    UcxWire* wire;
    PeerId peer;
    void* request;
    std::chrono::steady_clock::time_point expires;
  };
  static constexpr std::chrono::seconds kDiscardTtl{60};

  struct Peer {
    PeerId id = 0;
    ucp_ep_h ep = nullptr;
    uint64_t remote_id = 0;
    bool up = false;
    bool closed = false;
    bool data_seen = false;  // lanes re-read once data flows (wireup may finish after hello)
    std::unique_ptr<EpArg> arg;
    std::shared_ptr<ConnectWaiter> waiter;
    std::vector<OpCtx*> queued;  // sends posted before the wire handshake finished
  };

  // --- progress thread ----------------------------------------------------------------------

  void Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(qmu_);
      commands_.push_back(std::move(fn));
    }
    qcv_.notify_all();
    Wake();
  }

  void Wake() {
    if (wake_fd_ < 0) return;
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));  // EAGAIN: already signalled
  }

  // Sleeps until UCX has an event, a command is posted, or `timeout` passes. False when the
  // worker cannot be armed right now (events pending: progress again at once).
  bool WaitForEvents(std::chrono::microseconds timeout) {
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return false;
    {
      std::lock_guard<std::mutex> lock(qmu_);
      if (!commands_.empty() || stop_requested_) return false;
    }
    pollfd fds[2] = {{worker_efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int ms = static_cast<int>((timeout.count() + 999) / 1000);
    if (poll(fds, 2, ms) > 0 && (fds[1].revents & POLLIN) != 0) {
      uint64_t drained = 0;
      [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
    }
    return true;
  }

  void Run() {
    auto last_active = std::chrono::steady_clock::now();
    bool stopping = false;
    std::chrono::steady_clock::time_point stop_deadline;
    while (true) {
      std::deque<std::function<void()>> cmds;
      {
        std::lock_guard<std::mutex> lock(qmu_);
        cmds.swap(commands_);
        if (stop_requested_ && !stopping) {
          stopping = true;
          stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
        }
      }
      bool active = !cmds.empty();
      for (auto& c : cmds) c();
      if (stopping && !closing_all_) {
        closing_all_ = true;
        std::vector<PeerId> ids;
        for (auto& [id, p] : peers_) ids.push_back(id);
        for (PeerId id : ids) ClosePeerNow(id, absl::CancelledError("transport stopping"));
      }
      for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) active = true;
      active |= RunDeferred();
      ReapCloses();
      ExpireDiscards();
      if (stopping) {
        if ((inflight_.empty() && closing_.empty()) ||
            std::chrono::steady_clock::now() > stop_deadline)
          break;
        continue;
      }
      // Spin while UCX makes progress and shortly after; then nap (briefly while operations are
      // in flight, longer when idle). A peer that never answers thus costs no CPU.
      const auto now = std::chrono::steady_clock::now();
      if (active) {
        last_active = now;
        continue;
      }
      if (now - last_active < spin_) continue;
      if (worker_efd_ >= 0) {
        // Event-driven: the timeout only paces the housekeeping (closes, discards).
        WaitForEvents(std::chrono::microseconds(inflight_.empty() ? 10000 : 1000));
        continue;
      }
      std::unique_lock<std::mutex> lock(qmu_);
      qcv_.wait_for(lock, std::chrono::microseconds(inflight_.empty() ? 500 : 50),
                    [&] { return !commands_.empty() || stop_requested_; });
    }
    CancelDiscards(0);
    // Whatever UCX did not complete in time completes here with an error; the worker is
    // destroyed next, so nothing can touch the memory afterwards.
    for (OpCtx* ctx : std::vector<OpCtx*>(inflight_.begin(), inflight_.end()))
      Abandon(ctx, absl::CancelledError("transport stopped"));
    inflight_.clear();
    RunDeferred();
    for (auto& [id, p] : peers_)
      for (OpCtx* ctx : p->queued) FinishOp(ctx, absl::CancelledError("transport stopped"));
    RunDeferred();
  }

  bool RunDeferred() {
    bool any = false;
    while (!deferred_.empty()) {
      any = true;
      std::vector<std::function<void()>> batch;
      batch.swap(deferred_);
      for (auto& fn : batch) fn();
    }
    return any;
  }

  void ReapCloses() {
    for (auto it = closing_.begin(); it != closing_.end();) {
      if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
        ucp_request_free(*it);
        it = closing_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void Cleanup() {
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    listener_ = nullptr;
    {
      std::lock_guard<std::mutex> lock(mem_mu_);
      for (auto& [h, memh] : mems_) ucp_mem_unmap(context_, memh);
      mems_.clear();
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    worker_ = nullptr;
    for (OpCtx* ctx : abandoned_) delete ctx;
    abandoned_.clear();
    if (context_ != nullptr) ucp_cleanup(context_);
    context_ = nullptr;
    if (wake_fd_ >= 0) close(wake_fd_);
    wake_fd_ = -1;
    worker_efd_ = -1;
  }

  bool ErrorHandling() const {
    return options_.peer_error_handling.value_or(options_.mode == UcxOptions::Mode::kListener);
  }

  ucp_ep_h CreateEp(ucp_ep_params_t& p, PeerId id, std::string* error) {
    auto peer = std::make_unique<Peer>();
    peer->id = id;
    peer->arg = std::make_unique<EpArg>(EpArg{this, id});
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    if (ErrorHandling()) {
      p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      p.err_handler.cb = &UcxWire::OnEpError;
      p.err_handler.arg = peer->arg.get();
    } else {
      p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    }
    ucp_ep_h ep = nullptr;
    ucs_status_t st = ucp_ep_create(worker_, &p, &ep);
    if (st != UCS_OK) {
      *error = absl::StrCat("ucp_ep_create: ", ucs_status_string(st));
      return nullptr;
    }
    peer->ep = ep;
    peers_[id] = std::move(peer);
    return ep;
  }

  void StartConnect(const std::string& address, PeerId id, std::shared_ptr<ConnectWaiter> waiter) {
    ucp_ep_params_t p{};
    sockaddr_in sa{};
    std::string remote_address;
    if (absl::StartsWith(address, "ucx+tcp://")) {
      absl::string_view hp = absl::string_view(address).substr(10);
      const size_t colon = hp.rfind(':');
      int port = 0;
      sa.sin_family = AF_INET;
      if (colon == absl::string_view::npos || !absl::SimpleAtoi(hp.substr(colon + 1), &port) ||
          inet_pton(AF_INET, std::string(hp.substr(0, colon)).c_str(), &sa.sin_addr) != 1) {
        waiter->Set(absl::InvalidArgumentError(absl::StrCat("bad UCX address ", address)));
        return;
      }
      sa.sin_port = htons(static_cast<uint16_t>(port));
      p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
      p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
      p.sockaddr.addrlen = sizeof(sa);
    } else if (absl::StartsWith(address, "ucx+addr:")) {
      remote_address = absl::HexStringToBytes(absl::string_view(address).substr(9));
      if (remote_address.empty()) {
        waiter->Set(absl::InvalidArgumentError("empty UCX worker address"));
        return;
      }
      p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
      p.address = reinterpret_cast<const ucp_address_t*>(remote_address.data());
    } else {
      waiter->Set(absl::InvalidArgumentError(absl::StrCat(
          "not a UCX address (want ucx+tcp:// or ucx+addr:): ", address.substr(0, 64))));
      return;
    }
    std::string error;
    if (CreateEp(p, id, &error) == nullptr) {
      waiter->Set(absl::UnavailableError(error));
      return;
    }
    Peer& peer = *peers_[id];
    peer.waiter = waiter;
    // Wire hello: our id, and our worker address so an address-mode server can reach us back.
    auto* ctx = new OpCtx;
    ctx->wire = this;
    ctx->peer = id;
    ctx->done = [](absl::Status) {};
    ctx->payload = my_worker_address_;
    PostAm(peer, ctx, kWireHello, UCP_AM_SEND_FLAG_REPLY);
  }

  // Sends ctx->payload as a control AM (eager) on `peer`.
  void PostAm(Peer& peer, OpCtx* ctx, uint32_t type, uint32_t extra_flags = 0) {
    ctx->kind = OpCtx::Kind::kSend;
    ctx->ctl.dest_peer = peer.remote_id;
    ctx->ctl.src_peer = peer.id;
    ctx->ctl.type = type;
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxWire::OnSendDone;
    rp.user_data = ctx;
    rp.flags = UCP_AM_SEND_FLAG_EAGER | extra_flags;
    ucs_status_ptr_t r = ucp_am_send_nbx(peer.ep, kAmControl, &ctx->ctl, sizeof(ctx->ctl),
                                         ctx->payload.data(), ctx->payload.size(), &rp);
    TrackSend(ctx, r);
  }

  void TrackSend(OpCtx* ctx, ucs_status_ptr_t r) {
    if (r == nullptr) {
      FinishOp(ctx, absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(r)) {
      FinishOp(ctx, UcsError("ucp_am_send_nbx", UCS_PTR_STATUS(r)));
    } else {
      inflight_.insert(ctx);
    }
  }

  Peer* LivePeer(PeerId id) {
    auto it = peers_.find(id);
    if (it == peers_.end() || it->second->closed) return nullptr;
    return it->second.get();
  }

  void DoSendControl(OpCtx* ctx, uint32_t type) {
    Peer* peer = LivePeer(ctx->peer);
    if (peer == nullptr) {
      FinishOp(ctx, absl::UnavailableError("UCX peer is not connected"));
      return;
    }
    if (!peer->up) {
      peer->queued.push_back(ctx);
      return;
    }
    PostAm(*peer, ctx, type);
  }

  void DoSendData(OpCtx* ctx, const uint8_t* data, uint64_t mem) {
    Peer* peer = LivePeer(ctx->peer);
    if (peer == nullptr || !peer->up) {
      FinishOp(ctx, absl::UnavailableError("UCX peer is not connected"));
      return;
    }
    if (!peer->data_seen) {
      peer->data_seen = true;
      UpdateKind(*peer);
    }
    ctx->kind = OpCtx::Kind::kSend;
    ctx->data.dest_peer = peer->remote_id;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = &UcxWire::OnSendDone;
    rp.user_data = ctx;
    if (mem != 0) {
      std::lock_guard<std::mutex> lock(mem_mu_);
      auto it = mems_.find(mem);
      if (it != mems_.end()) {
        rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        rp.memh = it->second;
      }
    }
    // Tagged send into the receive the peer posted before it claimed (tag_bw's data path).
    ucs_status_ptr_t r =
        ucp_tag_send_nbx(peer->ep, data, ctx->length, ChunkTag(peer->remote_id, ctx->data.h), &rp);
    TrackSend(ctx, r);
  }

  void DoPostReceive(OpCtx* ctx, uint8_t* dst, uint64_t mem) {
    Peer* peer = LivePeer(ctx->peer);
    if (peer == nullptr) {
      FinishOp(ctx, absl::UnavailableError("UCX peer is not connected"));
      return;
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    rp.cb.recv = &UcxWire::OnTagRecvDone;
    rp.user_data = ctx;
    if (mem != 0) {
      std::lock_guard<std::mutex> lock(mem_mu_);
      auto it = mems_.find(mem);
      if (it != mems_.end()) {
        rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        rp.memh = it->second;
      }
    }
    // With NO_IMM_CMPL the callback runs inside ucp_tag_recv_nbx when the chunk is already there
    // (it came before the claim): FinishOp then takes ctx out of inflight_ (and deletes it later).
    inflight_.insert(ctx);
    ucs_status_ptr_t r = ucp_tag_recv_nbx(worker_, dst, ctx->length,
                                          ChunkTag(peer->id, ctx->data.h), ~ucp_tag_t{0}, &rp);
    if (UCS_PTR_IS_ERR(r)) {
      FinishOp(ctx, UcsError("ucp_tag_recv_nbx", UCS_PTR_STATUS(r)));
      return;
    }
    if (inflight_.contains(ctx)) ctx->request = r;
  }

  // Cancels the discarding receives of `peer` (all when peer is 0) that nothing has matched.
  void CancelDiscards(PeerId peer) {
    std::vector<Discard*> mine;
    for (Discard* d : discards_)
      if (peer == 0 || d->peer == peer) mine.push_back(d);
    for (Discard* d : mine)
      if (discards_.contains(d)) ucp_request_cancel(worker_, d->request);
  }

  // Cancels the posted receives (not yet matched) of one transfer, or of every transfer of the
  // peer when receiver_transfer_id is 0. Their callbacks run inside ucp_request_cancel.
  // For one transfer (the connection stays): a chunk the sender sends later is swallowed by a
  // discarding receive, so its send completes instead of waiting for a receive forever.
  void CancelPosted(PeerId peer, uint64_t receiver_transfer_id) {
    std::vector<OpCtx*> posted;
    for (OpCtx* ctx : inflight_)
      if (ctx->kind == OpCtx::Kind::kRecv && ctx->request != nullptr && ctx->peer == peer &&
          (receiver_transfer_id == 0 || ctx->data.h.receiver_transfer_id == receiver_transfer_id))
        posted.push_back(ctx);
    std::vector<DataHeader> cancelled;
    for (OpCtx* ctx : posted) {
      if (!inflight_.contains(ctx)) continue;
      const DataHeader h = ctx->data.h;
      ucp_request_cancel(worker_, ctx->request);
      // The callback ran inside the cancel (ctx itself is deleted later, from deferred_).
      if (!inflight_.contains(ctx)) cancelled.push_back(h);
    }
    if (receiver_transfer_id != 0 && !cancelled.empty()) PostDiscards(peer, cancelled);
  }

  void FinishOp(OpCtx* ctx, absl::Status st) {
    inflight_.erase(ctx);
    deferred_.push_back([this, ctx, st] {
      if (ctx->kind == OpCtx::Kind::kRecv) {
        handler_->OnDataEnd(ctx->peer, ctx->data.h, ctx->length, st);
      } else if (ctx->done) {
        ctx->done(st);
      }
      delete ctx;
    });
  }

  // Completes `ctx` towards the engine now, while UCX may still hold its request: only when no
  // one can touch the memory any more (peer process dead, or the worker about to be destroyed).
  void Abandon(OpCtx* ctx, absl::Status st) {
    inflight_.erase(ctx);
    ctx->abandoned = true;
    abandoned_.insert(ctx);
    const bool recv = ctx->kind == OpCtx::Kind::kRecv;
    deferred_.push_back([this, recv, peer = ctx->peer, h = ctx->data.h, len = ctx->length,
                         done = std::move(ctx->done), st] {
      if (recv) {
        handler_->OnDataEnd(peer, h, len, st);
      } else if (done) {
        done(st);
      }
    });
  }

  void ClosePeerNow(PeerId id, absl::Status why, bool peer_dead = false) {
    auto it = peers_.find(id);
    if (it == peers_.end() || it->second->closed) return;
    Peer& peer = *it->second;
    peer.closed = true;
    for (OpCtx* ctx : peer.queued) FinishOp(ctx, why);
    peer.queued.clear();
    if (peer.waiter) peer.waiter->Set(absl::UnavailableError(why.message()));
    by_ep_.erase(peer.ep);
    // Tag receives belong to the worker, not the endpoint: the ones no data has matched are
    // cancelled here (matched ones complete or fail with the endpoint).
    CancelPosted(id, 0);
    CancelDiscards(id);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer.ep, &rp);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing_.push_back(r);
    if (peer_dead && !ErrorHandling()) {
      // Without peer-failure handling UCX never completes requests to a dead peer; since the
      // peer process is gone, nothing can read or write their memory: hand it back now.
      std::vector<OpCtx*> stuck;
      for (OpCtx* ctx : inflight_)
        if (ctx->peer == id) stuck.push_back(ctx);
      for (OpCtx* ctx : stuck) Abandon(ctx, why);
    }
    if (peer.up || peer.remote_id != 0 || peer.waiter == nullptr)
      deferred_.push_back([this, id, why] { handler_->OnPeerDown(id, why); });
  }

  TransportKind Classify(ucp_ep_h ep) {
    if (options_.mode == UcxOptions::Mode::kListener) return TransportKind::kTcp;
    char* buf = nullptr;
    size_t size = 0;
    FILE* f = open_memstream(&buf, &size);
    if (f == nullptr) return TransportKind::kTcp;
    ucp_ep_print_info(ep, f);
    fclose(f);
    std::string info(buf, size);
    free(buf);
    spdlog::debug("ucx ep info: {}", info);
    for (const char* rdma : {"rc_", "dc_", "ud_", "/mlx", "gga"})
      if (absl::StrContains(info, rdma)) return TransportKind::kRdma;
    for (const char* shm : {"posix", "sysv", "cma", "xpmem", "knem"})
      if (absl::StrContains(info, shm)) return TransportKind::kShm;
    return TransportKind::kTcp;
  }

  void UpdateKind(Peer& peer) {
    const TransportKind kind = Classify(peer.ep);
    std::lock_guard<std::mutex> lock(kinds_mu_);
    kinds_[peer.id] = kind;
  }

  void MarkUp(Peer& peer) {
    peer.up = true;
    UpdateKind(peer);
    std::vector<OpCtx*> queued;
    queued.swap(peer.queued);
    for (OpCtx* ctx : queued) PostAm(peer, ctx, kEngineMsg);
  }

  void HandleControl(CtlHeader hdr, std::string payload, ucp_ep_h reply_ep) {
    if (hdr.type == kWireHello) {
      PeerId id = 0;
      auto it = by_ep_.find(reply_ep);
      if (reply_ep != nullptr && it != by_ep_.end()) {
        id = it->second;  // listener flow: the endpoint we accepted
      } else if (!payload.empty()) {
        id = next_peer_.fetch_add(1);
        ucp_ep_params_t p{};
        p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        p.address = reinterpret_cast<const ucp_address_t*>(payload.data());
        std::string error;
        if (CreateEp(p, id, &error) == nullptr) {
          spdlog::warn("ucx: cannot connect back to a peer: {}", error);
          return;
        }
      } else {
        spdlog::warn("ucx: wire hello from an unknown endpoint without an address; ignored");
        return;
      }
      Peer* peer = LivePeer(id);
      if (peer == nullptr) return;
      peer->remote_id = hdr.src_peer;
      auto* ctx = new OpCtx;
      ctx->wire = this;
      ctx->peer = id;
      ctx->done = [](absl::Status) {};
      PostAm(*peer, ctx, kWireHelloAck);
      MarkUp(*peer);
      return;
    }
    Peer* peer = LivePeer(hdr.dest_peer);
    if (peer == nullptr) return;
    if (hdr.type == kWireHelloAck) {
      peer->remote_id = hdr.src_peer;
      MarkUp(*peer);
      if (peer->waiter) {
        peer->waiter->Set(peer->id);
        peer->waiter.reset();
      }
      return;
    }
    if (hdr.type == kEngineMsg && peer->up && hdr.src_peer == peer->remote_id)
      handler_->OnControl(peer->id, std::move(payload));
  }

  // --- UCX callbacks (progress context) -------------------------------------------------------

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    auto* ctx = static_cast<OpCtx*>(user_data);
    if (ctx->abandoned) {
      ucp_request_free(request);
      ctx->wire->abandoned_.erase(ctx);
      delete ctx;
      return;
    }
    ctx->wire->FinishOp(ctx, status == UCS_OK ? absl::OkStatus() : UcsError("UCX send", status));
    ucp_request_free(request);
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
    auto* ctx = static_cast<OpCtx*>(user_data);
    if (ctx->abandoned) {
      ucp_request_free(request);
      ctx->wire->abandoned_.erase(ctx);
      delete ctx;
      return;
    }
    ctx->wire->FinishOp(ctx, status == UCS_OK ? absl::OkStatus() : UcsError("UCX receive", status));
    ucp_request_free(request);
  }

  static void OnDiscardDone(void* request, ucs_status_t, const ucp_tag_recv_info_t*,
                            void* user_data) {
    auto* d = static_cast<Discard*>(user_data);
    d->wire->discards_.erase(d);
    delete d;
    ucp_request_free(request);
  }

  static void OnTagRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                            void* user_data) {
    auto* ctx = static_cast<OpCtx*>(user_data);
    if (ctx->abandoned) {
      ucp_request_free(request);
      ctx->wire->abandoned_.erase(ctx);
      delete ctx;
      return;
    }
    ctx->request = nullptr;
    absl::Status st;
    if (status == UCS_OK) {
      ctx->length = info != nullptr ? info->length : 0;  // shorter than posted: truncated
      UcxWire* w = ctx->wire;
      const PeerId id = ctx->peer;
      w->deferred_.push_back([w, id] {
        Peer* p = w->LivePeer(id);
        if (p != nullptr && !p->data_seen) {
          p->data_seen = true;
          w->UpdateKind(*p);
        }
      });
    } else if (status == UCS_ERR_MESSAGE_TRUNCATED) {
      st = absl::DataLossError(absl::StrCat("the chunk is longer than the ", ctx->length,
                                            " bytes its receive was posted for"));
    } else {
      st = UcsError("UCX tag receive", status);
    }
    ctx->wire->FinishOp(ctx, st);
    ucp_request_free(request);
  }

  static void OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* a = static_cast<EpArg*>(arg);
    UcxWire* w = a->wire;
    const PeerId id = a->peer;
    w->deferred_.push_back([w, id, status] {
      w->ClosePeerNow(id, absl::UnavailableError(
                              absl::StrCat("UCX endpoint error: ", ucs_status_string(status))));
    });
  }

  static void OnConnRequest(ucp_conn_request_h request, void* arg) {
    auto* w = static_cast<UcxWire*>(arg);
    w->deferred_.push_back([w, request] {
      const PeerId id = w->next_peer_.fetch_add(1);
      ucp_ep_params_t p{};
      p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
      p.conn_request = request;
      std::string error;
      ucp_ep_h ep = w->CreateEp(p, id, &error);
      if (ep == nullptr) {
        // ucp_ep_create consumed the request even on failure (UCX rejects and frees it itself),
        // so rejecting it again here would be a double free that kills the process.
        spdlog::warn("ucx: cannot accept a connection: {}", error);
        return;
      }
      w->by_ep_[ep] = id;
    });
  }

  static ucs_status_t OnControlAm(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
    auto* w = static_cast<UcxWire*>(arg);
    if (header_length != sizeof(CtlHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
      return UCS_OK;
    CtlHeader hdr;
    std::memcpy(&hdr, header, sizeof(hdr));
    std::string payload(static_cast<const char*>(data), length);
    ucp_ep_h reply_ep =
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
    w->deferred_.push_back([w, hdr, payload = std::move(payload), reply_ep]() mutable {
      w->HandleControl(hdr, std::move(payload), reply_ep);
    });
    return UCS_OK;
  }

  static ucs_status_t OnDataAm(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
    auto* w = static_cast<UcxWire*>(arg);
    const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
    if (header_length != sizeof(DataWireHeader)) return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    DataWireHeader hdr;
    std::memcpy(&hdr, header, sizeof(hdr));
    Peer* peer = w->LivePeer(hdr.dest_peer);
    if (peer == nullptr || !peer->up) return rndv ? UCS_ERR_NOT_CONNECTED : UCS_OK;
    if (!peer->data_seen) {
      peer->data_seen = true;
      w->UpdateKind(*peer);
    }
    DataSink sink = w->handler_->OnDataBegin(peer->id, hdr.h, length);
    if (sink.dst == nullptr) return rndv ? UCS_ERR_REJECTED : UCS_OK;
    auto* ctx = new OpCtx;
    ctx->kind = OpCtx::Kind::kRecv;
    ctx->wire = w;
    ctx->peer = peer->id;
    ctx->data = hdr;
    ctx->length = length;
    if (!rndv) {
      std::memcpy(sink.dst, data, length);
      w->FinishOp(ctx, absl::OkStatus());
      return UCS_OK;
    }
    // Rendezvous: keep the descriptor and start the zero-copy receive once out of the callback.
    w->inflight_.insert(ctx);
    w->deferred_.push_back([w, ctx, data, sink] {
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = &UcxWire::OnRecvDone;
      rp.user_data = ctx;
      if (sink.mem != 0) {
        std::lock_guard<std::mutex> lock(w->mem_mu_);
        auto it = w->mems_.find(sink.mem);
        if (it != w->mems_.end()) {
          rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
          rp.memh = it->second;
        }
      }
      ucs_status_ptr_t r = ucp_am_recv_data_nbx(w->worker_, data, sink.dst, ctx->length, &rp);
      if (r == nullptr) {
        w->FinishOp(ctx, absl::OkStatus());
      } else if (UCS_PTR_IS_ERR(r)) {
        w->FinishOp(ctx, UcsError("ucp_am_recv_data_nbx", UCS_PTR_STATUS(r)));
      }
    });
    return UCS_INPROGRESS;
  }

  UcxOptions options_;
  const std::chrono::microseconds spin_;
  WireHandler* handler_ = nullptr;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  std::string local_address_;
  std::string my_worker_address_;
  std::thread thread_;
  std::atomic<PeerId> next_peer_{1};

  int worker_efd_ = -1;  // UCX's event fd (owned by the worker); -1: nap instead
  int wake_fd_ = -1;     // eventfd written by Post and Stop
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<std::function<void()>> commands_;
  bool stop_requested_ = false;

  // Progress thread only.
  std::vector<std::function<void()>> deferred_;
  std::unordered_map<PeerId, std::unique_ptr<Peer>> peers_;
  std::unordered_map<ucp_ep_h, PeerId> by_ep_;
  std::unordered_set<OpCtx*> inflight_;
  std::unordered_set<OpCtx*> abandoned_;
  std::unordered_set<Discard*> discards_;
  uint8_t discard_byte_ = 0;
  std::chrono::steady_clock::time_point next_discard_scan_;
  std::vector<void*> closing_;
  bool closing_all_ = false;

  mutable std::mutex kinds_mu_;
  std::unordered_map<PeerId, TransportKind> kinds_;
  std::mutex mem_mu_;
  std::unordered_map<uint64_t, ucp_mem_h> mems_;
  uint64_t next_mem_ = 1;
};

}  // namespace

absl::Duration EffectiveSpin(const UcxOptions& options) {
  if (options.spin.has_value()) return *options.spin;
  return std::thread::hardware_concurrency() > kSpinMinCores ? absl::Microseconds(200)
                                                             : absl::ZeroDuration();
}

std::unique_ptr<Wire> MakeUcxWire(const UcxOptions& options) {
  return std::make_unique<UcxWire>(options);
}

absl::StatusOr<std::unique_ptr<TransferEngine>> MakeUcxTransport(const UcxOptions& ucx,
                                                                 const EngineOptions& engine,
                                                                 prometheus::Registry& registry,
                                                                 const common::Clock& clock) {
  return TransferEngine::Create(MakeUcxWire(ucx), engine, registry, clock);
}

absl::StatusOr<SelfTestResult> RunBandwidthSelfTest(const UcxOptions& ucx, uint64_t bytes,
                                                    prometheus::Registry& registry) {
  EngineOptions eo;
  eo.config_fingerprint = "selftest";
  eo.cluster_token = "selftest";
  eo.node_name = "selftest";
  UcxOptions a = ucx;
  UcxOptions b = ucx;
  b.listen_port = 0;
  a.listen_port = 0;
  auto& clock = common::SystemClock::Get();
  auto rx = MakeUcxTransport(a, eo, registry, clock);
  if (!rx.ok()) return rx.status();
  auto tx = MakeUcxTransport(b, eo, registry, clock);
  if (!tx.ok()) return tx.status();
  auto peer = (*tx)->Connect((*rx)->LocalAddress(), absl::Seconds(10));
  if (!peer.ok()) return peer.status();
  SelfTestResult result;
  result.bytes = bytes;
  auto kind = (*tx)->PeerTransport(*peer);
  if (kind.ok()) result.transport = *kind;
  epd::v1::Manifest m;
  m.set_request_id("selftest");
  m.set_config_fingerprint("selftest");
  auto* s = m.add_segments();
  s->set_kind(epd::v1::SEGMENT_BLOCK);
  s->set_layer_id(-1);
  s->set_entry_count(1);
  s->set_layout_id(0xff);
  s->set_byte_length(bytes);
  s->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
  auto payload = (*tx)->Allocate(bytes);
  auto into = (*rx)->Allocate(bytes);
  if (!payload.ok() || !into.ok()) return absl::ResourceExhaustedError("self-test allocation");
  std::memset((*payload)->data(), 0x5a, bytes);
  std::memset((*into)->data(), 0, bytes);
  const auto t0 = std::chrono::steady_clock::now();
  auto rid = (*rx)->Receive(m, std::move(*into), TransferOptions{});
  if (!rid.ok()) return rid.status();
  auto sid = (*tx)->Send(*peer, m, std::move(*payload), TransferOptions{});
  if (!sid.ok()) return sid.status();
  if (absl::Status st = (*rx)->Wait(*rid, absl::Seconds(30)); !st.ok()) return st;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  result.bytes_per_second = static_cast<double>(bytes) / std::max(secs, 1e-9);
  (void)(*tx)->Wait(*sid, absl::Seconds(5));
  (*rx)->Forget(*rid);
  TransferMetrics(registry).SetSelfTestBandwidth(TransportLabel(result.transport),
                                                 result.bytes_per_second);
  if (result.transport == TransportKind::kTcp) {
    spdlog::warn(
        "!!! KV transfer self-test: ONLY TCP IS AVAILABLE ({:.2f} GiB/s for {} MiB). No shared "
        "memory or RDMA transport was selected; hand-offs will be slow. Check UCX_TLS / "
        "UCX_NET_DEVICES and the connection mode. !!!",
        result.bytes_per_second / (1 << 30), bytes >> 20);
  } else {
    spdlog::info("KV transfer self-test: {} at {:.2f} GiB/s ({} MiB)",
                 std::string(TransportLabel(result.transport)), result.bytes_per_second / (1 << 30),
                 bytes >> 20);
  }
  return result;
}

}  // namespace epd::transfer
