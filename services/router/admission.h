#pragma once

// Bounded admission in front of RouterCore::Run: at most `max_running` requests run at once and
// at most `max_queued` wait (FIFO) for a running slot. A request beyond both is refused at once
// with ResourceExhausted (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED), so latency stays
// bounded under overload instead of growing with an unbounded backlog (docs/router.md, Overload).
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace epd::services::router {

struct AdmissionOptions {
  int max_running = 256;    // Default: requests dispatched through the router at once
  int max_queued = 128;     // Default: requests waiting for a running slot (0 = no queue)
  int retry_after_s = 1;    // Default: the Retry-After (seconds) told to refused clients
  int64_t max_queue_wait_ms = 60000;  // Default: a queued request gives up (429) after this
  absl::Status Validate() const;
};

// Thread-safe. Tickets may be released on any thread; the queue must outlive them.
class AdmissionQueue {
 public:
  // Holds one running slot until destroyed.
  class Ticket {
   public:
    Ticket() = default;
    ~Ticket();
    Ticket(Ticket&& other) noexcept : queue_(std::exchange(other.queue_, nullptr)) {}
    Ticket& operator=(Ticket&& other) noexcept;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

   private:
    friend class AdmissionQueue;
    explicit Ticket(AdmissionQueue* q) : queue_(q) {}
    AdmissionQueue* queue_ = nullptr;
  };

  AdmissionQueue(AdmissionOptions options, prometheus::Registry& metrics);

  // Returns a ticket once a running slot is free (waiting in the queue if needed), or at once
  // ApiError(ResourceExhausted, code "overloaded") when the queue is full; also after waiting
  // max_queue_wait_ms. `api` ("http" | "grpc") labels the refusal counter.
  absl::StatusOr<Ticket> Admit(const std::string& api);

  const AdmissionOptions& options() const { return options_; }
  int running() const;
  int queued() const;

 private:
  struct Waiter {
    bool granted = false;
  };
  void Release();
  absl::Status Refuse(const std::string& api, const std::string& why);

  const AdmissionOptions options_;
  mutable absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<Waiter*> waiters_ ABSL_GUARDED_BY(mu_);  // FIFO

  prometheus::Family<prometheus::Counter>& refusals_;
  prometheus::Gauge& running_gauge_;
  prometheus::Gauge& queued_gauge_;
};

}  // namespace epd::services::router
