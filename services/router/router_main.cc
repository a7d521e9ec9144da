// epd-router: the front door. OpenAI-compatible HTTP (--http-port), gRPC epd.v1.Inference and
// the worker registry (--grpc-port), /metrics and /health on --metrics-port, drain on SIGTERM.
// Flow and choices: docs/router.md.
#include <signal.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <iostream>
#include <memory>
#include <thread>

#include "common/clock.h"
#include "model/config.h"
#include "model/fingerprint.h"
#include "model/stages.h"
#include "services/router/admission.h"
#include "services/router/byte_text_codec.h"
#include "services/router/dispatch.h"
#include "services/router/grpc_api.h"
#include "services/router/kvstore_prefix_oracle.h"
#include "services/router/model_text_codec.h"
#include "services/router/openai_http.h"
#include "services/router/prefix_oracle.h"
#include "services/router/registry.h"
#include "services/router/replica_planner.h"
#include "services/router/router_core.h"
#include "services/router/scheduler.h"
#include "runtime/process.h"
#include "runtime/shutdown.h"

namespace {

namespace r = epd::services::router;

int Fail(const absl::Status& s) {
  spdlog::error("epd-router: {}", std::string(s.message()));
  std::cerr << "epd-router: " << s.message() << "\n";
  return 1;
}

// Every flag of epd-router, filled by AddFlags.
struct RouterFlags {
  epd::runtime::RuntimeOptions runtime_options;
  int http_port = 0, grpc_port = 0;
  r::CoreOptions core_options;
  r::RegistryOptions registry_options;
  r::SchedulerOptions scheduler_options;
  r::HttpOptions http_options;
  std::string model_dir, kvstore_address, api_key_file;
  int kv_block_tokens = 64;
  r::AdmissionOptions admission_options;
  r::GrpcTlsOptions grpc_tls;
  r::PlannerOptions planner_options;
};

void AddFlags(CLI::App& app, RouterFlags& f) {
  epd::runtime::AddRuntimeFlags(app, &f.runtime_options);
  app.add_option("--http-port", f.http_port, "OpenAI HTTP port (0 = any)");
  app.add_option("--grpc-port", f.grpc_port, "gRPC port: Inference + WorkerRegistry (0 = any)");
  app.add_option("--served-model-name", f.core_options.model,
                 "The model name clients ask for (/v1/models)")
      ->capture_default_str();
  app.add_option("--model", f.model_dir,
                 "Model directory (tokenizer + chat format); default: the built-in byte codec");
  app.add_option(
      "--kvstore", f.kvstore_address,
      "kvstore gRPC address(es) for prefix lookups, comma-separated for several on the hash "
      "ring (the workers' list; default: none, no prefix hints)");
  app.add_option("--kv-block-tokens", f.kv_block_tokens, "Tokens per kvstore block (chain hashes)")
      ->capture_default_str();
  app.add_option("--context-length", f.core_options.context_length,
                 "Prompt + completion tokens per request")
      ->capture_default_str();
  app.add_option("--max-tokens-limit", f.core_options.max_tokens_limit,
                 "Largest max_tokens a request may ask for")
      ->capture_default_str();
  app.add_option("--default-max-tokens", f.core_options.default_max_tokens,
                 "max_tokens of a chat request that gives none")
      ->capture_default_str();
  app.add_option("--migration-limit", f.core_options.migration_limit,
                 "Times a request moves to another decode worker when its decode worker dies "
                 "mid-generation (0 = never; docs/router.md)")
      ->capture_default_str();
  app.add_option("--api-key", f.http_options.api_key,
                 "Require 'Authorization: Bearer <key>' (default: $EPD_API_KEY, else none; "
                 "visible in the command line: prefer --api-key-file or $EPD_API_KEY)");
  app.add_option("--api-key-file", f.api_key_file,
                 "Require the Bearer key held in this file (docs/security.md)");
  app.add_option("--http-threads", f.http_options.threads, "HTTP connection threads")
      ->capture_default_str();
  app.add_option("--max-running-requests", f.admission_options.max_running,
                 "Requests dispatched at once; more wait in the admission queue")
      ->capture_default_str();
  app.add_option("--max-queued-requests", f.admission_options.max_queued,
                 "Requests that may wait for a running slot; beyond, 429 / RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--max-queue-wait-ms", f.admission_options.max_queue_wait_ms,
                 "A queued request is refused (429) after waiting this long")
      ->capture_default_str();
  app.add_option("--retry-after-s", f.admission_options.retry_after_s,
                 "Retry-After (seconds) sent with a 429")
      ->capture_default_str();
  app.add_option("--tls-cert", f.http_options.tls_cert_file,
                 "PEM certificate: HTTPS on --http-port and TLS on --grpc-port");
  app.add_option("--tls-key", f.http_options.tls_key_file, "PEM private key of --tls-cert");
  app.add_option("--worker-grpc-port", f.grpc_tls.worker_port,
                 "Plaintext WorkerRegistry-only port for workers (0 = any; default: none)");
  app.add_option("--heartbeat-interval-ms", f.registry_options.heartbeat_interval_ms,
                 "Heartbeat interval told to workers")
      ->capture_default_str();
  app.add_option("--heartbeat-miss-limit", f.registry_options.heartbeat_miss_limit,
                 "Missed heartbeats before a worker is forgotten")
      ->capture_default_str();
  app.add_option("--direct-decode-max-tokens", f.scheduler_options.direct_decode_max_tokens,
                 "Uncached prompt tokens at or below which decode runs a request alone")
      ->capture_default_str();
  // Autoscaling signals: epd_router_recommended_replicas{pool} (docs/router.md).
  app.add_option("--target-queue-encoder", f.planner_options.target_queue[0],
                 "Planner: jobs per encoder worker to aim for")
      ->capture_default_str();
  app.add_option("--target-queue-prefill", f.planner_options.target_queue[1],
                 "Planner: jobs per prefill worker to aim for")
      ->capture_default_str();
  app.add_option("--target-queue-decode", f.planner_options.target_queue[2],
                 "Planner: sequences per decode worker to aim for")
      ->capture_default_str();
  app.add_option("--target-ttft-ms", f.planner_options.target_ttft_ms,
                 "Planner: mean time to first token to aim for (encoder, prefill; 0 = off)")
      ->capture_default_str();
  app.add_option("--target-itl-ms", f.planner_options.target_itl_ms,
                 "Planner: mean inter-token latency to aim for (decode; 0 = off)")
      ->capture_default_str();
  app.add_option("--max-replicas", f.planner_options.max_replicas,
                 "Planner: the most replicas it recommends for a pool")
      ->capture_default_str();
  app.add_option("--planner-interval-ms", f.planner_options.interval_ms,
                 "Planner: how often the recommendations are recomputed")
      ->capture_default_str();
}

// The option checks that run once the process runtime is up.
absl::Status ValidateFlags(const RouterFlags& f) {
  if (auto s = f.core_options.Validate(); !s.ok()) return s;
  if (auto s = f.registry_options.Validate(); !s.ok()) return s;
  if (auto s = f.admission_options.Validate(); !s.ok()) return s;
  // Every admitted or queued HTTP request holds a connection thread; keep spare ones so a 429,
  // /health and /metrics are answered at once.
  if (f.http_options.threads <
      f.admission_options.max_running + f.admission_options.max_queued + 8) {
    return absl::InvalidArgumentError(
        "--http-threads must be at least --max-running-requests + --max-queued-requests + 8");
  }
  if (auto s = f.planner_options.Validate(); !s.ok()) return s;
  return absl::OkStatus();
}

// The real codec when --model has a tokenizer.json, else the byte codec (docs/router.md, Text).
absl::StatusOr<std::unique_ptr<r::TextCodec>> LoadCodec(const std::string& model_dir) {
  std::unique_ptr<r::TextCodec> codec_owner;
  if (!model_dir.empty() && std::filesystem::exists(model_dir + "/tokenizer.json")) {
    auto loaded = r::ModelTextCodec::Load(model_dir);
    if (!loaded.ok()) return loaded.status();
    codec_owner = *std::move(loaded);
    spdlog::info("epd-router: tokenizer of {} (vocab {})", model_dir, codec_owner->vocab_size());
  } else {
    // A checkpoint without a tokenizer (the golden sets): token-id prompts may use its whole
    // vocabulary.
    int32_t vocab = 256;
    if (!model_dir.empty()) {
      auto cfg = epd::model::LoadModelConfig(model_dir + "/config.json");
      if (cfg.ok()) vocab = static_cast<int32_t>(cfg->vocab_size);
    }
    codec_owner = std::make_unique<r::ByteTextCodec>(vocab);
    if (!model_dir.empty()) {
      spdlog::warn("epd-router: {} has no tokenizer.json; using the byte codec (vocab {})",
                   model_dir, codec_owner->vocab_size());
    }
  }
  return codec_owner;
}

// No prefix hints without --kvstore; with it, kvstore lookups (and the scheduler's block and tail
// rows set to match).
std::unique_ptr<r::PrefixOracle> MakePrefixOracle(RouterFlags& f, prometheus::Registry& metrics) {
  std::unique_ptr<r::PrefixOracle> oracle_owner = std::make_unique<r::NoPrefixOracle>();
  if (!f.kvstore_address.empty()) {
    r::KvOracleOptions kv_options;
    kv_options.target = f.kvstore_address;
    kv_options.block_tokens = f.kv_block_tokens;
    f.scheduler_options.prefix_block_tokens = f.kv_block_tokens;
    if (!f.model_dir.empty()) {
      // The tail rule's rows: window + DSpark block of the served config.
      auto config = epd::model::LoadModelConfig(f.model_dir + "/config.json");
      if (config.ok()) {
        f.scheduler_options.prefix_tail_rows =
            static_cast<int>(epd::model::DecoderTailRows(*config));
      }
      auto fp = epd::model::ModelDirFingerprint(f.model_dir);
      if (fp.ok()) {
        kv_options.default_fingerprint = *fp;
      } else {
        spdlog::warn("epd-router: no config fingerprint for prefix lookups: {}",
                     std::string(fp.status().message()));
      }
    }
    oracle_owner = std::make_unique<r::KvStorePrefixOracle>(kv_options, metrics);
  }
  return oracle_owner;
}

// Until SIGTERM: forget workers that stop heartbeating and recompute the planner's replicas.
void ServeUntilShutdown(const RouterFlags& f, r::Registry& registry, r::RouterCore& core,
                        r::ReplicaPlanner& planner) {
  const auto sweep =
      std::chrono::milliseconds(std::max(10, f.registry_options.heartbeat_interval_ms / 2));
  auto next_plan = std::chrono::steady_clock::now();
  while (!epd::runtime::WaitForShutdown(sweep)) {
    // A worker that stops heartbeating may hang its streams rather than close them.
    for (const auto& id : registry.ExpireStale()) core.FailWorker(id, "missed heartbeats");
    if (std::chrono::steady_clock::now() >= next_plan) {
      planner.Update();
      next_plan = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(f.planner_options.interval_ms);
    }
  }
}

// Lets running requests finish (up to --drain-timeout-ms), then stops the servers.
void DrainAndStop(const RouterFlags& f, r::RouterCore& core, r::OpenAiHttpServer& http_server,
                  r::RouterGrpcServer& grpc_server, epd::runtime::ProcessRuntime& runtime) {
  spdlog::info("epd-router: shutdown requested, draining {} running request(s)", core.inflight());
  core.StartDraining();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(f.runtime_options.drain_timeout_ms);
  while (core.inflight() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  http_server.Stop();
  grpc_server.Stop();
  // Its /health reads `core`, which goes before `runtime` does.
  runtime.metrics_server().Stop();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"epd-router: OpenAI HTTP + gRPC front end of epd"};
  RouterFlags f;
  AddFlags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (!f.api_key_file.empty()) {
    std::ifstream in(f.api_key_file, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    f.http_options.api_key = ss.str();
    while (!f.http_options.api_key.empty() &&
           (f.http_options.api_key.back() == '\n' || f.http_options.api_key.back() == '\r'))
      f.http_options.api_key.pop_back();
    if (!in || f.http_options.api_key.empty()) {
      std::cerr << "epd-router: --api-key-file " << f.api_key_file << ": cannot read a key\n";
      return 1;
    }
  }
  if (f.http_options.api_key.empty()) {
    if (const char* k = std::getenv("EPD_API_KEY")) f.http_options.api_key = k;
  }

  signal(SIGPIPE, SIG_IGN);  // a client that hangs up must not kill the process
  epd::runtime::ProcessRuntime runtime("epd-router", f.runtime_options);
  if (auto s = runtime.Start(); !s.ok()) return Fail(s);
  if (auto s = ValidateFlags(f); !s.ok()) return Fail(s);

  auto& clock = epd::common::SystemClock::Get();
  auto codec_owner = LoadCodec(f.model_dir);
  if (!codec_owner.ok()) return Fail(codec_owner.status());
  const r::TextCodec& codec = **codec_owner;
  r::Registry registry(f.registry_options, clock, runtime.registry());
  std::unique_ptr<r::PrefixOracle> oracle_owner = MakePrefixOracle(f, runtime.registry());
  r::PrefixOracle& oracle = *oracle_owner;
  r::Scheduler scheduler(f.scheduler_options, registry, oracle, runtime.registry());
  auto workers = r::NewGrpcWorkerClient();
  r::RouterCore core(f.core_options, codec, registry, scheduler, *workers, clock,
                     runtime.registry());
  r::ReplicaPlanner planner(f.planner_options, runtime.registry());

  r::AdmissionQueue admission(f.admission_options, runtime.registry());
  f.http_options.admission = &admission;
  r::RouterGrpcServer grpc_server(core, f.http_options.api_key, &admission);
  f.grpc_tls.cert_file = f.http_options.tls_cert_file;
  f.grpc_tls.key_file = f.http_options.tls_key_file;
  if (auto s = grpc_server.SetTls(f.grpc_tls); !s.ok()) return Fail(s);
  auto gport = grpc_server.Start(f.runtime_options.host, f.grpc_port);
  if (!gport.ok()) return Fail(gport.status());
  r::OpenAiHttpServer http_server(core, runtime.shared_registry(), f.http_options);
  auto hport = http_server.Start(f.runtime_options.host, f.http_port);
  if (!hport.ok()) return Fail(hport.status());
  runtime.metrics_server().SetHealth([&core] {
    bool serving = false;
    r::RouterHealthJson(core, &serving);
    // Liveness stays healthy without workers; readiness is the HTTP port's /health. The metrics
    // port checks no key, so it says only live/ready: the workers' addresses and load are on the
    // HTTP port's /health, behind the API key (docs/security.md).
    return epd::runtime::HealthReport{true, serving ? "{\"serving\":true}" : "{\"serving\":false}"};
  });
  runtime.PublishPort("grpc", *gport);
  if (grpc_server.worker_port() > 0) runtime.PublishPort("worker_grpc", grpc_server.worker_port());
  runtime.PublishPort("http", *hport);
  const bool tls = !f.http_options.tls_cert_file.empty();
  spdlog::info("epd-router: model {} (context {}), OpenAI HTTP on {}://{}:{}, gRPC{} on {}:{}",
               f.core_options.model, f.core_options.context_length, tls ? "https" : "http",
               f.runtime_options.host, *hport, tls ? " (TLS)" : "", f.runtime_options.host, *gport);

  ServeUntilShutdown(f, registry, core, planner);
  DrainAndStop(f, core, http_server, grpc_server, runtime);
  spdlog::info("epd-router: stopped");
  return 0;
}
