// epd-kvstore: the per-node KV store daemon (DESIGN §5). Serves Hello/Lookup/Get/Put/Pin/Stats over
// gRPC (the control plane), moves bulk value bytes over UCX (kvstore/bulk.h), serves /metrics and
// /health over HTTP, sweeps TTLs periodically and drains on SIGTERM.
#include <signal.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "common/clock.h"
#include "kvstore/bulk.h"
#include "kvstore/kvstore.h"
#include "kvstore/kvstore_service.h"
#include "transfer/fault_wire.h"
#include "runtime/process.h"
#include "runtime/shutdown.h"

int main(int argc, char** argv) {
  CLI::App app{"epd-kvstore: tiered KV store (G1 block pool, G2 SWA pool, G3 RocksDB)"};
  epd::runtime::RuntimeOptions runtime_options;
  epd::runtime::AddRuntimeFlags(app, &runtime_options);
  epd::kvstore::KvStoreConfig config;
  int grpc_port = 0;
  int64_t swa_ttl_minutes = 10;
  int64_t swa_ttl_ms = 0;
  double global_ttl_hours = 72;
  int sweep_interval_s = 60;
  epd::kvstore::KvServiceOptions service_options;
  app.add_option("--data-dir", config.data_dir, "Directory of the RocksDB tier (G3)")->required();
  app.add_option("--grpc-port", grpc_port, "gRPC port (0 = any; published as \"grpc\")");
  app.add_option("--swa-ttl-minutes", swa_ttl_minutes, "TTL of G2 SWA snapshots (default 10)")
      ->check(CLI::PositiveNumber);
  app.add_option("--swa-ttl-ms", swa_ttl_ms,
                 "TTL of G2 SWA snapshots in milliseconds (overrides --swa-ttl-minutes; tests)")
      ->check(CLI::PositiveNumber);
  app.add_option("--swa-capacity-bytes", config.g2.capacity_bytes,
                 "G2 capacity (default ~10% of host memory)")
      ->check(CLI::PositiveNumber);
  app.add_option("--global-ttl-hours", global_ttl_hours, "TTL of G3 global KV (default 72)")
      ->check(CLI::PositiveNumber);
  app.add_option("--g3-capacity-bytes", config.g3.capacity_bytes,
                 "G3 cap on stored value bytes (default 100 GiB)")
      ->check(CLI::PositiveNumber);
  app.add_option("--g1-capacity-bytes", config.g1.capacity_bytes,
                 "G1 host-arena block pool size (default 256 MiB; 0 disables G1)");
  app.add_option("--block-bytes", config.g1.block_bytes,
                 "G1 page size in bytes (default 56960 = 64 tokens x 890 B)")
      ->check(CLI::PositiveNumber);
  app.add_option("--min-free-bytes", config.g3.min_free_bytes,
                 "G3 refuses puts (and keeps serving gets) while its filesystem would keep less "
                 "than this free (default 256 MiB)");
  app.add_flag("--sync-writes", config.g3.sync_writes,
               "fsync the RocksDB WAL on every put (survives power loss, slower)");
  app.add_option("--sweep-interval-s", sweep_interval_s, "Seconds between TTL/capacity sweeps")
      ->check(CLI::PositiveNumber);
  app.add_option("--debug-put-delay-ms", service_options.debug_put_delay_ms,
                 "TEST ONLY: delay every put before storing it");
  std::string bulk = "ucx";
  std::string debug_bulk_fault = "none";
  int bulk_deadline_ms = 30000;
  epd::kvstore::BulkEndpointOptions bulk_options;
  app.add_option("--bulk", bulk, "Bulk value path: ucx (UCX endpoint, advertised by Hello) or off")
      ->check(CLI::IsMember({"ucx", "off"}));
  app.add_option("--ucx-net-devices", bulk_options.net_devices,
                 "UCX_NET_DEVICES of the bulk endpoint (default: environment)");
  app.add_flag("--ucx-listener", bulk_options.listener,
               "Bulk endpoint as a UCX TCP listener on --host (remote clients) instead of a "
               "worker address (shared memory on one host)");
  app.add_option("--bulk-deadline-ms", bulk_deadline_ms, "Deadline of one bulk transfer")
      ->check(CLI::PositiveNumber);
  app.add_option("--debug-bulk-fault", debug_bulk_fault,
                 "TEST ONLY: corrupt, truncate or delay (400 ms apart) every data chunk the "
                 "daemon sends for a bulk get")
      ->check(CLI::IsMember({"none", "corrupt", "truncate", "delay"}));
  CLI11_PARSE(app, argc, argv);
  signal(SIGPIPE, SIG_IGN);
  bulk_options.deadline = absl::Milliseconds(bulk_deadline_ms);
  bulk_options.listen_ip = runtime_options.host;
  if (debug_bulk_fault != "none") {
    epd::transfer::FaultPlan plan;
    plan.action = debug_bulk_fault == "corrupt"    ? epd::transfer::FaultPlan::Action::kCorrupt
                  : debug_bulk_fault == "truncate" ? epd::transfer::FaultPlan::Action::kTruncate
                                                   : epd::transfer::FaultPlan::Action::kDelay;
    plan.target = epd::transfer::FaultPlan::Target::kData;
    plan.nth = -1;
    plan.delay = absl::Milliseconds(400);  // kDelay: a slow link, chunks 400 ms apart
    plan.spaced = true;
    bulk_options.wrap_wire = [plan](std::unique_ptr<epd::transfer::Wire> inner) {
      return epd::transfer::MakeFaultWire(std::move(inner), plan);
    };
  }
  config.g2.ttl_ms = swa_ttl_ms > 0 ? swa_ttl_ms : swa_ttl_minutes * 60 * 1000;
  config.g3.ttl_ms = static_cast<int64_t>(global_ttl_hours * 3600.0 * 1000.0);

  epd::runtime::ProcessRuntime runtime("epd-kvstore", runtime_options);
  if (auto s = runtime.Start(); !s.ok()) {
    std::cerr << "epd-kvstore: " << s.message() << "\n";
    return 1;
  }
  // The UCX handshake and every gRPC call prove the cluster secret (docs/security.md).
  bulk_options.cluster_token = runtime.cluster_secret();
  service_options.cluster_secret = runtime.cluster_secret();
  auto store =
      epd::kvstore::KvStore::Open(config, epd::common::SystemClock::Get(), runtime.registry());
  if (!store.ok()) {
    spdlog::error("epd-kvstore: {}", std::string(store.status().message()));
    return 1;
  }
  std::unique_ptr<epd::kvstore::KvBulkEndpoint> bulk_endpoint;
  if (bulk == "ucx") {
    bulk_options.max_value_bytes = config.g3.max_value_bytes;
    auto ep = epd::kvstore::KvBulkEndpoint::Create(bulk_options, runtime.registry(),
                                                   epd::common::SystemClock::Get());
    if (!ep.ok()) {
      // Not fatal: Hello then advertises no bulk endpoint and clients send values inline.
      spdlog::error("epd-kvstore: no bulk (UCX) endpoint, values travel inline only: {}",
                    std::string(ep.status().message()));
    } else {
      bulk_endpoint = std::move(*ep);
      service_options.bulk = bulk_endpoint.get();
      spdlog::info("epd-kvstore: bulk (UCX) endpoint {}", bulk_endpoint->address().substr(0, 48));
    }
  }
  auto server =
      epd::kvstore::KvStoreServer::Start(**store, runtime_options.host, grpc_port, service_options);
  if (!server.ok()) {
    spdlog::error("epd-kvstore: {}", std::string(server.status().message()));
    return 1;
  }
  spdlog::info("epd-kvstore: gRPC on {}:{}, data dir {}", runtime_options.host, (*server)->port(),
               config.data_dir);
  runtime.PublishPort("grpc", (*server)->port());

  auto next_sweep = std::chrono::steady_clock::now() + std::chrono::seconds(sweep_interval_s);
  while (!epd::runtime::WaitForShutdown(std::chrono::milliseconds(500))) {
    if (std::chrono::steady_clock::now() >= next_sweep) {
      (*store)->Sweep();
      next_sweep = std::chrono::steady_clock::now() + std::chrono::seconds(sweep_interval_s);
    }
  }
  spdlog::info("epd-kvstore: shutdown requested, draining");
  (*server)->Shutdown(runtime_options.drain_timeout_ms);
  server->reset();
  bulk_endpoint.reset();  // fails transfers still in flight, frees their buffers
  spdlog::info("epd-kvstore: gRPC stopped, closing the store");
  store->reset();  // closes RocksDB cleanly
  spdlog::info("epd-kvstore: stopped");
  return 0;
}
