#include "kvstore/bulk.h"

#include "common/cluster_secret.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "transfer/manifest.h"
#include "transfer/transfer_engine.h"
#include "transfer/transfer_error.h"
#include "transfer/ucx_wire.h"

namespace epd::kvstore {

epd::v1::Manifest BulkManifest(const std::string& request_id, uint64_t bytes) {
  epd::v1::Manifest m;
  m.set_request_id(request_id);
  m.set_config_fingerprint(kBulkFingerprint);
  transfer::AddRawBytesSegment(m, epd::v1::SEGMENT_BLOCK, -1, 0, 0, bytes);
  return m;
}

epd::v1::Manifest BulkManifest(const std::string& request_id, uint64_t bytes, uint64_t checksum) {
  epd::v1::Manifest m = BulkManifest(request_id, bytes);
  m.mutable_segments(0)->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
  m.mutable_segments(0)->set_checksum(checksum);
  return m;
}

uint64_t BulkChecksum(std::span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

absl::Status BulkLengthMismatch(const std::string& request_id, std::string_view who,
                                uint64_t announced, uint64_t carried) {
  return transfer::WithTransferError(
      absl::DataLossError(absl::StrCat("accounting error in request '", request_id, "': the ",
                                       std::string(who), " announced ", announced,
                                       " bytes but its offer carried ", carried, " (truncated)")),
      "truncated", "byte_length");
}

std::string TransferErrorReason(const absl::Status& status) {
  // The engine's own label where it gave one (transfer/transfer_error.h); a receiver's
  // rejection carries the manifest field it found wrong.
  if (std::optional<transfer::TransferErrorInfo> info = transfer::TransferErrorOf(status)) {
    if (info->reason == "checksum" || info->field == "checksum") return "checksum";
    if (info->reason == "truncated" || info->field == "byte_length") return "truncated";
    if (info->reason == "handshake") return "handshake";
    if (info->reason == "lease_expired") return "lease_expired";
  }
  switch (status.code()) {
    case absl::StatusCode::kDataLoss:
      return "truncated";
    case absl::StatusCode::kUnavailable:
      return "peer_down";
    case absl::StatusCode::kDeadlineExceeded:
      return "deadline";
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kInvalidArgument:
      return "rejected";
    case absl::StatusCode::kAborted:
      return "peer_ended";
    case absl::StatusCode::kCancelled:
      return "cancelled";
    case absl::StatusCode::kResourceExhausted:
      return "memory";
    default:
      return "other";
  }
}

TransferErrorMetric::TransferErrorMetric(prometheus::Registry& registry)
    : family_(&prometheus::BuildCounter()
                   .Name("epd_kv_transfer_errors_total")
                   .Help("Bulk (UCX) value transfers that failed, by cause and direction")
                   .Register(registry)) {}

void TransferErrorMetric::Count(const absl::Status& status, std::string_view direction) {
  Count(TransferErrorReason(status), direction);
}

void TransferErrorMetric::Count(std::string_view reason, std::string_view direction) {
  family_->Add({{"reason", std::string(reason)}, {"direction", std::string(direction)}})
      .Increment();
}

KvBulkEndpoint::KvBulkEndpoint(const BulkEndpointOptions& options, prometheus::Registry& registry)
    : options_(options), errors_(registry) {}

absl::StatusOr<std::unique_ptr<KvBulkEndpoint>> KvBulkEndpoint::Create(
    const BulkEndpointOptions& options, prometheus::Registry& registry,
    const common::Clock& clock) {
  std::unique_ptr<KvBulkEndpoint> ep(new KvBulkEndpoint(options, registry));
  transfer::UcxOptions uo;
  uo.net_devices = options.net_devices;
  uo.spin = kBulkProgressSpin;
  if (options.listener) {
    uo.mode = transfer::UcxOptions::Mode::kListener;
    uo.listen_ip = options.listen_ip;
  }
  transfer::EngineOptions eo;
  eo.config_fingerprint = kBulkFingerprint;
  eo.cluster_token =
      options.cluster_token.empty() ? common::ClusterSecretFromEnv() : options.cluster_token;
  if (eo.cluster_token.empty())
    return absl::FailedPreconditionError(
        "kvstore bulk endpoint: no cluster secret (--cluster-secret-file or $EPD_CLUSTER_SECRET)");
  eo.node_name = "epd-kvstore";
  eo.pool_bytes = kBulkPoolBytes;
  // Puts: an offer is received as soon as it arrives (usually before its Put rpc), bounded by
  // the largest value accepted.
  eo.eager_receive_bytes = options.max_value_bytes;
  std::unique_ptr<transfer::Wire> wire = transfer::MakeUcxWire(uo);
  if (options.wrap_wire) wire = options.wrap_wire(std::move(wire));
  auto engine = transfer::TransferEngine::Create(std::move(wire), eo, registry, clock);
  if (!engine.ok()) return engine.status();
  ep->engine_ = std::move(*engine);
  ep->reaper_ = std::thread([e = ep.get()] { e->ReapLoop(); });
  return ep;
}

KvBulkEndpoint::~KvBulkEndpoint() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  for (const Send& s : sends_) engine_->Forget(s.id);
  engine_->Shutdown();
}

std::string KvBulkEndpoint::address() const { return engine_->LocalAddress(); }

transfer::ResourceCounts KvBulkEndpoint::Resources() const { return engine_->Resources(); }

absl::StatusOr<std::unique_ptr<transfer::TransferBuffer>> KvBulkEndpoint::ReceivePut(
    const std::string& request_id, uint64_t bytes) {
  auto fail = [&](const absl::Status& s) {
    errors_.Count(s, "put");
    return absl::Status(
        s.code(), absl::StrCat("bulk put of request '", request_id, "' failed: ", s.message()));
  };
  if (bytes > options_.max_value_bytes) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "value of ", bytes, " bytes is over the limit of ", options_.max_value_bytes)));
  }
  // The offer usually came before this rpc and is already being received (the engine's eager
  // receives): this takes it over. The offer may carry at most `bytes` (else it is refused as an
  // accounting error) and must carry exactly that many to be stored.
  transfer::TransferOptions to;
  to.deadline = options_.deadline;
  auto id = engine_->ReceiveAny(BulkManifest(request_id, 0), std::max<uint64_t>(bytes, 1), to);
  if (!id.ok()) return fail(id.status());
  absl::Status s = engine_->Wait(*id, options_.deadline + absl::Seconds(1));
  if (s.ok()) {
    auto received = engine_->TakeReceived(*id);
    if (!received.ok()) {
      s = received.status();
    } else if (received->buffer->size() != bytes) {
      s = BulkLengthMismatch(request_id, "put", bytes, received->buffer->size());
    } else {
      return std::move(received->buffer);
    }
  }
  engine_->Cancel(*id, "bulk put failed");
  engine_->Forget(*id);  // the engine frees the buffer once no UCX operation can touch it
  return fail(s);
}

absl::StatusOr<transfer::PeerId> KvBulkEndpoint::PeerFor(const std::string& address,
                                                         bool reconnect) {
  std::lock_guard<std::mutex> connect_lock(connect_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(address);
    if (it != peers_.end()) {
      if (!reconnect) return it->second;
      engine_->Disconnect(it->second);
      peers_.erase(it);
    }
  }
  auto peer = engine_->Connect(address, absl::Seconds(10));
  if (!peer.ok()) return peer.status();
  std::lock_guard<std::mutex> lock(mu_);
  peers_[address] = *peer;
  return *peer;
}

void KvBulkEndpoint::DropPeer(transfer::PeerId peer) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = peers_.begin(); it != peers_.end(); ++it) {
    if (it->second == peer) {
      peers_.erase(it);
      engine_->Disconnect(peer);
      return;
    }
  }
}

absl::StatusOr<std::unique_ptr<transfer::TransferBuffer>> KvBulkEndpoint::AllocateValue(
    uint64_t bytes) {
  return engine_->Allocate(bytes);
}

absl::Status KvBulkEndpoint::StartGetSend(const std::string& client_address,
                                          const std::string& request_id,
                                          std::span<const uint8_t> value) {
  auto buffer = engine_->Allocate(value.size());
  if (!buffer.ok()) {
    errors_.Count(buffer.status(), "get");
    return absl::Status(buffer.status().code(),
                        absl::StrCat("bulk get of request '", request_id,
                                     "' could not be offered: ", buffer.status().message()));
  }
  std::shared_ptr<transfer::TransferBuffer> copy = std::move(*buffer);
  // The checksum is computed while copying (one pass), so the offer carries it.
  const uint64_t checksum = CopyAndChecksum(value, copy->data());
  return Offer(client_address, request_id, std::move(copy), checksum);
}

absl::Status KvBulkEndpoint::StartGetSend(const std::string& client_address,
                                          const std::string& request_id,
                                          std::shared_ptr<transfer::TransferBuffer> value) {
  const uint64_t checksum = BulkChecksum(std::span<const uint8_t>(value->data(), value->size()));
  return Offer(client_address, request_id, std::move(value), checksum);
}

absl::Status KvBulkEndpoint::Offer(const std::string& client_address, const std::string& request_id,
                                   std::shared_ptr<transfer::TransferBuffer> value,
                                   uint64_t checksum) {
  absl::Status last;
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto peer = PeerFor(client_address, attempt > 0);
    if (!peer.ok()) {
      last = peer.status();
      continue;
    }
    // A view of `value` for this attempt: a refused Send drops the view, not the bytes.
    auto view = engine_->Borrow(value->data(), value->size(), value);
    if (!view.ok()) {
      last = view.status();
      break;
    }
    transfer::TransferOptions to;
    to.deadline = options_.deadline;
    to.lease = options_.deadline;
    to.checksums_in_manifest = true;
    auto id = engine_->Send(*peer, BulkManifest(request_id, value->size(), checksum),
                            std::move(*view), to);
    if (id.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      sends_.push_back({*id, *peer});
      return absl::OkStatus();
    }
    last = id.status();  // e.g. the cached connection went down: reconnect once
  }
  errors_.Count(last, "get");
  return absl::Status(last.code(), absl::StrCat("bulk get of request '", request_id,
                                                "' could not be offered: ", last.message()));
}

void KvBulkEndpoint::ReapLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(20));
    std::vector<Send> pending;
    pending.swap(sends_);
    lock.unlock();
    std::vector<Send> keep;
    std::vector<transfer::PeerId> dead;
    for (const Send& s : pending) {
      auto st = engine_->Status(s.id);
      if (!st.ok()) continue;  // record gone
      if (st->state == transfer::TransferState::kDone) {
        engine_->Forget(s.id);
      } else if (st->state == transfer::TransferState::kFailed) {
        errors_.Count(st->error, "get");
        spdlog::warn("epd-kvstore: bulk get failed: {}", std::string(st->error.message()));
        if (TransferErrorReason(st->error) == "peer_down") dead.push_back(s.peer);
        engine_->Forget(s.id);
      } else {
        keep.push_back(s);
      }
    }
    for (transfer::PeerId p : dead) DropPeer(p);
    lock.lock();
    sends_.insert(sends_.end(), keep.begin(), keep.end());
  }
}

}  // namespace epd::kvstore
