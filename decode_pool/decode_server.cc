#include "decode_pool/decode_server.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "decode_pool/decode_stage.h"
#include "prometheus/histogram.h"

namespace epd::decode_pool {
namespace {

model::SamplingParams FromProto(const epd::v1::SamplingParams& p) {
  model::SamplingParams s;
  s.temperature = p.temperature();
  s.top_p = p.top_p() > 0.f ? p.top_p() : 1.f;
  s.top_k = p.top_k();
  s.min_p = p.min_p();
  s.repetition_penalty = p.repetition_penalty() > 0.f ? p.repetition_penalty() : 1.f;
  s.frequency_penalty = p.frequency_penalty();
  s.presence_penalty = p.presence_penalty();
  s.seed = p.has_seed() ? p.seed() : 0;
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  if (p.max_tokens() > 0) s.max_tokens = p.max_tokens();
  s.top_logprobs = p.top_logprobs();
  return s;  // stop strings are matched by the router on text
}

class DecodeHandler final : public worker::JobHandler {
 public:
  explicit DecodeHandler(const worker::WorkerSetup& setup)
      : setup_(setup), stage_(*setup.model), loop_([this] { Loop(); }) {
    prometheus::BuildCounter()
        .Name("epd_dspark_drafted_tokens_total")
        .Help("DSpark draft tokens proposed")
        .Register(*setup.registry)
        .Add({});
    prometheus::BuildCounter()
        .Name("epd_dspark_accepted_tokens_total")
        .Help("DSpark draft tokens accepted by verification")
        .Register(*setup.registry)
        .Add({});
    prometheus::BuildHistogram()
        .Name("epd_dspark_verify_length_tokens")
        .Help("Draft tokens verified per step (the chosen k)")
        .Register(*setup.registry)
        .Add({}, prometheus::Histogram::BucketBoundaries{0, 1, 2, 3, 4, 5});
  }

  ~DecodeHandler() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    loop_.join();
  }

  absl::Status Run(const epd::v1::Job& job, const worker::Emit& emit,
                   const std::atomic<bool>& cancelled) override {
    const model::ModelConfig& c = setup_.model->config();
    if (!job.config_fingerprint().empty() && job.config_fingerprint() != setup_.fingerprint)
      return absl::FailedPreconditionError(
          absl::StrCat("job fingerprint ", job.config_fingerprint(), " != worker fingerprint ",
                       setup_.fingerprint));
    const std::vector<int32_t> prompt(job.prompt_ids().begin(), job.prompt_ids().end());
    const int64_t n = static_cast<int64_t>(prompt.size());
    if (n <= 0) return absl::InvalidArgumentError("decode: empty prompt");
    const model::SamplingParams params = FromProto(job.sampling());
    std::unique_ptr<DecodeSequence> seq;
    if (job.prev_worker_id().empty()) {
      auto s = stage_.StartFromPrompt(prompt, params);
      if (!s.ok()) return s.status();
      seq = std::move(*s);
    } else {
      std::vector<worker::SegmentShape> shapes = worker::ExpectedStateShapes(c, n, true);
      shapes.push_back(worker::LogitsShape(c));
      worker::HandoffHeader h{job.request_id(), setup_.fingerprint, n, 0, job.dspark()};
      auto got =
          setup_.handoff->Receive(worker::BuildHandoffManifest(c, h, shapes), shapes,
                                  absl::Milliseconds(setup_.handoff_deadline_ms), &cancelled);
      if (!got.ok())
        return absl::Status(got.status().code(),
                            absl::StrCat("prefill -> decode hand-off: ", got.status().message()));
      auto logits = worker::UnpackLogits(*got);
      if (!logits.ok()) return logits.status();
      got->pop_back();  // the logits segment
      auto s = stage_.Start(*got, *logits, params, prompt);
      if (!s.ok()) return s.status();
      seq = std::move(*s);
    }
    // Hand the sequence to the batching loop; stream what it produces.
    auto slot = std::make_shared<Slot>();
    slot->seq = std::move(seq);
    {
      std::lock_guard<std::mutex> lock(mu_);
      slots_.push_back(slot);
    }
    work_cv_.notify_all();
    size_t sent = 0;
    absl::Status result = absl::OkStatus();
    while (true) {
      std::vector<int32_t> fresh;
      bool done = false;
      std::string finish;
      {
        std::unique_lock<std::mutex> lock(mu_);
        done_cv_.wait_for(lock, std::chrono::milliseconds(20), [&] {
          return slot->seq->output.size() > sent || slot->seq->done || !slot->error.ok();
        });
        if (!slot->error.ok()) {
          result = slot->error;
          break;
        }
        fresh.assign(slot->seq->output.begin() + sent, slot->seq->output.end());
        sent = slot->seq->output.size();
        done = slot->seq->done;
        finish = slot->seq->finish_reason;
      }
      if (cancelled.load()) {
        result = absl::CancelledError("cancelled");
        break;
      }
      if (fresh.empty() && !done) continue;
      epd::v1::SubmitResponse r;
      r.set_request_id(job.request_id());
      for (int32_t t : fresh) r.add_token_ids(t);
      if (done) r.set_finish_reason(finish);
      if (!emit(r)) {
        result = absl::CancelledError("the router's stream is gone");
        break;
      }
      if (done) break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot->seq->done = true;  // the loop skips it from now on
      slots_.erase(std::remove(slots_.begin(), slots_.end(), slot), slots_.end());
    }
    return result;
  }

 private:
  struct Slot {
    std::unique_ptr<DecodeSequence> seq;
    absl::Status error;
  };

  // Continuous batching: every step advances all live sequences by one token (one DecodeStep);
  // sequences join and leave between steps. The sequences are only touched under mu_ or by this
  // thread while it holds them in `batch` (Run does not read a slot's sequence while a step runs,
  // because it reads under mu_ and the step's results are published under mu_).
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      work_cv_.wait(lock, [&] {
        if (stop_) return true;
        for (auto& s : slots_)
          if (!s->seq->done && s->error.ok()) return true;
        return false;
      });
      if (stop_) return;
      std::vector<std::shared_ptr<Slot>> live;
      std::vector<std::unique_ptr<DecodeSequence>> seqs;
      for (auto& s : slots_) {
        if (s->seq->done || !s->error.ok()) continue;
        live.push_back(s);
        seqs.push_back(std::move(s->seq));            // the loop owns it during the step
        s->seq = std::make_unique<DecodeSequence>();  // placeholder: not done, no output
        s->seq->output = seqs.back()->output;
      }
      lock.unlock();
      std::vector<DecodeSequence*> batch;
      for (auto& q : seqs) batch.push_back(q.get());
      setup_.batch_size->Set(static_cast<double>(batch.size()));
      absl::Status st = stage_.Step(batch);
      lock.lock();
      for (size_t i = 0; i < live.size(); ++i) {
        const bool left = live[i]->seq->done;  // Run gave up on it during the step
        live[i]->seq = std::move(seqs[i]);
        if (left) live[i]->seq->done = true;
        if (!st.ok()) live[i]->error = st;
      }
      done_cv_.notify_all();
    }
  }

  worker::WorkerSetup setup_;
  DecodeStage stage_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::shared_ptr<Slot>> slots_;
  bool stop_ = false;
  std::thread loop_;  // last: starts after the members it uses
};

}  // namespace

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeDecodeHandler(
    const worker::WorkerSetup& setup) {
  return std::make_unique<DecodeHandler>(setup);
}

}  // namespace epd::decode_pool
