#pragma once

// The request path shared by the OpenAI HTTP and gRPC front ends: validate and tokenize
// (Prepare), then schedule, dispatch to the stages, detokenize, split reasoning / content / tool
// calls, apply stop strings, and account metrics (Run).
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "grammar/grammar.h"
#include "epd/v1/inference.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "services/router/dispatch.h"
#include "services/router/registry.h"
#include "services/router/scheduler.h"
#include "services/router/text_codec.h"
#include "services/router/watch_pool.h"

namespace epd::services::router {

struct CoreOptions {
  std::string model = "epd-nano";  // Default: the nano model's served name
  int context_length = 8192;       // Default: prompt + completion tokens per request
  int max_tokens_limit = 4096;     // Default: largest max_tokens a request may ask for
  int default_max_tokens = 1024;   // Default: when a chat request gives none (capped by context)
  int max_attempts = 2;            // Default: a request is re-dispatched once if a worker of
                                   // its chain is unreachable or dies before any token streamed
  int migration_limit = 1;         // Default: 1. Times a request moves to another decode worker
                                   // (prompt + streamed tokens) when its decode worker dies
                                   // mid-generation (docs/router.md, Request migration); 0 = never
  int64_t request_timeout_ms = 30 * 60 * 1000;  // Default: 30 min; Job.deadline_unix_ms, after
                                                // which every stage's stream is cut (0 = none)
  absl::Status Validate() const;
};

// Errors carry the OpenAI `param` and `code` as payloads; the status code maps to HTTP
// (InvalidArgument 400, Unauthenticated 401, NotFound 404, Unavailable 503, other 500).
absl::Status ApiError(absl::StatusCode code, std::string message, std::string param = "",
                      std::string error_code = "");
std::string ErrorParam(const absl::Status& s);
std::string ErrorCode(const absl::Status& s);

// A parsed front-end request, before tokenization.
struct GenerateSpec {
  std::string request_id;
  std::string model;
  std::optional<ChatRenderInput> chat;   // chat completions
  std::string prompt_text;               // completions with a text prompt
  std::optional<std::vector<int32_t>> prompt_ids;  // completions with ids
  epd::v1::SamplingParams sampling;      // max_tokens 0 = default
  bool parse_tools = false;              // split a DSML tool-call block into tool_calls
  // The request field a refused sampling.constraint is reported under (response_format, tools).
  std::string constraint_param = "sampling.constraint";
  // Completions `best_of` > `n` (docs/api.md): sampling.n = best_of samples are drawn (with
  // sampling.logprobs on, for the ranking) and KeepBestOf returns the best_of_keep with the highest
  // mean token logprob; 0: every sample is returned.
  int32_t best_of_keep = 0;
  bool hide_logprobs = false;  // logprobs were turned on only for the ranking: not returned
};

struct PreparedRequest {
  GenerateSpec spec;
  std::vector<int32_t> prompt_ids;
  int32_t max_tokens = 0;
  bool thinking = false;
  // -1: no logprobs; else sampling.logprobs was asked with this many top entries per token
  // (the job asks the decode worker for max(1, n): it sends the chosen token, then its top n).
  int32_t logprobs_top = -1;
};

// One generated token's log probability (raw logits of the row that produced it) and its most
// likely alternatives, most likely first.
struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;
};

// What one step of generation added. Text deltas are complete UTF-8.
struct Delta {
  std::string reasoning;
  std::string content;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprobs> logprobs;  // one per token_ids entry when logprobs were asked
  int index = 0;                        // the choice (sampling.n > 1)
};

// One choice of a finished request.
struct Choice {
  std::string finish_reason;  // stop | length | tool_calls
  ParsedAssistant parsed;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprobs> logprobs;
  int32_t reasoning_tokens = 0;  // tokens up to and including </think> (thinking mode)
};

// finish_reason / parsed / token_ids / logprobs are choice 0's (choices[0]); usage counts the
// prompt once and the completion tokens of every choice.
struct Outcome {
  std::vector<Choice> choices;  // sampling.n of them, by index
  std::string finish_reason;  // stop | length | tool_calls
  ParsedAssistant parsed;     // the whole output, split
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprobs> logprobs;  // one per token_ids entry when logprobs were asked
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t reasoning_tokens = 0;
  std::string decode_worker;  // id of the decode worker that served it
};

// Receives deltas on the request's thread. Returning false means the client is gone: the
// request is cancelled at every stage.
class StreamObserver {
 public:
  virtual ~StreamObserver() = default;
  virtual bool OnDelta(const Delta& delta) = 0;
};

// Thread-safe: Prepare and Run may be called concurrently for different requests.
class RouterCore {
 public:
  RouterCore(CoreOptions options, const TextCodec& codec, Registry& registry,
             Scheduler& scheduler, WorkerClient& client, const common::Clock& clock,
             prometheus::Registry& metrics);

  // Validates limits and tokenizes. Errors are ApiError with param/code.
  absl::StatusOr<PreparedRequest> Prepare(GenerateSpec spec) const;
  // Runs the request to the end. Cancelled when the observer gave up; Unavailable when no
  // worker could serve it, or its decode worker died mid-generation more often than
  // migration_limit allows (a dead worker is removed from the registry). A worker lost before
  // the first token costs a re-dispatch (max_attempts); one lost after it a migration: the
  // request continues on another decode worker and the observer sees one stream.
  absl::StatusOr<Outcome> Run(const PreparedRequest& request, StreamObserver* observer);

  // Fails every running request that uses `worker_id` (e.g. it stopped heartbeating while a
  // stream to it hangs): their streams are cancelled and they end with worker_failed (or are
  // re-dispatched or migrated). Does not call into a run's streams while holding runs_mu_.
  void FailWorker(const std::string& worker_id, const std::string& reason);

  // Counts a request refused before Run (bad input, auth, unknown model) by its error code.
  void CountRejected(const absl::Status& status);
  const CoreOptions& options() const { return options_; }
  const TextCodec& codec() const { return codec_; }
  Registry& registry() { return registry_; }
  int64_t inflight() const { return inflight_.load(); }
  // After this, Prepare refuses new requests (Unavailable); running ones finish.
  void StartDraining() { draining_ = true; }

 private:
  struct RequestState;
  struct AttemptResult {
    absl::Status status;
    bool worker_lost = false;  // a worker of the chain died or became unreachable
  };
  // A run of one attempt: the workers it uses are listed in runs_ so FailWorker can cut it.
  // Thread-safe; `cancel` is only called before `done`.
  struct ActiveRun {
    void Fail(const std::string& reason);
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    std::string lost ABSL_GUARDED_BY(mu);  // why a worker of this run was failed
    std::function<void()> cancel;          // cancels every stage's stream; set before listing
  };

  // What reading one attempt's decode stream gave.
  struct DecodeRead {
    absl::Status error;              // the worker reported an error
    bool cancelled = false;          // the observer gave up
    std::optional<int32_t> cached;   // the prefix the decode worker reported reusing
  };
  // Reads the decode stream into the request's output assembly and the latency metrics, sending
  // deltas to the observer; cancels the run on an error, a client gone or a stop string.
  DecodeRead ReadDecode(RequestState& state, const Plan& plan, JobStream& decode, ActiveRun& run);
  // One attempt: builds the chain for `plan`, submits every stage, watches the side stages and
  // feeds the decode stream into the request's output assembly.
  AttemptResult RunAttempt(RequestState& state, const Plan& plan);
  // The job every stage of an attempt starts from: the prompt (with any tokens already streamed
  // appended, for a migration) and the tokens still to generate.
  epd::v1::Job BaseJob(const RequestState& state, const Plan& plan) const;
  void Unlist(const std::shared_ptr<ActiveRun>& run, const std::string& worker_id);
  void CountOutcome(const std::string& outcome);

  const CoreOptions options_;
  mutable grammar::GrammarCache grammars_;  // constraints checked by Prepare
  const TextCodec& codec_;
  Registry& registry_;
  Scheduler& scheduler_;
  WorkerClient& client_;
  const common::Clock& clock_;
  std::atomic<int64_t> inflight_{0};
  std::atomic<bool> draining_{false};
  absl::Mutex runs_mu_;
  std::multimap<std::string, std::shared_ptr<ActiveRun>> runs_
      ABSL_GUARDED_BY(runs_mu_);  // by worker id

  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& rejects_;
  prometheus::Histogram& ttft_;
  prometheus::Histogram& itl_;
  prometheus::Histogram& e2e_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& cached_tokens_;
  prometheus::Counter& generated_tokens_;
  prometheus::Gauge& inflight_gauge_;
  prometheus::Family<prometheus::Counter>& migrations_;
  // Threads reading the side stages' streams (declared last: joined before the rest goes).
  WatchPool watchers_;
};

// Streams reasoning and content deltas from raw output text as it grows: text before the
// think-end marker (thinking mode) is reasoning; a tool-call block is held back; a trailing
// partial marker is held until it resolves. Not thread-safe.
class AssistantSplitter {
 public:
  AssistantSplitter(AssistantMarkers markers, bool thinking, bool parse_tools);
  Delta Push(std::string_view text);
  // End of output: what is still held that is not a tool-call block.
  Delta Finish();

 private:
  enum class State { kReasoning, kContent, kToolCalls };
  AssistantMarkers markers_;
  bool parse_tools_;
  State state_;
  std::string held_;
};

// Finds stop strings in streamed text, holding back a possible partial match. Not thread-safe.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  // Appends text; returns what may be released. Sets *stopped once a stop string completes
  // (the stop string and everything after it are dropped).
  std::string Push(std::string_view text, bool* stopped);
  std::string Flush();

 private:
  std::vector<std::string> stops_;
  size_t max_len_ = 0;
  std::string held_;
};

}  // namespace epd::services::router
