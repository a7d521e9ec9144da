#include "runtime/metrics_server.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "prometheus/text_serializer.h"
#include "runtime/http_util.h"

namespace epd::runtime {
namespace {
std::mutex g_health_mu;  // guards swaps of health_ against the server thread
}

MetricsServer::MetricsServer(std::shared_ptr<prometheus::Registry> registry,
                             std::string process_name)
    : registry_(std::move(registry)),
      process_name_(std::move(process_name)),
      health_(std::make_shared<HealthFn>([] { return HealthReport{}; })) {}

MetricsServer::~MetricsServer() { Stop(); }

void MetricsServer::SetHealth(HealthFn fn) {
  std::lock_guard<std::mutex> lock(g_health_mu);
  health_ = std::make_shared<HealthFn>(std::move(fn));
}

std::string MetricsServer::Scrape() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

absl::StatusOr<int> MetricsServer::Start(const std::string& host, int port) {
  if (server_) return absl::FailedPreconditionError("metrics server already started");
  server_ = std::make_unique<httplib::Server>();
  ConfigureListener(*server_);
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(Scrape(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::shared_ptr<HealthFn> fn;
    {
      std::lock_guard<std::mutex> lock(g_health_mu);
      fn = health_;
    }
    HealthReport report = (*fn)();
    std::string body = std::string("{\"status\":\"") + (report.healthy ? "ok" : "unhealthy") +
                       "\",\"process\":\"" + process_name_ + "\"";
    if (!report.detail.empty()) body += ",\"detail\":" + report.detail;
    body += "}";
    res.status = report.healthy ? 200 : 503;
    res.set_content(body, "application/json");
  });
  if (port == 0) {
    port_ = server_->bind_to_any_port(host);
    if (port_ < 0) return absl::UnavailableError("cannot bind metrics server on " + host);
  } else {
    if (!server_->bind_to_port(host, port)) {
      server_.reset();
      return absl::UnavailableError("cannot bind metrics server on " + host + ":" +
                                    std::to_string(port) + " (port in use?)");
    }
    port_ = port;
  }
  listener_.Start(server_.get());
  return port_;
}

void MetricsServer::Stop() {
  if (!server_) return;
  listener_.Stop();
  server_.reset();
}

}  // namespace epd::runtime
