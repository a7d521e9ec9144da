#include "services/router/admission.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "services/router/router_core.h"

namespace epd::services::router {

absl::Status AdmissionOptions::Validate() const {
  if (max_running <= 0) return absl::InvalidArgumentError("max running requests must be > 0");
  if (max_queued < 0) return absl::InvalidArgumentError("max queued requests must be >= 0");
  if (retry_after_s <= 0) return absl::InvalidArgumentError("retry-after must be > 0 seconds");
  if (max_queue_wait_ms <= 0) return absl::InvalidArgumentError("max queue wait must be > 0 ms");
  return absl::OkStatus();
}

AdmissionQueue::Ticket::~Ticket() {
  if (queue_) queue_->Release();
}

AdmissionQueue::Ticket& AdmissionQueue::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    if (queue_) queue_->Release();
    queue_ = std::exchange(other.queue_, nullptr);
  }
  return *this;
}

AdmissionQueue::AdmissionQueue(AdmissionOptions options, prometheus::Registry& metrics)
    : options_(std::move(options)),
      refusals_(prometheus::BuildCounter()
                    .Name("epd_router_overload_rejections_total")
                    .Help("Requests refused because the admission queue was full (429 / "
                          "RESOURCE_EXHAUSTED), by api")
                    .Register(metrics)),
      running_gauge_(prometheus::BuildGauge()
                         .Name("epd_router_admission_running")
                         .Help("Requests holding a running slot of the admission queue")
                         .Register(metrics)
                         .Add({})),
      queued_gauge_(prometheus::BuildGauge()
                        .Name("epd_router_admission_queued")
                        .Help("Requests waiting in the admission queue for a running slot")
                        .Register(metrics)
                        .Add({})) {
  for (const char* api : {"http", "grpc"}) refusals_.Add({{"api", api}});
}

absl::Status AdmissionQueue::Refuse(const std::string& api, const std::string& why) {
  refusals_.Add({{"api", api}}).Increment();
  return ApiError(absl::StatusCode::kResourceExhausted,
                  absl::StrCat("The server is overloaded (", why, "); retry after ",
                               options_.retry_after_s, " s"),
                  "", "overloaded");
}

absl::StatusOr<AdmissionQueue::Ticket> AdmissionQueue::Admit(const std::string& api) {
  absl::MutexLock lock(&mu_);
  if (running_ < options_.max_running && waiters_.empty()) {
    ++running_;
    running_gauge_.Set(running_);
    return Ticket(this);
  }
  if (static_cast<int>(waiters_.size()) >= options_.max_queued) {
    return Refuse(api, absl::StrCat(running_, " running, ", waiters_.size(), " queued"));
  }
  Waiter me;
  auto it = waiters_.insert(waiters_.end(), &me);
  queued_gauge_.Set(static_cast<double>(waiters_.size()));
  if (!mu_.AwaitWithTimeout(absl::Condition(&me.granted),
                            absl::Milliseconds(options_.max_queue_wait_ms))) {
    waiters_.erase(it);
    queued_gauge_.Set(static_cast<double>(waiters_.size()));
    return Refuse(api, absl::StrCat("waited ", options_.max_queue_wait_ms, " ms in the queue"));
  }
  // Release() handed its slot over (running_ unchanged) and removed us from waiters_.
  return Ticket(this);
}

void AdmissionQueue::Release() {
  absl::MutexLock lock(&mu_);
  if (!waiters_.empty()) {
    waiters_.front()->granted = true;  // the slot passes to the oldest waiter
    waiters_.pop_front();
    queued_gauge_.Set(static_cast<double>(waiters_.size()));
    return;
  }
  --running_;
  running_gauge_.Set(running_);
}

int AdmissionQueue::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int AdmissionQueue::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiters_.size());
}

}  // namespace epd::services::router
