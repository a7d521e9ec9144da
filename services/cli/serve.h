#pragma once

// `epd serve`: the all-in-one launcher. Starts epd-kvstore, epd-router and N/M/K encoder, prefill
// and decode workers on one host, prints the endpoint, and stops
// everything (SIGTERM, then SIGKILL after a grace period) on Ctrl-C or SIGTERM. Every child
// (workers, the router and the kvstore) is restarted with a backoff and a restart budget, and
// gets PR_SET_PDEATHSIG so none outlives a launcher that is SIGKILLed.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace CLI {
class App;
}

namespace epd::services {

// The largest fixed DSpark k `epd serve --dspark-k` takes (the decode worker's max_k, the nano
// model's DSpark block of 5 drafts).
inline constexpr int kMaxDSparkK = 5;

struct ServeOptions {
  std::string model_dir;           // Default: <data_dir>/models/nano, generated on first start
  std::string data_dir = "./data"; // Default: ./data (kvstore RocksDB, logs, generated model)
  std::string host = "127.0.0.1";  // Default: loopback
  int http_port = 8000;            // Default: 8000 (OpenAI API)
  int grpc_port = 50051;           // Default: 50051 (epd.v1.Inference and worker registry)
  int encoders = 1;                // Default: 1 per pool
  int prefills = 1;
  int decodes = 1;
  int swa_ttl_minutes = 10;        // Default: 10 minutes for the host-DRAM SWA pool
  int global_ttl_hours = 72;       // Default: 72 hours for global KV on SSD
  std::string api_key;             // Default: none (no auth). Reaches the router by its environment
  std::string api_key_file;        // Default: none. The API key from a file (or $EPD_API_KEY)
  std::string cluster_secret_file; // Default: none: $EPD_CLUSTER_SECRET[_FILE], else a fresh one
  std::string config_file;         // Optional JSON file with the same keys (flags win)
  std::string log_level = "info";
  std::string dspark = "on";       // Default: on. DSpark speculative decoding in every worker
  int dspark_k = -1;               // Default: -1 = the k policy; 0..kMaxDSparkK = fixed k
  std::string device = "cpu";      // Default: cpu. The workers' backend: cpu, cuda (spread over
                                   // every visible GPU, round-robin) or cuda:N (all on N)
  std::string step_graphs = "on";  // Default: on. Decode step graphs (docs/cuda.md) on|off
  std::string tls_cert;            // Default: none. PEM files: the router's HTTP and gRPC ports
  std::string tls_key;             // speak TLS; workers register on a plaintext internal port
  // Supervision (docs/serve.md): a process that exits is restarted after a backoff that doubles
  // from restart_backoff_ms (up to 16x) and resets once it stayed up restart_window_s; more than
  // max_restarts restarts within restart_window_s stop epd serve (exit 1) when the process is the
  // kvstore or the router, and park a worker for restart_window_s (its pool serves without it,
  // then it is tried again).
  int max_restarts = 5;            // Default: 5 per window
  int restart_window_s = 60;       // Default: 60 s
  int restart_backoff_ms = 500;    // Default: 0.5 s
  int migration_limit = 1;         // Default: 1. Router --migration-limit (docs/router.md)
  // Default: 32768. Router --context-length: prompt + completion tokens per request; sized so
  // `epd bench` with its defaults (4 turns of ~1024 tool tokens) fits (docs/demo.md).
  int context_length = 32768;
  // One worker in its own network namespace (the chaos campaign's network cut, docs/chaos.md):
  // "NAME:NETNS:ADDR" runs worker NAME (e.g. epd-decode-1) under `ip netns exec NETNS`, bound to
  // 0.0.0.0 and advertising ADDR, with UCX on TCP over the namespace's eth0. `host` must then be
  // an address reachable from the namespace. Default: none.
  std::string worker_netns;
  int64_t kv_pool_bytes = 0;       // Default: 0 = the decode worker's default (a quarter of the
                                   // host memory). Decode workers' --kv-pool-bytes
  // "POOL=PATH" (pool encoder, prefill or decode): the pool's workers run the binary PATH (a bare
  // name: beside `epd`) instead of epd-POOL beside `epd`, e.g. a worker built elsewhere or a
  // wrapper script; tests run the workers built against the emulated CUDA runtime so.
  // Default: none.
  std::vector<std::string> worker_binaries;
};

void AddServeFlags(CLI::App& app, ServeOptions* options);

// Fills options from --config (a JSON object with keys model, data_dir, http_port, grpc_port,
// encoders, prefills, decodes, context_length, swa_ttl_minutes, global_ttl_hours, api_key, api_key_file,
// dspark, dspark_k, device, tls_cert, tls_key); flags given on the command line win.
absl::Status ApplyServeConfigFile(const CLI::App& serve_command, ServeOptions* options);

// Runs until interrupted. Returns the process exit code.
int RunServe(ServeOptions options);

}  // namespace epd::services
