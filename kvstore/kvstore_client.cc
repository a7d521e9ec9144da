#include "kvstore/kvstore_client.h"

#include "common/cluster_secret.h"
#include "runtime/grpc_auth.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/hash.h"
#include "epd/v1/kvstore.grpc.pb.h"
#include "kvstore/bulk.h"
#include "kvstore/kvstore_service.h"
#include "kvstore/shm_segment.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx_wire.h"
#include "prometheus/registry.h"

namespace epd::kvstore {
namespace {

absl::Status FromGrpc(const grpc::Status& s, std::string_view what) {
  if (s.ok()) return absl::OkStatus();
  absl::StatusCode code = absl::StatusCode::kUnavailable;
  switch (s.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case grpc::StatusCode::FAILED_PRECONDITION:
      code = absl::StatusCode::kFailedPrecondition;
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      code = absl::StatusCode::kDeadlineExceeded;
      break;
    case grpc::StatusCode::INTERNAL:
      code = absl::StatusCode::kInternal;
      break;
    case grpc::StatusCode::DATA_LOSS:
      code = absl::StatusCode::kDataLoss;
      break;
    case grpc::StatusCode::ABORTED:
      code = absl::StatusCode::kAborted;
      break;
    case grpc::StatusCode::CANCELLED:
      code = absl::StatusCode::kCancelled;
      break;
    case grpc::StatusCode::UNIMPLEMENTED:
      code = absl::StatusCode::kUnimplemented;
      break;
    default:
      break;
  }
  return absl::Status(code, absl::StrCat("kvstore ", std::string(what), ": ", s.error_message()));
}

MissReason ParseMissReason(const std::string& s) {
  if (s.empty()) return MissReason::kNone;
  if (s == "expired") return MissReason::kExpired;
  if (s == "checksum") return MissReason::kChecksum;
  return MissReason::kAbsent;
}

// One UCX transfer engine per process and (cluster token, net devices), shared by every
// KvStoreClient of that process: one UCX worker and progress thread instead of one per client.
// Kept alive by its clients (weak cache). Thread-safe.
struct SharedEngine {
  prometheus::Registry own_registry;  // the engine's epd_transfer_* families when none is given
  std::unique_ptr<transfer::TransferEngine> engine;  // null when injected (not owned)
  transfer::TransferEngine* injected = nullptr;
  transfer::TransferEngine* get() const { return injected != nullptr ? injected : engine.get(); }
  ~SharedEngine() {
    if (engine) engine->Shutdown();
  }
};

absl::StatusOr<std::shared_ptr<SharedEngine>> MakeEngine(
    const transfer::UcxOptions& uo, const transfer::EngineOptions& eo,
    const std::function<std::unique_ptr<transfer::Wire>(std::unique_ptr<transfer::Wire>)>& wrap,
    prometheus::Registry* registry) {
  auto shared = std::make_shared<SharedEngine>();
  std::unique_ptr<transfer::Wire> wire = transfer::MakeUcxWire(uo);
  if (wrap) wire = wrap(std::move(wire));
  auto engine = transfer::TransferEngine::Create(
      std::move(wire), eo, registry != nullptr ? *registry : shared->own_registry,
      common::SystemClock::Get());
  if (!engine.ok()) return engine.status();
  shared->engine = std::move(*engine);
  return shared;
}

absl::StatusOr<std::shared_ptr<SharedEngine>> GetSharedEngine(const transfer::UcxOptions& uo,
                                                              const transfer::EngineOptions& eo,
                                                              prometheus::Registry* registry) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<SharedEngine>> cache;
  const std::string key =
      absl::StrCat(eo.cluster_token, "\n", uo.net_devices, "\n",
                   uo.mode == transfer::UcxOptions::Mode::kListener ? uo.listen_ip : "addr", "\n",
                   reinterpret_cast<uintptr_t>(registry));
  std::lock_guard<std::mutex> lock(mu);
  if (auto live = cache[key].lock()) return live;
  auto made = MakeEngine(uo, eo, nullptr, registry);
  if (made.ok()) cache[key] = *made;
  return made;
}

}  // namespace

class KvStoreClient::Impl {
 public:
  Impl(std::shared_ptr<grpc::Channel> channel, KvClientOptions options)
      : stub_(v1::KvStore::NewStub(channel)),
        options_(options),
        errors_(options.registry != nullptr ? *options.registry : own_registry_) {
    std::random_device rd;
    nonce_ = absl::StrCat("kv-", getpid(), "-", rd(), "-", rd());
  }
  ~Impl() {
    if (engine_ && has_peer_) engine_->get()->Disconnect(peer_);
  }
  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(options_.deadline_ms));
  }
  bool WantsBulk(uint64_t bytes) const {
    return options_.bulk == BulkTransport::kUcx && bytes >= options_.bulk_min_bytes;
  }
  std::string NextRequestId() { return absl::StrCat(nonce_, "-", seq_.fetch_add(1)); }
  transfer::TransferOptions TransferOpts() const {
    transfer::TransferOptions to;
    to.deadline = absl::Milliseconds(options_.deadline_ms);
    to.lease = absl::Milliseconds(options_.deadline_ms);
    return to;
  }

  // The client's transfer engine (created on first use). Null + status when UCX is unavailable.
  absl::StatusOr<transfer::TransferEngine*> Engine() {
    std::lock_guard<std::mutex> lock(mu_);
    return EngineLocked();
  }

  // The connection to the daemon's bulk endpoint; `reconnect` replaces a cached one.
  // NotFound when the daemon advertises no bulk endpoint (the caller falls back to inline).
  absl::StatusOr<transfer::PeerId> DaemonPeer(bool reconnect) {
    std::lock_guard<std::mutex> lock(mu_);
    if (has_peer_ && !reconnect) return peer_;
    // A reconnect asks the daemon again (it may have restarted with a new address).
    if (reconnect && engine_) daemon_address_.clear();
    auto engine = EngineLocked();
    if (!engine.ok()) return engine.status();
    if (auto s = HelloLocked(); !s.ok()) return s;
    if (has_peer_) (*engine)->Disconnect(peer_);
    has_peer_ = false;
    auto peer = (*engine)->Connect(daemon_address_, absl::Milliseconds(options_.deadline_ms));
    if (!peer.ok()) {
      errors_.Count(peer.status(), "connect");
      return absl::Status(
          peer.status().code(),
          absl::StrCat("kvstore bulk connect to ", daemon_address_, ": ", peer.status().message()));
    }
    peer_ = *peer;
    has_peer_ = true;
    return peer_;
  }

  // --- shared memory (kvstore/shm_segment.h) ---
  // Whether batched calls may name a segment: asks the daemon's host id once.
  bool ShmUsable() {
    if (!options_.shared_memory) return false;
    std::lock_guard<std::mutex> lock(shm_mu_);
    if (shm_state_ != 0) return shm_state_ > 0;
    v1::HelloRequest req;
    v1::HelloResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    if (!stub_->Hello(&ctx, req, &resp).ok()) return false;  // asked again next call
    const std::string mine = HostId();
    shm_state_ = !mine.empty() && resp.host_id() == mine ? 1 : -1;
    return shm_state_ > 0;
  }
  void DisableShm(std::string_view why) {
    std::lock_guard<std::mutex> lock(shm_mu_);
    if (shm_state_ > 0) {
      spdlog::warn("kvstore client: shared memory refused by the daemon ({}); values travel inline",
                   std::string(why));
    }
    shm_state_ = -1;
    free_segments_.clear();
  }
  bool ShmActive() {
    std::lock_guard<std::mutex> lock(shm_mu_);
    return shm_state_ > 0;
  }
  // A segment of at least `bytes` (reused from this client's pool), or null (then inline).
  std::unique_ptr<ClientSegment> TakeSegment(size_t bytes) {
    std::unique_ptr<ClientSegment> seg;
    {
      std::lock_guard<std::mutex> lock(shm_mu_);
      if (!free_segments_.empty()) {
        seg = std::move(free_segments_.back());
        free_segments_.pop_back();
      }
    }
    if (seg == nullptr) {
      auto made = ClientSegment::Create(bytes);
      if (!made.ok()) {
        spdlog::warn("kvstore client: no shared-memory segment: {}",
                     std::string(made.status().message()));
        return nullptr;
      }
      return *std::move(made);
    }
    if (!seg->Reserve(bytes).ok()) return nullptr;
    return seg;
  }
  void ReturnSegment(std::unique_ptr<ClientSegment> seg) {
    if (seg == nullptr) return;
    std::lock_guard<std::mutex> lock(shm_mu_);
    if (shm_state_ > 0 && free_segments_.size() < 4) free_segments_.push_back(std::move(seg));
  }
  void NoteValueBytes(size_t n) {
    size_t cur = value_hint_.load();
    while (n > cur && !value_hint_.compare_exchange_weak(cur, n)) {
    }
  }
  size_t value_hint() const { return value_hint_.load(); }

  std::unique_ptr<v1::KvStore::Stub> stub_;
  KvClientOptions options_;
  prometheus::Registry own_registry_;
  TransferErrorMetric errors_;

 private:
  // Learns the daemon's bulk address (Hello). NotFound when it has none.
  absl::Status HelloLocked() {
    if (!daemon_address_.empty()) return absl::OkStatus();
    if (no_bulk_) return absl::NotFoundError("the daemon has no bulk (UCX) endpoint");
    v1::HelloRequest req;
    v1::HelloResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    if (auto s = FromGrpc(stub_->Hello(&ctx, req, &resp), "hello"); !s.ok()) return s;
    if (resp.transfer_address().empty()) {
      no_bulk_ = true;  // remembered: this client sends everything inline from now on
      return absl::NotFoundError("the daemon has no bulk (UCX) endpoint");
    }
    daemon_address_ = resp.transfer_address();
    return absl::OkStatus();
  }

  absl::StatusOr<transfer::TransferEngine*> EngineLocked() {
    if (engine_) return engine_->get();
    if (!engine_error_.ok()) return engine_error_;
    if (options_.bulk_engine != nullptr) {  // injected by the owning process
      engine_ = std::make_shared<SharedEngine>();
      engine_->injected = options_.bulk_engine;
      return engine_->get();
    }
    // The daemon's mode decides ours: UCX refuses endpoints whose error-handling modes differ, and
    // the daemon connects back to us for gets, so against a TCP-listener daemon we listen too.
    if (auto s = HelloLocked(); !s.ok()) return s;
    transfer::UcxOptions uo;
    uo.net_devices = options_.ucx_net_devices;
    uo.spin = kBulkProgressSpin;
    if (daemon_address_.rfind("ucx+tcp://", 0) == 0) {
      uo.mode = transfer::UcxOptions::Mode::kListener;
      uo.listen_ip = options_.ucx_listen_ip;
    }
    transfer::EngineOptions eo;
    eo.config_fingerprint = kBulkFingerprint;
    eo.cluster_token = options_.cluster_token;
    if (eo.cluster_token.empty()) eo.cluster_token = common::ClusterSecretFromEnv();
    eo.node_name = "kvstore-client";
    eo.pool_bytes = kBulkPoolBytes;
    // A fault-injecting client gets an engine of its own; the others share one per process.
    auto engine = options_.debug_wrap_wire
                      ? MakeEngine(uo, eo, options_.debug_wrap_wire, options_.registry)
                      : GetSharedEngine(uo, eo, options_.registry);
    if (!engine.ok()) {
      engine_error_ = engine.status();
      spdlog::warn("kvstore client: no UCX bulk path ({}); values travel inline",
                   std::string(engine_error_.message()));
      return engine_error_;
    }
    engine_ = std::move(*engine);
    return engine_->get();
  }

  std::mutex mu_;  // guards the engine and the daemon connection
  std::shared_ptr<SharedEngine> engine_;
  absl::Status engine_error_;
  std::string daemon_address_;
  bool no_bulk_ = false;
  transfer::PeerId peer_ = 0;
  bool has_peer_ = false;
  std::string nonce_;
  std::atomic<uint64_t> seq_{0};
  std::mutex shm_mu_;  // guards shm_state_ and free_segments_
  int shm_state_ = 0;  // 0: not asked yet, 1: same host, -1: not usable
  std::vector<std::unique_ptr<ClientSegment>> free_segments_;
  std::atomic<size_t> value_hint_{64 << 10};  // the largest value seen (sizes a get's segment)
};

double KvStoreClient::transfer_errors() const {
  double total = 0;
  for (const auto& family :
       (impl_->options_.registry != nullptr ? *impl_->options_.registry : impl_->own_registry_)
           .Collect()) {
    if (family.name != "epd_kv_transfer_errors_total") continue;
    for (const auto& m : family.metric) total += m.counter.value;
  }
  return total;
}

KvStoreClient::KvStoreClient(std::string target, std::unique_ptr<Impl> impl)
    : target_(std::move(target)), impl_(std::move(impl)) {}
KvStoreClient::~KvStoreClient() = default;

std::unique_ptr<KvStoreClient> KvStoreClient::Create(const std::string& target,
                                                     KvClientOptions options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Every call proves the cluster secret (runtime/grpc_auth.h); the UCX handshake too.
  if (options.cluster_token.empty()) options.cluster_token = common::ClusterSecretFromEnv();
  if (options.cluster_token.empty())
    spdlog::error("kvstore client: no cluster secret (--cluster-secret-file or "
                  "$EPD_CLUSTER_SECRET); the daemon will refuse every call");
  auto channel = runtime::CreateClusterChannel(target, options.cluster_token, args);
  // Start connecting now, so the first call (the router's has a 200 ms deadline) does not pay
  // for the TCP + HTTP/2 handshake.
  channel->GetState(/*try_to_connect=*/true);
  return std::unique_ptr<KvStoreClient>(
      new KvStoreClient(target, std::make_unique<Impl>(std::move(channel), options)));
}

absl::StatusOr<LookupResult> KvStoreClient::Lookup(std::string_view config_fingerprint,
                                                   std::span<const BlockHash> chain_hashes) {
  v1::LookupRequest req;
  req.set_config_fingerprint(std::string(config_fingerprint));
  for (const BlockHash& h : chain_hashes) req.add_chain_hashes(std::string(AsBytes(h)));
  v1::LookupResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  if (auto s = FromGrpc(impl_->stub_->Lookup(&ctx, req, &resp), "lookup"); !s.ok()) return s;
  LookupResult r;
  r.cached_blocks = resp.cached_blocks();
  for (int t : resp.tiers()) r.tiers.push_back(FromProto(static_cast<v1::Tier>(t)));
  r.swa_snapshot_present = resp.swa_snapshot_present();
  return r;
}

absl::StatusOr<GetResult> KvStoreClient::Get(Tier tier, std::string_view key) {
  if (impl_->options_.bulk == BulkTransport::kShm) {
    const std::string k(key);
    auto batch = BatchGet(tier, std::span<const std::string>(&k, 1), false);
    if (!batch.ok()) return batch.status();
    return std::move(batch->front());
  }
  v1::GetRequest req;
  req.set_tier(ToProto(tier));
  req.set_key(std::string(key));
  transfer::TransferEngine* engine = nullptr;
  // kUcx: the receive is posted before the rpc (its length comes with the offer), so the daemon's
  // offer, the bytes and the checksums move while the answer does (docs/kvstore.md "Bulk path").
  std::optional<transfer::TransferId> open;
  if (impl_->options_.bulk == BulkTransport::kUcx) {
    auto e = impl_->Engine();
    if (e.ok()) {
      engine = *e;
      auto* bulk = req.mutable_bulk();
      bulk->set_client_address(engine->LocalAddress());
      bulk->set_request_id(impl_->NextRequestId());
      bulk->set_min_bytes(impl_->options_.bulk_min_bytes);
      auto id = engine->ReceiveAny(BulkManifest(bulk->request_id(), 0),
                                   static_cast<uint64_t>(impl_->options_.max_message_bytes),
                                   impl_->TransferOpts());
      if (id.ok()) open = *id;  // else (engine stopping) the offer waits for Receive below
    }
  }
  v1::GetResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  const absl::Status rpc = FromGrpc(impl_->stub_->Get(&ctx, req, &resp), "get");
  if (open.has_value() && (!rpc.ok() || !resp.bulk())) engine->Withdraw(*open);
  if (!rpc.ok()) return rpc;
  GetResult r;
  r.found = resp.found();
  if (resp.bulk()) {
    if (engine == nullptr) return absl::InternalError("kvstore get: unsolicited bulk answer");
    // The daemon has offered the value: the engine checks every chunk and the checksum before we
    // copy a byte; the length the daemon announced must be the length that arrived.
    const std::string& rid = req.bulk().request_id();
    auto fail = [&](const absl::Status& s) {
      impl_->errors_.Count(s, "get");
      return absl::Status(s.code(),
                          absl::StrCat("kvstore get: bulk transfer of ", resp.byte_length(),
                                       " bytes (request '", rid, "') failed: ", s.message()));
    };
    transfer::TransferId id = 0;
    if (open.has_value()) {
      id = *open;
    } else {
      auto buffer = engine->Allocate(resp.byte_length());
      if (!buffer.ok()) return fail(buffer.status());
      auto made = engine->Receive(BulkManifest(rid, resp.byte_length()), std::move(*buffer),
                                  impl_->TransferOpts());
      if (!made.ok()) return fail(made.status());
      id = *made;
    }
    absl::Status s = engine->Wait(id, absl::Milliseconds(impl_->options_.deadline_ms + 1000));
    if (s.ok()) {
      auto received = engine->TakeReceived(id);
      if (!received.ok()) {
        s = received.status();
      } else if (received->buffer->size() != resp.byte_length()) {
        s = BulkLengthMismatch(rid, "daemon", resp.byte_length(), received->buffer->size());
      } else {
        r.value.assign(reinterpret_cast<const char*>(received->buffer->data()),
                       received->buffer->size());
      }
    }
    if (!s.ok()) {
      engine->Cancel(id, "bulk get failed");
      engine->Forget(id);
      return fail(s);
    }
  } else {
    r.value = std::move(*resp.mutable_value());
  }
  r.miss = r.found ? MissReason::kNone : ParseMissReason(resp.miss_reason());
  if (!r.found && r.miss == MissReason::kNone) r.miss = MissReason::kAbsent;
  r.tier = FromProto(resp.tier());
  return r;
}

absl::Status KvStoreClient::Put(Tier tier, std::string_view key, std::string_view value) {
  if (impl_->options_.bulk == BulkTransport::kShm) {
    const KvPut item{key, value};
    auto batch = BatchPut(tier, std::span<const KvPut>(&item, 1));
    if (!batch.ok()) return batch.status();
    return batch->front();
  }
  if (impl_->WantsBulk(value.size())) {
    absl::Status s = BulkPut(tier, key, value);
    if (!absl::IsNotFound(s) && !absl::IsUnimplemented(s)) return s;
    // NotFound/Unimplemented: the daemon (or this host) has no bulk path; send inline.
  }
  v1::PutRequest req;
  req.set_tier(ToProto(tier));
  req.set_key(std::string(key));
  req.set_value(std::string(value));
  v1::PutResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  if (auto s = FromGrpc(impl_->stub_->Put(&ctx, req, &resp), "put"); !s.ok()) return s;
  if (!resp.stored()) return absl::InternalError("kvstore put: daemon did not store the value");
  return absl::OkStatus();
}

absl::Status KvStoreClient::BulkPut(Tier tier, std::string_view key, std::string_view value) {
  auto engine_or = impl_->Engine();
  if (!engine_or.ok()) return absl::NotFoundError(engine_or.status().message());
  transfer::TransferEngine* engine = *engine_or;
  const std::string rid = impl_->NextRequestId();
  // 1. Offer the bytes (the engine computes the checksum; the daemon holds the offer, manifest
  //    only, until its Put handler claims it).
  //    The checksum is computed while the value is copied into the engine's buffer (one pass), so
  //    the offer carries it and no seal has to follow.
  absl::StatusOr<transfer::TransferId> send = absl::UnknownError("not sent");
  transfer::TransferOptions to = impl_->TransferOpts();
  to.checksums_in_manifest = true;
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto peer = impl_->DaemonPeer(attempt > 0);
    if (!peer.ok()) return peer.status();
    auto buffer = engine->Allocate(value.size());
    if (!buffer.ok()) return buffer.status();
    const uint64_t checksum = CopyAndChecksum(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(value.data()), value.size()),
        (*buffer)->data());
    send = engine->Send(*peer, BulkManifest(rid, value.size(), checksum), std::move(*buffer), to);
    if (send.ok()) break;  // else the cached connection is gone: reconnect once
  }
  if (!send.ok()) {
    impl_->errors_.Count(send.status(), "put");
    return absl::Status(send.status().code(),
                        absl::StrCat("kvstore put: bulk offer failed: ", send.status().message()));
  }
  // 2. Commit over gRPC: OK only once the daemon verified and stored the bytes.
  v1::PutRequest req;
  req.set_tier(ToProto(tier));
  req.set_key(std::string(key));
  req.mutable_bulk()->set_request_id(rid);
  req.mutable_bulk()->set_byte_length(value.size());
  v1::PutResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  absl::Status s = FromGrpc(impl_->stub_->Put(&ctx, req, &resp), "put");
  if (s.ok() && !resp.stored()) s = absl::InternalError("kvstore put: daemon did not store it");
  if (s.ok()) {
    // The daemon verified and stored the bytes before answering; the transfer's END may trail
    // the answer. It finishes on its own: no wait here, and a late END is not a failure (a fixed
    // 2 s wait used to fail and count it as "cancelled").
    engine->Detach(*send);
    return s;
  }
  auto st = engine->Status(*send);
  if (st.ok() && st->state == transfer::TransferState::kFailed) {
    impl_->errors_.Count(st->error, "put");
  }
  engine->Cancel(*send, "bulk put failed");
  engine->Forget(*send);
  return s;
}

bool KvStoreClient::shared_memory_active() { return impl_->ShmUsable() && impl_->ShmActive(); }

absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> KvStoreClient::BatchGet(
    Tier tier, std::span<const std::string> keys, bool stop_at_first_miss) {
  v1::BatchGetRequest req;
  req.set_tier(ToProto(tier));
  for (const std::string& k : keys) req.add_keys(k);
  req.set_stop_at_first_miss(stop_at_first_miss);
  std::unique_ptr<ClientSegment> seg;
  if (!keys.empty() && impl_->ShmUsable()) {
    seg = impl_->TakeSegment(keys.size() * (impl_->value_hint() + 64));
    if (seg != nullptr) {
      auto* shm = req.mutable_shm();
      shm->set_pid(getpid());
      shm->set_fd(seg->fd());
      shm->set_inode(seg->inode());
      shm->set_size(seg->size());
    }
  }
  v1::BatchGetResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  if (auto s = FromGrpc(impl_->stub_->BatchGet(&ctx, req, &resp), "batch get"); !s.ok()) {
    impl_->ReturnSegment(std::move(seg));
    return s;
  }
  if (seg != nullptr && !resp.shm_used()) {
    impl_->DisableShm(resp.shm_refused());
    seg.reset();
  }
  if (resp.items_size() != static_cast<int>(keys.size())) {
    impl_->ReturnSegment(std::move(seg));
    return absl::InternalError(absl::StrCat("kvstore batch get: asked for ", keys.size(),
                                            " keys, the daemon answered ", resp.items_size()));
  }
  std::vector<absl::StatusOr<GetResult>> out;
  out.reserve(keys.size());
  for (v1::BatchGetItem& item : *resp.mutable_items()) {
    if (!item.error().empty() || item.error_code() != 0) {
      out.push_back(absl::Status(static_cast<absl::StatusCode>(item.error_code()),
                                 absl::StrCat("kvstore batch get: ", item.error())));
      continue;
    }
    GetResult r;
    r.found = item.found();
    r.tier = FromProto(item.tier());
    if (item.in_shm()) {
      if (seg == nullptr || item.offset() > seg->size() ||
          item.byte_length() > seg->size() - item.offset()) {
        out.push_back(absl::DataLossError(
            absl::StrCat("kvstore batch get: the daemon placed a value at [", item.offset(), ", +",
                         item.byte_length(), ") outside this client's segment")));
        continue;
      }
      // Copied first, then the copy verified (it is what the caller gets, and hot in cache).
      r.value.assign(reinterpret_cast<const char*>(seg->data() + item.offset()),
                     item.byte_length());
      if (common::Xxh3_64(r.value, item.checksum_seed()) != item.checksum()) {
        out.push_back(absl::DataLossError(
            absl::StrCat("kvstore batch get: the ", item.byte_length(),
                         " bytes in shared memory do not match the daemon's checksum")));
        continue;
      }
    } else {
      r.value = std::move(*item.mutable_value());
    }
    if (r.found) impl_->NoteValueBytes(r.value.size());
    r.miss = r.found ? MissReason::kNone : ParseMissReason(item.miss_reason());
    if (!r.found && r.miss == MissReason::kNone) r.miss = MissReason::kAbsent;
    out.push_back(std::move(r));
  }
  impl_->ReturnSegment(std::move(seg));
  return out;
}

absl::StatusOr<std::vector<absl::Status>> KvStoreClient::BatchPut(Tier tier,
                                                                  std::span<const KvPut> items) {
  v1::BatchPutRequest req;
  req.set_tier(ToProto(tier));
  std::unique_ptr<ClientSegment> seg;
  if (!items.empty() && impl_->ShmUsable()) {
    size_t total = 0;
    for (const KvPut& it : items) total += (it.value.size() + 63) & ~static_cast<size_t>(63);
    seg = impl_->TakeSegment(total);
  }
  size_t used = 0;
  for (const KvPut& it : items) {
    v1::BatchPutItem* item = req.add_items();
    item->set_key(std::string(it.key));
    if (seg != nullptr) {
      if (!it.value.empty()) std::memcpy(seg->data() + used, it.value.data(), it.value.size());
      const std::span<const uint8_t> bytes(seg->data() + used, it.value.size());
      item->set_in_shm(true);
      item->set_offset(used);
      item->set_byte_length(it.value.size());
      item->set_checksum(common::Xxh3_64(bytes));
      used += (it.value.size() + 63) & ~static_cast<size_t>(63);
    } else {
      item->set_value(std::string(it.value));
    }
  }
  if (seg != nullptr) {
    auto* shm = req.mutable_shm();
    shm->set_pid(getpid());
    shm->set_fd(seg->fd());
    shm->set_inode(seg->inode());
    shm->set_size(seg->size());
  }
  v1::BatchPutResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  absl::Status rpc = FromGrpc(impl_->stub_->BatchPut(&ctx, req, &resp), "batch put");
  impl_->ReturnSegment(std::move(seg));
  if (!rpc.ok()) return rpc;
  if (resp.results_size() != static_cast<int>(items.size())) {
    return absl::InternalError(absl::StrCat("kvstore batch put: sent ", items.size(),
                                            " items, the daemon answered ", resp.results_size()));
  }
  std::vector<absl::Status> out;
  out.reserve(items.size());
  std::vector<KvPut> retry;  // values the daemon could not read from the segment
  std::vector<size_t> retry_at;
  for (int i = 0; i < resp.results_size(); ++i) {
    const v1::BatchPutResult& r = resp.results(i);
    if (r.stored()) {
      out.push_back(absl::OkStatus());
      continue;
    }
    const auto code = static_cast<absl::StatusCode>(r.error_code());
    if (req.items(i).in_shm() && !resp.shm_refused().empty()) {
      retry.push_back(items[static_cast<size_t>(i)]);
      retry_at.push_back(out.size());
    }
    out.push_back(absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kInternal : code,
                               absl::StrCat("kvstore batch put: ", r.error())));
  }
  if (!retry.empty()) {
    // The daemon could not map the segment: inline from now on, and once more for these.
    impl_->DisableShm(resp.shm_refused());
    auto again = BatchPut(tier, retry);
    if (!again.ok()) return again.status();
    for (size_t j = 0; j < retry_at.size(); ++j) out[retry_at[j]] = (*again)[j];
  }
  return out;
}

absl::StatusOr<bool> KvStoreClient::Pin(std::string_view key, bool pin) {
  v1::PinRequest req;
  req.set_key(std::string(key));
  req.set_pin(pin);
  v1::PinResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  if (auto s = FromGrpc(impl_->stub_->Pin(&ctx, req, &resp), "pin"); !s.ok()) return s;
  return resp.found();
}

absl::StatusOr<std::vector<TierStats>> KvStoreClient::Stats() {
  v1::StatsRequest req;
  v1::StatsResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  if (auto s = FromGrpc(impl_->stub_->Stats(&ctx, req, &resp), "stats"); !s.ok()) return s;
  std::vector<TierStats> out;
  for (const auto& t : resp.tiers()) {
    out.push_back({FromProto(t.tier()), static_cast<uint64_t>(t.entries()),
                   static_cast<uint64_t>(t.bytes()), static_cast<uint64_t>(t.capacity_bytes())});
  }
  return out;
}

ShardedSwaClient::ShardedSwaClient(const std::vector<std::string>& targets, KvClientOptions options,
                                   int virtual_nodes)
    : ring_(virtual_nodes) {
  for (const std::string& t : targets) {
    ring_.AddNode(t);
    clients_.emplace_back(t, KvStoreClient::Create(t, options));
  }
}

std::string ShardedSwaClient::OwnerOf(std::string_view key) const {
  return ring_.NodeFor(key).value_or("");
}

KvStoreClient* ShardedSwaClient::ClientFor(std::string_view key) const {
  const std::string owner = OwnerOf(key);
  for (const auto& [t, c] : clients_) {
    if (t == owner) return c.get();
  }
  return nullptr;
}

absl::Status ShardedSwaClient::Put(std::string_view key, std::string_view value) {
  KvStoreClient* c = ClientFor(key);
  if (c == nullptr) return absl::FailedPreconditionError("SWA shard ring is empty");
  return c->Put(Tier::kG2, key, value);
}

absl::StatusOr<GetResult> ShardedSwaClient::Get(std::string_view key) {
  KvStoreClient* c = ClientFor(key);
  if (c == nullptr) return absl::FailedPreconditionError("SWA shard ring is empty");
  return c->Get(Tier::kG2, key);
}

}  // namespace epd::kvstore
