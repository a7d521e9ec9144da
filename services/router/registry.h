#pragma once

// The router's table of live workers: registration, heartbeats with load figures, expiry after
// missed heartbeats, failure marking, and the config-fingerprint pairing rule. Also exports
// epd_router_workers{pool} and epd_router_queue_depth{pool}.
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace epd::services::router {

enum class PoolKind { kEncoder = 0, kPrefill = 1, kDecode = 2 };
inline constexpr int kNumPools = 3;
const char* PoolName(PoolKind pool);  // "encoder" | "prefill" | "decode"

struct WorkerLoad {
  int32_t queue_depth = 0;
  int64_t free_kv_blocks = 0;
  int32_t batch_size = 0;
  int32_t running_requests = 0;
};

struct WorkerInfo {
  std::string id;
  PoolKind pool = PoolKind::kDecode;
  std::string control_address;   // host:port of WorkerControl
  std::string transfer_address;  // opaque, handed to the previous stage
  std::string fingerprint;
  std::string model;              // informational: one router serves one model (docs/router.md)
  WorkerLoad load;
  int32_t router_inflight = 0;   // jobs the router has sent and not seen finish
  int64_t last_heartbeat_ms = 0;
  bool draining = false;
};

struct RegistryOptions {
  int heartbeat_interval_ms = 1000;  // Default: 1 s between heartbeats
  int heartbeat_miss_limit = 3;      // Default: forget a worker after 3 missed heartbeats
  absl::Status Validate() const;
};

// Thread-safe: every method may be called from any thread.
class Registry {
 public:
  Registry(RegistryOptions options, const common::Clock& clock, prometheus::Registry& metrics);

  // Adds or replaces a worker. FailedPrecondition when its fingerprint differs from the one the
  // live workers (of any pool) share; InvalidArgument for missing fields. Every refusal is
  // logged and kept for /health (RecentRefusals).
  absl::Status Register(const WorkerInfo& worker);
  // Records a heartbeat; false when the worker is unknown (expired or never registered) or its
  // fingerprint changed, meaning: register again.
  bool Heartbeat(const std::string& worker_id, const std::string& fingerprint,
                 const WorkerLoad& load, bool draining);
  // Removes workers whose last heartbeat is older than interval * miss_limit; returns their ids.
  std::vector<std::string> ExpireStale();
  // Removes a worker the router saw fail (transport error); it must register again.
  void MarkFailed(const std::string& worker_id, const std::string& reason);

  // Least-loaded live, non-draining worker of `pool`; workers in `preferred` win ties and a
  // small load difference (prefix locality). Increments its router_inflight.
  std::optional<WorkerInfo> Pick(PoolKind pool, const std::vector<std::string>& preferred = {});
  // Undo of Pick's accounting when the job ends.
  void Release(const std::string& worker_id);

  std::vector<WorkerInfo> Workers(PoolKind pool) const;
  int Count(PoolKind pool) const;
  // The fingerprint the live workers share; empty when none is registered.
  std::string Fingerprint() const;
  std::vector<std::string> RecentRefusals() const;  // newest last, at most 16
  const RegistryOptions& options() const { return options_; }

 private:
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefuseLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveLocked(const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RegistryOptions options_;
  const common::Clock& clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, WorkerInfo> workers_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> refusals_ ABSL_GUARDED_BY(mu_);
  uint64_t pick_counter_ ABSL_GUARDED_BY(mu_) = 0;

  prometheus::Gauge* workers_gauge_[kNumPools];
  prometheus::Gauge* queue_gauge_[kNumPools];
  prometheus::Family<prometheus::Counter>& registrations_;
  prometheus::Counter& expired_;
  prometheus::Counter& failed_;
};

}  // namespace epd::services::router
