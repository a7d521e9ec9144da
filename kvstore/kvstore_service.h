#pragma once

// gRPC adapter of KvStore (epd.v1.KvStore: Lookup/Get/Put/Pin/Stats) and a small server wrapper.
// Values travel inline in the messages, or (when the request asks for it and the daemon has a
// KvBulkEndpoint) over UCX with these RPCs as the control plane (kvstore/bulk.h).
// Thread-safe: gRPC calls handlers concurrently; KvStore is thread-safe.
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "epd/v1/kvstore.grpc.pb.h"
#include "kvstore/kvstore.h"
#include "runtime/grpc_auth.h"

namespace grpc {
class Server;
}

namespace epd::kvstore {

class KvBulkEndpoint;
class MappedPeerSegment;
class PeerSegmentCache;

struct KvServiceOptions {
  // Test-only fault injection: every Put waits this long after receiving its request and before
  // storing it, so a test can kill the daemon while a put is "in flight". Default: 0 (off).
  int debug_put_delay_ms = 0;
  // The UCX bulk endpoint (must outlive the service); null = inline only.
  KvBulkEndpoint* bulk = nullptr;
  // The cluster secret every call must prove (runtime/grpc_auth.h). Empty: the environment's
  // (common/cluster_secret.h); none there either: Start fails.
  std::string cluster_secret;
};

v1::Tier ToProto(Tier tier);
Tier FromProto(v1::Tier tier);

class KvStoreServiceImpl final : public v1::KvStore::Service {
 public:
  // `store` must outlive the service.
  KvStoreServiceImpl(KvStore& store, KvServiceOptions options = {});
  ~KvStoreServiceImpl() override;

  grpc::Status Hello(grpc::ServerContext*, const v1::HelloRequest*, v1::HelloResponse*) override;
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*, v1::LookupResponse*) override;
  grpc::Status Get(grpc::ServerContext*, const v1::GetRequest*, v1::GetResponse*) override;
  grpc::Status Put(grpc::ServerContext*, const v1::PutRequest*, v1::PutResponse*) override;
  // A prefix's blocks in one call, each with its own status; values inline or, for a same-host
  // client that names its memfd segment, copied straight into it (kvstore/shm_segment.h).
  grpc::Status BatchGet(grpc::ServerContext*, const v1::BatchGetRequest*,
                        v1::BatchGetResponse*) override;
  grpc::Status BatchPut(grpc::ServerContext*, const v1::BatchPutRequest*,
                        v1::BatchPutResponse*) override;
  grpc::Status Pin(grpc::ServerContext*, const v1::PinRequest*, v1::PinResponse*) override;
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*, v1::StatsResponse*) override;

 private:
  // A client's segment mapped for this call (cached across calls); null (counted, `why` set)
  // when it cannot be used.
  std::shared_ptr<MappedPeerSegment> MapSegment(const v1::ShmSegment& shm, bool writable,
                                                std::string* why);

  KvStore& store_;
  KvServiceOptions options_;
  runtime::ClusterAuthChecker auth_;
  std::string host_id_;
  std::unique_ptr<PeerSegmentCache> segments_;
};

// Owns a gRPC server bound to host:port (port 0 = any) serving one KvStoreServiceImpl.
class KvStoreServer {
 public:
  ~KvStoreServer();
  // `store` must outlive the server. max_message_bytes bounds one request/response.
  static absl::StatusOr<std::unique_ptr<KvStoreServer>> Start(KvStore& store,
                                                              const std::string& host, int port,
                                                              KvServiceOptions options = {},
                                                              int max_message_bytes = 300 << 20);
  int port() const { return port_; }
  // Stops taking calls and waits for running ones up to `deadline_ms`.
  void Shutdown(int deadline_ms);

 private:
  KvStoreServer() = default;
  std::unique_ptr<KvStoreServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace epd::kvstore
