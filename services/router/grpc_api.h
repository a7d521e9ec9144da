#pragma once

// The router's gRPC port: epd.v1.Inference (Generate, ListModels, Health) for operators and
// epd.v1.WorkerRegistry (Register, Heartbeat) for workers.
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "services/router/router_core.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace epd::services::router {

// Thread-safe: Start/Stop from one thread; RPCs run on gRPC's threads.
class RouterGrpcServer {
 public:
  // `api_key` empty = no auth; else Inference RPCs need metadata "authorization: Bearer <key>".
  RouterGrpcServer(RouterCore& core, std::string api_key);
  ~RouterGrpcServer();

  absl::StatusOr<int> Start(const std::string& host, int port);
  void Stop();

 private:
  RouterCore& core_;
  std::string api_key_;
  std::unique_ptr<grpc::Service> inference_;
  std::unique_ptr<grpc::Service> registry_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace epd::services::router
