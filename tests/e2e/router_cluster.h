#pragma once

// A real epd-router plus epd-fake-worker processes on 127.0.0.1 with port 0 and a temp dir, and
// the small HTTP/SSE/metrics helpers the router tests share.
#include <httplib.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/subprocess.h"

namespace epd::testing {

struct HttpResult {
  int status = 0;
  std::string body;
  nlohmann::json json;  // parsed body (discarded when not JSON)
};

// One SSE response: the parsed `data:` events before [DONE], and whether [DONE] came.
struct SseResult {
  int status = 0;
  std::vector<nlohmann::json> events;
  bool done = false;
  std::string raw;
};

struct Proc {
  Subprocess proc;
  std::string port_file;
  int grpc = 0;
  int metrics = 0;
};

inline std::optional<double> ScrapeMetric(int port, const std::string& series) {
  auto body = HttpGet(port, "/metrics");
  if (!body) return std::nullopt;
  size_t pos = 0;
  while ((pos = body->find(series + " ", pos)) != std::string::npos) {
    if (pos == 0 || (*body)[pos - 1] == '\n') {
      return std::stod(body->substr(pos + series.size() + 1));
    }
    ++pos;
  }
  return std::nullopt;
}

class RouterCluster {
 public:
  explicit RouterCluster(std::vector<std::string> router_args = {}) {
    std::vector<std::string> argv = {BinaryPath("epd-router"), "--metrics-port", "0",
                                     "--http-port", "0", "--grpc-port", "0", "--port-file",
                                     dir_.File("router.json"), "--heartbeat-interval-ms", "200"};
    argv.insert(argv.end(), router_args.begin(), router_args.end());
    router_.proc = Subprocess::Start(argv, dir_.File("router.log"));
    auto http = WaitForPortFile(dir_.File("router.json"), "http", std::chrono::seconds(20));
    EXPECT_TRUE(http.has_value()) << router_.proc.ReadLog();
    if (!http) return;
    http_port_ = *http;
    grpc_port_ = *WaitForPortFile(dir_.File("router.json"), "grpc", std::chrono::seconds(5));
    router_.metrics =
        *WaitForPortFile(dir_.File("router.json"), "metrics", std::chrono::seconds(5));
  }

  int http_port() const { return http_port_; }
  int grpc_port() const { return grpc_port_; }
  Proc& router() { return router_; }
  const TempDir& dir() const { return dir_; }

  // Starts a fake worker; with `wait`, returns once it registered (nullptr if it exited).
  Proc* AddWorker(const std::string& pool, const std::string& id,
                  std::vector<std::string> extra = {}, bool wait = true) {
    auto p = std::make_unique<Proc>();
    p->port_file = dir_.File(id + ".json");
    std::vector<std::string> argv = {BinaryPath("epd-fake-worker"), "--metrics-port", "0",
                                     "--port-file", p->port_file, "--router",
                                     "127.0.0.1:" + std::to_string(grpc_port_), "--pool", pool,
                                     "--worker-id", id};
    argv.insert(argv.end(), extra.begin(), extra.end());
    p->proc = Subprocess::Start(argv, dir_.File(id + ".log"));
    auto metrics = WaitForPortFile(p->port_file, "metrics", std::chrono::seconds(20));
    if (metrics) p->metrics = *metrics;
    if (wait) {
      auto reg = WaitForPortFile(p->port_file, "registered", std::chrono::seconds(20));
      EXPECT_TRUE(reg.has_value()) << p->proc.ReadLog();
      if (!reg) return nullptr;
      p->grpc = *WaitForPortFile(p->port_file, "grpc", std::chrono::seconds(1));
    }
    workers_.push_back(std::move(p));
    return workers_.back().get();
  }

  nlohmann::json Health() {
    auto body = HttpGet(http_port_, "/health");
    if (!body) return nlohmann::json();
    return nlohmann::json::parse(*body, nullptr, false);
  }

  int WorkerCount(const std::string& pool) {
    auto h = Health();
    if (!h.is_object()) return -1;
    return h["pools"][pool]["count"].get<int>();
  }

  bool WaitForWorkerCount(const std::string& pool, int n,
                          std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (WorkerCount(pool) == n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  HttpResult Post(const std::string& path, const std::string& body,
                  const httplib::Headers& headers = {}) {
    httplib::Client cli("127.0.0.1", http_port_);
    cli.set_read_timeout(30, 0);
    HttpResult r;
    auto res = cli.Post(path.c_str(), headers, body, "application/json");
    if (!res) return r;
    r.status = res->status;
    r.body = res->body;
    r.json = nlohmann::json::parse(r.body, nullptr, false);
    return r;
  }

  HttpResult Get(const std::string& path, const httplib::Headers& headers = {}) {
    httplib::Client cli("127.0.0.1", http_port_);
    HttpResult r;
    auto res = cli.Get(path.c_str(), headers);
    if (!res) return r;
    r.status = res->status;
    r.body = res->body;
    r.json = nlohmann::json::parse(r.body, nullptr, false);
    return r;
  }

  // POSTs and reads the SSE stream. `stop_after_events` > 0 hangs up after that many events.
  SseResult Stream(const std::string& path, const std::string& body, int stop_after_events = 0) {
    httplib::Client cli("127.0.0.1", http_port_);
    cli.set_read_timeout(30, 0);
    SseResult r;
    std::string buffer;
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
      buffer.append(data, len);
      r.raw.append(data, len);
      size_t pos;
      while ((pos = buffer.find("\n\n")) != std::string::npos) {
        std::string ev = buffer.substr(0, pos);
        buffer.erase(0, pos + 2);
        if (ev.rfind("data: ", 0) != 0) continue;
        std::string payload = ev.substr(6);
        if (payload == "[DONE]") {
          r.done = true;
          continue;
        }
        r.events.push_back(nlohmann::json::parse(payload, nullptr, false));
        if (stop_after_events > 0 && static_cast<int>(r.events.size()) >= stop_after_events) {
          return false;
        }
      }
      return true;
    };
    httplib::Response res;
    httplib::Error err;
    cli.send(req, res, err);
    r.status = res.status;
    if (r.status != 200 && !res.body.empty()) r.raw = res.body;
    return r;
  }

 private:
  TempDir dir_;
  Proc router_;
  int http_port_ = 0;
  int grpc_port_ = 0;
  std::vector<std::unique_ptr<Proc>> workers_;
};

// Concatenated delta.content of a chat stream (or text of a completions stream).
inline std::string StreamText(const SseResult& r, const char* field = "content") {
  std::string out;
  for (const auto& ev : r.events) {
    if (!ev.contains("choices") || ev["choices"].empty()) continue;
    const auto& c = ev["choices"][0];
    if (c.contains("delta")) {
      if (c["delta"].contains(field) && c["delta"][field].is_string()) {
        out += c["delta"][field].get<std::string>();
      }
    } else if (c.contains("text") && c["text"].is_string()) {
      out += c["text"].get<std::string>();
    }
  }
  return out;
}

}  // namespace epd::testing
