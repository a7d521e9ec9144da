#include "kvstore/kvstore_service.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kvstore/chain_hash.h"

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
    : store_(store), options_(options) {}

grpc::Status KvStoreServiceImpl::Lookup(grpc::ServerContext*, const v1::LookupRequest* req,
                                        v1::LookupResponse* resp) {
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

grpc::Status KvStoreServiceImpl::Get(grpc::ServerContext*, const v1::GetRequest* req,
                                     v1::GetResponse* resp) {
  auto r = store_.Get(FromProto(req->tier()), req->key());
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_found(r->found);
  if (r->found) *resp->mutable_value() = std::move(r->value);
  resp->set_miss_reason(std::string(MissReasonName(r->miss)));
  resp->set_tier(ToProto(r->tier));
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Put(grpc::ServerContext*, const v1::PutRequest* req,
                                     v1::PutResponse* resp) {
  prometheus::Gauge& in_flight = store_.metrics().puts_in_flight();
  in_flight.Increment();
  if (options_.debug_put_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(options_.debug_put_delay_ms));
  }
  auto s = store_.Put(FromProto(req->tier()), req->key(), AsSpan(req->value()));
  in_flight.Decrement();
  if (!s.ok()) return ToGrpc(s);
  resp->set_stored(true);
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Pin(grpc::ServerContext*, const v1::PinRequest* req,
                                     v1::PinResponse* resp) {
  auto r = store_.Pin(req->key(), req->pin());
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_found(*r);
  return grpc::Status::OK;
}

grpc::Status KvStoreServiceImpl::Stats(grpc::ServerContext*, const v1::StatsRequest*,
                                       v1::StatsResponse* resp) {
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
