#pragma once

// The shell every worker process shares (docs/workers.md): flags, model load, the UCX transfer
// engine, the WorkerControl gRPC server dispatching jobs to a per-pool JobHandler, registration
// and heartbeats with the router, and drain on SIGTERM.
//
// Threading: gRPC runs each Submit on its own thread; a JobHandler must be thread-safe.
#include <CLI/CLI.hpp>
#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "epd/v1/worker.grpc.pb.h"
#include "transfer/kv_transport.h"
#include "model/model.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "runtime/worker/handoff.h"

namespace epd::worker {

// Sends one stream message; false when the router's stream is gone.
using Emit = std::function<bool(const epd::v1::SubmitResponse&)>;

class JobHandler {
 public:
  virtual ~JobHandler() = default;
  // Runs one job to its end. A non-OK status is sent to the router as SubmitResponse.error.
  // `cancelled` turns true on Cancel, a dropped stream, or a drain past its deadline.
  virtual absl::Status Run(const epd::v1::Job& job, const Emit& emit,
                           const std::atomic<bool>& cancelled) = 0;
};

// What a handler gets from the shell. Everything outlives the handler.
struct WorkerSetup {
  epd::v1::Pool pool = epd::v1::POOL_UNSPECIFIED;
  std::string pool_label;  // "encoder" | "prefill" | "decode"
  const model::Model* model = nullptr;
  std::string model_dir;  // --model (the decode worker reads tokenizer.json for grammar masks)
  HandoffPeer* handoff = nullptr;
  std::string fingerprint;
  std::string kvstore;  // kvstore gRPC address(es), comma-separated (may be empty)
  // Values of at least kvstore_bulk_min_bytes move over UCX (--kvstore-bulk ucx, the default), this
  // worker's UCX listener bound to advertise_address; else inline gRPC.
  bool kvstore_bulk_ucx = false;
  uint64_t kvstore_bulk_min_bytes = 64 << 10;
  std::string advertise_address;  // --advertise-address (else --host)
  std::string ucx_net_devices;    // --ucx-net-devices (empty: environment)
  std::string cluster_token;      // the cluster secret (docs/security.md)
  bool dspark = true;  // --dspark on|off: DSpark state in hand-offs, draft + verify in decode
  prometheus::Registry* registry = nullptr;
  prometheus::Gauge* batch_size = nullptr;  // epd_batch_size{pool}
  int handoff_deadline_ms = 30000;
};

// Every pool's handler checks this before it works on a job: a job that carries a config
// fingerprint was built for this worker's (model, cache layout, DSpark setting), else
// FailedPrecondition naming both.
absl::Status CheckJobFingerprint(const epd::v1::Job& job, const std::string& fingerprint);

// The last message of a job whose state went on to the next stage (encoder, prefill): its
// finish_reason "handoff".
void EmitHandoffDone(const Emit& emit, const std::string& request_id);

using HandlerFactory =
    std::function<absl::StatusOr<std::unique_ptr<JobHandler>>(const WorkerSetup&)>;

// Adds a pool's own flags to the shared ones (they show in --help and are parsed with them).
using FlagAdder = std::function<void(CLI::App&)>;

// The exit code of a worker whose GPU was lost (kernels::DeviceLost).
inline constexpr int kExitDeviceLost = 4;

// Runs a worker process; returns the exit code (0 after SIGTERM, 3 when the router refuses the
// registration, 1 on setup errors, kExitDeviceLost when its GPU's context became unusable).
// `add_flags` (optional) runs before parsing; the factory runs after it.
int RunWorkerMain(int argc, char** argv, epd::v1::Pool pool, const HandlerFactory& factory,
                  const FlagAdder& add_flags = nullptr);

// The fingerprint of a model directory: canonical config.json + cache layout + DSpark on/off
// (model/fingerprint.h, the same value the router and the kvstore keys use).
absl::StatusOr<std::string> ModelFingerprint(const std::string& model_dir, bool dspark);

}  // namespace epd::worker
