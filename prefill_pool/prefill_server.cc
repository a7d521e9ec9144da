#include "prefill_pool/prefill_server.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "prefill_pool/prefill_stage.h"

namespace epd::prefill_pool {
namespace {

class PrefillHandler final : public worker::JobHandler {
 public:
  explicit PrefillHandler(const worker::WorkerSetup& setup)
      : setup_(setup),
        stage_(*setup.model),
        replays_(prometheus::BuildCounter()
                     .Name("epd_swa_replay_total")
                     .Help("SWA bounded replays, per stage")
                     .Register(*setup.registry)
                     .Add({{"stage", "decoder"}})),
        replayed_tokens_(prometheus::BuildCounter()
                             .Name("epd_swa_replay_tokens_total")
                             .Help("Tokens run through SWA bounded replays, per stage")
                             .Register(*setup.registry)
                             .Add({{"stage", "decoder"}})) {
    auto& modes = prometheus::BuildCounter()
                      .Name("epd_handoff_receives_total")
                      .Help(
                          "Encoder -> prefill hand-offs received, by how the encoder sent them "
                          "(streamed: layer groups while it computed; whole: after its pass)")
                      .Register(*setup.registry);
    streamed_ = &modes.Add({{"mode", "streamed"}});
    whole_ = &modes.Add({{"mode", "whole"}});
  }

  absl::Status Run(const epd::v1::Job& job, const worker::Emit& emit,
                   const std::atomic<bool>& cancelled) override {
    const model::ModelConfig& c = setup_.model->config();
    if (absl::Status s = worker::CheckJobFingerprint(job, setup_.fingerprint); !s.ok()) return s;
    if (job.next_transfer_address().empty())
      return absl::InvalidArgumentError("prefill job without next_transfer_address");
    if (job.prev_worker_id().empty())
      return absl::InvalidArgumentError("prefill job without an encoder (prev_worker_id)");
    const int64_t n = job.prompt_ids_size();
    if (n <= 0) return absl::InvalidArgumentError("prefill: empty prompt");
    // What the encoder must send, derived here from (config, N) alone.
    std::vector<worker::SegmentShape> shapes = worker::ExpectedStateShapes(c, n, false);
    const size_t n_state = shapes.size();
    for (auto& s : worker::ExpectedEncoderOutputShapes(c, n, worker::HandoffTailRows(c)))
      shapes.push_back(s);
    // Every hand-off header carries this worker's --dspark (part of the fingerprint, so the
    // encoder and decode paired with it run the same setting); decode checks it against its own.
    worker::HandoffHeader h{job.request_id(), setup_.fingerprint, n, 0, setup_.dspark};
    const absl::Duration deadline = absl::Milliseconds(setup_.handoff_deadline_ms);
    // Whole or layer-streamed (the encoder's --handoff-streaming): the first offer decides.
    bool streamed = false;
    const absl::Time posted = absl::Now();
    auto got = setup_.handoff->ReceiveStreamable(c, h, shapes, deadline, &cancelled, &streamed);
    if (got.ok()) {
      (streamed ? streamed_ : whole_)->Increment();
      spdlog::info("epd-prefill: request {}: {} hand-off of {} tokens in {:.0f} ms after the job",
                   job.request_id(), streamed ? "streamed" : "whole", n,
                   absl::ToDoubleMilliseconds(absl::Now() - posted));
    }
    if (!got.ok())
      return absl::Status(got.status().code(),
                          absl::StrCat("encoder -> prefill hand-off: ", got.status().message()));
    std::vector<model::StateSegment> state(std::make_move_iterator(got->begin()),
                                           std::make_move_iterator(got->begin() + n_state));
    std::vector<model::StateSegment> enc_segs(std::make_move_iterator(got->begin() + n_state),
                                              std::make_move_iterator(got->end()));
    auto enc = worker::UnpackEncoderOutput(c, enc_segs);
    if (!enc.ok()) return enc.status();
    setup_.batch_size->Increment();  // epd_batch_size: sequences in a prefill pass now
    auto res = stage_.Run(state, *enc);
    setup_.batch_size->Decrement();
    if (!res.ok()) return res.status();
    replays_.Increment();
    replayed_tokens_.Increment(static_cast<double>(res->replayed_rows));
    if (cancelled.load()) return absl::CancelledError("cancelled");
    std::vector<model::StateSegment> out = std::move(res->state);
    out.push_back(worker::PackLogits(res->logits));
    auto manifest = worker::BuildHandoffManifest(c, h, worker::ShapesOf(out));
    absl::Status st = setup_.handoff->Send(job.next_transfer_address(), std::move(manifest), out,
                                           deadline, &cancelled);
    if (!st.ok())
      return absl::Status(st.code(), absl::StrCat("prefill -> decode hand-off: ", st.message()));
    worker::EmitHandoffDone(emit, job.request_id());
    return absl::OkStatus();
  }

 private:
  worker::WorkerSetup setup_;
  PrefillStage stage_;
  prometheus::Counter& replays_;
  prometheus::Counter& replayed_tokens_;
  prometheus::Counter* streamed_;
  prometheus::Counter* whole_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakePrefillHandler(
    const worker::WorkerSetup& setup) {
  return std::make_unique<PrefillHandler>(setup);
}

}  // namespace epd::prefill_pool
