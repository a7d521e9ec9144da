#include "decode_pool/decode_server.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "decode_pool/decode_stage.h"
#include "decode_pool/dspark/verifier.h"
#include "decode_pool/grammar/grammar.h"
#include "model/sequence_state.h"
#include "model/tokenizer.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "spdlog/spdlog.h"

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

// The pool's capacity: --kv-pool-bytes, else sized from the backend's memory and split among
// the decode workers that share it (--kv-pool-share).
int64_t PoolCapacity(int64_t flag, int share, const model::Model& model) {
  if (flag > 0) return flag;
  const int64_t all =
      model::DefaultKvPoolCapacity(model.backend(), model.options().scratch_cache_bytes);
  return std::max<int64_t>(1, all / std::max(1, share));
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
        pool_blocks_(prometheus::BuildGauge()
                         .Name("epd_kv_pool_blocks")
                         .Help("KV pool blocks (64 tokens of global KV over all sources, packed) "
                               "by state: free (capacity not in use), used (held by sequences), "
                               "cached (sealed blocks nobody holds, kept for prefix reuse, "
                               "evictable)")
                         .Register(*setup.registry)),
        pool_free_(pool_blocks_.Add({{"state", "free"}})),
        pool_used_(pool_blocks_.Add({{"state", "used"}})),
        pool_cached_(pool_blocks_.Add({{"state", "cached"}})),
        preemptions_(prometheus::BuildCounter()
                         .Name("epd_kv_pool_preemptions_total")
                         .Help("Decode sequences swapped out of the KV pool (their packed state "
                               "kept in host memory) because it ran out; each resumes later "
                               "with the same output")
                         .Register(*setup.registry)
                         .Add({})),
        graph_steps_(prometheus::BuildCounter()
                         .Name("epd_decode_step_graph_steps_total")
                         .Help("Batched decode steps by how their row-independent parts ran: "
                               "graph (recorded segments launched, docs/cuda.md \"Decode step "
                               "graphs\") or op_by_op (the first step of a row count, or its "
                               "capture failed); 0 on a backend that records no graphs (CPU)")
                         .Register(*setup.registry)),
        graph_launched_steps_(graph_steps_.Add({{"mode", "graph"}})),
        op_by_op_steps_(graph_steps_.Add({{"mode", "op_by_op"}})),
        graph_failures_(prometheus::BuildCounter()
                            .Name("epd_decode_step_graph_failures_total")
                            .Help("Decode step graph captures or launches that failed: that "
                                  "row count then runs op by op (slower, the same output)")
                            .Register(*setup.registry)
                            .Add({})),
        loop_([this] { Loop(); }) {
    setup_.model->kv_pool().SetCapacity(
        PoolCapacity(options.kv_pool_bytes, options.kv_pool_share, *setup_.model));
    UpdatePoolGauges();
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
    std::shared_ptr<const grammar::Grammar> constraint;
    if (!job.sampling().constraint().empty()) {
      auto g = grammars_.Get(job.sampling().constraint());
      if (!g.ok())
        return absl::InvalidArgumentError(
            absl::StrCat("decode: constraint: ", g.status().message()));
      constraint = *std::move(g);
    }
    // n > 1: one hand-off, then n sequences forked from it: the received state is deserialized
    // into the KV pool once and each choice starts from a copy, sharing every block until it
    // writes (copy-on-write: the choices differ only in their own tail blocks); choice i samples
    // with its own seed (choice 0 keeps the request's). The batching loop starts them when the
    // pool has room (admission).
    const int choices = std::max(1, job.sampling().n());
    auto params_of = [&](int i) {
      model::SamplingParams p = params;
      if (i > 0) p.seed = params.seed + static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull;
      return p;
    };
    std::vector<StartFn> starts;
    if (job.prev_worker_id().empty()) {
      auto shared_prompt = std::make_shared<const std::vector<int32_t>>(prompt);
      for (int i = 0; i < choices; ++i) {
        starts.push_back([this, shared_prompt, p = params_of(i), constraint] {
          return stage_.StartFromPrompt(*shared_prompt, p, constraint);
        });
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
      auto segs = std::make_shared<const std::vector<model::StateSegment>>(*std::move(got));
      auto lg = std::make_shared<const std::vector<float>>(*std::move(logits));
      auto shared_prompt = std::make_shared<const std::vector<int32_t>>(prompt);
      if (choices == 1) {
        starts.push_back([this, segs, lg, shared_prompt, p = params_of(0), constraint] {
          return stage_.Start(*segs, *lg, p, *shared_prompt, constraint);
        });
      } else {
        // The received state, deserialized by the first choice to start (the loop thread starts
        // them, one at a time); released with the last closure.
        auto proto = std::make_shared<std::unique_ptr<model::SequenceState>>();
        for (int i = 0; i < choices; ++i) {
          starts.push_back([this, segs, lg, shared_prompt, proto, p = params_of(i),
                            constraint]() -> absl::StatusOr<std::unique_ptr<DecodeSequence>> {
            if (*proto == nullptr) {
              auto st = model::DeserializeState(*setup_.model, *segs);
              if (!st.ok()) return st.status();
              *proto = *std::move(st);
            }
            return stage_.StartWithState(std::make_unique<model::SequenceState>(**proto), *lg, p,
                                         *shared_prompt, constraint);
          });
        }
      }
    }
    // Hand the sequences to the batching loop (which admits them into the KV pool); stream what
    // they produce, each message for one choice (SubmitResponse.index).
    std::vector<std::shared_ptr<Slot>> slots;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& start : starts) {
        auto slot = std::make_shared<Slot>();
        slot->seq = std::make_unique<DecodeSequence>();  // placeholder until admitted
        slot->start = std::move(start);
        // Global KV + the packed SWA rings and compressor tails (a copy of a shared state
        // copies them on its first step).
        slot->need_bytes = setup_.model->KvBytesFor(n) + setup_.model->FixedStateBytes();
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
            const Slot& q = *slots[i];
            if (q.out.size() > sent[i] || q.finished || !q.error.ok()) return true;
          }
          return false;
        });
        for (size_t i = 0; i < slots.size(); ++i) {
          if (finished[i]) continue;
          if (!slots[i]->error.ok()) {
            result = slots[i]->error;
            break;
          }
          const Slot& q = *slots[i];
          if (q.out.size() == sent[i] && !q.finished) continue;
          Fresh f{static_cast<int>(i),
                  {q.out.begin() + sent[i], q.out.end()},
                  {},
                  q.finished,
                  q.finish};
          if (q.out_lp.size() >= q.out.size())
            f.lp.assign(q.out_lp.begin() + sent[i], q.out_lp.end());
          sent[i] = q.out.size();
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
    std::vector<std::unique_ptr<DecodeSequence>> gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& slot : slots) {
        slot->seq->done = true;  // the loop skips it from now on
        slots_.erase(std::remove(slots_.begin(), slots_.end(), slot), slots_.end());
        // Its state leaves the pool now (a placeholder when the loop holds it: the loop drops
        // the slot after its step).
        gone.push_back(std::move(slot->seq));
        slot->seq = std::make_unique<DecodeSequence>();
        slot->seq->done = true;
      }
    }
    gone.clear();
    UpdatePoolGauges();
    return result;
  }

 private:
  using StartFn = std::function<absl::StatusOr<std::unique_ptr<DecodeSequence>>()>;
  struct Slot {
    std::unique_ptr<DecodeSequence> seq;
    absl::Status error;
    // What the loop published for Run (under mu_), appended step by step: Run reads these, never
    // the sequence (which the loop holds during a step), so nothing is copied twice.
    std::vector<int32_t> out;
    std::vector<model::Logprobs> out_lp;  // parallel to out when the request wants logprobs
    bool finished = false;
    std::string finish;
    // Loop thread only: admission (start() deserializes the hand-off into the KV pool) and
    // preemption (the state swapped out to host memory, packed).
    StartFn start;
    bool admitted = false;
    bool preempted = false;
    int64_t need_bytes = 0;  // pool bytes the state takes when admitted or resumed
    uint64_t order = 0;      // admission order: the youngest live sequence is preempted first
    std::vector<model::StateSegment> swapped;
  };

  static bool Wants(const Slot& s) { return !s.seq->done && s.error.ok(); }

  // The model's decode step graph counters since the last call, into the metrics (loop thread).
  void UpdateGraphCounters() {
    const model::StepGraphStats now = setup_.model->step_graph_stats();
    auto add = [](prometheus::Counter& c, int64_t now_v, int64_t& seen) {
      if (now_v > seen) c.Increment(static_cast<double>(now_v - seen));
      seen = now_v;
    };
    add(graph_launched_steps_, now.graph_steps, graph_seen_.graph_steps);
    add(op_by_op_steps_, now.eager_steps, graph_seen_.eager_steps);
    add(graph_failures_, now.failures, graph_seen_.failures);
  }

  void UpdatePoolGauges() {
    const model::KvPool::Stats st = setup_.model->kv_pool().stats();
    const double block = static_cast<double>(std::max<int64_t>(1, setup_.model->KvBlockBytes()));
    pool_used_.Set(static_cast<double>(st.used_bytes) / block);
    pool_cached_.Set(static_cast<double>(st.cached_bytes) / block);
    pool_free_.Set(static_cast<double>(
                       std::max<int64_t>(0, st.capacity_bytes - st.used_bytes - st.cached_bytes)) /
                   block);
  }

  // Continuous batching: every step advances all live sequences by one token (one DecodeStep);
  // sequences join and leave between steps. Before a step the loop (1) admits waiting requests
  // and resumes preempted ones, oldest first, while the KV pool has room for their state plus
  // the step's headroom (2 blocks per live sequence: a block boundary and a copy-on-write per
  // stream), and (2) preempts the youngest live sequences (swaps their packed state out to host
  // memory, freeing their blocks) while the headroom is missing. A resumed sequence continues
  // bit for bit (the swap is the exact hand-off serialization; batch composition does not change
  // a sequence's numerics). The sequences are only touched under mu_ or by this thread while it
  // holds them (Run reads a slot's sequence under mu_; the loop publishes under mu_).
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    model::KvPool& pool = setup_.model->kv_pool();
    const int64_t headroom = 2 * setup_.model->KvBlockBytes();
    while (true) {
      work_cv_.wait(lock, [&] {
        if (stop_) return true;
        for (auto& s : slots_)
          if (Wants(*s)) return true;
        return false;
      });
      if (stop_) return;
      struct Held {
        std::shared_ptr<Slot> slot;
        std::unique_ptr<DecodeSequence> seq;
        bool live = false;
        absl::Status error;  // admission or resumption failed (published under mu_)
      };
      std::vector<Held> held;  // live first (admission order), then waiting (arrival order)
      for (int pass = 0; pass < 2; ++pass) {
        for (auto& s : slots_) {
          if (!Wants(*s)) continue;
          const bool live = s->admitted && !s->preempted;
          if (live != (pass == 0)) continue;
          Held h{s, std::move(s->seq), live};
          s->seq = std::make_unique<DecodeSequence>();  // placeholder: not done
          held.push_back(std::move(h));
        }
      }
      lock.unlock();
      std::stable_sort(held.begin(), held.end(), [](const Held& a, const Held& b) {
        if (a.live != b.live) return a.live;
        return a.live ? a.slot->order < b.slot->order : false;
      });
      int64_t live = 0;
      for (const Held& h : held) live += h.live ? 1 : 0;
      // (1) Admission and resumption, oldest first, while the pool has room.
      for (Held& h : held) {
        if (h.live) continue;
        Slot& s = *h.slot;
        const int64_t need = s.need_bytes + headroom * (live + 1);
        if (pool.available_bytes() < need) {
          if (live == 0 && need > pool.capacity_bytes() && pool.capacity_bytes() > 0) {
            h.error = absl::ResourceExhaustedError(
                absl::StrCat("decode: the request's KV state needs ", need,
                             " bytes of the KV pool, which holds ", pool.capacity_bytes(),
                             " (--kv-pool-bytes)"));
            continue;
          }
          break;  // first come, first served: later requests wait too
        }
        if (!s.admitted) {
          auto q = s.start();
          s.start = nullptr;
          if (!q.ok()) {
            h.error = q.status();
            continue;
          }
          h.seq = std::move(*q);
          s.admitted = true;
        } else {
          auto st = model::DeserializeState(*setup_.model, s.swapped);
          if (!st.ok()) {
            h.error = st.status();
            continue;
          }
          h.seq->state = std::move(*st);
          s.swapped.clear();
          s.preempted = false;
        }
        s.order = ++admissions_;
        h.live = true;
        ++live;
      }
      // (2) Preemption: the youngest live sequences go while the step's headroom is missing.
      while (live > 0 && pool.available_bytes() < headroom * live) {
        Held* victim = nullptr;
        for (Held& h : held) {
          if (h.live && !h.seq->done && (victim == nullptr || h.slot->order > victim->slot->order))
            victim = &h;
        }
        if (victim == nullptr) break;
        Slot& s = *victim->slot;
        s.swapped = model::SerializeState(setup_.model->config(), *victim->seq->state);
        s.need_bytes =
            setup_.model->KvBytesFor(victim->seq->state->pos) + setup_.model->FixedStateBytes();
        victim->seq->state.reset();  // releases its blocks
        s.preempted = true;
        victim->live = false;
        --live;
        preemptions_.Increment();
      }
      // (3) One step over the live batch.
      std::vector<DecodeSequence*> batch;
      for (Held& h : held)
        if (h.live && !h.seq->done) batch.push_back(h.seq.get());
      absl::Status st = absl::OkStatus();
      DecodeStepStats stats;
      if (!batch.empty()) {
        setup_.batch_size->Set(static_cast<double>(batch.size()));
        st = stage_.Step(batch, &stats);
      }
      if (st.ok() && stage_.options().dspark && !batch.empty()) {
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
      UpdatePoolGauges();
      UpdateGraphCounters();
      lock.lock();
      for (Held& h : held) {
        const bool left = h.slot->seq->done;  // Run gave up on it meanwhile
        if (h.seq != nullptr) h.slot->seq = std::move(h.seq);
        Slot& sl = *h.slot;
        const DecodeSequence& q = *sl.seq;
        if (q.output.size() > sl.out.size()) {  // publish the new tokens only
          const size_t from = sl.out.size();
          sl.out.insert(sl.out.end(), q.output.begin() + from, q.output.end());
          if (q.logprobs.size() >= q.output.size())
            sl.out_lp.insert(sl.out_lp.end(), q.logprobs.begin() + from,
                             q.logprobs.begin() + q.output.size());
        }
        if (!q.error.ok()) {
          sl.error = q.error;  // this request alone failed in the step
        } else if (q.done && !sl.finished) {
          sl.finished = true;
          sl.finish = q.finish_reason;
        }
        if (left) h.slot->seq->done = true;
        if (!st.ok() && h.live) h.slot->error = st;
        if (!h.error.ok()) h.slot->error = h.error;
      }
      // Idle after this step: the running batch is empty until the next job joins.
      bool any_live = false;
      for (auto& s : slots_) any_live = any_live || Wants(*s);
      if (!any_live) setup_.batch_size->Set(0);
      done_cv_.notify_all();
      held.clear();  // slots Run gave up meanwhile release their state here
      UpdatePoolGauges();
      // Nothing could run (waiting for room that sequences of finishing requests free): do not
      // spin.
      if (batch.empty() && any_live) work_cv_.wait_for(lock, std::chrono::milliseconds(5));
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
  prometheus::Family<prometheus::Gauge>& pool_blocks_;
  prometheus::Gauge& pool_free_;
  prometheus::Gauge& pool_used_;
  prometheus::Gauge& pool_cached_;
  prometheus::Counter& preemptions_;
  prometheus::Family<prometheus::Counter>& graph_steps_;
  prometheus::Counter& graph_launched_steps_;
  prometheus::Counter& op_by_op_steps_;
  prometheus::Counter& graph_failures_;
  model::StepGraphStats graph_seen_;  // loop thread only
  uint64_t admissions_ = 0;  // loop thread only
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
