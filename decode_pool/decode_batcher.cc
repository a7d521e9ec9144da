#include "decode_pool/decode_batcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/kv_pool.h"

namespace epd::decode_pool {

// One choice of a request. The sequence is touched under mu_, or by the loop while it holds it
// (Prepare moves it out, Publish moves it back).
struct DecodeBatcher::Slot {
  std::unique_ptr<DecodeSequence> seq;
  absl::Status error;
  // What the loop published for Collect (under mu_), appended step by step: Collect reads these,
  // never the sequence (which the loop holds during a step), so nothing is copied twice.
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

// The request's side: its slots and what Collect has returned of each (the request's thread).
class DecodeBatcher::Ticket {
 public:
  std::vector<std::shared_ptr<Slot>> slots;
  std::vector<size_t> sent;
  std::vector<char> finished;
  size_t left = 0;
};

struct DecodeBatcher::Held {
  std::shared_ptr<Slot> slot;
  std::unique_ptr<DecodeSequence> seq;
  bool live = false;
  absl::Status error;  // admission or resumption failed (published under mu_)
};

struct DecodeBatcher::Iteration {
  std::vector<Held> held;  // live first (admission order), then waiting (arrival order)
  std::vector<DecodeSequence*> batch;
  StepReport report;
};

void DecodeBatcher::IterationDeleter::operator()(Iteration* it) const { delete it; }

namespace {

// epd_dspark_position_{drafted,accepted}_tokens_total{position="1".."max_k"}, created at start so
// the acceptance-per-position panel has series before the first draft.
template <typename PositionCounter>
std::vector<PositionCounter> PositionCounters(prometheus::Registry& reg, int max_k) {
  auto& drafted = prometheus::BuildCounter()
                      .Name("epd_dspark_position_drafted_tokens_total")
                      .Help(
                          "DSpark drafts verified at draft position `position` (1 = the first "
                          "draft token of a step)")
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

}  // namespace

DecodeBatcher::DecodeBatcher(const model::Model& model, DecodeStage& stage,
                             prometheus::Registry& registry, prometheus::Gauge* batch_size,
                             Options options)
    : model_(model),
      stage_(stage),
      batch_size_(batch_size),
      clock_(options.clock != nullptr ? *options.clock : common::SystemClock::Get()),
      drafted_(prometheus::BuildCounter()
                   .Name("epd_dspark_drafted_tokens_total")
                   .Help("DSpark draft tokens verified by the target (sum of k over sequences "
                         "and steps)")
                   .Register(registry)
                   .Add({})),
      accepted_(prometheus::BuildCounter()
                    .Name("epd_dspark_accepted_tokens_total")
                    .Help("DSpark draft tokens accepted by verification (<= drafted)")
                    .Register(registry)
                    .Add({})),
      verify_len_(prometheus::BuildHistogram()
                      .Name("epd_dspark_verify_length_tokens")
                      .Help("Draft tokens verified per sequence and step (the chosen k)")
                      .Register(registry)
                      .Add({}, prometheus::Histogram::BucketBoundaries{0, 1, 2, 3, 4, 5})),
      per_position_(PositionCounters<PositionCounter>(registry, stage.options().max_k)),
      pool_blocks_(prometheus::BuildGauge()
                       .Name("epd_kv_pool_blocks")
                       .Help("KV pool blocks (64 tokens of global KV over all sources, packed) "
                             "by state: free (capacity not in use), used (held by sequences), "
                             "cached (sealed blocks nobody holds, kept for prefix reuse, "
                             "evictable)")
                       .Register(registry)),
      pool_free_(pool_blocks_.Add({{"state", "free"}})),
      pool_used_(pool_blocks_.Add({{"state", "used"}})),
      pool_cached_(pool_blocks_.Add({{"state", "cached"}})),
      preemptions_(prometheus::BuildCounter()
                       .Name("epd_kv_pool_preemptions_total")
                       .Help("Decode sequences swapped out of the KV pool (their packed state "
                             "kept in host memory) because it ran out; each resumes later "
                             "with the same output")
                       .Register(registry)
                       .Add({})),
      graph_steps_(prometheus::BuildCounter()
                       .Name("epd_decode_step_graph_steps_total")
                       .Help("Batched decode steps by how their row-independent parts ran: "
                             "graph (recorded segments launched, docs/cuda.md \"Decode step "
                             "graphs\") or op_by_op (the first step of a row count, or its "
                             "capture failed); 0 on a backend that records no graphs (CPU)")
                       .Register(registry)),
      graph_launched_steps_(graph_steps_.Add({{"mode", "graph"}})),
      op_by_op_steps_(graph_steps_.Add({{"mode", "op_by_op"}})),
      graph_failures_(prometheus::BuildCounter()
                          .Name("epd_decode_step_graph_failures_total")
                          .Help("Decode step graph captures or launches that failed: that "
                                "row count then runs op by op (slower, the same output)")
                          .Register(registry)
                          .Add({})) {
  UpdatePoolGauges();
  if (options.run_loop) loop_ = std::thread([this] { Loop(); });
}

DecodeBatcher::~DecodeBatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (loop_.joinable()) loop_.join();
}

bool DecodeBatcher::Wants(const Slot& s) { return !s.seq->done && s.error.ok(); }

std::shared_ptr<DecodeBatcher::Ticket> DecodeBatcher::Submit(std::vector<StartFn> starts,
                                                             int64_t need_bytes) {
  auto ticket = std::make_shared<Ticket>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& start : starts) {
      auto slot = std::make_shared<Slot>();
      slot->seq = std::make_unique<DecodeSequence>();  // placeholder until admitted
      slot->start = std::move(start);
      slot->need_bytes = need_bytes;
      slots_.push_back(slot);
      ticket->slots.push_back(std::move(slot));
    }
  }
  ticket->sent.assign(ticket->slots.size(), 0);
  ticket->finished.assign(ticket->slots.size(), 0);
  ticket->left = ticket->slots.size();
  work_cv_.notify_all();
  return ticket;
}

absl::Status DecodeBatcher::Collect(Ticket& t, std::chrono::milliseconds wait,
                                    std::vector<Chunk>* out) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait_for(lock, wait, [&] {
    for (size_t i = 0; i < t.slots.size(); ++i) {
      if (t.finished[i]) continue;
      const Slot& q = *t.slots[i];
      if (q.out.size() > t.sent[i] || q.finished || !q.error.ok()) return true;
    }
    return false;
  });
  for (size_t i = 0; i < t.slots.size(); ++i) {
    if (t.finished[i]) continue;
    const Slot& q = *t.slots[i];
    if (!q.error.ok()) return q.error;
    if (q.out.size() == t.sent[i] && !q.finished) continue;
    Chunk c{
        static_cast<int>(i), {q.out.begin() + t.sent[i], q.out.end()}, {}, q.finished, q.finish};
    if (q.out_lp.size() >= q.out.size())
      c.logprobs.assign(q.out_lp.begin() + t.sent[i], q.out_lp.end());
    t.sent[i] = q.out.size();
    if (c.finished) {
      t.finished[i] = 1;
      --t.left;
    }
    out->push_back(std::move(c));
  }
  return absl::OkStatus();
}

bool DecodeBatcher::Finished(const Ticket& t) { return t.left == 0; }

void DecodeBatcher::Release(Ticket& t) {
  std::vector<std::unique_ptr<DecodeSequence>> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& slot : t.slots) {
      slot->seq->done = true;  // the loop skips it from now on
      slots_.erase(std::remove(slots_.begin(), slots_.end(), slot), slots_.end());
      // Its state leaves the pool now (a placeholder when the loop holds it: the loop drops the
      // slot after its step).
      gone.push_back(std::move(slot->seq));
      slot->seq = std::make_unique<DecodeSequence>();
      slot->seq->done = true;
    }
  }
  gone.clear();
  UpdatePoolGauges();
}

void DecodeBatcher::UpdateGraphCounters() {
  const model::StepGraphStats now = model_.step_graph_stats();
  auto add = [](prometheus::Counter& c, int64_t now_v, int64_t& seen) {
    if (now_v > seen) c.Increment(static_cast<double>(now_v - seen));
    seen = now_v;
  };
  add(graph_launched_steps_, now.graph_steps, graph_seen_.graph_steps);
  add(op_by_op_steps_, now.eager_steps, graph_seen_.eager_steps);
  add(graph_failures_, now.failures, graph_seen_.failures);
}

void DecodeBatcher::UpdatePoolGauges() {
  const model::KvPool::Stats st = model_.kv_pool().stats();
  const double block = static_cast<double>(std::max<int64_t>(1, model_.KvBlockBytes()));
  pool_used_.Set(static_cast<double>(st.used_bytes) / block);
  pool_cached_.Set(static_cast<double>(st.cached_bytes) / block);
  pool_free_.Set(static_cast<double>(
                     std::max<int64_t>(0, st.capacity_bytes - st.used_bytes - st.cached_bytes)) /
                 block);
}

void DecodeBatcher::CountDSpark(const DecodeStepStats& stats) {
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

DecodeBatcher::IterationPtr DecodeBatcher::Prepare() {
  IterationPtr it(new Iteration());
  std::vector<Held>& held = it->held;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  }
  std::stable_sort(held.begin(), held.end(), [](const Held& a, const Held& b) {
    if (a.live != b.live) return a.live;
    return a.live ? a.slot->order < b.slot->order : false;
  });
  model::KvPool& pool = model_.kv_pool();
  const int64_t headroom = 2 * model_.KvBlockBytes();
  StepReport& r = it->report;
  int64_t live = 0;
  for (const Held& h : held) live += h.live ? 1 : 0;
  // (1) Admission and resumption, oldest first, while the pool has room.
  for (Held& h : held) {
    if (h.live) continue;
    Slot& s = *h.slot;
    const int64_t need = s.need_bytes + headroom * (live + 1);
    if (pool.available_bytes() < need) {
      if (live == 0 && need > pool.capacity_bytes() && pool.capacity_bytes() > 0) {
        h.error = absl::ResourceExhaustedError(absl::StrCat(
            "decode: the request's KV state needs ", need, " bytes of the KV pool, which holds ",
            pool.capacity_bytes(), " (--kv-pool-bytes)"));
        ++r.failed;
        continue;
      }
      break;  // first come, first served: later requests wait too
    }
    if (!s.admitted) {
      auto q = s.start();
      s.start = nullptr;
      if (!q.ok()) {
        h.error = q.status();
        ++r.failed;
        continue;
      }
      h.seq = std::move(*q);
      s.admitted = true;
      ++r.admitted;
    } else {
      auto st = model::DeserializeState(model_, s.swapped);
      if (!st.ok()) {
        h.error = st.status();
        ++r.failed;
        continue;
      }
      h.seq->state = std::move(*st);
      s.swapped.clear();
      s.preempted = false;
      ++r.resumed;
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
    s.swapped = model::SerializeState(model_.config(), *victim->seq->state);
    s.need_bytes = model_.KvBytesFor(victim->seq->state->pos) + model_.FixedStateBytes();
    victim->seq->state.reset();  // releases its blocks
    s.preempted = true;
    victim->live = false;
    --live;
    ++r.preempted;
    preemptions_.Increment();
  }
  for (Held& h : held) {
    if (h.live && !h.seq->done) it->batch.push_back(h.seq.get());
    if (!h.live && h.error.ok()) ++r.waiting;
  }
  return it;
}

void DecodeBatcher::Step(Iteration& it) {
  StepReport& r = it.report;
  if (it.batch.empty()) return;
  r.stepped = static_cast<int>(it.batch.size());
  if (batch_size_ != nullptr) batch_size_->Set(static_cast<double>(it.batch.size()));
  const int64_t t0 = clock_.NowMonoNs();
  r.step_status = stage_.Step(it.batch, &r.stats);
  r.step_ns = clock_.NowMonoNs() - t0;
  if (r.step_status.ok() && stage_.options().dspark) CountDSpark(r.stats);
}

DecodeBatcher::StepReport DecodeBatcher::Publish(IterationPtr it) {
  UpdatePoolGauges();
  UpdateGraphCounters();
  StepReport r = std::move(it->report);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Held& h : it->held) {
      // Released meanwhile (its placeholder is done): nobody collects it; its state leaves the
      // pool with `it` below, outside the lock.
      if (h.slot->seq->done) continue;
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
        ++r.failed;
      } else if (q.done && !sl.finished) {
        sl.finished = true;
        sl.finish = q.finish_reason;
      }
      if (!r.step_status.ok() && h.live) h.slot->error = r.step_status;
      if (!h.error.ok()) h.slot->error = h.error;
    }
    // Idle after this step: the running batch is empty until the next job joins.
    bool any_live = false;
    for (auto& s : slots_) any_live = any_live || Wants(*s);
    if (!any_live && batch_size_ != nullptr) batch_size_->Set(0);
  }
  done_cv_.notify_all();
  it.reset();  // slots Release gave up meanwhile release their state here
  UpdatePoolGauges();
  return r;
}

DecodeBatcher::StepReport DecodeBatcher::RunOnce() {
  IterationPtr it = Prepare();
  Step(*it);
  return Publish(std::move(it));
}

void DecodeBatcher::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] {
        if (stop_) return true;
        for (auto& s : slots_)
          if (Wants(*s)) return true;
        return false;
      });
      if (stop_) return;
    }
    const StepReport r = RunOnce();
    // Nothing could run (waiting for room that sequences of finishing requests free): do not
    // spin.
    if (r.stepped == 0) {
      std::unique_lock<std::mutex> lock(mu_);
      bool any_live = false;
      for (auto& s : slots_) any_live = any_live || Wants(*s);
      if (any_live && !stop_) work_cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
  }
}

}  // namespace epd::decode_pool
