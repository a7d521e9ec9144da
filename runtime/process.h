#pragma once

// The runtime every epd process shares: common flags, logging, a Prometheus registry served at
// /metrics and /health, and graceful drain on SIGTERM.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "prometheus/registry.h"
#include "runtime/metrics_server.h"

namespace CLI {
class App;
}

namespace epd::runtime {

struct RuntimeOptions {
  std::string host = "127.0.0.1";  // Default: loopback only
  int metrics_port = 0;            // Default: 0 = any free port (printed at start)
  std::string log_level = "info";  // Default: info
  int drain_timeout_ms = 10000;    // Default: 10 s to finish running work after SIGTERM
  std::string port_file;           // Default: none. If set, the bound ports are written here
  // The cluster secret's file (common/cluster_secret.h, docs/security.md). Default: none, then
  // $EPD_CLUSTER_SECRET_FILE, $EPD_CLUSTER_SECRET, $EPD_CLUSTER_TOKEN; none of them: Start fails.
  std::string cluster_secret_file;
};

// Registers --host, --metrics-port, --log-level, --drain-timeout-ms, --port-file,
// --cluster-secret-file on `app`.
void AddRuntimeFlags(CLI::App& app, RuntimeOptions* options);

// Owns the registry and the metrics endpoint of one process. Not copyable; one per process.
class ProcessRuntime {
 public:
  ProcessRuntime(std::string process_name, RuntimeOptions options);
  ~ProcessRuntime();

  // Sets umask 077 (the files and sockets the process makes are its owner's only), loads the
  // cluster secret (an error naming --cluster-secret-file / $EPD_CLUSTER_SECRET without one),
  // initialises logging, installs SIGTERM/SIGINT handlers, starts /metrics and /health.
  absl::Status Start();
  // The cluster secret (after Start). Never log it.
  const std::string& cluster_secret() const { return cluster_secret_; }

  prometheus::Registry& registry() { return *registry_; }
  std::shared_ptr<prometheus::Registry> shared_registry() { return registry_; }
  MetricsServer& metrics_server() { return *metrics_; }
  const RuntimeOptions& options() const { return options_; }
  const std::string& name() const { return name_; }

  // Records a named port ("grpc", "http", ...) and rewrites --port-file as JSON if set.
  void PublishPort(const std::string& name, int port);

 private:
  std::string name_;
  RuntimeOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsServer> metrics_;
  std::string ports_json_;
  std::string cluster_secret_;
};

}  // namespace epd::runtime
