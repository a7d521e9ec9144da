#include "services/router/registry.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace epd::services::router {

const char* PoolName(PoolKind pool) {
  switch (pool) {
    case PoolKind::kEncoder:
      return "encoder";
    case PoolKind::kPrefill:
      return "prefill";
    case PoolKind::kDecode:
      return "decode";
  }
  return "unknown";
}

absl::Status RegistryOptions::Validate() const {
  if (heartbeat_interval_ms <= 0) {
    return absl::InvalidArgumentError("heartbeat interval must be > 0 ms");
  }
  if (heartbeat_miss_limit <= 0) return absl::InvalidArgumentError("miss limit must be > 0");
  return absl::OkStatus();
}

Registry::Registry(RegistryOptions options, const common::Clock& clock,
                   prometheus::Registry& metrics)
    : options_(std::move(options)),
      clock_(clock),
      registrations_(prometheus::BuildCounter()
                         .Name("epd_router_registrations_total")
                         .Help("Worker registrations by outcome")
                         .Register(metrics)),
      expired_(prometheus::BuildCounter()
                   .Name("epd_router_worker_expiries_total")
                   .Help("Workers forgotten after missed heartbeats")
                   .Register(metrics)
                   .Add({})),
      failed_(prometheus::BuildCounter()
                  .Name("epd_router_worker_failures_total")
                  .Help("Workers removed after a transport failure seen by the router")
                  .Register(metrics)
                  .Add({})) {
  auto& workers = prometheus::BuildGauge()
                      .Name("epd_router_workers")
                      .Help("Live registered workers per pool")
                      .Register(metrics);
  auto& queue = prometheus::BuildGauge()
                    .Name("epd_router_queue_depth")
                    .Help(
                        "Queued requests per pool, summed over the workers' last heartbeats "
                        "(the workers' own figure is epd_queue_depth; one name for both "
                        "double-counted every pool)")
                    .Register(metrics);
  for (int p = 0; p < kNumPools; ++p) {
    const char* name = PoolName(static_cast<PoolKind>(p));
    workers_gauge_[p] = &workers.Add({{"pool", name}});
    queue_gauge_[p] = &queue.Add({{"pool", name}});
  }
  for (const char* outcome : {"accepted", "fingerprint_mismatch", "invalid"}) {
    registrations_.Add({{"outcome", outcome}});
  }
}

void Registry::RefuseLocked(const std::string& reason) {
  spdlog::warn("registry: refused worker: {}", reason);
  refusals_.push_back(reason);
  while (refusals_.size() > 16) refusals_.pop_front();
}

absl::Status Registry::Register(const WorkerInfo& worker) {
  absl::MutexLock lock(&mu_);
  if (worker.id.empty() || worker.control_address.empty() || worker.fingerprint.empty()) {
    const std::string reason = absl::StrCat(
        "worker '", worker.id, "': id, control address and config fingerprint are required");
    RefuseLocked(reason);
    registrations_.Add({{"outcome", "invalid"}}).Increment();
    return absl::InvalidArgumentError(reason);
  }
  for (const auto& [id, w] : workers_) {
    if (id == worker.id || w.fingerprint == worker.fingerprint) continue;
    const std::string reason = absl::StrCat(
        "worker '", worker.id, "' (", PoolName(worker.pool), ", model '", worker.model,
        "') has config fingerprint ", worker.fingerprint, " but live ", PoolName(w.pool),
        " worker '", w.id, "' (model '", w.model, "') has ", w.fingerprint,
        "; workers with different fingerprints are never paired");
    RefuseLocked(reason);
    registrations_.Add({{"outcome", "fingerprint_mismatch"}}).Increment();
    return absl::FailedPreconditionError(reason);
  }
  WorkerInfo w = worker;
  w.last_heartbeat_ms = clock_.NowUnixMs();
  w.router_inflight = 0;
  if (auto it = workers_.find(w.id); it != workers_.end()) w.router_inflight = it->second.router_inflight;
  spdlog::info("registry: {} worker '{}' at {} (model {}, fingerprint {})", PoolName(w.pool), w.id,
               w.control_address, w.model, w.fingerprint);
  workers_[w.id] = std::move(w);
  registrations_.Add({{"outcome", "accepted"}}).Increment();
  UpdateGaugesLocked();
  return absl::OkStatus();
}

bool Registry::Heartbeat(const std::string& worker_id, const std::string& fingerprint,
                         const WorkerLoad& load, bool draining) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  if (!fingerprint.empty() && fingerprint != it->second.fingerprint) {
    // A worker that changed config must go through Register's pairing check again.
    RemoveLocked(worker_id);
    UpdateGaugesLocked();
    return false;
  }
  it->second.load = load;
  it->second.draining = draining;
  it->second.last_heartbeat_ms = clock_.NowUnixMs();
  UpdateGaugesLocked();
  return true;
}

std::vector<std::string> Registry::ExpireStale() {
  absl::MutexLock lock(&mu_);
  const int64_t now = clock_.NowUnixMs();
  const int64_t limit =
      static_cast<int64_t>(options_.heartbeat_interval_ms) * options_.heartbeat_miss_limit;
  std::vector<std::string> expired;
  for (const auto& [id, w] : workers_) {
    if (now - w.last_heartbeat_ms > limit) expired.push_back(id);
  }
  for (const auto& id : expired) {
    spdlog::warn("registry: worker '{}' missed {} heartbeats; removed", id,
                 options_.heartbeat_miss_limit);
    RemoveLocked(id);
    expired_.Increment();
  }
  if (!expired.empty()) UpdateGaugesLocked();
  return expired;
}

void Registry::MarkFailed(const std::string& worker_id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (!workers_.contains(worker_id)) return;
  spdlog::warn("registry: worker '{}' failed ({}); no longer routed to", worker_id, reason);
  RemoveLocked(worker_id);
  failed_.Increment();
  UpdateGaugesLocked();
}

void Registry::RemoveLocked(const std::string& worker_id) { workers_.erase(worker_id); }

std::optional<WorkerInfo> Registry::Pick(PoolKind pool,
                                         const std::vector<std::string>& preferred) {
  absl::MutexLock lock(&mu_);
  // Load = what the worker reported, or what the router knows it sent since, if larger
  // (heartbeats lag behind dispatch).
  const auto load_of = [](const WorkerInfo& w) -> int64_t {
    return std::max<int64_t>(w.load.queue_depth + w.load.running_requests, w.router_inflight);
  };
  WorkerInfo* best = nullptr;
  int64_t best_score = 0;
  std::vector<WorkerInfo*> candidates;
  for (auto& [id, w] : workers_) {
    if (w.pool != pool || w.draining) continue;
    candidates.push_back(&w);
  }
  if (candidates.empty()) return std::nullopt;
  // Deterministic order, rotated by a counter so equal loads share work.
  std::sort(candidates.begin(), candidates.end(),
            [](const WorkerInfo* a, const WorkerInfo* b) { return a->id < b->id; });
  const size_t start = pick_counter_++ % candidates.size();
  for (size_t k = 0; k < candidates.size(); ++k) {
    WorkerInfo* w = candidates[(start + k) % candidates.size()];
    // A worker holding the prefix is worth up to 2 queued requests.
    const bool pref = std::find(preferred.begin(), preferred.end(), w->id) != preferred.end();
    const int64_t score = load_of(*w) * 4 - (pref ? 8 : 0);
    if (best == nullptr || score < best_score ||
        (score == best_score && w->load.free_kv_blocks > best->load.free_kv_blocks)) {
      best = w;
      best_score = score;
    }
  }
  ++best->router_inflight;
  return *best;
}

void Registry::Release(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end() && it->second.router_inflight > 0) --it->second.router_inflight;
}

std::vector<WorkerInfo> Registry::Workers(PoolKind pool) const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerInfo> out;
  for (const auto& [id, w] : workers_) {
    if (w.pool == pool) out.push_back(w);
  }
  std::sort(out.begin(), out.end(),
            [](const WorkerInfo& a, const WorkerInfo& b) { return a.id < b.id; });
  return out;
}

int Registry::Count(PoolKind pool) const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, w] : workers_) n += w.pool == pool;
  return n;
}

std::string Registry::Fingerprint() const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, w] : workers_) return w.fingerprint;
  return "";
}

std::vector<std::string> Registry::RecentRefusals() const {
  absl::MutexLock lock(&mu_);
  return {refusals_.begin(), refusals_.end()};
}

void Registry::UpdateGaugesLocked() {
  int count[kNumPools] = {0, 0, 0};
  int64_t queue[kNumPools] = {0, 0, 0};
  for (const auto& [id, w] : workers_) {
    const int p = static_cast<int>(w.pool);
    ++count[p];
    queue[p] += w.load.queue_depth;
  }
  for (int p = 0; p < kNumPools; ++p) {
    workers_gauge_[p]->Set(count[p]);
    queue_gauge_[p]->Set(static_cast<double>(queue[p]));
  }
}

}  // namespace epd::services::router
