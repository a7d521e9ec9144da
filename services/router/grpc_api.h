#pragma once

// The router's gRPC port: epd.v1.Inference (Generate, ListModels, Health) for operators and
// epd.v1.WorkerRegistry (Register, Heartbeat) for workers.
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "services/router/admission.h"
#include "services/router/router_core.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace epd::services::router {

// TLS for the public gRPC port. Both empty = plaintext.
struct GrpcTlsOptions {
  std::string cert_file;  // PEM certificate chain
  std::string key_file;   // PEM private key
  // Default: -1 = none. >= 0 (0 = any): a second, plaintext port serving only WorkerRegistry,
  // for workers inside the cluster while the public port speaks TLS.
  int worker_port = -1;
};

// Thread-safe: Start/Stop from one thread; RPCs run on gRPC's threads.
class RouterGrpcServer {
 public:
  // `api_key` empty = no auth; else Inference RPCs need metadata "authorization: Bearer <key>".
  // `admission` (not owned, may be null = unbounded) bounds Generate like the HTTP port.
  RouterGrpcServer(RouterCore& core, std::string api_key, AdmissionQueue* admission = nullptr);
  ~RouterGrpcServer();

  absl::StatusOr<int> Start(const std::string& host, int port);
  void Stop();
  // Before Start: serve the public port over TLS (errors name an unreadable file).
  absl::Status SetTls(const GrpcTlsOptions& tls);
  // The plaintext worker port after Start (0 when there is none).
  int worker_port() const { return worker_bound_; }

 private:
  RouterCore& core_;
  std::string api_key_;
  AdmissionQueue* admission_;
  std::unique_ptr<grpc::Service> inference_;
  std::unique_ptr<grpc::Service> registry_;
  std::unique_ptr<grpc::Server> server_;
  std::string tls_cert_pem_, tls_key_pem_;
  int worker_port_ = -1;
  int worker_bound_ = 0;
  std::unique_ptr<grpc::Service> worker_registry_;
  std::unique_ptr<grpc::Server> worker_server_;
};

}  // namespace epd::services::router
