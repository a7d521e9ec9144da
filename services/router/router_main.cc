// epd-router: the front door. OpenAI-compatible HTTP (--http-port), gRPC epd.v1.Inference and
// the worker registry (--grpc-port), /metrics and /health on --metrics-port, drain on SIGTERM.
// Flow and choices: docs/router.md.
#include <signal.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"epd-router: OpenAI HTTP + gRPC front end of epd"};
  epd::runtime::RuntimeOptions runtime_options;
  epd::runtime::AddRuntimeFlags(app, &runtime_options);
  int http_port = 0, grpc_port = 0;
  r::CoreOptions core_options;
  r::RegistryOptions registry_options;
  r::SchedulerOptions scheduler_options;
  r::HttpOptions http_options;
  app.add_option("--http-port", http_port, "OpenAI HTTP port (0 = any)");
  app.add_option("--grpc-port", grpc_port, "gRPC port: Inference + WorkerRegistry (0 = any)");
  std::string model_dir, kvstore_address;
  app.add_option("--served-model-name", core_options.model,
                 "The model name clients ask for (/v1/models)")
      ->capture_default_str();
  app.add_option("--model", model_dir,
                 "Model directory (tokenizer + chat format); default: the built-in byte codec");
  app.add_option("--kvstore", kvstore_address,
                 "kvstore gRPC address(es) for prefix lookups, comma-separated for several on the hash "
                 "ring (the workers' list; default: none, no prefix hints)");
  int kv_block_tokens = 64;
  app.add_option("--kv-block-tokens", kv_block_tokens, "Tokens per kvstore block (chain hashes)")
      ->capture_default_str();
  app.add_option("--context-length", core_options.context_length,
                 "Prompt + completion tokens per request")
      ->capture_default_str();
  app.add_option("--max-tokens-limit", core_options.max_tokens_limit,
                 "Largest max_tokens a request may ask for")
      ->capture_default_str();
  app.add_option("--default-max-tokens", core_options.default_max_tokens,
                 "max_tokens of a chat request that gives none")
      ->capture_default_str();
  app.add_option("--migration-limit", core_options.migration_limit,
                 "Times a request moves to another decode worker when its decode worker dies "
                 "mid-generation (0 = never; docs/router.md)")
      ->capture_default_str();
  app.add_option("--api-key", http_options.api_key,
                 "Require 'Authorization: Bearer <key>' (default: $EPD_API_KEY, else none)");
  app.add_option("--http-threads", http_options.threads, "HTTP connection threads")
      ->capture_default_str();
  r::AdmissionOptions admission_options;
  app.add_option("--max-running-requests", admission_options.max_running,
                 "Requests dispatched at once; more wait in the admission queue")
      ->capture_default_str();
  app.add_option("--max-queued-requests", admission_options.max_queued,
                 "Requests that may wait for a running slot; beyond, 429 / RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--max-queue-wait-ms", admission_options.max_queue_wait_ms,
                 "A queued request is refused (429) after waiting this long")
      ->capture_default_str();
  app.add_option("--retry-after-s", admission_options.retry_after_s,
                 "Retry-After (seconds) sent with a 429")
      ->capture_default_str();
  r::GrpcTlsOptions grpc_tls;
  app.add_option("--tls-cert", http_options.tls_cert_file,
                 "PEM certificate: HTTPS on --http-port and TLS on --grpc-port");
  app.add_option("--tls-key", http_options.tls_key_file, "PEM private key of --tls-cert");
  app.add_option("--worker-grpc-port", grpc_tls.worker_port,
                 "Plaintext WorkerRegistry-only port for workers (0 = any; default: none)");
  app.add_option("--heartbeat-interval-ms", registry_options.heartbeat_interval_ms,
                 "Heartbeat interval told to workers")
      ->capture_default_str();
  app.add_option("--heartbeat-miss-limit", registry_options.heartbeat_miss_limit,
                 "Missed heartbeats before a worker is forgotten")
      ->capture_default_str();
  app.add_option("--direct-decode-max-tokens", scheduler_options.direct_decode_max_tokens,
                 "Uncached prompt tokens at or below which decode runs a request alone")
      ->capture_default_str();
  // Autoscaling signals: epd_router_recommended_replicas{pool} (docs/router.md).
  r::PlannerOptions planner_options;
  app.add_option("--target-queue-encoder", planner_options.target_queue[0],
                 "Planner: jobs per encoder worker to aim for")
      ->capture_default_str();
  app.add_option("--target-queue-prefill", planner_options.target_queue[1],
                 "Planner: jobs per prefill worker to aim for")
      ->capture_default_str();
  app.add_option("--target-queue-decode", planner_options.target_queue[2],
                 "Planner: sequences per decode worker to aim for")
      ->capture_default_str();
  app.add_option("--target-ttft-ms", planner_options.target_ttft_ms,
                 "Planner: mean time to first token to aim for (encoder, prefill; 0 = off)")
      ->capture_default_str();
  app.add_option("--target-itl-ms", planner_options.target_itl_ms,
                 "Planner: mean inter-token latency to aim for (decode; 0 = off)")
      ->capture_default_str();
  app.add_option("--max-replicas", planner_options.max_replicas,
                 "Planner: the most replicas it recommends for a pool")
      ->capture_default_str();
  app.add_option("--planner-interval-ms", planner_options.interval_ms,
                 "Planner: how often the recommendations are recomputed")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (http_options.api_key.empty()) {
    if (const char* k = std::getenv("EPD_API_KEY")) http_options.api_key = k;
  }

  signal(SIGPIPE, SIG_IGN);  // a client that hangs up must not kill the process
  epd::runtime::ProcessRuntime runtime("epd-router", runtime_options);
  if (auto s = runtime.Start(); !s.ok()) return Fail(s);
  if (auto s = core_options.Validate(); !s.ok()) return Fail(s);
  if (auto s = registry_options.Validate(); !s.ok()) return Fail(s);
  if (auto s = admission_options.Validate(); !s.ok()) return Fail(s);
  // Every admitted or queued HTTP request holds a connection thread; keep spare ones so a 429,
  // /health and /metrics are answered at once.
  if (http_options.threads < admission_options.max_running + admission_options.max_queued + 8) {
    return Fail(absl::InvalidArgumentError(
        "--http-threads must be at least --max-running-requests + --max-queued-requests + 8"));
  }
  if (auto s = planner_options.Validate(); !s.ok()) return Fail(s);

  auto& clock = epd::common::SystemClock::Get();
  // The real codec when --model has a tokenizer.json, else the byte codec (docs/router.md, Text).
  std::unique_ptr<r::TextCodec> codec_owner;
  if (!model_dir.empty() && std::filesystem::exists(model_dir + "/tokenizer.json")) {
    auto loaded = r::ModelTextCodec::Load(model_dir);
    if (!loaded.ok()) return Fail(loaded.status());
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
  const r::TextCodec& codec = *codec_owner;
  r::Registry registry(registry_options, clock, runtime.registry());
  std::unique_ptr<r::PrefixOracle> oracle_owner = std::make_unique<r::NoPrefixOracle>();
  if (!kvstore_address.empty()) {
    r::KvOracleOptions kv_options;
    kv_options.target = kvstore_address;
    kv_options.block_tokens = kv_block_tokens;
    scheduler_options.prefix_block_tokens = kv_block_tokens;
    if (!model_dir.empty()) {
      // The tail rule's rows: window + DSpark block of the served config.
      auto config = epd::model::LoadModelConfig(model_dir + "/config.json");
      if (config.ok()) {
        scheduler_options.prefix_tail_rows = static_cast<int>(epd::model::DecoderTailRows(*config));
      }
      auto fp = epd::model::ModelDirFingerprint(model_dir);
      if (fp.ok()) {
        kv_options.default_fingerprint = *fp;
      } else {
        spdlog::warn("epd-router: no config fingerprint for prefix lookups: {}",
                     std::string(fp.status().message()));
      }
    }
    oracle_owner = std::make_unique<r::KvStorePrefixOracle>(kv_options, runtime.registry());
  }
  r::PrefixOracle& oracle = *oracle_owner;
  r::Scheduler scheduler(scheduler_options, registry, oracle, runtime.registry());
  auto workers = r::NewGrpcWorkerClient();
  r::RouterCore core(core_options, codec, registry, scheduler, *workers, clock, runtime.registry());
  r::ReplicaPlanner planner(planner_options, runtime.registry());

  r::AdmissionQueue admission(admission_options, runtime.registry());
  http_options.admission = &admission;
  r::RouterGrpcServer grpc_server(core, http_options.api_key, &admission);
  grpc_tls.cert_file = http_options.tls_cert_file;
  grpc_tls.key_file = http_options.tls_key_file;
  if (auto s = grpc_server.SetTls(grpc_tls); !s.ok()) return Fail(s);
  auto gport = grpc_server.Start(runtime_options.host, grpc_port);
  if (!gport.ok()) return Fail(gport.status());
  r::OpenAiHttpServer http_server(core, runtime.shared_registry(), http_options);
  auto hport = http_server.Start(runtime_options.host, http_port);
  if (!hport.ok()) return Fail(hport.status());
  runtime.metrics_server().SetHealth([&core] {
    bool serving = false;
    // Liveness stays healthy without workers; readiness is the HTTP port's /health.
    return epd::runtime::HealthReport{true, r::RouterHealthJson(core, &serving)};
  });
  runtime.PublishPort("grpc", *gport);
  if (grpc_server.worker_port() > 0) runtime.PublishPort("worker_grpc", grpc_server.worker_port());
  runtime.PublishPort("http", *hport);
  const bool tls = !http_options.tls_cert_file.empty();
  spdlog::info("epd-router: model {} (context {}), OpenAI HTTP on {}://{}:{}, gRPC{} on {}:{}",
               core_options.model, core_options.context_length, tls ? "https" : "http",
               runtime_options.host, *hport, tls ? " (TLS)" : "", runtime_options.host, *gport);

  const auto sweep =
      std::chrono::milliseconds(std::max(10, registry_options.heartbeat_interval_ms / 2));
  auto next_plan = std::chrono::steady_clock::now();
  while (!epd::runtime::WaitForShutdown(sweep)) {
    // A worker that stops heartbeating may hang its streams rather than close them.
    for (const auto& id : registry.ExpireStale()) core.FailWorker(id, "missed heartbeats");
    if (std::chrono::steady_clock::now() >= next_plan) {
      planner.Update();
      next_plan = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(planner_options.interval_ms);
    }
  }

  spdlog::info("epd-router: shutdown requested, draining {} running request(s)", core.inflight());
  core.StartDraining();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(runtime_options.drain_timeout_ms);
  while (core.inflight() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  http_server.Stop();
  grpc_server.Stop();
  // Its /health reads `core`, which goes before `runtime` does.
  runtime.metrics_server().Stop();
  spdlog::info("epd-router: stopped");
  return 0;
}
