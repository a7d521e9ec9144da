#include "services/router/router_core.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "services/router/request_validator.h"
#include "services/router/output_assembly.h"
#include "services/router/stage_chain.h"

namespace epd::services::router {
namespace {

constexpr char kParamPayload[] = "epd.dev/param";
constexpr char kCodePayload[] = "epd.dev/code";

// Length of the longest suffix of `s` that is a proper prefix of `marker`.
size_t PartialSuffix(std::string_view s, std::string_view marker) {
  const size_t max = std::min(s.size(), marker.size() - 1);
  for (size_t n = max; n > 0; --n) {
    if (s.substr(s.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
}

bool DeltaEmpty(const Delta& d) {
  return d.reasoning.empty() && d.content.empty() && d.token_ids.empty();
}

}  // namespace

absl::Status CoreOptions::Validate() const {
  if (model.empty()) return absl::InvalidArgumentError("model name is empty");
  if (context_length <= 1) return absl::InvalidArgumentError("context length must be > 1");
  if (max_tokens_limit <= 0) return absl::InvalidArgumentError("max tokens limit must be > 0");
  if (default_max_tokens <= 0) return absl::InvalidArgumentError("default max tokens must be > 0");
  if (max_attempts <= 0) return absl::InvalidArgumentError("max attempts must be > 0");
  if (migration_limit < 0) return absl::InvalidArgumentError("migration limit must be >= 0");
  if (request_timeout_ms < 0) return absl::InvalidArgumentError("request timeout must be >= 0");
  return absl::OkStatus();
}

absl::Status ApiError(absl::StatusCode code, std::string message, std::string param,
                      std::string error_code) {
  absl::Status s(code, message);
  if (!param.empty()) s.SetPayload(kParamPayload, absl::Cord(param));
  if (!error_code.empty()) s.SetPayload(kCodePayload, absl::Cord(error_code));
  return s;
}

std::string ErrorParam(const absl::Status& s) {
  auto p = s.GetPayload(kParamPayload);
  return p ? std::string(*p) : "";
}

std::string ErrorCode(const absl::Status& s) {
  auto p = s.GetPayload(kCodePayload);
  return p ? std::string(*p) : "";
}

// ---------------------------------------------------------------------------------------------

AssistantSplitter::AssistantSplitter(AssistantMarkers markers, bool thinking, bool parse_tools)
    : markers_(std::move(markers)),
      parse_tools_(parse_tools),
      state_(thinking ? State::kReasoning : State::kContent) {}

Delta AssistantSplitter::Push(std::string_view text) {
  Delta d;
  held_.append(text);
  while (true) {
    if (state_ == State::kReasoning) {
      const size_t pos = held_.find(markers_.think_end);
      if (pos != std::string::npos) {
        d.reasoning.append(held_, 0, pos);
        held_.erase(0, pos + markers_.think_end.size());
        state_ = State::kContent;
        continue;
      }
      const size_t keep = PartialSuffix(held_, markers_.think_end);
      d.reasoning.append(held_, 0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return d;
    }
    if (state_ == State::kContent) {
      if (!parse_tools_) {
        d.content.append(held_);
        held_.clear();
        return d;
      }
      const size_t pos = held_.find(markers_.tool_calls_begin);
      if (pos != std::string::npos) {
        d.content.append(held_, 0, pos);
        held_.erase(0, pos);
        state_ = State::kToolCalls;
        return d;
      }
      const size_t keep = PartialSuffix(held_, markers_.tool_calls_begin);
      d.content.append(held_, 0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return d;
    }
    return d;  // kToolCalls: hold everything for the final parse
  }
}

Delta AssistantSplitter::Finish() {
  Delta d;
  if (state_ == State::kReasoning) d.reasoning = std::move(held_);
  if (state_ == State::kContent) d.content = std::move(held_);
  held_.clear();
  return d;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), ""), stops_.end());
  for (const auto& s : stops_) max_len_ = std::max(max_len_, s.size());
}

std::string StopMatcher::Push(std::string_view text, bool* stopped) {
  held_.append(text);
  if (stops_.empty()) return std::exchange(held_, {});
  size_t first = std::string::npos;
  for (const auto& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    std::string out = held_.substr(0, first);
    held_.clear();
    *stopped = true;
    return out;
  }
  if (held_.size() < max_len_) return "";
  size_t cut = held_.size() - (max_len_ - 1);
  // Never split a UTF-8 character.
  while (cut > 0 && (static_cast<unsigned char>(held_[cut]) & 0xC0) == 0x80) --cut;
  std::string out = held_.substr(0, cut);
  held_.erase(0, cut);
  return out;
}

std::string StopMatcher::Flush() { return std::exchange(held_, {}); }

// ---------------------------------------------------------------------------------------------

RouterCore::RouterCore(CoreOptions options, const TextCodec& codec, Registry& registry,
                       Scheduler& scheduler, WorkerClient& client, const common::Clock& clock,
                       prometheus::Registry& metrics)
    : options_(std::move(options)),
      codec_(codec),
      registry_(registry),
      scheduler_(scheduler),
      client_(client),
      clock_(clock),
      requests_(prometheus::BuildCounter()
                    .Name("epd_requests_total")
                    .Help("Requests by outcome: ok, rejected, unavailable, error, cancelled")
                    .Register(metrics)),
      rejects_(prometheus::BuildCounter()
                   .Name("epd_request_rejections_total")
                   .Help("Requests refused before dispatch, by error code")
                   .Register(metrics)),
      ttft_(prometheus::BuildHistogram()
                .Name("epd_ttft_seconds")
                .Help("Time from request arrival to the first generated token, seconds")
                .Register(metrics)
                .Add({}, LatencyBuckets())),
      itl_(prometheus::BuildHistogram()
               .Name("epd_itl_seconds")
               .Help("Inter-token latency after the first token, seconds")
               .Register(metrics)
               .Add({}, LatencyBuckets())),
      e2e_(prometheus::BuildHistogram()
               .Name("epd_e2e_latency_seconds")
               .Help("Time from request arrival to its last token, seconds")
               .Register(metrics)
               .Add({}, LatencyBuckets())),
      prompt_tokens_(prometheus::BuildCounter()
                         .Name("epd_prompt_tokens_total")
                         .Help("Prompt tokens of dispatched requests")
                         .Register(metrics)
                         .Add({})),
      cached_tokens_(prometheus::BuildCounter()
                         .Name("epd_cached_tokens_total")
                         .Help("Prompt tokens served from the KV store")
                         .Register(metrics)
                         .Add({})),
      generated_tokens_(prometheus::BuildCounter()
                            .Name("epd_generated_tokens_total")
                            .Help("Tokens generated and streamed to clients")
                            .Register(metrics)
                            .Add({})),
      inflight_gauge_(prometheus::BuildGauge()
                          .Name("epd_router_inflight_requests")
                          .Help("Requests the router is running now")
                          .Register(metrics)
                          .Add({})),
      migrations_(prometheus::BuildCounter()
                      .Name("epd_request_migrations_total")
                      .Help("Requests whose decode worker died mid-generation, by outcome: ok "
                            "(migrated and completed), failed (migrated, then failed), limit "
                            "(--migration-limit allowed no migration)")
                      .Register(metrics)) {
  for (const char* o : {"ok", "rejected", "unavailable", "error", "cancelled"}) {
    requests_.Add({{"outcome", o}});
  }
  // The request errors the front ends answer (docs/api.md "Errors"), at 0 from start so the
  // rejections panel has series before the first refusal; another code appears on first use.
  for (const char* reason : {"invalid_json", "invalid_utf8", "invalid_type", "invalid_value",
                             "missing_required_parameter", "context_length_exceeded",
                             "max_tokens_exceeded", "unsupported_parameter", "model_not_found",
                             "invalid_api_key", "method_not_allowed", "overloaded"}) {
    rejects_.Add({{"reason", reason}});
  }
  for (const char* o : {"ok", "failed", "limit"}) migrations_.Add({{"outcome", o}});
}

void RouterCore::ActiveRun::Fail(const std::string& reason) {
  absl::MutexLock lock(&mu);
  if (lost.empty()) lost = reason;
  if (!done) cancel();
}

void RouterCore::FailWorker(const std::string& worker_id, const std::string& reason) {
  // Collect under runs_mu_, cancel outside it: a cancel reaches into gRPC and must not hold the
  // lock every request's start and end take.
  registry_.MarkFailed(worker_id, reason);  // a migration must not pick it again
  std::vector<std::shared_ptr<ActiveRun>> hit;
  {
    absl::MutexLock lock(&runs_mu_);
    auto [begin, end] = runs_.equal_range(worker_id);
    for (auto it = begin; it != end; ++it) hit.push_back(it->second);
  }
  for (auto& run : hit) run->Fail(absl::StrCat("worker '", worker_id, "' lost (", reason, ")"));
}

void RouterCore::Unlist(const std::shared_ptr<ActiveRun>& run, const std::string& worker_id) {
  absl::MutexLock lock(&runs_mu_);
  auto [begin, end] = runs_.equal_range(worker_id);
  for (auto it = begin; it != end;) it = it->second == run ? runs_.erase(it) : std::next(it);
}

void RouterCore::CountOutcome(const std::string& outcome) {
  requests_.Add({{"outcome", outcome}}).Increment();
}

void RouterCore::CountRejected(const absl::Status& status) {
  std::string code = ErrorCode(status);
  if (code.empty()) code = absl::StatusCodeToString(status.code());
  rejects_.Add({{"reason", code}}).Increment();
  CountOutcome("rejected");
}

absl::StatusOr<PreparedRequest> RouterCore::Prepare(GenerateSpec spec) const {
  if (draining_) {
    return ApiError(absl::StatusCode::kUnavailable, "the router is shutting down", "", "draining");
  }
  // One validation for both front ends (request_validator.h): model, ranges, roles.
  if (absl::Status st = ValidateSpec(spec, options_); !st.ok()) return st;
  PreparedRequest req;
  const char* input_param = spec.chat ? "messages" : "prompt";
  if (spec.chat) {
    req.thinking = spec.chat->thinking;
    auto ids = codec_.RenderChat(*spec.chat);
    if (!ids.ok()) {
      return ApiError(absl::StatusCode::kInvalidArgument, std::string(ids.status().message()),
                      "messages", "invalid_value");
    }
    req.prompt_ids = std::move(*ids);
  } else if (spec.prompt_ids) {
    for (int32_t id : *spec.prompt_ids) {
      if (id < 0 || id >= codec_.vocab_size()) {
        return ApiError(absl::StatusCode::kInvalidArgument,
                        absl::StrCat("token id ", id, " is outside the vocabulary [0, ",
                                     codec_.vocab_size(), ")"),
                        "prompt", "invalid_value");
      }
    }
    req.prompt_ids = *spec.prompt_ids;
  } else {
    auto ids = codec_.EncodePrompt(spec.prompt_text);
    if (!ids.ok()) {
      return ApiError(absl::StatusCode::kInvalidArgument, std::string(ids.status().message()),
                      "prompt", "invalid_value");
    }
    req.prompt_ids = std::move(*ids);
  }
  if (spec.sampling.logprobs()) {  // ranges checked by ValidateSpec
    req.logprobs_top = spec.sampling.top_logprobs();
    spec.sampling.set_top_logprobs(std::max(1, req.logprobs_top));
  }
  if (!spec.sampling.constraint().empty()) {
    // Thinking mode: the constrained output comes after the reasoning (free text to </think>).
    if (req.thinking) {
      auto c = nlohmann::json::parse(spec.sampling.constraint(), nullptr, false);
      if (c.is_object()) {
        c["thinking"] = true;
        spec.sampling.set_constraint(c.dump());
      }
    }
    auto g = grammars_.Get(spec.sampling.constraint());
    if (!g.ok()) {
      const std::string msg(g.status().message());
      return ApiError(absl::StatusCode::kInvalidArgument, msg, spec.constraint_param,
                      msg.starts_with("unsupported") ? "unsupported_value" : "invalid_value");
    }
  }
  auto max_tokens = ValidateLength(static_cast<int64_t>(req.prompt_ids.size()),
                                   spec.sampling.max_tokens(), options_, input_param);
  if (!max_tokens.ok()) return max_tokens.status();
  req.max_tokens = *max_tokens;
  req.spec = std::move(spec);
  req.spec.sampling.set_max_tokens(req.max_tokens);
  return req;
}

// What one request carries across its attempts.
struct RouterCore::RequestState {
  RequestState(const PreparedRequest& r, StreamObserver* o, const TextCodec& codec,
               int64_t start, int64_t deadline)
      : request(r), observer(o), assembler(codec, r), start_ns(start), deadline_unix_ms(deadline) {}
  const PreparedRequest& request;
  StreamObserver* observer;
  OutputAssembler assembler;
  const int64_t start_ns;
  const int64_t deadline_unix_ms;  // 0 = none; one deadline for every attempt
  int64_t last_token_ns = 0;
  int attempt = 0;                 // 1 for the first dispatch
  int32_t cached_tokens = 0;       // reported by the attempt that produced the first token
  std::string decode_worker;       // of the last attempt
};

absl::StatusOr<Outcome> RouterCore::Run(const PreparedRequest& request, StreamObserver* observer) {
  ++inflight_;
  inflight_gauge_.Increment();
  const int64_t start_ns = clock_.NowMonoNs();
  RequestState state(request, observer, codec_, start_ns,
                     options_.request_timeout_ms > 0
                         ? clock_.NowUnixMs() + options_.request_timeout_ms
                         : 0);
  absl::Status status = absl::UnavailableError("no attempt made");
  int retries = 0, migrations = 0;
  bool died_mid_generation = false;
  while (true) {
    const size_t streamed = state.assembler.token_ids().size();
    if (streamed >= static_cast<size_t>(request.max_tokens)) {
      // The worker died after its last token but before it said so: nothing is left to do.
      state.assembler.set_finish_reason("length");
      status = absl::OkStatus();
      break;
    }
    std::vector<int32_t> context = request.prompt_ids;
    context.insert(context.end(), state.assembler.token_ids().begin(),
                   state.assembler.token_ids().end());
    auto plan = scheduler_.Schedule(context);
    if (!plan.ok() && migrations > 0) break;  // the client learns why it had to move
    if (!plan.ok()) {
      status = ApiError(absl::StatusCode::kUnavailable, std::string(plan.status().message()), "",
                        "no_workers");
      break;
    }
    AttemptResult attempt = RunAttempt(state, *plan);
    scheduler_.Release(*plan);
    status = attempt.status;
    if (status.ok() || status.code() != absl::StatusCode::kUnavailable) break;
    if (!state.assembler.any_tokens()) {
      if (++retries >= options_.max_attempts) break;
      spdlog::warn("request {}: attempt {} failed before any token ({}); dispatching again",
                   request.spec.request_id, retries, std::string(status.message()));
      continue;
    }
    if (!attempt.worker_lost) break;
    died_mid_generation = true;
    // n > 1 and grammar-constrained requests are not continued elsewhere: the worker's fork and
    // its grammar state would have to be rebuilt (docs/router.md, Request migration).
    const bool migratable = state.assembler.n() == 1 && request.spec.sampling.constraint().empty();
    if (!migratable || migrations >= options_.migration_limit) break;
    ++migrations;
    spdlog::warn("request {}: {}; migrating with {} streamed token(s) (migration {} of {})",
                 request.spec.request_id, std::string(status.message()),
                 state.assembler.token_ids().size(), migrations, options_.migration_limit);
  }
  if (migrations > 0) {
    migrations_.Add({{"outcome", status.ok() ? "ok" : "failed"}}).Increment();
  } else if (died_mid_generation) {
    migrations_.Add({{"outcome", "limit"}}).Increment();
  }

  absl::StatusOr<Outcome> result = absl::UnknownError("unset");
  if (!status.ok()) {
    result = status;
  } else {
    Outcome out;
    const std::vector<Delta> last = state.assembler.Finish(&out);
    out.prompt_tokens = static_cast<int32_t>(request.prompt_ids.size());
    out.cached_tokens = state.cached_tokens;
    out.decode_worker = state.decode_worker;
    for (const Delta& d : last) {
      if (!DeltaEmpty(d)) observer->OnDelta(d);
    }
    result = std::move(out);
  }
  const double e2e = (clock_.NowMonoNs() - start_ns) / 1e9;
  if (result.ok()) {
    CountOutcome("ok");
    e2e_.Observe(e2e);
    prompt_tokens_.Increment(result->prompt_tokens);
    cached_tokens_.Increment(result->cached_tokens);
  } else if (result.status().code() == absl::StatusCode::kCancelled) {
    CountOutcome("cancelled");
  } else if (result.status().code() == absl::StatusCode::kUnavailable) {
    CountOutcome("unavailable");
  } else {
    CountOutcome("error");
  }
  inflight_gauge_.Decrement();
  --inflight_;
  return result;
}

epd::v1::Job RouterCore::BaseJob(const RequestState& state, const Plan& plan) const {
  const PreparedRequest& req = state.request;
  const auto& streamed = state.assembler.token_ids();
  epd::v1::Job base;
  // Workers key hand-offs and cancellation by the job's id, and a worker of the failed attempt
  // may still be tearing that job down: a re-dispatch or migration gets its own id.
  base.set_request_id(state.attempt <= 1 ? req.spec.request_id
                                         : absl::StrCat(req.spec.request_id, "~", state.attempt));
  base.mutable_prompt_ids()->Add(req.prompt_ids.begin(), req.prompt_ids.end());
  base.mutable_prompt_ids()->Add(streamed.begin(), streamed.end());
  base.set_cached_tokens(plan.cached_tokens);
  *base.mutable_sampling() = req.spec.sampling;
  base.mutable_sampling()->set_max_tokens(req.max_tokens - static_cast<int32_t>(streamed.size()));
  base.set_model(req.spec.model);
  base.set_config_fingerprint(plan.fingerprint);
  if (state.deadline_unix_ms > 0) base.set_deadline_unix_ms(state.deadline_unix_ms);
  return base;
}

RouterCore::DecodeRead RouterCore::ReadDecode(RequestState& state, const Plan& plan,
                                              JobStream& decode, ActiveRun& run) {
  DecodeRead r;
  epd::v1::SubmitResponse m;
  while (decode.Read(&m)) {
    if (!m.error().empty()) {
      r.error = StageError(m, absl::StrCat("decode worker '", plan.decode.id, "'"));
      run.cancel();
      break;
    }
    if (m.has_cached_tokens()) r.cached = m.cached_tokens();
    if (m.token_ids_size() > 0) {
      const int64_t now = clock_.NowMonoNs();
      if (state.last_token_ns == 0) {
        ttft_.Observe((now - state.start_ns) / 1e9);
      } else {
        const double gap = (now - state.last_token_ns) / 1e9 / m.token_ids_size();
        for (int k = 0; k < m.token_ids_size(); ++k) itl_.Observe(gap);
      }
      state.last_token_ns = now;
      generated_tokens_.Increment(m.token_ids_size());
    }
    Delta d;
    if (absl::Status added = state.assembler.Add(m, &d); !added.ok()) {
      r.error = absl::InternalError(
          absl::StrCat("decode worker '", plan.decode.id, "' ", added.message()));
      run.cancel();
      break;
    }
    if (!DeltaEmpty(d) && !state.observer->OnDelta(d)) {
      r.cancelled = true;
      run.cancel();
      break;
    }
    if (state.assembler.stopped()) {
      run.cancel();  // the worker need not generate past the stop string
      break;
    }
  }
  return r;
}

RouterCore::AttemptResult RouterCore::RunAttempt(RequestState& state, const Plan& plan) {
  const bool continuation = state.assembler.any_tokens();
  ++state.attempt;
  std::vector<StageJob> chain = BuildChain(BaseJob(state, plan), plan);
  const StageJob decode_job = chain.back();
  chain.pop_back();
  state.decode_worker = plan.decode.id;

  // Every stage gets its job now (decode first: it is the one that waits longest); a stage
  // waits for its inbound hand-off keyed by request_id.
  auto run = std::make_shared<ActiveRun>();
  std::unique_ptr<JobStream> decode = client_.Submit(plan.decode, decode_job.job);
  SideStages sides(
      client_, registry_, watchers_, chain, [d = decode.get()] { d->Cancel(); },
      [this, run](const std::string& worker_id) { Unlist(run, worker_id); });
  run->cancel = [&decode, &sides] {
    decode->Cancel();
    sides.CancelAll();
  };
  {
    absl::MutexLock lock(&runs_mu_);
    runs_.emplace(plan.decode.id, run);
    for (const auto& stage : chain) runs_.emplace(stage.worker.id, run);
  }
  sides.Start();

  // Stage watching of the decode stream; output assembly turns its tokens into deltas.
  DecodeRead read = ReadDecode(state, plan, *decode, *run);
  int32_t cached = read.cached.value_or(plan.encoder ? plan.cached_tokens : 0);
  const absl::Status& error = read.error;
  const bool cancelled = read.cancelled, finished = state.assembler.finished();
  const absl::Status fin = decode->Finish();
  std::string lost;
  {
    absl::MutexLock lock(&run->mu);
    run->done = true;  // from here FailWorker no longer reaches into this attempt's streams
    lost = run->lost;
  }
  sides.Stop();
  {
    absl::MutexLock lock(&runs_mu_);
    for (auto it = runs_.begin(); it != runs_.end();) {
      it = it->second == run ? runs_.erase(it) : std::next(it);
    }
  }
  if (!continuation) {
    if (auto e = sides.encoder_cached()) cached = *e;
    state.cached_tokens = cached;
  }
  const bool streamed_any = state.assembler.any_tokens();
  if (cancelled) return {absl::CancelledError("client disconnected")};
  if (!lost.empty()) {
    return {ApiError(absl::StatusCode::kUnavailable,
                     absl::StrCat(lost, streamed_any ? " mid-generation" : ""), "",
                     "worker_failed"),
            /*worker_lost=*/true};
  }
  const bool stopped = state.assembler.stopped();
  // A decode worker found unreachable is dropped even when a side stage failed first (its
  // hand-off to that worker is what failed): the retry must not pick it again.
  const bool unreachable = !stopped && fin.code() == absl::StatusCode::kUnavailable;
  if (unreachable) {
    registry_.MarkFailed(plan.decode.id, std::string(fin.message()));
    client_.Forget(plan.decode);
  }
  if (!sides.error().ok()) return {sides.error()};
  if (!error.ok()) return {error};
  if (!stopped && !fin.ok()) {
    return {ApiError(absl::StatusCode::kUnavailable,
                     absl::StrCat("decode worker '", plan.decode.id, "' failed",
                                  streamed_any ? " mid-generation" : "", ": ", fin.message()),
                     "", "worker_failed"),
            unreachable};
  }
  if (!stopped && !finished) {
    return {absl::InternalError(absl::StrCat("decode worker '", plan.decode.id,
                                             "' ended the stream without a finish reason"))};
  }
  return {absl::OkStatus()};
}

}  // namespace epd::services::router
