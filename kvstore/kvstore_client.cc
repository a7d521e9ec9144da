#include "kvstore/kvstore_client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "epd/v1/kvstore.grpc.pb.h"
#include "kvstore/kvstore_service.h"

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

}  // namespace

class KvStoreClient::Impl {
 public:
  Impl(std::shared_ptr<grpc::Channel> channel, KvClientOptions options)
      : stub_(v1::KvStore::NewStub(channel)), options_(options) {}
  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(options_.deadline_ms));
  }
  std::unique_ptr<v1::KvStore::Stub> stub_;
  KvClientOptions options_;
};

KvStoreClient::KvStoreClient(std::string target, std::unique_ptr<Impl> impl)
    : target_(std::move(target)), impl_(std::move(impl)) {}
KvStoreClient::~KvStoreClient() = default;

std::unique_ptr<KvStoreClient> KvStoreClient::Create(const std::string& target,
                                                     KvClientOptions options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
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
  v1::GetRequest req;
  req.set_tier(ToProto(tier));
  req.set_key(std::string(key));
  v1::GetResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  if (auto s = FromGrpc(impl_->stub_->Get(&ctx, req, &resp), "get"); !s.ok()) return s;
  GetResult r;
  r.found = resp.found();
  r.value = std::move(*resp.mutable_value());
  r.miss = r.found ? MissReason::kNone : ParseMissReason(resp.miss_reason());
  if (!r.found && r.miss == MissReason::kNone) r.miss = MissReason::kAbsent;
  r.tier = FromProto(resp.tier());
  return r;
}

absl::Status KvStoreClient::Put(Tier tier, std::string_view key, std::string_view value) {
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
