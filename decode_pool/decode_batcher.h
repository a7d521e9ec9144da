#pragma once

// The decode pool's continuous batcher (docs/workers.md, "Decode loop"): requests join and leave
// between steps; each step advances every live sequence by one DecodeStage::Step. Before a step
// it (1) admits waiting requests and resumes preempted ones, oldest first, while the KV pool has
// room for their state plus the step's headroom (2 blocks per live sequence: a block boundary and
// a copy-on-write per stream), and (2) preempts the youngest live sequences (their packed state
// swapped out to host memory, freeing their blocks) while that headroom is missing. A resumed
// sequence continues bit for bit (the swap is the exact hand-off serialization; batch composition
// does not change a sequence's numerics). A sequence that fails in a step fails its request alone.
//
// The batcher knows no gRPC: decode_server.cc turns a Job into StartFns (a hand-off received, a
// prompt prefilled locally, n > 1 forks) and streams what Collect returns. With
// Options::run_loop, a thread of the batcher steps whenever a request wants to; without it the
// caller steps (RunOnce, or Prepare / Step / Publish to interleave other calls with a step), as
// the in-process tests do (tests/decode_pool/decode_batcher_test.cc).
//
// Thread-safety: Submit, Collect, Finished and Release may be called from any thread (one thread
// per Ticket at a time). RunOnce / Prepare / Step / Publish are the loop's: one thread at a time,
// and only when run_loop is false.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "decode_pool/decode_stage.h"
#include "model/model.h"
#include "model/sampling.h"
#include "model/sequence_state.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace epd::decode_pool {

class DecodeBatcher {
 public:
  // Makes one choice's sequence when the batcher admits it (deserializes a hand-off into the KV
  // pool, forks a shared state, or prefills the prompt). Called on the loop's thread.
  using StartFn = std::function<absl::StatusOr<std::unique_ptr<DecodeSequence>>()>;

  struct Options {
    // A thread of the batcher runs RunOnce whenever a request wants a step. false: the caller
    // steps (tests). Default: true
    bool run_loop = true;
    // Times each step (StepReport::step_ns). Default: the system clock
    const common::Clock* clock = nullptr;
  };

  // New output of one choice since the previous Collect.
  struct Chunk {
    int index = 0;  // the choice (SubmitResponse.index)
    std::vector<int32_t> tokens;
    std::vector<model::Logprobs> logprobs;  // parallel to tokens when the request wants them
    bool finished = false;                  // the choice's last chunk
    std::string finish_reason;              // "stop" | "length" when finished
  };

  // One request's choices in the batcher; returned by Submit, read by Collect, ended by Release.
  class Ticket;

  // What one iteration did.
  struct StepReport {
    int admitted = 0;          // sequences started (a StartFn ran and succeeded)
    int resumed = 0;           // preempted sequences brought back
    int preempted = 0;         // sequences swapped out
    int waiting = 0;           // sequences that want to run but had no room
    int failed = 0;            // sequences whose admission, resumption or step failed
    int stepped = 0;           // sequences in the step
    absl::Status step_status;  // DecodeStage::Step's (a whole-step failure fails every live one)
    DecodeStepStats stats;
    int64_t step_ns = 0;  // the step's time on Options::clock
  };

  // An iteration between Prepare and Publish: the sequences the loop holds (opaque; destroying
  // it gives back what it holds).
  struct Iteration;
  struct IterationDeleter {
    void operator()(Iteration* it) const;
  };
  using IterationPtr = std::unique_ptr<Iteration, IterationDeleter>;

  // `model` and `stage` outlive the batcher; `registry` holds its metrics (the epd_dspark_*,
  // epd_kv_pool_* and epd_decode_step_graph_* families; docs/dashboards.md); `batch_size`
  // (optional) is the worker's epd_batch_size gauge.
  DecodeBatcher(const model::Model& model, DecodeStage& stage, prometheus::Registry& registry,
                prometheus::Gauge* batch_size, Options options);
  ~DecodeBatcher();
  DecodeBatcher(const DecodeBatcher&) = delete;
  DecodeBatcher& operator=(const DecodeBatcher&) = delete;

  // Queues a request's choices (one StartFn each); `need_bytes` is the pool bytes one choice's
  // state takes when admitted. The choices start when the pool has room, in arrival order.
  std::shared_ptr<Ticket> Submit(std::vector<StartFn> starts, int64_t need_bytes);

  // Waits up to `wait` for new output or a failure of the ticket's choices, then appends what is
  // new to `out` (at most one chunk per choice). Returns the first failed choice's error: the
  // request has failed (Release it).
  absl::Status Collect(Ticket& ticket, std::chrono::milliseconds wait, std::vector<Chunk>* out);
  // Whether Collect has returned the last chunk of every choice of `ticket`.
  static bool Finished(const Ticket& ticket);
  // The request leaves (finished, cancelled or failed): its sequences are skipped from now on and
  // their state leaves the KV pool now, or after the step that holds them.
  void Release(Ticket& ticket);

  // One iteration: Prepare, Step, Publish.
  StepReport RunOnce();
  // The three phases of RunOnce, public so that a test can call Submit or Release while a step
  // holds the sequences (what the worker's request threads do while the loop steps).
  IterationPtr Prepare();               // take the wanted sequences; admit, resume, preempt
  void Step(Iteration& it);             // one DecodeStage::Step over the live ones
  StepReport Publish(IterationPtr it);  // publish output and errors; give back

  // Updates the KV pool gauges from the pool (after a request's state left it).
  void UpdatePoolGauges();

 private:
  struct Slot;
  struct Held;
  static bool Wants(const Slot& s);
  void Loop();
  void UpdateGraphCounters();
  void CountDSpark(const DecodeStepStats& stats);

  const model::Model& model_;
  DecodeStage& stage_;
  prometheus::Gauge* batch_size_;
  const common::Clock& clock_;

  prometheus::Counter& drafted_;
  prometheus::Counter& accepted_;
  prometheus::Histogram& verify_len_;
  struct PositionCounter {
    prometheus::Counter* drafted;
    prometheus::Counter* accepted;
  };
  std::vector<PositionCounter> per_position_;
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
  uint64_t admissions_ = 0;           // loop thread only

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::shared_ptr<Slot>> slots_;  // guarded by mu_
  bool stop_ = false;                         // guarded by mu_
  std::thread loop_;                          // last: starts after the members it uses
};

}  // namespace epd::decode_pool
