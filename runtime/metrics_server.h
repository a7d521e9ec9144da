#pragma once

// Per-process HTTP endpoint serving the Prometheus registry at /metrics and liveness at /health.
// Served by cpp-httplib on its own thread; the registry is prometheus-cpp's.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"
#include "runtime/listen_thread.h"

namespace httplib {
class Server;
}

namespace epd::runtime {

struct HealthReport {
  bool healthy = true;
  std::string detail;  // JSON object text merged into the /health body; may be empty
};

// Thread-safe: Start/Stop from one thread; the health callback may be called from the server
// thread at any time while running.
class MetricsServer {
 public:
  using HealthFn = std::function<HealthReport()>;

  MetricsServer(std::shared_ptr<prometheus::Registry> registry, std::string process_name);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Binds host:port (port 0 = any free port) and starts serving. Returns the bound port.
  absl::StatusOr<int> Start(const std::string& host, int port);
  void Stop();
  void SetHealth(HealthFn fn);
  int port() const { return port_; }

  // The exposition text, as /metrics serves it.
  std::string Scrape() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::string process_name_;
  std::unique_ptr<httplib::Server> server_;
  ListenThread listener_;
  int port_ = 0;
  std::shared_ptr<HealthFn> health_;
};

}  // namespace epd::runtime
