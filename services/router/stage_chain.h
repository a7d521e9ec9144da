#pragma once

// Chain building and stage watching for one attempt of a request (RouterCore::RunAttempt):
// BuildChain wires the encoder -> prefill -> decode jobs; SideStages watches the encoder and
// prefill streams until each hands off.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "epd/v1/worker.pb.h"
#include "services/router/dispatch.h"
#include "services/router/registry.h"
#include "services/router/scheduler.h"
#include "services/router/watch_pool.h"

namespace epd::services::router {

struct StageJob {
  WorkerInfo worker;
  epd::v1::Job job;
};

// The plan's stages in order (encoder, prefill, decode; absent pools skipped), each job a copy
// of `base` with its stage, final flag and neighbours' worker ids and transfer addresses.
std::vector<StageJob> BuildChain(const epd::v1::Job& base, const Plan& plan);

// The status of a stage's error message `m` (m.error() non-empty), its message prefixed with
// `who`: Unavailable when the worker reported the failure as UNAVAILABLE (m.error_code(): a
// hand-off whose peer was gone, a transport that failed), which the router may retry elsewhere;
// Internal otherwise (a property of the request, not of the cluster).
absl::Status StageError(const epd::v1::SubmitResponse& m, const std::string& who);

// The side (non-final) stages of one attempt. Start submits them (last first: a stage waits for
// its inbound hand-off keyed by request_id) and reads each stream on a thread of `watchers`
// (which must outlive this; no thread is made per stage). A stage that
// reports an error, or whose stream fails before it handed off, records error() and calls
// `on_failure` (the owner cancels the decode stream); a worker found unreachable is marked failed
// in the registry and forgotten by the client. What happens after a stage handed off is not a
// failure of the request. Thread-safe; Stop must be called before destruction.
class SideStages {
 public:
  SideStages(WorkerClient& client, Registry& registry, WatchPool& watchers,
             std::vector<StageJob> stages, std::function<void()> on_failure,
             std::function<void(const std::string& worker_id)> on_handoff);
  ~SideStages();

  void Start();
  // Cancels every stream (a no-op for a stage that already handed off).
  void CancelAll();
  // Ignores failures from now on, cancels every stream and waits until each watcher is done.
  // Idempotent.
  void Stop();

  // The first failure before a hand-off (OK if none). Unavailable when a worker was unreachable
  // or died: the request may be retried elsewhere.
  absl::Status error() const;
  // The prefix the encoder reported it reused (docs/workers.md), if it did.
  std::optional<int32_t> encoder_cached() const;

 private:
  struct Stage {
    StageJob stage;
    std::unique_ptr<JobStream> stream;
    absl::Notification watched;  // its watcher returned
  };
  void Watch(Stage* s);

  WorkerClient& client_;
  Registry& registry_;
  WatchPool& watchers_;
  const std::function<void()> on_failure_;
  const std::function<void(const std::string&)> on_handoff_;
  std::vector<std::unique_ptr<Stage>> stages_;
  bool started_ = false;  // owner thread only
  bool stopped_ = false;  // owner thread only
  mutable absl::Mutex mu_;
  bool ignore_failures_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::optional<int32_t> encoder_cached_ ABSL_GUARDED_BY(mu_);
};

}  // namespace epd::services::router
