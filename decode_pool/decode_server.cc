#include "decode_pool/decode_server.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "decode_pool/decode_stage.h"
#include "decode_pool/grammar/grammar.h"
#include "model/tokenizer.h"
#include "spdlog/spdlog.h"
#include "decode_pool/dspark/verifier.h"
#include "prometheus/counter.h"
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
  // Stop strings are validated here but matched by the router, which holds the detokenizer
  // and cancels this job on a match (docs/dspark.md, "Decode loop").
  s.stop_strings.assign(p.stop().begin(), p.stop().end());
  return s;
}

// The vocabulary's token bytes for grammar masks (tokenizer.json beside the model); added and
// special tokens are never allowed by a mask (their text is dropped or has protocol meaning).
std::shared_ptr<const grammar::TokenMasker> LoadMasker(const worker::WorkerSetup& setup) {
  if (setup.model_dir.empty() || setup.model == nullptr) return nullptr;
  auto tok = model::Tokenizer::FromFile(setup.model_dir + "/tokenizer.json");
  if (!tok.ok()) {
    spdlog::warn("decode: no tokenizer for constrained decoding: {}",
                 std::string(tok.status().message()));
    return nullptr;
  }
  const int64_t vocab = setup.model->config().vocab_size;
  std::vector<std::string> bytes(static_cast<size_t>(vocab));
  std::vector<int32_t> excluded;
  for (int32_t id = 0; id < vocab; ++id) {
    if (id < (*tok)->vocab_size() && (*tok)->IsAddedToken(id)) excluded.push_back(id);
    const int32_t one[1] = {id};
    auto b = (*tok)->Decode(one, /*skip_special=*/false);
    if (b.ok()) bytes[static_cast<size_t>(id)] = *std::move(b);
  }
  return std::make_shared<grammar::TokenMasker>(
      bytes, excluded, static_cast<int32_t>(setup.model->config().eos_token_id));
}

DecodeStageOptions WithSetup(DecodeStageOptions o, const worker::WorkerSetup& setup) {
  o.dspark = setup.dspark;
  if (!o.masker) o.masker = LoadMasker(setup);
  return o;
}

class DecodeHandler final : public worker::JobHandler {
 public:
  DecodeHandler(const worker::WorkerSetup& setup, const DecodeStageOptions& options)
      : setup_(setup),
        stage_(*setup.model, WithSetup(options, setup)),
        drafted_(prometheus::BuildCounter()
                     .Name("epd_dspark_drafted_tokens_total")
                     .Help("DSpark draft tokens verified by the target (sum of k over sequences "
                           "and steps)")
                     .Register(*setup.registry)
                     .Add({})),
        accepted_(prometheus::BuildCounter()
                      .Name("epd_dspark_accepted_tokens_total")
                      .Help("DSpark draft tokens accepted by verification (<= drafted)")
                      .Register(*setup.registry)
                      .Add({})),
        verify_len_(prometheus::BuildHistogram()
                        .Name("epd_dspark_verify_length_tokens")
                        .Help("Draft tokens verified per sequence and step (the chosen k)")
                        .Register(*setup.registry)
                        .Add({}, prometheus::Histogram::BucketBoundaries{0, 1, 2, 3, 4, 5})),
        per_position_(PositionCounters(*setup.registry, stage_.options().max_k)),
        handoff_mismatch_(prometheus::BuildCounter()
                              .Name("epd_dspark_handoff_mismatch_total")
                              .Help("Hand-offs refused because the DSpark setting of prefill "
                                    "and decode differ")
                              .Register(*setup.registry)
                              .Add({})),
        loop_([this] { Loop(); }) {}

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
    std::shared_ptr<const grammar::Grammar> constraint;
    if (!job.sampling().constraint().empty()) {
      auto g = grammars_.Get(job.sampling().constraint());
      if (!g.ok())
        return absl::InvalidArgumentError(absl::StrCat("decode: constraint: ", g.status().message()));
      constraint = *std::move(g);
    }
    // n > 1: one hand-off, then n sequences forked from it (each Start deserializes its own
    // copy of the received state: a full copy for now, until the KV pool shares blocks); choice
    // i samples with its own seed (choice 0 keeps the request's).
    const int choices = std::max(1, job.sampling().n());
    auto params_of = [&](int i) {
      model::SamplingParams p = params;
      if (i > 0) p.seed = params.seed + static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull;
      return p;
    };
    std::vector<std::unique_ptr<DecodeSequence>> seqs;
    if (job.prev_worker_id().empty()) {
      for (int i = 0; i < choices; ++i) {
        auto s = stage_.StartFromPrompt(prompt, params_of(i), constraint);
        if (!s.ok()) return s.status();
        seqs.push_back(std::move(*s));
      }
    } else {
      std::vector<worker::SegmentShape> shapes = worker::ExpectedStateShapes(c, n, true);
      shapes.push_back(worker::LogitsShape(c));
      // The header's dspark field says whether the state carries DSpark state: this worker's
      // setting, as prefill sends its own (the transfer engine refuses an offer whose field
      // differs; DSparkHandoffReceiveError below names the switch).
      worker::HandoffHeader h{job.request_id(), setup_.fingerprint, n, 0, setup_.dspark};
      auto got =
          setup_.handoff->Receive(worker::BuildHandoffManifest(c, h, shapes), shapes,
                                  absl::Milliseconds(setup_.handoff_deadline_ms), &cancelled);
      if (!got.ok()) {
        bool mismatch = false;
        const absl::Status e = DSparkHandoffReceiveError(setup_.dspark, got.status(), &mismatch);
        if (mismatch) handoff_mismatch_.Increment();
        return absl::Status(e.code(), absl::StrCat("prefill -> decode hand-off: ", e.message()));
      }
      if (setup_.dspark) {  // drafting needs the DSpark input (main_hidden) and draft rings
        if (absl::Status d = CheckDSparkHandoff(true, HandoffHasDSparkState(c, *got)); !d.ok()) {
          handoff_mismatch_.Increment();
          return absl::Status(d.code(), absl::StrCat("prefill -> decode hand-off: ", d.message()));
        }
      }
      auto logits = worker::UnpackLogits(*got);
      if (!logits.ok()) return logits.status();
      got->pop_back();  // the logits segment
      for (int i = 0; i < choices; ++i) {
        auto s = stage_.Start(*got, *logits, params_of(i), prompt, constraint);
        if (!s.ok()) return s.status();
        seqs.push_back(std::move(*s));
      }
    }
    // Hand the sequences to the batching loop; stream what they produce, each message for one
    // choice (SubmitResponse.index).
    std::vector<std::shared_ptr<Slot>> slots;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& seq : seqs) {
        auto slot = std::make_shared<Slot>();
        slot->seq = std::move(seq);
        slots_.push_back(slot);
        slots.push_back(std::move(slot));
      }
    }
    work_cv_.notify_all();
    std::vector<size_t> sent(slots.size(), 0);
    std::vector<char> finished(slots.size(), 0);
    size_t left = slots.size();
    absl::Status result = absl::OkStatus();
    while (left > 0 && result.ok()) {
      struct Fresh {
        int index;
        std::vector<int32_t> tokens;
        std::vector<model::Logprobs> lp;
        bool done = false;
        std::string finish;
      };
      std::vector<Fresh> fresh;
      {
        std::unique_lock<std::mutex> lock(mu_);
        done_cv_.wait_for(lock, std::chrono::milliseconds(20), [&] {
          for (size_t i = 0; i < slots.size(); ++i) {
            if (finished[i]) continue;
            const auto& q = *slots[i]->seq;
            if (q.output.size() > sent[i] || q.done || !slots[i]->error.ok()) return true;
          }
          return false;
        });
        for (size_t i = 0; i < slots.size(); ++i) {
          if (finished[i]) continue;
          if (!slots[i]->error.ok()) {
            result = slots[i]->error;
            break;
          }
          const DecodeSequence& q = *slots[i]->seq;
          if (q.output.size() == sent[i] && !q.done) continue;
          Fresh f{static_cast<int>(i), {q.output.begin() + sent[i], q.output.end()}, {}, q.done,
                  q.finish_reason};
          if (q.logprobs.size() >= q.output.size())
            f.lp.assign(q.logprobs.begin() + sent[i], q.logprobs.begin() + q.output.size());
          sent[i] = q.output.size();
          fresh.push_back(std::move(f));
        }
      }
      if (!result.ok()) break;
      if (cancelled.load()) {
        result = absl::CancelledError("cancelled");
        break;
      }
      for (Fresh& f : fresh) {
        epd::v1::SubmitResponse r;
        r.set_request_id(job.request_id());
        r.set_index(f.index);
        for (int32_t t : f.tokens) r.add_token_ids(t);
        // Logprobs (top_logprobs = n > 0): per token, the chosen token then its top n.
        for (const model::Logprobs& lp : f.lp) {
          auto add = [&](const model::TokenLogprob& x) {
            epd::v1::TokenLogprob* o = r.add_top_logprobs();
            o->set_token_id(x.token);
            o->set_logprob(x.logprob);
          };
          add(lp.chosen);
          for (const model::TokenLogprob& x : lp.top) add(x);
        }
        if (f.done) {
          r.set_finish_reason(f.finish);
          finished[static_cast<size_t>(f.index)] = 1;
          --left;
        }
        if (!emit(r)) {
          result = absl::CancelledError("the router's stream is gone");
          break;
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& slot : slots) {
        slot->seq->done = true;  // the loop skips it from now on
        slots_.erase(std::remove(slots_.begin(), slots_.end(), slot), slots_.end());
      }
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
        s->seq->logprobs = seqs.back()->logprobs;
      }
      lock.unlock();
      std::vector<DecodeSequence*> batch;
      for (auto& q : seqs) batch.push_back(q.get());
      setup_.batch_size->Set(static_cast<double>(batch.size()));
      DecodeStepStats stats;
      absl::Status st = stage_.Step(batch, &stats);
      if (st.ok() && stage_.options().dspark) {
        drafted_.Increment(static_cast<double>(stats.drafted));
        accepted_.Increment(static_cast<double>(stats.accepted));
        for (int k : stats.k) verify_len_.Observe(k);
        // Per draft position j (1-based): verified when k >= j, accepted when accepted >= j.
        for (size_t i = 0; i < stats.k.size() && i < stats.accepted_k.size(); ++i) {
          const int k = std::min<int>(stats.k[i], static_cast<int>(per_position_.size()));
          for (int j = 0; j < k; ++j) {
            per_position_[j].drafted->Increment();
            if (j < stats.accepted_k[i]) per_position_[j].accepted->Increment();
          }
        }
      }
      lock.lock();
      for (size_t i = 0; i < live.size(); ++i) {
        const bool left = live[i]->seq->done;  // Run gave up on it during the step
        live[i]->seq = std::move(seqs[i]);
        if (left) live[i]->seq->done = true;
        if (!st.ok()) live[i]->error = st;
      }
      // Idle after this step: the running batch is empty until the next job joins.
      bool any_live = false;
      for (auto& s : slots_) any_live = any_live || (!s->seq->done && s->error.ok());
      if (!any_live) setup_.batch_size->Set(0);
      done_cv_.notify_all();
    }
  }

  worker::WorkerSetup setup_;
  DecodeStage stage_;
  grammar::GrammarCache grammars_;  // compiled constraints, per constraint text
  prometheus::Counter& drafted_;
  prometheus::Counter& accepted_;
  prometheus::Histogram& verify_len_;
  struct PositionCounter {
    prometheus::Counter* drafted;
    prometheus::Counter* accepted;
  };
  // epd_dspark_position_{drafted,accepted}_tokens_total{position="1".."max_k"}, created at start
  // so the acceptance-per-position panel has series before the first draft.
  static std::vector<PositionCounter> PositionCounters(prometheus::Registry& reg, int max_k) {
    auto& drafted = prometheus::BuildCounter()
                        .Name("epd_dspark_position_drafted_tokens_total")
                        .Help(
                            "DSpark drafts verified at draft position `position` (1 = the "
                            "first draft token of a step)")
                        .Register(reg);
    auto& accepted = prometheus::BuildCounter()
                         .Name("epd_dspark_position_accepted_tokens_total")
                         .Help(
                             "DSpark drafts accepted at draft position `position`; accepted / "
                             "drafted per position is the acceptance rate there")
                         .Register(reg);
    std::vector<PositionCounter> out;
    for (int j = 1; j <= max_k; ++j) {
      const std::string pos = std::to_string(j);
      out.push_back({&drafted.Add({{"position", pos}}), &accepted.Add({{"position", pos}})});
    }
    return out;
  }
  std::vector<PositionCounter> per_position_;
  prometheus::Counter& handoff_mismatch_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::shared_ptr<Slot>> slots_;
  bool stop_ = false;
  std::thread loop_;  // last: starts after the members it uses
};

}  // namespace

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeDecodeHandler(
    const worker::WorkerSetup& setup, DecodeStageOptions options) {
  if (options.fixed_k > options.max_k)
    return absl::InvalidArgumentError(absl::StrCat("decode: --dspark-k ", options.fixed_k,
                                                   " exceeds the maximum ", options.max_k));
  return std::make_unique<DecodeHandler>(setup, options);
}

}  // namespace epd::decode_pool
