#pragma once

// A cluster of REAL processes for end-to-end tests: epd-router + one epd-encoder, epd-prefill and
// epd-decode (UCX over loopback, UCX_NET_DEVICES=lo), optionally an epd-kvstore that the router
// and every worker use; plus a /metrics scraper and a gRPC Generate client. Header-only: a test
// using it links epd::testing, epd::proto and gRPC::grpc++. (router_cluster.h is the same for
// fake workers.)
//
// Ownership: RealCluster owns its temp dir (port files, logs, kvstore data) and every process it
// started; the destructor stops them. Thread-safety: a RealCluster is used from the test thread
// (grpc_port()/http_port() may be read from any thread); Generate and ScrapeMetric are reentrant.
// Units: ports are TCP ports on 127.0.0.1; deadlines are wall-clock.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epd/v1/inference.grpc.pb.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/wait_for.h"

namespace epd::testing {

// The value of one series (exact name + labels) in the /metrics page on `port`; nullopt when the
// page or the series is missing.
inline std::optional<double> ScrapeMetric(int port, const std::string& series) {
  auto body = HttpGet(port, "/metrics");
  if (!body) return std::nullopt;
  size_t pos = 0;
  while ((pos = body->find(series + " ", pos)) != std::string::npos) {
    if (pos == 0 || (*body)[pos - 1] == '\n')
      return std::stod(body->substr(pos + series.size() + 1));
    ++pos;
  }
  return std::nullopt;
}

// Polls `series` on `port` until it reads `want`, up to `limit` (a gauge set by a worker's
// heartbeat loop after it starts); true once it did. *last: the last value read (-1: none).
inline bool WaitForMetricValue(int port, const std::string& series, double want,
                               std::chrono::seconds limit, double* last) {
  return WaitFor(
      [&] {
        *last = ScrapeMetric(port, series).value_or(-1);
        return *last == want;
      },
      limit);
}

// One started process and the ports its --port-file published (0 when not published).
struct RealProc {
  Subprocess proc;
  std::string port_file;
  int grpc = 0;
  int metrics = 0;
};

// How Add starts one worker, beyond the cluster's options: another binary of the same kind (empty:
// epd-<kind>), extra flags after every other, extra environment.
struct WorkerSpec {
  std::string binary;
  std::vector<std::string> args;
  std::map<std::string, std::string> env;
};

struct RealClusterOptions {
  // Directory of the model every process loads (--model).
  std::string model_dir;
  // Start an epd-kvstore (G3 only: --g1-capacity-bytes 0, then `kv_args`) and pass --kvstore to
  // the router and every worker.
  bool store = false;
  std::vector<std::string> kv_args;
  // When set, every worker gets `--dspark on|off` (the router pairs only workers with the same
  // config fingerprint, which covers the switch).
  std::optional<bool> dspark;
  // Extra flags for every worker, then for decode (encoder) workers only.
  std::vector<std::string> worker_args;
  std::vector<std::string> decode_args;
  std::vector<std::string> encoder_args;
  // Extra flags for the router.
  std::vector<std::string> router_args;
  // When false the cluster starts no decode worker: the test Adds its own.
  bool start_decode = true;
  // How the first worker of a kind ("encoder", "prefill", "decode") is started (default: {}).
  std::map<std::string, WorkerSpec> first;
};

// Router (+ kvstore) + one worker per pool ("encoder-0", "prefill-0", "decode-0"); Add() starts
// more workers against the running router. Failures to start are EXPECT failures with the log.
class RealCluster {
 public:
  explicit RealCluster(RealClusterOptions options) : options_(std::move(options)) {
    if (options_.store) {
      kv_.port_file = dir_.File("kv.json");
      std::vector<std::string> argv = {BinaryPath("epd-kvstore"),
                                       "--data-dir",
                                       dir_.File("kvdata"),
                                       "--grpc-port",
                                       "0",
                                       "--metrics-port",
                                       "0",
                                       "--port-file",
                                       kv_.port_file,
                                       "--g1-capacity-bytes",
                                       "0"};
      argv.insert(argv.end(), options_.kv_args.begin(), options_.kv_args.end());
      kv_.proc = Subprocess::Start(argv, dir_.File("kv.log"));
      kv_.grpc = WaitForPortFile(kv_.port_file, "grpc", std::chrono::seconds(30)).value_or(0);
      EXPECT_GT(kv_.grpc, 0) << kv_.proc.ReadLog();
      kv_.metrics = WaitForPortFile(kv_.port_file, "metrics", std::chrono::seconds(5)).value_or(0);
      kv_address_ = "127.0.0.1:" + std::to_string(kv_.grpc);
    }
    router_.port_file = dir_.File("router.json");
    std::vector<std::string> argv = {BinaryPath("epd-router"),
                                     "--metrics-port",
                                     "0",
                                     "--http-port",
                                     "0",
                                     "--grpc-port",
                                     "0",
                                     "--port-file",
                                     router_.port_file,
                                     "--heartbeat-interval-ms",
                                     "200",
                                     "--model",
                                     options_.model_dir};
    if (options_.store) argv.insert(argv.end(), {"--kvstore", kv_address_});
    // 200 ms heartbeats keep registration quick; 10 misses (2 s) before a worker is forgotten,
    // so a loaded 2-core machine (CI runs tests in parallel) does not drop a busy live worker.
    if (std::find(options_.router_args.begin(), options_.router_args.end(),
                  "--heartbeat-miss-limit") == options_.router_args.end()) {
      argv.insert(argv.end(), {"--heartbeat-miss-limit", "10"});
    }
    argv.insert(argv.end(), options_.router_args.begin(), options_.router_args.end());
    router_.proc = Subprocess::Start(argv, dir_.File("router.log"));
    auto grpc = WaitForPortFile(router_.port_file, "grpc", std::chrono::seconds(30));
    EXPECT_TRUE(grpc.has_value()) << router_.proc.ReadLog();
    router_.grpc = grpc.value_or(0);
    http_port_ = WaitForPortFile(router_.port_file, "http", std::chrono::seconds(5)).value_or(0);
    router_.metrics =
        WaitForPortFile(router_.port_file, "metrics", std::chrono::seconds(5)).value_or(0);
    for (const char* kind : {"encoder", "prefill", "decode"}) {
      if (kind != std::string("decode") || options_.start_decode) {
        const auto spec = options_.first.find(kind);
        Add(kind, std::string(kind) + "-0",
            spec == options_.first.end() ? WorkerSpec{} : spec->second);
      }
    }
  }

  // Starts one more `kind` worker ("encoder" | "prefill" | "decode") named `id` and waits until it
  // registered; it becomes worker(kind). The cluster owns it.
  RealProc* Add(const std::string& kind, const std::string& id, const WorkerSpec& spec = {}) {
    auto p = std::make_unique<RealProc>();
    p->port_file = dir_.File(id + ".json");
    std::vector<std::string> argv = {BinaryPath(spec.binary.empty() ? "epd-" + kind : spec.binary),
                                     "--router",
                                     "127.0.0.1:" + std::to_string(router_.grpc),
                                     "--model",
                                     options_.model_dir,
                                     "--worker-id",
                                     id,
                                     "--port-file",
                                     p->port_file,
                                     "--metrics-port",
                                     "0"};
    if (options_.dspark) argv.insert(argv.end(), {"--dspark", *options_.dspark ? "on" : "off"});
    if (options_.store) argv.insert(argv.end(), {"--kvstore", kv_address_});
    argv.insert(argv.end(), options_.worker_args.begin(), options_.worker_args.end());
    if (kind == "decode")
      argv.insert(argv.end(), options_.decode_args.begin(), options_.decode_args.end());
    if (kind == "encoder")
      argv.insert(argv.end(), options_.encoder_args.begin(), options_.encoder_args.end());
    argv.insert(argv.end(), spec.args.begin(), spec.args.end());
    std::map<std::string, std::string> env = spec.env;
    env.emplace("UCX_NET_DEVICES", "lo");
    p->proc = Subprocess::Start(argv, dir_.File(id + ".log"), env);
    auto reg = WaitForPortFile(p->port_file, "registered", std::chrono::seconds(60));
    EXPECT_TRUE(reg.has_value()) << p->proc.ReadLog();
    p->grpc = WaitForPortFile(p->port_file, "grpc", std::chrono::seconds(1)).value_or(0);
    p->metrics = WaitForPortFile(p->port_file, "metrics", std::chrono::seconds(1)).value_or(0);
    RealProc* raw = p.get();
    workers_[kind] = raw;
    owned_.push_back(std::move(p));
    return raw;
  }

  // The last worker of `kind` that was started.
  RealProc& worker(const std::string& kind) { return *workers_.at(kind); }
  int metrics(const std::string& kind) const { return workers_.at(kind)->metrics; }
  int grpc_port() const { return router_.grpc; }
  // The router's metrics port.
  int router_metrics() const { return router_.metrics; }
  int http_port() const { return http_port_; }
  // The kvstore's metrics port (0 without a store).
  int kv_metrics() const { return kv_.metrics; }
  void KillKvStore() { kv_.proc.Signal(SIGKILL); }
  // The kvstore's gRPC port (0 without a store).
  int kv_grpc() const { return kv_.grpc; }
  // Every process of the cluster, kvstore and router first.
  std::vector<const Subprocess*> processes() const {
    std::vector<const Subprocess*> out = {&router_.proc};
    if (kv_.grpc > 0) out.insert(out.begin(), &kv_.proc);
    for (const auto& p : owned_) out.push_back(&p->proc);
    return out;
  }

  // Every process's log, labelled.
  std::string Logs() {
    std::string out = "--- router\n" + router_.proc.ReadLog();
    if (kv_.grpc > 0) out += "--- kvstore\n" + kv_.proc.ReadLog();
    for (auto& p : owned_) out += "--- " + p->port_file + "\n" + p->proc.ReadLog();
    return out;
  }

 private:
  RealClusterOptions options_;
  TempDir dir_;
  RealProc kv_, router_;
  std::string kv_address_;
  int http_port_ = 0;
  std::map<std::string, RealProc*> workers_;
  std::vector<std::unique_ptr<RealProc>> owned_;
};

// What a Generate stream returned: the token ids in order, the finish reason and the usage
// (-1 when the stream carried none), and the RPC's status.
struct Generation {
  std::vector<int32_t> ids;
  std::string finish;
  int cached = -1;
  int prompt_tokens = -1;
  grpc::Status status;
};

struct GenerateOptions {
  float temperature = 0.f;
  std::optional<uint64_t> seed;
  std::chrono::seconds deadline{60};
  // Runs once, after the first chunk that carries tokens (e.g. to signal a worker mid-stream).
  std::function<void()> on_first;
  // The client's request_id (a label: the router makes its own internal id). Empty: none.
  std::string request_id;
};

// One Generate RPC for model "epd-nano" to the router's gRPC `port`, read to the end.
inline Generation Generate(int port, const std::vector<int32_t>& prompt, int max_tokens,
                           const GenerateOptions& options = {}) {
  auto stub = epd::v1::Inference::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options.deadline);
  epd::v1::GenerateRequest req;
  req.set_model("epd-nano");
  for (int32_t id : prompt) req.mutable_prompt_ids()->add_ids(id);
  req.mutable_sampling()->set_temperature(options.temperature);
  if (options.seed) req.mutable_sampling()->set_seed(*options.seed);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  if (!options.request_id.empty()) req.set_request_id(options.request_id);
  auto reader = stub->Generate(&ctx, req);
  Generation g;
  epd::v1::GenerateResponse m;
  bool first = true;
  while (reader->Read(&m)) {
    g.ids.insert(g.ids.end(), m.token_ids().begin(), m.token_ids().end());
    if (!m.finish_reason().empty()) g.finish = m.finish_reason();
    if (m.has_usage()) {
      g.cached = m.usage().cached_tokens();
      g.prompt_tokens = m.usage().prompt_tokens();
    }
    if (first && m.token_ids_size() > 0 && options.on_first) {
      first = false;
      options.on_first();
    }
  }
  g.status = reader->Finish();
  return g;
}

// A deterministic prompt of `n` ordinary token ids (10..309) that differs by `salt`.
inline std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 10 + (i * 31 + salt * 7) % 300;
  return p;
}

}  // namespace epd::testing
