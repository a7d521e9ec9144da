#include "encoder_pool/encoder_server.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "encoder_pool/encoder_stage.h"

namespace epd::encoder_pool {
namespace {

class EncoderHandler final : public worker::JobHandler {
 public:
  explicit EncoderHandler(const worker::WorkerSetup& setup)
      : setup_(setup), stage_(*setup.model, worker::HandoffTailRows(setup.model->config())) {
    auto& replay = prometheus::BuildCounter()
                       .Name("epd_swa_replay_total")
                       .Help("SWA bounded replays, per stage")
                       .Register(*setup.registry);
    replay.Add({{"stage", "encoder"}});
    prometheus::BuildCounter()
        .Name("epd_swa_replay_tokens_total")
        .Help("Tokens run through SWA bounded replays, per stage")
        .Register(*setup.registry)
        .Add({{"stage", "encoder"}});
  }

  absl::Status Run(const epd::v1::Job& job, const worker::Emit& emit,
                   const std::atomic<bool>& cancelled) override {
    if (!job.config_fingerprint().empty() && job.config_fingerprint() != setup_.fingerprint)
      return absl::FailedPreconditionError(
          absl::StrCat("job fingerprint ", job.config_fingerprint(), " != worker fingerprint ",
                       setup_.fingerprint));
    if (job.next_transfer_address().empty())
      return absl::InvalidArgumentError("encoder job without next_transfer_address");
    const std::vector<int32_t> prompt(job.prompt_ids().begin(), job.prompt_ids().end());
    setup_.batch_size->Set(1);
    auto res = stage_.Run(prompt);
    if (!res.ok()) return res.status();
    if (cancelled.load()) return absl::CancelledError("cancelled");
    std::vector<model::StateSegment> segs = std::move(res->state);
    for (auto& s : worker::PackEncoderOutput(res->output)) segs.push_back(std::move(s));
    worker::HandoffHeader h{job.request_id(), setup_.fingerprint,
                            static_cast<int64_t>(prompt.size()), 0, job.dspark()};
    auto manifest = worker::BuildHandoffManifest(setup_.model->config(), h, worker::ShapesOf(segs));
    absl::Status st =
        setup_.handoff->Send(job.next_transfer_address(), std::move(manifest), segs,
                             absl::Milliseconds(setup_.handoff_deadline_ms), &cancelled);
    if (!st.ok())
      return absl::Status(st.code(), absl::StrCat("encoder -> prefill hand-off: ", st.message()));
    epd::v1::SubmitResponse r;
    r.set_request_id(job.request_id());
    r.set_finish_reason("handoff");
    emit(r);
    return absl::OkStatus();
  }

 private:
  worker::WorkerSetup setup_;
  EncoderStage stage_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeEncoderHandler(
    const worker::WorkerSetup& setup) {
  return std::make_unique<EncoderHandler>(setup);
}

}  // namespace epd::encoder_pool
