#pragma once

// The UCX Wire (UCX 1.13 UCP, active messages). Large chunks go by UCX rendezvous straight into
// the receiver's buffer (shared memory: CMA/posix get; TCP: pipelined). One progress thread owns
// the UCP worker; everything else talks to it through a command queue.
//
// Connection modes:
//  - kListener: a ucp_listener on listen_ip:port; peers connect by sockaddr. UCX 1.13 then moves
//    the bytes over TCP even on one host. Address: "ucx+tcp://IP:PORT".
//  - kWorkerAddress: the worker address blob is exchanged out of band (here: inside our address
//    string; in production over the gRPC control plane). Same-host peers get shared memory.
//    Address: "ucx+addr:<hex>".
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "transfer/transfer_engine.h"
#include "transfer/wire.h"

namespace epd::transfer {

// UcxOptions::spin's default spins only on hosts with more cores than this.
inline constexpr unsigned kSpinMinCores = 4;

struct UcxOptions {
  enum class Mode { kListener, kWorkerAddress };
  Mode mode = Mode::kWorkerAddress;     // Default: worker-address exchange (shm on one host)
  std::string listen_ip = "127.0.0.1";  // kListener. Default: 127.0.0.1
  int listen_port = 0;                  // kListener; 0 = any. Default: 0
  std::string tls;                      // UCX_TLS for this context; empty = environment/UCX default
  std::string net_devices;  // UCX_NET_DEVICES; empty = environment/UCX default (use "lo" in tests)
  // How often UCX probes idle peers. Default: 1 s.
  absl::Duration keepalive = absl::Seconds(1);
  // UCP_ERR_HANDLING_MODE_PEER on every endpoint. UCX 1.13's sysv/posix transports have no peer
  // failure handler, so with it on, same-host peers fall back to TCP; with it off they get shared
  // memory and peer death is caught by the engine (pid liveness for same-host peers, deadlines
  // otherwise). Default: on for kListener, off for kWorkerAddress (see docs/transfer.md).
  std::optional<bool> peer_error_handling;
  // The progress thread spins this long after UCX last made progress, then sleeps until an event
  // (event_wakeup) or naps (50 us while operations are in flight, 500 us when idle). A spin saves
  // a wake-up only where the thread has a core to itself; on a small host it takes the core the
  // other side's copy and the hashing threads need. Unset (the default): 200 us on hosts with more
  // than kSpinMinCores cores, 0 on smaller ones (the 2-core dev VM: 1 MiB shm hand-off 1.29 ->
  // 0.86 ms, 256 MiB shm 3.9 -> 5.1 GiB/s, medians of three transfer_bench runs; docs/transfer.md).
  std::optional<absl::Duration> spin;
  // After the spin, sleep in poll() on UCX's event fd (UCP_FEATURE_WAKEUP) and a command eventfd
  // instead of napping: a message or a posted command wakes the thread at once. Default: on.
  bool event_wakeup = true;
};

// The progress thread's spin under `options` on this host (UcxOptions::spin or its default).
absl::Duration EffectiveSpin(const UcxOptions& options);

std::unique_ptr<Wire> MakeUcxWire(const UcxOptions& options);

// A KvTransport over UCX: MakeUcxWire + TransferEngine.
absl::StatusOr<std::unique_ptr<TransferEngine>> MakeUcxTransport(const UcxOptions& ucx,
                                                                 const EngineOptions& engine,
                                                                 prometheus::Registry& registry,
                                                                 const common::Clock& clock);

struct SelfTestResult {
  TransportKind transport = TransportKind::kTcp;
  double bytes_per_second = 0;
  uint64_t bytes = 0;
};

// Startup self-test: moves `bytes` between two UCX transports of this process built with
// `ucx` and reports the bandwidth and the transport UCX chose. Logs spdlog::warn loudly when only
// TCP is available, and sets epd_transfer_selftest_bandwidth_bytes_per_second{transport}.
absl::StatusOr<SelfTestResult> RunBandwidthSelfTest(const UcxOptions& ucx, uint64_t bytes,
                                                    prometheus::Registry& registry);

}  // namespace epd::transfer
