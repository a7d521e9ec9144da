#include "runtime/worker/worker_runtime.h"

#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "kernels/backend.h"
#include "kernels/device/device.h"
#include "transfer/ucx_wire.h"
#include "model/fingerprint.h"
#include "model/kv_pool.h"
#include "model/model.h"
#include "runtime/grpc_auth.h"
#include "runtime/process.h"
#include "runtime/shutdown.h"
#include "runtime/worker/pool_registration.h"

namespace epd::worker {
namespace {

std::string PoolLabel(epd::v1::Pool p) {
  switch (p) {
    case epd::v1::POOL_ENCODER:
      return "encoder";
    case epd::v1::POOL_PREFILL:
      return "prefill";
    default:
      return "decode";
  }
}

// A GPU whose context a fault made unusable fails every call from now on, and only a new process
// can use it (kernels::DeviceLost). The worker leaves at once, as a crash does, before it answers
// another job: the router sees its streams break (UNAVAILABLE), drops it, and re-dispatches or
// migrates their requests (docs/router.md), where a job's error message would fail them; the
// supervisor (epd serve, the pod's restart policy) starts a fresh worker. Nothing is torn down:
// that would need the GPU.
void ExitIfDeviceLost(const kernels::Backend& backend, const std::string& label) {
  const absl::Status lost = kernels::DeviceLost(backend);
  if (lost.ok()) return;
  spdlog::critical("epd-{}: {}; exiting (status {}) to be restarted", label, lost.ToString(),
                   kExitDeviceLost);
  spdlog::default_logger()->flush();
  std::fflush(nullptr);
  std::_Exit(kExitDeviceLost);
}

class ControlService final : public epd::v1::WorkerControl::Service {
 public:
  ControlService(JobHandler& handler, const kernels::Backend& backend, const std::string& pool,
                 prometheus::Registry& reg, const std::string& cluster_secret)
      : handler_(handler), backend_(backend), pool_(pool), auth_(cluster_secret) {
    queue_ = &prometheus::BuildGauge()
                  .Name("epd_queue_depth")
                  .Help("Jobs received and not finished, per pool")
                  .Register(reg)
                  .Add({{"pool", pool}});
    auto& req = prometheus::BuildCounter()
                    .Name("epd_worker_requests_total")
                    .Help("Jobs finished by a worker, per pool and outcome")
                    .Register(reg);
    for (const char* o : {"ok", "error", "cancelled", "rejected"})
      outcomes_[o] = &req.Add({{"pool", pool}, {"outcome", o}});
  }

  grpc::Status Submit(grpc::ServerContext* ctx, const epd::v1::Job* job,
                      grpc::ServerWriter<epd::v1::SubmitResponse>* writer) override {
    // Only the router (a holder of the cluster secret) may submit work (docs/security.md).
    if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.WorkerControl/Submit"); !a.ok()) return a;
    ExitIfDeviceLost(backend_, pool_);
    if (draining_.load()) {
      outcomes_["rejected"]->Increment();
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is draining");
    }
    auto flag = std::make_shared<std::atomic<bool>>(false);
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancel_[job->request_id()] = flag;
      ++active_;
      queue_->Set(active_);
    }
    std::atomic<bool> stop_watch{false};
    // Watches for a dropped stream (router gone or cancelled) while the handler runs.
    std::thread watcher([&] {
      while (!stop_watch.load()) {
        if (ctx->IsCancelled()) flag->store(true);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    std::mutex write_mu;
    const Emit emit = [&](const epd::v1::SubmitResponse& r) {
      std::lock_guard<std::mutex> lock(write_mu);
      return writer->Write(r);
    };
    absl::Status st = handler_.Run(*job, emit, *flag);
    stop_watch.store(true);
    watcher.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancel_.erase(job->request_id());
      --active_;
      queue_->Set(active_);
    }
    if (st.ok()) {
      outcomes_["ok"]->Increment();
      return grpc::Status::OK;
    }
    ExitIfDeviceLost(backend_, pool_);  // the job failed because the GPU is gone: not its fault
    if (flag->load()) {
      outcomes_["cancelled"]->Increment();
      spdlog::info("job {} cancelled: {}", job->request_id(), std::string(st.message()));
      return grpc::Status(grpc::StatusCode::CANCELLED, std::string(st.message()));
    }
    outcomes_["error"]->Increment();
    spdlog::warn("job {} failed: {}", job->request_id(), std::string(st.message()));
    epd::v1::SubmitResponse r;
    r.set_request_id(job->request_id());
    r.set_error(std::string(st.message()));
    r.set_error_code(absl::StatusCodeToString(st.code()));
    r.set_finish_reason("error");
    emit(r);
    return grpc::Status::OK;
  }

  grpc::Status Cancel(grpc::ServerContext* ctx, const epd::v1::CancelRequest* req,
                      epd::v1::CancelResponse* resp) override {
    if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.WorkerControl/Cancel"); !a.ok()) return a;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cancel_.find(req->request_id());
    resp->set_found(it != cancel_.end());
    if (it != cancel_.end()) it->second->store(true);
    return grpc::Status::OK;
  }

  int active() {
    std::lock_guard<std::mutex> lock(mu_);
    return active_;
  }
  void StartDrain() { draining_.store(true); }
  void CancelAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, f] : cancel_) f->store(true);
  }

 private:
  JobHandler& handler_;
  const kernels::Backend& backend_;  // the model's
  const std::string pool_;
  runtime::ClusterAuthChecker auth_;
  prometheus::Gauge* queue_;
  std::map<std::string, prometheus::Counter*> outcomes_;
  std::atomic<bool> draining_{false};
  std::mutex mu_;
  int active_ = 0;
  std::map<std::string, std::shared_ptr<std::atomic<bool>>> cancel_;
};

// Where the process's memory goes, for the soak (docs/chaos.md) and an operator reading RSS:
// the model's KV pool (used: blocks held by sequences; cached: released sealed blocks kept for
// prefix reuse, at most kUnboundedCacheBytes in an unbounded pool; slabs: the memory it holds,
// which only grows to its high-water, docs/memory.md; capacity: its bound, 0 = none) and the C
// heap (in_use: allocated; free: freed chunks the allocator keeps for reuse, resident where
// touched; mmapped: large blocks mapped on their own). Refreshed by Update (the heartbeat loop,
// every second).
class MemoryGauges {
 public:
  MemoryGauges(prometheus::Registry& reg, const model::KvPool& kv) : kv_(kv) {
    auto& pool = prometheus::BuildGauge()
                     .Name("epd_kv_pool_bytes")
                     .Help(
                         "Bytes of the worker's KV pool by state: used (held by sequences), "
                         "cached (sealed blocks nobody holds, kept for prefix reuse), slabs "
                         "(the memory the pool holds: used + cached + free slots), capacity "
                         "(the most used + cached may reach; 0 = unbounded)")
                     .Register(reg);
    pool_used_ = &pool.Add({{"state", "used"}});
    pool_cached_ = &pool.Add({{"state", "cached"}});
    pool_slabs_ = &pool.Add({{"state", "slabs"}});
    pool_capacity_ = &pool.Add({{"state", "capacity"}});
    auto& heap = prometheus::BuildGauge()
                     .Name("epd_malloc_bytes")
                     .Help(
                         "C heap (glibc mallinfo2) by state: in_use (allocated), free (freed "
                         "chunks its arenas keep for reuse), mmapped (large blocks mapped on "
                         "their own)")
                     .Register(reg);
    heap_in_use_ = &heap.Add({{"state", "in_use"}});
    heap_free_ = &heap.Add({{"state", "free"}});
    heap_mmapped_ = &heap.Add({{"state", "mmapped"}});
    Update();
  }

  void Update() {
    const model::KvPool::Stats s = kv_.stats();
    pool_used_->Set(static_cast<double>(s.used_bytes));
    pool_cached_->Set(static_cast<double>(s.cached_bytes));
    pool_slabs_->Set(static_cast<double>(s.slab_bytes));
    pool_capacity_->Set(static_cast<double>(s.capacity_bytes));
    const struct mallinfo2 m = mallinfo2();
    heap_in_use_->Set(static_cast<double>(m.uordblks));
    heap_free_->Set(static_cast<double>(m.fordblks));
    heap_mmapped_->Set(static_cast<double>(m.hblkhd));
  }

 private:
  const model::KvPool& kv_;
  prometheus::Gauge* pool_used_;
  prometheus::Gauge* pool_cached_;
  prometheus::Gauge* pool_slabs_;
  prometheus::Gauge* pool_capacity_;
  prometheus::Gauge* heap_in_use_;
  prometheus::Gauge* heap_free_;
  prometheus::Gauge* heap_mmapped_;
};

// The flags every worker takes (a pool adds its own through its FlagAdder).
struct WorkerFlags {
  runtime::RuntimeOptions runtime;
  std::string router, kvstore, model_dir, worker_id, net_devices;
  std::string cluster_token;  // the cluster secret, from runtime.Start (never a flag)
  std::string advertise, kvstore_bulk = "ucx";
  uint64_t kvstore_bulk_min_bytes = 64 << 10;
  int handoff_deadline_ms = 30000;
  std::string dspark = "on";
  std::string device = "cpu";
  std::string step_graphs = "on";
  int64_t selftest_bytes = 4 << 20;
  int malloc_arena_max = 2;
};

void AddWorkerFlags(CLI::App& app, WorkerFlags* f) {
  runtime::AddRuntimeFlags(app, &f->runtime);
  app.add_option("--router", f->router, "Router gRPC address host:port")->required();
  app.add_option("--kvstore", f->kvstore,
                 "KV store gRPC address host:port, or several comma-separated (keys placed on a "
                 "consistent-hash ring; every worker and the router must list the same daemons)");
  app.add_option("--kvstore-bulk", f->kvstore_bulk,
                 "How kvstore values move: ucx (default: values of at least "
                 "--kvstore-bulk-min-bytes over UCX where the daemon has --bulk ucx, else inline) "
                 "or inline (in the gRPC messages)")
      ->check(CLI::IsMember({"inline", "ucx"}));
  app.add_option("--kvstore-bulk-min-bytes", f->kvstore_bulk_min_bytes,
                 "--kvstore-bulk ucx: smaller values stay inline (default 64 KiB)");
  app.add_option("--advertise-address", f->advertise,
                 "Address other hosts reach this worker at: registered with the router as the "
                 "control address (default: --host; required when --host is 0.0.0.0)");
  app.add_option("--model", f->model_dir, "Model directory (config.json + safetensors)")
      ->required();
  app.add_option("--worker-id", f->worker_id, "Worker id (default: <pool>-<pid>)");
  app.add_option("--ucx-net-devices", f->net_devices, "UCX_NET_DEVICES (default: environment)");
  app.add_option("--handoff-deadline-ms", f->handoff_deadline_ms, "Deadline of one hand-off");
  app.add_option("--dspark", f->dspark,
                 "DSpark speculative decoding on|off (part of the config fingerprint; every worker "
                 "of a deployment must agree)")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--device", f->device,
                 "Backend the model runs on: cpu, cuda or cuda:N (default cpu; docs/cuda.md)");
  app.add_option("--step-graphs", f->step_graphs,
                 "Decode step graphs on|off (default on): a batched decode step's "
                 "row-independent parts launched as CUDA graphs (docs/cuda.md, \"Decode step "
                 "graphs\"); off runs every op one by one, with the same output. A backend that "
                 "records no graphs (cpu) runs op by op either way")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--transfer-selftest-bytes", f->selftest_bytes,
                 "Bytes of the startup transfer self-test (bandwidth and transport UCX picks; "
                 "0 = skip)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--malloc-arena-max", f->malloc_arena_max,
                 "Most C heap arenas (glibc M_ARENA_MAX; default 2; 0 = glibc's 8 per core). "
                 "Each arena keeps its own freed memory, and a worker's per-stream threads "
                 "spread over new arenas, so more arenas means more resident memory "
                 "(docs/chaos.md, Soak)")
      ->check(CLI::Range(0, 1024));
}

// The device first: a missing GPU fails at once, before any port or model is opened. The
// backend made here is the one the model runs on; null (said on stderr) when there is none.
std::unique_ptr<kernels::Backend> OpenBackend(const std::string& label, const std::string& device,
                                              kernels::DeviceSpec* spec) {
  auto device_spec = kernels::ParseDeviceSpec(device);
  if (!device_spec.ok()) {
    std::cerr << "epd-" << label << ": " << device_spec.status().message() << "\n";
    return nullptr;
  }
  auto made = kernels::MakeBackend(*device_spec);
  if (!made.ok()) {
    std::cerr << "epd-" << label << ": --device " << device << ": " << made.status().message()
              << "\n";
    return nullptr;
  }
  *spec = *device_spec;
  return std::move(*made);
}

// The worker id (default <pool>-<pid>) and the address the router dials (default --host); false (said on stderr) when
// --host is a wildcard and no --advertise-address is given.
bool ResolveIdentity(const CLI::App& /*app*/, const std::string& label, WorkerFlags* f) {
  if (f->worker_id.empty()) f->worker_id = label + "-" + std::to_string(getpid());
  if (f->advertise.empty()) {
    if (f->runtime.host == "0.0.0.0" || f->runtime.host == "::") {
      std::cerr << "epd-" << label << ": --host " << f->runtime.host
                << " is not an address the router can dial; give --advertise-address\n";
      return false;
    }
    f->advertise = f->runtime.host;
  }
  return true;
}

// The UCX transfer engine of the hand-offs, its handshake bound to the model's fingerprint and
// the cluster token.
absl::StatusOr<std::unique_ptr<transfer::TransferEngine>> MakeTransport(
    const transfer::UcxOptions& uo, const WorkerFlags& f, const std::string& fingerprint,
    prometheus::Registry& registry) {
  transfer::EngineOptions eo;
  eo.config_fingerprint = fingerprint;
  eo.cluster_token = f.cluster_token;
  eo.node_name = f.worker_id;
  eo.pool_bytes = transfer::kHandoffPoolBytes;  // hand-off buffers reused, registered once
  eo.inline_hash_bytes = transfer::kHandoffInlineHashBytes;  // small hand-offs: fewer wake-ups
  return transfer::MakeUcxTransport(uo, eo, registry, common::SystemClock::Get());
}

// epd_transfer_selftest_bandwidth_bytes_per_second{transport}: what this host's UCX moves, the
// operator's baseline for the transfer panels. A failure is logged, not fatal.
void RunTransferSelfTest(const std::string& label, const transfer::UcxOptions& uo, int64_t bytes,
                         prometheus::Registry& registry) {
  auto st = transfer::RunBandwidthSelfTest(uo, static_cast<uint64_t>(bytes), registry);
  if (st.ok()) {
    spdlog::info("epd-{}: transfer self-test: {:.0f} MB/s over {} ({} bytes)", label,
                 st->bytes_per_second / 1e6, std::string(transfer::TransportLabel(st->transport)),
                 st->bytes);
  } else {
    spdlog::warn("epd-{}: transfer self-test failed: {}", label,
                 std::string(st.status().message()));
  }
}

WorkerSetup MakeSetup(epd::v1::Pool pool, const std::string& label, const WorkerFlags& f,
                      const model::Model* model, HandoffPeer* handoff,
                      const std::string& fingerprint, prometheus::Registry& registry) {
  WorkerSetup setup;
  setup.pool = pool;
  setup.pool_label = label;
  setup.model = model;
  setup.model_dir = f.model_dir;
  setup.handoff = handoff;
  setup.fingerprint = fingerprint;
  setup.kvstore = f.kvstore;
  setup.kvstore_bulk_ucx = f.kvstore_bulk == "ucx";
  setup.kvstore_bulk_min_bytes = f.kvstore_bulk_min_bytes;
  setup.advertise_address = f.advertise;
  setup.ucx_net_devices = f.net_devices;
  setup.cluster_token = f.cluster_token;
  setup.dspark = f.dspark == "on";
  setup.registry = &registry;
  setup.batch_size = &prometheus::BuildGauge()
                          .Name("epd_batch_size")
                          .Help(
                              "Sequences running in this worker's step now, per pool (decode: "
                              "the last batched step; 0 when idle)")
                          .Register(registry)
                          .Add({{"pool", label}});
  setup.handoff_deadline_ms = f.handoff_deadline_ms;
  return setup;
}

// The WorkerControl gRPC server on a free port of `host` (*port); null when it cannot bind.
std::unique_ptr<grpc::Server> StartControlServer(const std::string& host, ControlService* service,
                                                 int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(host + ":0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

// Readiness (/health): 503 until registered with the router, and again once draining.
// 0 registering, 1 serving, 2 draining. Shared: the server thread may outlive RunWorkerMain.
std::shared_ptr<std::atomic<int>> PublishPhase(runtime::ProcessRuntime& runtime) {
  auto phase = std::make_shared<std::atomic<int>>(0);
  runtime.metrics_server().SetHealth([phase] {
    static const char* kPhase[] = {"registering", "serving", "draining"};
    const int p = phase->load();
    return runtime::HealthReport{p == 1, std::string("{\"phase\":\"") + kPhase[p] + "\"}"};
  });
  return phase;
}

// The worker's link to the router: its registration (again when the router forgot it) and the
// heartbeats that carry its load and, once it drains, say so.
class RouterLink {
 public:
  RouterLink(const std::string& label, const WorkerFlags& f, const std::string& fingerprint,
             epd::v1::RegisterRequest reg, ControlService& service)
      : label_(label),
        router_(f.router),
        worker_id_(f.worker_id),
        fingerprint_(fingerprint),
        stub_(epd::v1::WorkerRegistry::NewStub(
            runtime::CreateClusterChannel(f.router, f.cluster_token))),
        reg_(std::move(reg)),
        service_(service) {}

  // 0 once registered (or when shutdown was asked meanwhile); 3 when the router refuses this
  // worker, 1 when it stays unreachable.
  int Register() {
    for (int attempt = 0; attempt < 100; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      ctx.set_wait_for_ready(true);
      epd::v1::RegisterResponse resp;
      if (!stub_->Register(&ctx, reg_, &resp).ok()) {
        if (runtime::ShutdownRequested()) return 0;
        continue;
      }
      if (!resp.accepted()) {
        spdlog::error("epd-{}: registration refused: {}", label_, resp.reason());
        return 3;
      }
      interval_ms_ = resp.heartbeat_interval_ms() > 0 ? resp.heartbeat_interval_ms() : 1000;
      spdlog::info("epd-{}: registered with {} as '{}' (fingerprint {})", label_, router_,
                   worker_id_, fingerprint_);
      return 0;
    }
    spdlog::error("epd-{}: router {} unreachable", label_, router_);
    return 1;
  }

  // One heartbeat; true when the router answered that it does not know this worker.
  bool Heartbeat(bool draining) {
    grpc::ClientContext ctx;
    // At least a second: with a short interval (tests run 200 ms) a loaded host's round trip can
    // exceed it, and a beat that arrives late still counts, while one abandoned at its deadline
    // is a miss. The router judges liveness on its own clock (interval x miss limit).
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(std::max(interval_ms_, 1000)));
    epd::v1::HeartbeatRequest hb;
    hb.set_worker_id(worker_id_);
    hb.set_config_fingerprint(fingerprint_);
    hb.set_draining(draining);
    hb.mutable_load()->set_running_requests(service_.active());
    hb.mutable_load()->set_queue_depth(service_.active());
    epd::v1::HeartbeatResponse resp;
    return stub_->Heartbeat(&ctx, hb, &resp).ok() && !resp.known();
  }

  // The heartbeat interval the router asked for.
  int interval_ms() const { return interval_ms_; }

 private:
  const std::string label_;
  const std::string router_;
  const std::string worker_id_;
  const std::string fingerprint_;
  std::unique_ptr<epd::v1::WorkerRegistry::Stub> stub_;
  const epd::v1::RegisterRequest reg_;
  ControlService& service_;
  int interval_ms_ = 1000;
};

epd::v1::RegisterRequest MakeRegisterRequest(epd::v1::Pool pool, const WorkerFlags& f, int port,
                                             const std::string& transfer_address,
                                             const std::string& fingerprint) {
  epd::v1::RegisterRequest reg;
  reg.set_pool(pool);
  reg.set_worker_id(f.worker_id);
  reg.set_control_address(f.advertise + ":" + std::to_string(port));
  reg.set_transfer_address(transfer_address);
  reg.set_config_fingerprint(fingerprint);
  reg.set_model(std::filesystem::path(f.model_dir).filename().string());
  return reg;
}

// Serving: heartbeats every interval until shutdown is asked, the memory gauges refreshed and the
// GPU checked on each; registers again when the router forgot this worker. 0, or Register's
// error.
int HeartbeatUntilShutdown(RouterLink& link, MemoryGauges& memory, const kernels::Backend& backend,
                           const std::string& label) {
  while (!runtime::WaitForShutdown(std::chrono::milliseconds(link.interval_ms()))) {
    memory.Update();
    ExitIfDeviceLost(backend, label);  // also when no job runs into it
    if (link.Heartbeat(false)) {
      spdlog::warn("epd-{}: the router forgot us; registering again", label);
      if (int rc = link.Register(); rc != 0) return rc;
    }
  }
  return 0;
}

// Drain: refuse new jobs, tell the router, finish running jobs within --drain-timeout-ms (then
// cancel them).
void Drain(RouterLink& link, ControlService& service, std::atomic<int>& phase,
           const std::string& label, int drain_timeout_ms) {
  spdlog::info("epd-{}: draining ({} running, up to {} ms)", label, service.active(),
               drain_timeout_ms);
  phase.store(2);
  service.StartDrain();
  link.Heartbeat(true);
  const auto drain_end =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(drain_timeout_ms);
  auto next_beat = std::chrono::steady_clock::now();
  while (service.active() > 0 && std::chrono::steady_clock::now() < drain_end) {
    if (std::chrono::steady_clock::now() >= next_beat) {
      link.Heartbeat(true);
      next_beat += std::chrono::milliseconds(link.interval_ms());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (service.active() > 0) {
    spdlog::warn("epd-{}: drain timeout; cancelling {} job(s)", label, service.active());
    service.CancelAll();
  }
}

}  // namespace

absl::Status CheckJobFingerprint(const epd::v1::Job& job, const std::string& fingerprint) {
  if (!job.config_fingerprint().empty() && job.config_fingerprint() != fingerprint)
    return absl::FailedPreconditionError(absl::StrCat("job fingerprint ", job.config_fingerprint(),
                                                      " != worker fingerprint ", fingerprint));
  return absl::OkStatus();
}

void EmitHandoffDone(const Emit& emit, const std::string& request_id) {
  epd::v1::SubmitResponse r;
  r.set_request_id(request_id);
  r.set_finish_reason("handoff");
  emit(r);
}

absl::StatusOr<std::string> ModelFingerprint(const std::string& model_dir, bool dspark) {
  return model::ModelDirFingerprint(model_dir, /*cache_layout_version=*/1, dspark);
}

int RunWorkerMain(int argc, char** argv, epd::v1::Pool pool, const HandlerFactory& factory,
                  const FlagAdder& add_flags) {
  const std::string label = PoolLabel(pool);
  CLI::App app{"epd-" + label + ": the " + label + " worker (docs/workers.md)"};
  WorkerFlags f;
  AddWorkerFlags(app, &f);
  if (add_flags) add_flags(app);
  CLI11_PARSE(app, argc, argv);
  // Before any thread is made: a thread takes its arena on its first allocation.
  if (f.malloc_arena_max > 0) mallopt(M_ARENA_MAX, f.malloc_arena_max);
  kernels::DeviceSpec device_spec;
  std::unique_ptr<kernels::Backend> backend = OpenBackend(label, f.device, &device_spec);
  if (!backend) return 1;
  signal(SIGPIPE, SIG_IGN);
  if (!ResolveIdentity(app, label, &f)) return 1;

  runtime::ProcessRuntime runtime("epd-" + label, f.runtime);
  if (auto s = runtime.Start(); !s.ok()) {
    std::cerr << "epd-" << label << ": " << s.message() << "\n";
    return 1;
  }
  f.cluster_token = runtime.cluster_secret();
  spdlog::info("epd-{}: the model runs on {} (backend {})", label, device_spec.ToString(),
               backend->Name());
  auto model = model::Model::Load(f.model_dir, *backend,
                                  model::ModelOptions{.step_graphs = f.step_graphs == "on"});
  if (!model.ok()) {
    spdlog::error("epd-{}: cannot load model {}: {}", label, f.model_dir,
                  std::string(model.status().message()));
    return 1;
  }
  auto fingerprint = ModelFingerprint(f.model_dir, f.dspark == "on");
  if (!fingerprint.ok()) {
    spdlog::error("epd-{}: {}", label, std::string(fingerprint.status().message()));
    return 1;
  }
  transfer::UcxOptions uo;
  uo.net_devices = f.net_devices;
  auto transport = MakeTransport(uo, f, *fingerprint, runtime.registry());
  if (!transport.ok()) {
    spdlog::error("epd-{}: transfer engine: {}", label, std::string(transport.status().message()));
    return 1;
  }
  HandoffPeer handoff(**transport);
  // The KV pool's slabs, registered with the wire once each as the pool allocates them (counted
  // in epd_transfer_outstanding{resource="registrations"}); destroyed before the transport.
  PoolRegistration pool_registration((*model)->kv_pool_ptr(), **transport);
  if (f.selftest_bytes > 0) RunTransferSelfTest(label, uo, f.selftest_bytes, runtime.registry());

  const WorkerSetup setup =
      MakeSetup(pool, label, f, model->get(), &handoff, *fingerprint, runtime.registry());
  auto handler = factory(setup);
  if (!handler.ok()) {
    spdlog::error("epd-{}: {}", label, std::string(handler.status().message()));
    return 1;
  }
  ControlService service(**handler, *backend, label, runtime.registry(), f.cluster_token);
  MemoryGauges memory(runtime.registry(), (*model)->kv_pool());
  int port = 0;
  std::unique_ptr<grpc::Server> server = StartControlServer(f.runtime.host, &service, &port);
  if (!server || port == 0) {
    spdlog::error("epd-{}: cannot bind gRPC on {}", label, f.runtime.host);
    return 1;
  }
  runtime.PublishPort("grpc", port);

  RouterLink link(label, f, *fingerprint,
                  MakeRegisterRequest(pool, f, port, (*transport)->LocalAddress(), *fingerprint),
                  service);
  const std::shared_ptr<std::atomic<int>> phase = PublishPhase(runtime);
  if (int rc = link.Register(); rc != 0) {
    server->Shutdown();
    return rc;
  }
  phase->store(1);
  runtime.PublishPort("registered", 1);
  if (int rc = HeartbeatUntilShutdown(link, memory, *backend, label); rc != 0) {
    server->Shutdown();
    return rc;
  }
  Drain(link, service, *phase, label, f.runtime.drain_timeout_ms);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  handler->reset();
  spdlog::info("epd-{}: stopped", label);
  return 0;
}

}  // namespace epd::worker
