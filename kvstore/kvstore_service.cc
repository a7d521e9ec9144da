#include "kvstore/kvstore_service.h"

#include "common/cluster_secret.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "kvstore/bulk.h"
#include "kvstore/chain_hash.h"
#include "kvstore/shm_segment.h"

namespace epd::kvstore {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  grpc::StatusCode code = grpc::StatusCode::INTERNAL;
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      code = grpc::StatusCode::INVALID_ARGUMENT;
      break;
    case absl::StatusCode::kResourceExhausted:
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      break;
    case absl::StatusCode::kFailedPrecondition:
      code = grpc::StatusCode::FAILED_PRECONDITION;
      break;
    case absl::StatusCode::kNotFound:
      code = grpc::StatusCode::NOT_FOUND;
      break;
    case absl::StatusCode::kDataLoss:
      code = grpc::StatusCode::DATA_LOSS;
      break;
    case absl::StatusCode::kUnavailable:
      code = grpc::StatusCode::UNAVAILABLE;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      code = grpc::StatusCode::DEADLINE_EXCEEDED;
      break;
    case absl::StatusCode::kAborted:
      code = grpc::StatusCode::ABORTED;
      break;
    case absl::StatusCode::kCancelled:
      code = grpc::StatusCode::CANCELLED;
      break;
    default:
      break;
  }
  return grpc::Status(code, std::string(s.message()));
}

std::span<const uint8_t> AsSpan(const std::string& s) {
  return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

}  // namespace

v1::Tier ToProto(Tier tier) {
  switch (tier) {
    case Tier::kG1:
      return v1::TIER_G1_BLOCK_POOL;
    case Tier::kG2:
      return v1::TIER_G2_SWA_POOL;
    case Tier::kG3:
      return v1::TIER_G3_ROCKSDB;
    case Tier::kAuto:
      break;
  }
  return v1::TIER_UNSPECIFIED;
}

Tier FromProto(v1::Tier tier) {
  switch (tier) {
    case v1::TIER_G1_BLOCK_POOL:
      return Tier::kG1;
    case v1::TIER_G2_SWA_POOL:
      return Tier::kG2;
    case v1::TIER_G3_ROCKSDB:
      return Tier::kG3;
    default:
      return Tier::kAuto;
  }
}

KvStoreServiceImpl::KvStoreServiceImpl(KvStore& store, KvServiceOptions options)
    : store_(store),
      options_(options),
      auth_(options.cluster_secret.empty() ? common::ClusterSecretFromEnv()
                                           : options.cluster_secret),
      host_id_(HostId()),
      segments_(std::make_unique<PeerSegmentCache>(
          /*max_entries=*/64, std::chrono::milliseconds(500),
          [this](size_t n) { store_.metrics().shm_mapped().Set(static_cast<double>(n)); })) {}

KvStoreServiceImpl::~KvStoreServiceImpl() = default;

grpc::Status KvStoreServiceImpl::Hello(grpc::ServerContext* ctx, const v1::HelloRequest*,
                                       v1::HelloResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/Hello"); !a.ok()) return a;
  if (options_.bulk != nullptr) {
    resp->set_transfer_address(options_.bulk->address());
    resp->set_transfer_fingerprint(kBulkFingerprint);
    resp->set_max_value_bytes(options_.bulk->max_value_bytes());
  }
  resp->set_host_id(host_id_);
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Lookup(grpc::ServerContext* ctx, const v1::LookupRequest* req,
                                        v1::LookupResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/Lookup"); !a.ok()) return a;
  std::vector<BlockHash> hashes;
  hashes.reserve(req->chain_hashes_size());
  for (const std::string& h : req->chain_hashes()) {
    auto k = BlockHashFromBytes(h);
    if (!k.ok()) {
      store_.metrics().CountBadRequest("key_size");
      return ToGrpc(k.status());
    }
    hashes.push_back(*k);
  }
  const LookupResult r = store_.Lookup(hashes);
  resp->set_cached_blocks(r.cached_blocks);
  for (Tier t : r.tiers) resp->add_tiers(ToProto(t));
  resp->set_swa_snapshot_present(r.swa_snapshot_present);
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Get(grpc::ServerContext* ctx, const v1::GetRequest* req,
                                     v1::GetResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/Get"); !a.ok()) return a;
  // A bulk get has the store copy the hit straight into an engine buffer (no intermediate string),
  // which then goes to the client as it is.
  const bool bulk = req->has_bulk() && options_.bulk != nullptr;
  std::shared_ptr<transfer::TransferBuffer> bulk_value;
  ValueDest dest;
  if (bulk) {
    dest = [&](size_t n) -> uint8_t* {
      if (n < req->bulk().min_bytes()) return nullptr;
      auto buffer = options_.bulk->AllocateValue(n);
      if (!buffer.ok()) return nullptr;  // the value comes the usual way
      bulk_value = std::move(*buffer);
      return bulk_value->data();
    };
  }
  auto r = store_.Get(FromProto(req->tier()), req->key(), dest);
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_found(r->found);
  if (r->found && r->in_dest) {
    // Offer the bytes over UCX; the client receives them (its receive is already posted). If the
    // offer cannot be made (client unreachable: counted), the value goes inline instead.
    const absl::Status s = options_.bulk->StartGetSend(req->bulk().client_address(),
                                                       req->bulk().request_id(), bulk_value);
    if (s.ok()) {
      resp->set_bulk(true);
      resp->set_byte_length(bulk_value->size());
    } else {
      resp->set_value(reinterpret_cast<const char*>(bulk_value->data()), bulk_value->size());
    }
  } else if (r->found && bulk && r->value.size() >= req->bulk().min_bytes()) {
    const absl::Status s = options_.bulk->StartGetSend(req->bulk().client_address(),
                                                       req->bulk().request_id(), AsSpan(r->value));
    if (s.ok()) {
      resp->set_bulk(true);
      resp->set_byte_length(r->value.size());
    } else {
      *resp->mutable_value() = std::move(r->value);
    }
  } else if (r->found) {
    *resp->mutable_value() = std::move(r->value);
  }
  resp->set_miss_reason(std::string(MissReasonName(r->miss)));
  resp->set_tier(ToProto(r->tier));
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Put(grpc::ServerContext* ctx, const v1::PutRequest* req,
                                     v1::PutResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/Put"); !a.ok()) return a;
  prometheus::Gauge& in_flight = store_.metrics().puts_in_flight();
  in_flight.Increment();
  std::unique_ptr<transfer::TransferBuffer> bulk_bytes;
  std::span<const uint8_t> value = AsSpan(req->value());
  if (req->has_bulk()) {
    absl::Status bad;
    if (options_.bulk == nullptr) {
      bad = absl::FailedPreconditionError("bulk put: this daemon has no bulk (UCX) endpoint");
    } else if (!req->value().empty()) {
      bad = absl::InvalidArgumentError("bulk put: value must be empty when bulk is set");
    }
    if (!bad.ok()) {
      store_.metrics().CountBadRequest("bulk");
      in_flight.Decrement();
      return ToGrpc(bad);
    }
    // The bytes land in a private engine buffer, verified (length, checksum) before we see them;
    // nothing is visible to readers until store_.Put below commits them.
    auto received = options_.bulk->ReceivePut(req->bulk().request_id(), req->bulk().byte_length());
    if (!received.ok()) {
      in_flight.Decrement();
      return ToGrpc(received.status());
    }
    bulk_bytes = std::move(*received);
    value = std::span<const uint8_t>(bulk_bytes->data(), bulk_bytes->size());
  }
  if (options_.debug_put_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(options_.debug_put_delay_ms));
  }
  auto s = store_.Put(FromProto(req->tier()), req->key(), value);
  in_flight.Decrement();
  if (!s.ok()) return ToGrpc(s);
  resp->set_stored(true);
  return grpc::Status::OK;
}

std::shared_ptr<MappedPeerSegment> KvStoreServiceImpl::MapSegment(const v1::ShmSegment& shm,
                                                                  bool writable, std::string* why) {
  std::string reason;
  auto seg = segments_->Acquire(shm.pid(), shm.fd(), shm.inode(), shm.size(), writable, &reason);
  if (!seg.ok()) {
    store_.metrics().CountShmRefused(reason);
    *why = std::string(seg.status().message());
    return nullptr;
  }
  return *std::move(seg);
}

grpc::Status KvStoreServiceImpl::BatchGet(grpc::ServerContext* ctx, const v1::BatchGetRequest* req,
                                          v1::BatchGetResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/BatchGet"); !a.ok()) return a;
  store_.metrics().batch_calls(false).Increment();
  store_.metrics().batch_keys(false).Increment(req->keys_size());
  const Tier tier = FromProto(req->tier());
  std::shared_ptr<MappedPeerSegment> seg;
  if (req->has_shm()) {
    std::string why;
    seg = MapSegment(req->shm(), /*writable=*/true, &why);
    if (seg == nullptr) resp->set_shm_refused(why);
  }
  resp->set_shm_used(seg != nullptr);
  size_t used = 0;    // bytes of the segment handed out so far
  size_t offset = 0;  // where the current key's value went
  size_t length = 0;  // and its length
  ValueDest dest;
  if (seg != nullptr) {
    dest = [&](size_t n) -> uint8_t* {
      if (n < req->shm_min_bytes() || n > seg->size() - used) return nullptr;
      offset = used;
      length = n;
      used = std::min(seg->size(), used + ((n + 63) & ~static_cast<size_t>(63)));  // aligned
      return seg->data() + offset;
    };
  }
  uint64_t shm_bytes = 0;
  bool stopped = false;
  for (const std::string& key : req->keys()) {
    v1::BatchGetItem* item = resp->add_items();
    if (stopped) {
      item->set_miss_reason("skipped");
      item->set_tier(req->tier());
      continue;
    }
    auto r = store_.Get(tier, key, dest);
    if (!r.ok()) {
      item->set_error(std::string(r.status().message()));
      item->set_error_code(static_cast<int>(r.status().code()));
      stopped = req->stop_at_first_miss();
      continue;
    }
    item->set_found(r->found);
    item->set_tier(ToProto(r->tier));
    if (r->found && r->in_dest) {
      // An end-to-end check of the copy: the client verifies it before it uses a byte.
      item->set_in_shm(true);
      item->set_offset(offset);
      item->set_byte_length(length);
      if (r->has_checksum) {  // the tier's stored checksum (G3: verified over this very copy;
                              // G1: of the bytes put, so the client's check covers the page too)
        item->set_checksum(r->checksum);
        item->set_checksum_seed(r->checksum_seed);
      } else {
        item->set_checksum(common::Xxh3_64(std::span<const uint8_t>(seg->data() + offset, length)));
      }
      shm_bytes += length;
    } else if (r->found) {
      *item->mutable_value() = std::move(r->value);
    }
    item->set_miss_reason(std::string(MissReasonName(r->miss)));
    if (!r->found) stopped = req->stop_at_first_miss();
  }
  if (seg != nullptr) store_.metrics().shm_bytes(false).Increment(static_cast<double>(shm_bytes));
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::BatchPut(grpc::ServerContext* ctx, const v1::BatchPutRequest* req,
                                          v1::BatchPutResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/BatchPut"); !a.ok()) return a;
  store_.metrics().batch_calls(true).Increment();
  store_.metrics().batch_keys(true).Increment(req->items_size());
  prometheus::Gauge& in_flight = store_.metrics().puts_in_flight();
  in_flight.Increment();
  const Tier tier = FromProto(req->tier());
  std::shared_ptr<MappedPeerSegment> seg;
  std::string refused;
  if (req->has_shm()) {
    seg = MapSegment(req->shm(), /*writable=*/false, &refused);
    if (seg == nullptr) resp->set_shm_refused(refused);
  }
  uint64_t shm_bytes = 0;
  for (const v1::BatchPutItem& it : req->items()) {
    v1::BatchPutResult* out = resp->add_results();
    absl::Status s;
    std::span<const uint8_t> value = AsSpan(it.value());
    if (it.in_shm()) {
      if (seg == nullptr) {
        s = absl::FailedPreconditionError(
            absl::StrCat("batch put: value in a shared-memory segment the daemon cannot use: ",
                         refused.empty() ? "no segment named" : refused));
      } else if (!it.value().empty() || it.offset() > seg->size() ||
                 it.byte_length() > seg->size() - it.offset()) {
        store_.metrics().CountBadRequest("shm_range");
        s = absl::InvalidArgumentError(absl::StrCat("batch put: value at [", it.offset(), ", +",
                                                    it.byte_length(), ") is outside the ",
                                                    seg->size(), "-byte segment"));
      } else {
        value = std::span<const uint8_t>(seg->data() + it.offset(), it.byte_length());
        if (common::Xxh3_64(value) != it.checksum()) {
          store_.metrics().CountBadRequest("shm_checksum");
          s = absl::DataLossError(absl::StrCat("batch put: the segment's bytes at offset ",
                                               it.offset(),
                                               " do not match the checksum the client sent"));
        }
        shm_bytes += it.byte_length();
      }
    }
    if (s.ok()) s = store_.Put(tier, it.key(), value);
    out->set_stored(s.ok());
    if (!s.ok()) {
      out->set_error_code(static_cast<int>(s.code()));
      out->set_error(std::string(s.message()));
    }
  }
  if (seg != nullptr) store_.metrics().shm_bytes(true).Increment(static_cast<double>(shm_bytes));
  in_flight.Decrement();
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Pin(grpc::ServerContext* ctx, const v1::PinRequest* req,
                                     v1::PinResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/Pin"); !a.ok()) return a;
  auto r = store_.Pin(req->key(), req->pin());
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_found(*r);
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Stats(grpc::ServerContext* ctx, const v1::StatsRequest*,
                                       v1::StatsResponse* resp) {
  if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.KvStore/Stats"); !a.ok()) return a;
  for (const TierStats& t : store_.Stats()) {
    auto* out = resp->add_tiers();
    out->set_tier(ToProto(t.tier));
    out->set_entries(static_cast<int64_t>(t.entries));
    out->set_bytes(static_cast<int64_t>(t.bytes));
    out->set_capacity_bytes(static_cast<int64_t>(t.capacity_bytes));
  }
  return grpc::Status::OK;
}

KvStoreServer::~KvStoreServer() { Shutdown(0); }

absl::StatusOr<std::unique_ptr<KvStoreServer>> KvStoreServer::Start(KvStore& store,
                                                                    const std::string& host,
                                                                    int port,
                                                                    KvServiceOptions options,
                                                                    int max_message_bytes) {
  if (options.cluster_secret.empty()) {
    auto secret = common::LoadClusterSecret();
    if (!secret.ok()) return absl::FailedPreconditionError(absl::StrCat("kvstore: ", secret.status().message()));
    options.cluster_secret = *secret;
  }
  std::unique_ptr<KvStoreServer> server(new KvStoreServer());
  server->service_ = std::make_unique<KvStoreServiceImpl>(store, options);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(),
                           &bound);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  builder.RegisterService(server->service_.get());
  // Sync-server threads poll their queue with this timeout; the default (seconds) makes a
  // shutdown with connected clients take that long.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::CQ_TIMEOUT_MSEC, 200);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || bound == 0) {
    return absl::UnavailableError(absl::StrCat("kvstore: cannot listen on ", host, ":", port));
  }
  server->port_ = bound;
  return server;
}

void KvStoreServer::Shutdown(int deadline_ms) {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
  server_->Wait();
  server_.reset();
}

}  // namespace epd::kvstore
