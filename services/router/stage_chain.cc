#include "services/router/stage_chain.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace epd::services::router {

std::vector<StageJob> BuildChain(const epd::v1::Job& base, const Plan& plan) {
  std::vector<StageJob> chain;
  if (plan.encoder) chain.push_back({*plan.encoder, base});
  if (plan.prefill) chain.push_back({*plan.prefill, base});
  chain.push_back({plan.decode, base});
  for (size_t i = 0; i < chain.size(); ++i) {
    epd::v1::Job& job = chain[i].job;
    switch (chain[i].worker.pool) {
      case PoolKind::kEncoder:
        job.set_stage(epd::v1::POOL_ENCODER);
        break;
      case PoolKind::kPrefill:
        job.set_stage(epd::v1::POOL_PREFILL);
        break;
      case PoolKind::kDecode:
        job.set_stage(epd::v1::POOL_DECODE);
        break;
    }
    job.set_final_stage(i + 1 == chain.size());
    if (i > 0) {
      job.set_prev_worker_id(chain[i - 1].worker.id);
      job.set_prev_transfer_address(chain[i - 1].worker.transfer_address);
    }
    if (i + 1 < chain.size()) {
      job.set_next_worker_id(chain[i + 1].worker.id);
      job.set_next_transfer_address(chain[i + 1].worker.transfer_address);
    }
  }
  return chain;
}

absl::Status StageError(const epd::v1::SubmitResponse& m, const std::string& who) {
  std::string message = absl::StrCat(who, " failed: ", m.error());
  if (m.error_code() == absl::StatusCodeToString(absl::StatusCode::kUnavailable)) {
    return absl::UnavailableError(std::move(message));
  }
  return absl::InternalError(std::move(message));
}

SideStages::SideStages(WorkerClient& client, Registry& registry, WatchPool& watchers,
                       std::vector<StageJob> stages, std::function<void()> on_failure,
                       std::function<void(const std::string&)> on_handoff)
    : client_(client),
      registry_(registry),
      watchers_(watchers),
      on_failure_(std::move(on_failure)),
      on_handoff_(std::move(on_handoff)) {
  for (auto& s : stages) {
    auto stage = std::make_unique<Stage>();
    stage->stage = std::move(s);
    stages_.push_back(std::move(stage));
  }
}

SideStages::~SideStages() { Stop(); }

void SideStages::Start() {
  for (size_t i = stages_.size(); i-- > 0;) {
    stages_[i]->stream = client_.Submit(stages_[i]->stage.worker, stages_[i]->stage.job);
  }
  started_ = true;
  for (auto& s : stages_) {
    watchers_.Run([this, p = s.get()] {
      Watch(p);
      p->watched.Notify();  // the last touch of this object: Stop may return and free it
    });
  }
}

void SideStages::Watch(Stage* s) {
  const WorkerInfo& w = s->stage.worker;
  epd::v1::SubmitResponse m;
  absl::Status st;
  bool handed_off = false;
  while (s->stream->Read(&m)) {
    if (!m.error().empty() && !handed_off) {
      st = StageError(m, absl::StrCat(PoolName(w.pool), " worker '", w.id, "'"));
    }
    if (w.pool == PoolKind::kEncoder && m.has_cached_tokens()) {
      absl::MutexLock lock(&mu_);
      encoder_cached_ = m.cached_tokens();
    }
    if (m.finish_reason() == "handoff" && !handed_off) {
      handed_off = true;
      on_handoff_(w.id);
    }
  }
  const absl::Status fin = s->stream->Finish();
  absl::MutexLock lock(&mu_);
  if (ignore_failures_) return;
  if (handed_off) {
    // The next stage has the request: a worker that dies now costs this request nothing.
    if (!fin.ok()) {
      spdlog::debug("{} worker '{}' stream ended after its hand-off: {}", PoolName(w.pool), w.id,
                    std::string(fin.message()));
    }
    return;
  }
  if (st.ok() && !fin.ok()) {
    st = absl::Status(
        fin.code(), absl::StrCat(PoolName(w.pool), " worker '", w.id, "' failed: ", fin.message()));
    if (fin.code() == absl::StatusCode::kUnavailable) {
      registry_.MarkFailed(w.id, std::string(fin.message()));
      client_.Forget(w);
    }
  }
  if (st.ok()) {
    st = absl::InternalError(
        absl::StrCat(PoolName(w.pool), " worker '", w.id, "' ended its stream without a hand-off"));
  }
  if (error_.ok()) error_ = st;
  on_failure_();
}

void SideStages::CancelAll() {
  for (auto& s : stages_) {
    if (s->stream) s->stream->Cancel();
  }
}

void SideStages::Stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    absl::MutexLock lock(&mu_);
    ignore_failures_ = true;
  }
  CancelAll();
  if (!started_) return;
  for (auto& s : stages_) s->watched.WaitForNotification();
}

absl::Status SideStages::error() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

std::optional<int32_t> SideStages::encoder_cached() const {
  absl::MutexLock lock(&mu_);
  return encoder_cached_;
}

}  // namespace epd::services::router
