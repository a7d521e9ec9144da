#include "encoder_pool/encoder_server.h"

#include <spdlog/spdlog.h>

#include <functional>
#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "encoder_pool/encoder_stage.h"
#include "kvstore/sharded_kv_client.h"

namespace epd::encoder_pool {
namespace {

class EncoderHandler final : public worker::JobHandler {
 public:
  EncoderHandler(const worker::WorkerSetup& setup, const EncoderOptions& options)
      : setup_(setup),
        options_(options),
        stage_(*setup.model, worker::HandoffTailRows(setup.model->config())) {
    auto& reg = *setup.registry;
    replays_ =
        &prometheus::BuildCounter()
             .Name("epd_swa_replay_total")
             .Help("SWA replays (encoder: rings after a snapshot miss; decoder: tail), per stage")
             .Register(reg)
             .Add({{"stage", "encoder"}});
    replayed_tokens_ = &prometheus::BuildCounter()
                            .Name("epd_swa_replay_tokens_total")
                            .Help("Tokens run through SWA replays, per stage")
                            .Register(reg)
                            .Add({{"stage", "encoder"}});
    auto& errors = prometheus::BuildCounter()
                       .Name("epd_kv_worker_store_errors_total")
                       .Help(
                           "kvstore operations of a worker that failed (daemon down, deadline, "
                           "a value that did not assemble); the request went on with a shorter "
                           "prefix")
                       .Register(reg);
    for (const char* op : {"lookup", "get", "put", "decode"})
      errors_[op] = &errors.Add({{"pool", "encoder"}, {"op", op}});
    auto& tokens = prometheus::BuildCounter()
                       .Name("epd_kv_worker_prefix_tokens_total")
                       .Help("Prompt tokens a worker took from the kvstore instead of computing")
                       .Register(reg);
    prefix_tokens_ = &tokens.Add({{"pool", "encoder"}});
    auto& writes = prometheus::BuildCounter()
                       .Name("epd_kv_worker_writes_total")
                       .Help(
                           "Values a worker wrote to the kvstore, by tier (g3 blocks, g2 SWA "
                           "snapshots)")
                       .Register(reg);
    g3_writes_ = &writes.Add({{"pool", "encoder"}, {"tier", "g3"}});
    g2_writes_ = &writes.Add({{"pool", "encoder"}, {"tier", "g2"}});
    if (!setup.kvstore.empty()) {
      kvstore::KvClientOptions o;
      o.deadline_ms = 5000;
      if (setup.kvstore_bulk_ucx) {
        // A daemon started with --ucx-listener connects back to this address for gets.
        o.bulk = kvstore::BulkTransport::kUcx;
        o.bulk_min_bytes = setup.kvstore_bulk_min_bytes;
        o.ucx_listen_ip = setup.advertise_address;
        o.ucx_net_devices = setup.ucx_net_devices;
        o.cluster_token = setup.cluster_token;
        // The bulk engine's epd_transfer_* and epd_kv_transfer_errors_total on our /metrics.
        o.registry = &reg;
      } else {
        o.bulk = kvstore::BulkTransport::kInline;  // --kvstore-bulk inline
      }
      // --kvstore may list several daemons: blocks and snapshots go to their owners on the ring.
      auto store = kvstore::ShardedKvClient::Create(
          kvstore::ShardedKvClient::ParseTargets(setup.kvstore), o);
      if (store.ok()) {
        store_ = *std::move(store);
        spdlog::info("epd-encoder: prefix reuse through the kvstore at {}", setup.kvstore);
      } else {
        store_error_ = store.status();
      }
    }
  }

  const absl::Status& store_error() const { return store_error_; }

  absl::Status Run(const epd::v1::Job& job, const worker::Emit& emit,
                   const std::atomic<bool>& cancelled) override {
    if (absl::Status s = worker::CheckJobFingerprint(job, setup_.fingerprint); !s.ok()) return s;
    if (job.next_transfer_address().empty())
      return absl::InvalidArgumentError("encoder job without next_transfer_address");
    const std::vector<int32_t> prompt(job.prompt_ids().begin(), job.prompt_ids().end());
    PrefixOptions prefix;
    prefix.store = store_.get();
    prefix.fingerprint = setup_.fingerprint;
    prefix.hint = job.cached_tokens();
    PrefixReport report;
    const model::ModelConfig& c = setup_.model->config();
    worker::HandoffHeader h{job.request_id(), setup_.fingerprint,
                            static_cast<int64_t>(prompt.size()), 0, setup_.dspark};
    const absl::Duration deadline = absl::Milliseconds(setup_.handoff_deadline_ms);
    // Streamed: the pass runs in chunks; each chunk's KV rows go out while the next computes.
    std::optional<worker::HandoffStreamSender> stream;
    ChunkOptions chunks;
    absl::Status stream_error;  // a group that could not be offered stops the pass
    if (options_.handoff_streaming) {
      const int64_t n = static_cast<int64_t>(prompt.size());
      std::vector<worker::SegmentShape> shapes = worker::ExpectedStateShapes(c, n, false);
      for (auto& s : worker::ExpectedEncoderOutputShapes(c, n, worker::HandoffTailRows(c)))
        shapes.push_back(s);
      stream.emplace(*setup_.handoff, c, job.next_transfer_address(), h, std::move(shapes),
                     deadline, &cancelled);
      chunks.chunk_tokens = stream->chunk_tokens();
      chunks.after_chunk = [&](const model::SequenceState& state) -> absl::Status {
        if (stream->sent() >= stream->groups() ||
            (stream->sent() + 1) * stream->chunk_tokens() > state.pos)
          return absl::OkStatus();
        if (cancelled.load()) return absl::CancelledError("cancelled");
        stream_error = stream->SendReady(
            model::SerializeStateSegments(c, state,
                                          [](const std::string& name) {
                                            return absl::StartsWith(name, "kv.") ||
                                                   absl::StartsWith(name, "keys.");
                                          }),
            state.pos);
        return stream_error;
      };
    }
    const absl::Time started = absl::Now();
    setup_.batch_size->Increment();  // epd_batch_size: sequences in an encoder pass now
    auto res = stage_.Run(prompt, prefix, &report, stream ? &chunks : nullptr);
    setup_.batch_size->Decrement();
    const absl::Time passed = absl::Now();
    if (!res.ok()) {
      if (stream) stream->Abort("encoder pass failed");
      if (!stream_error.ok())
        return absl::Status(stream_error.code(),
                            absl::StrCat("encoder -> prefill hand-off: ", stream_error.message()));
      return res.status();
    }
    for (const std::string& op : report.errors) errors_.at(op)->Increment();
    if (!report.warning.empty())
      spdlog::warn("epd-encoder: request {}: kvstore degraded (prefix {} of hint {}): {}",
                   job.request_id(), report.cached_tokens, job.cached_tokens(), report.warning);
    if (report.replayed) {
      replays_->Increment();
      replayed_tokens_->Increment(static_cast<double>(report.replayed_tokens));
    }
    prefix_tokens_->Increment(static_cast<double>(report.cached_tokens));
    g3_writes_->Increment(static_cast<double>(report.blocks_written));
    if (report.snapshot_written) g2_writes_->Increment();
    if (cancelled.load()) return absl::CancelledError("cancelled");
    {
      // The prefix actually used, reported once and before the hand-off: the router cancels the
      // side streams when decode ends, which could drop a message sent after the hand-off.
      epd::v1::SubmitResponse used;
      used.set_request_id(job.request_id());
      used.set_cached_tokens(static_cast<int32_t>(report.cached_tokens));
      emit(used);
    }
    std::vector<model::StateSegment> segs = std::move(res->state);
    for (auto& s : worker::PackEncoderOutput(res->output)) segs.push_back(std::move(s));
    absl::Status st;
    if (stream) {
      st = stream->Finish(segs);
    } else {
      auto manifest = worker::BuildHandoffManifest(c, h, worker::ShapesOf(segs));
      st = setup_.handoff->Send(job.next_transfer_address(), std::move(manifest), segs, deadline,
                                &cancelled);
    }
    if (!st.ok())
      return absl::Status(st.code(), absl::StrCat("encoder -> prefill hand-off: ", st.message()));
    spdlog::info(
        "epd-encoder: request {}: {} tokens, pass {:.0f} ms, hand-off confirmed {:.0f} ms "
        "after the pass ({})",
        job.request_id(), prompt.size(), absl::ToDoubleMilliseconds(passed - started),
        absl::ToDoubleMilliseconds(absl::Now() - passed),
        stream ? absl::StrCat(stream->groups(), " groups streamed during the pass + 1")
               : std::string("whole"));
    worker::EmitHandoffDone(emit, job.request_id());
    return absl::OkStatus();
  }

 private:
  worker::WorkerSetup setup_;
  EncoderOptions options_;
  EncoderStage stage_;
  std::unique_ptr<kvstore::ShardedKvClient> store_;  // null without --kvstore
  absl::Status store_error_;                         // a --kvstore list that did not parse
  prometheus::Counter* replays_;
  prometheus::Counter* replayed_tokens_;
  std::map<std::string, prometheus::Counter*> errors_;
  prometheus::Counter* prefix_tokens_;
  prometheus::Counter* g3_writes_;
  prometheus::Counter* g2_writes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeEncoderHandler(
    const worker::WorkerSetup& setup, const EncoderOptions& options) {
  auto h = std::make_unique<EncoderHandler>(setup, options);
  if (!h->store_error().ok()) return h->store_error();
  return h;
}

}  // namespace epd::encoder_pool
