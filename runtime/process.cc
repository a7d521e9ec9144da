#include "runtime/process.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <fstream>

#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "common/cluster_secret.h"
#include "prometheus/gauge.h"
#include "runtime/logging.h"
#include "runtime/shutdown.h"
#include "runtime/version.h"

namespace epd::runtime {

void AddRuntimeFlags(CLI::App& app, RuntimeOptions* o) {
  app.add_option("--host", o->host, "Address to bind (default 127.0.0.1)");
  app.add_option("--metrics-port", o->metrics_port, "Port for /metrics and /health (0 = any)");
  app.add_option("--log-level", o->log_level, "trace|debug|info|warn|error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  app.add_option("--drain-timeout-ms", o->drain_timeout_ms, "Time to finish work after SIGTERM");
  app.add_option("--port-file", o->port_file, "Write the bound ports here as JSON");
  app.add_option("--cluster-secret-file", o->cluster_secret_file,
                 "File holding the cluster secret every internal plane authenticates with "
                 "(default: $EPD_CLUSTER_SECRET_FILE, $EPD_CLUSTER_SECRET; docs/security.md)");
}

ProcessRuntime::ProcessRuntime(std::string process_name, RuntimeOptions options)
    : name_(std::move(process_name)),
      options_(std::move(options)),
      registry_(std::make_shared<prometheus::Registry>()),
      metrics_(std::make_unique<MetricsServer>(registry_, name_)) {}

ProcessRuntime::~ProcessRuntime() { metrics_->Stop(); }

absl::Status ProcessRuntime::Start() {
  umask(077);
  auto secret = common::LoadClusterSecret(options_.cluster_secret_file);
  if (!secret.ok()) return secret.status();
  cluster_secret_ = std::move(*secret);
  // The libraries of this process that find the secret in the environment (the kvstore client,
  // the router's worker client) see the one a --cluster-secret-file named. The environment of a
  // process is readable by its owner only (/proc/PID/environ is 0400), never on a command line.
  setenv("EPD_CLUSTER_SECRET", cluster_secret_.c_str(), 1);
  if (auto s = InitLogging(name_, options_.log_level); !s.ok()) return s;
  InstallShutdownHandlers();
  prometheus::BuildGauge()
      .Name("epd_build_info")
      .Help("Build information; the value is always 1")
      .Register(*registry_)
      .Add({{"version", kVersion}, {"process", name_}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("epd_process_start_time_seconds")
      .Help("Start time of the process since the Unix epoch, in seconds")
      .Register(*registry_)
      .Add({{"process", name_}})
      .Set(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
               .count());
  auto port = metrics_->Start(options_.host, options_.metrics_port);
  if (!port.ok()) return port.status();
  spdlog::info("{} {} serving /metrics and /health on http://{}:{}", name_, kVersion,
               options_.host, *port);
  PublishPort("metrics", *port);
  return absl::OkStatus();
}

void ProcessRuntime::PublishPort(const std::string& name, int port) {
  auto j = ports_json_.empty() ? nlohmann::json::object() : nlohmann::json::parse(ports_json_);
  j[name] = port;
  j["pid"] = static_cast<int64_t>(getpid());
  ports_json_ = j.dump();
  if (options_.port_file.empty()) return;
  // Write then rename, so a reader never sees a half-written file.
  const std::string tmp = options_.port_file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << ports_json_ << "\n";
  }
  std::rename(tmp.c_str(), options_.port_file.c_str());
}

}  // namespace epd::runtime
