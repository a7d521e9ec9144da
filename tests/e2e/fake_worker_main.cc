// epd-fake-worker: a test-only worker that registers with epd-router like a real one, heartbeats,
// and serves WorkerControl. A decode job streams the prompt ids reversed (or the bytes of
// --reply), one token every --token-interval-ms, up to max_tokens; an encoder or prefill job
// answers "handoff" after --stage-delay-ms. Cancel (or the router dropping the stream) stops it.
// Exit codes: 0 after SIGTERM, 3 when the router refuses the registration.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "epd/v1/worker.grpc.pb.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "runtime/grpc_auth.h"
#include "runtime/process.h"
#include "runtime/shutdown.h"

namespace {

struct Options {
  std::string router;
  std::string pool = "decode";
  std::string worker_id;
  std::string model = "epd-nano";
  std::string fingerprint = "fp-test";
  std::string reply;
  int token_interval_ms = 5;
  int stage_delay_ms = 2;
  int first_token_delay_ms = 0;
};

class FakeWorker final : public epd::v1::WorkerControl::Service {
 public:
  FakeWorker(const Options& o, prometheus::Registry& reg)
      : o_(o),
        jobs_(prometheus::BuildCounter().Name("epd_fake_jobs_total").Help("Jobs received")
                  .Register(reg).Add({})),
        cancels_(prometheus::BuildCounter().Name("epd_fake_cancels_total")
                     .Help("Jobs stopped by Cancel or a dropped stream").Register(reg).Add({})),
        tokens_(prometheus::BuildCounter().Name("epd_fake_tokens_total").Help("Tokens sent")
                    .Register(reg).Add({})),
        active_gauge_(prometheus::BuildGauge().Name("epd_fake_active_jobs").Help("Running jobs")
                          .Register(reg).Add({})) {}

  grpc::Status Submit(grpc::ServerContext* ctx, const epd::v1::Job* job,
                      grpc::ServerWriter<epd::v1::SubmitResponse>* writer) override {
    jobs_.Increment();
    active_gauge_.Increment();
    ++active_;
    auto flag = std::make_shared<std::atomic<bool>>(false);
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancel_[job->request_id()] = flag;
    }
    spdlog::info("job {} stage {} prompt {} tokens max_tokens {} prev '{}' next '{}'",
                 job->request_id(), static_cast<int>(job->stage()), job->prompt_ids_size(),
                 job->sampling().max_tokens(), job->prev_worker_id(), job->next_worker_id());
    const bool stopped = job->final_stage() ? Decode(ctx, *job, writer, *flag)
                                            : Stage(ctx, writer, *flag);
    if (stopped) {
      cancels_.Increment();
      spdlog::info("job {} cancelled", job->request_id());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancel_.erase(job->request_id());
    }
    --active_;
    active_gauge_.Decrement();
    return grpc::Status::OK;
  }

  grpc::Status Cancel(grpc::ServerContext*, const epd::v1::CancelRequest* req,
                      epd::v1::CancelResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cancel_.find(req->request_id());
    resp->set_found(it != cancel_.end());
    if (it != cancel_.end()) it->second->store(true);
    return grpc::Status::OK;
  }

  int active() const { return active_.load(); }

 private:
  // Returns true when stopped early.
  bool Decode(grpc::ServerContext* ctx, const epd::v1::Job& job,
              grpc::ServerWriter<epd::v1::SubmitResponse>* writer, std::atomic<bool>& cancelled) {
    std::vector<int32_t> out;
    if (!o_.reply.empty()) {
      for (unsigned char c : o_.reply) out.push_back(c);
    } else {
      out.assign(job.prompt_ids().rbegin(), job.prompt_ids().rend());
    }
    const int max = job.sampling().max_tokens() > 0 ? job.sampling().max_tokens() : 16;
    const size_t n = std::min<size_t>(out.size(), max);
    // Stands for waiting on the inbound hand-off.
    for (int waited = 0; waited < o_.first_token_delay_ms; waited += 5) {
      if (cancelled || ctx->IsCancelled()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (size_t i = 0; i < n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o_.token_interval_ms));
      if (cancelled || ctx->IsCancelled()) return true;
      epd::v1::SubmitResponse r;
      r.set_request_id(job.request_id());
      r.add_token_ids(out[i]);
      if (i + 1 == n) r.set_finish_reason(n < out.size() ? "length" : "stop");
      if (!writer->Write(r)) return true;
      tokens_.Increment();
    }
    if (n == 0) {
      epd::v1::SubmitResponse r;
      r.set_request_id(job.request_id());
      r.set_finish_reason("stop");
      writer->Write(r);
    }
    return false;
  }

  bool Stage(grpc::ServerContext* ctx, grpc::ServerWriter<epd::v1::SubmitResponse>* writer,
             std::atomic<bool>& cancelled) {
    std::this_thread::sleep_for(std::chrono::milliseconds(o_.stage_delay_ms));
    if (cancelled || ctx->IsCancelled()) return true;
    epd::v1::SubmitResponse r;
    r.set_finish_reason("handoff");
    writer->Write(r);
    return false;
  }

  const Options& o_;
  prometheus::Counter& jobs_;
  prometheus::Counter& cancels_;
  prometheus::Counter& tokens_;
  prometheus::Gauge& active_gauge_;
  std::atomic<int> active_{0};
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<std::atomic<bool>>> cancel_;
};

epd::v1::Pool ParsePool(const std::string& p) {
  if (p == "encoder") return epd::v1::POOL_ENCODER;
  if (p == "prefill") return epd::v1::POOL_PREFILL;
  return epd::v1::POOL_DECODE;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"epd-fake-worker: a scripted worker for router tests"};
  epd::runtime::RuntimeOptions runtime_options;
  epd::runtime::AddRuntimeFlags(app, &runtime_options);
  Options o;
  app.add_option("--router", o.router, "Router gRPC address host:port")->required();
  app.add_option("--pool", o.pool, "encoder | prefill | decode")
      ->check(CLI::IsMember({"encoder", "prefill", "decode"}));
  app.add_option("--worker-id", o.worker_id, "Worker id")->required();
  app.add_option("--model", o.model, "Model name");
  app.add_option("--fingerprint", o.fingerprint, "Config fingerprint");
  app.add_option("--reply", o.reply, "Text a decode job streams instead of the reversed prompt");
  app.add_option("--token-interval-ms", o.token_interval_ms, "Delay per decode token");
  app.add_option("--stage-delay-ms", o.stage_delay_ms, "Delay of an encoder/prefill job");
  app.add_option("--first-token-delay-ms", o.first_token_delay_ms,
                 "Delay before a decode job's first token (stands for the hand-off)");
  CLI11_PARSE(app, argc, argv);
  signal(SIGPIPE, SIG_IGN);

  epd::runtime::ProcessRuntime runtime("epd-fake-worker", runtime_options);
  if (auto s = runtime.Start(); !s.ok()) {
    std::cerr << s.message() << "\n";
    return 1;
  }
  FakeWorker service(o, runtime.registry());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(runtime_options.host + ":0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "cannot bind gRPC\n";
    return 1;
  }
  runtime.PublishPort("grpc", port);

  auto channel = epd::runtime::CreateClusterChannel(o.router, runtime.cluster_secret());
  auto stub = epd::v1::WorkerRegistry::NewStub(channel);
  epd::v1::RegisterRequest reg;
  reg.set_pool(ParsePool(o.pool));
  reg.set_worker_id(o.worker_id);
  reg.set_control_address(runtime_options.host + ":" + std::to_string(port));
  reg.set_transfer_address("fake://" + o.worker_id);
  reg.set_config_fingerprint(o.fingerprint);
  reg.set_model(o.model);
  int interval_ms = 1000;
  auto do_register = [&]() -> int {
    for (int attempt = 0; attempt < 100; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      ctx.set_wait_for_ready(true);
      epd::v1::RegisterResponse resp;
      grpc::Status st = stub->Register(&ctx, reg, &resp);
      if (!st.ok()) {
        if (epd::runtime::ShutdownRequested()) return 0;
        continue;
      }
      if (!resp.accepted()) {
        spdlog::error("registration refused: {}", resp.reason());
        return 3;
      }
      interval_ms = resp.heartbeat_interval_ms() > 0 ? resp.heartbeat_interval_ms() : 1000;
      spdlog::info("registered with {} as {} worker '{}'", o.router, o.pool, o.worker_id);
      return 0;
    }
    spdlog::error("router {} unreachable", o.router);
    return 1;
  };
  if (int rc = do_register(); rc != 0) {
    server->Shutdown();
    return rc;
  }
  runtime.PublishPort("registered", 1);
  while (!epd::runtime::WaitForShutdown(std::chrono::milliseconds(interval_ms))) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(interval_ms));
    epd::v1::HeartbeatRequest hb;
    hb.set_worker_id(o.worker_id);
    hb.set_config_fingerprint(o.fingerprint);
    hb.mutable_load()->set_running_requests(service.active());
    epd::v1::HeartbeatResponse resp;
    if (stub->Heartbeat(&ctx, hb, &resp).ok() && !resp.known()) {
      spdlog::warn("router forgot us; registering again");
      if (int rc = do_register(); rc != 0) {
        server->Shutdown();
        return rc;
      }
    }
  }
  spdlog::info("epd-fake-worker: shutdown requested, draining");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
