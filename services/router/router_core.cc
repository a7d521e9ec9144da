#include "services/router/router_core.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "services/router/request_validator.h"

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
                          .Add({})) {
  for (const char* o : {"ok", "rejected", "unavailable", "error", "cancelled"}) {
    requests_.Add({{"outcome", o}});
  }
}

void RouterCore::FailWorker(const std::string& worker_id, const std::string& reason) {
  absl::MutexLock lock(&runs_mu_);
  auto [begin, end] = runs_.equal_range(worker_id);
  for (auto it = begin; it != end; ++it) {
    if (it->second->lost.empty()) {
      it->second->lost = absl::StrCat("worker '", worker_id, "' lost (", reason, ")");
    }
    it->second->cancel();
  }
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

absl::StatusOr<Outcome> RouterCore::Run(const PreparedRequest& request, StreamObserver* observer) {
  ++inflight_;
  inflight_gauge_.Increment();
  const int64_t start_ns = clock_.NowMonoNs();
  absl::StatusOr<Outcome> result = absl::UnavailableError("no attempt made");
  for (int attempt = 1; attempt <= options_.max_attempts; ++attempt) {
    auto plan = scheduler_.Schedule(request.prompt_ids);
    if (!plan.ok()) {
      result = ApiError(absl::StatusCode::kUnavailable, std::string(plan.status().message()), "",
                        "no_workers");
      break;
    }
    bool streamed_any = false;
    result = RunOnce(request, *plan, observer, &streamed_any);
    scheduler_.Release(*plan);
    if (result.ok() || result.status().code() != absl::StatusCode::kUnavailable || streamed_any ||
        attempt == options_.max_attempts) {
      break;
    }
    spdlog::warn("request {}: attempt {} failed before any token ({}); dispatching again",
                 request.spec.request_id, attempt, std::string(result.status().message()));
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

absl::StatusOr<Outcome> RouterCore::RunOnce(const PreparedRequest& request, const Plan& plan,
                                            StreamObserver* observer, bool* streamed_any) {
  const int64_t start_ns = clock_.NowMonoNs();
  const PreparedRequest& req = request;
  epd::v1::Job base;
  base.set_request_id(req.spec.request_id);
  base.mutable_prompt_ids()->Add(req.prompt_ids.begin(), req.prompt_ids.end());
  base.set_cached_tokens(plan.cached_tokens);
  *base.mutable_sampling() = req.spec.sampling;
  base.set_model(req.spec.model);
  base.set_config_fingerprint(plan.fingerprint);
  if (options_.request_timeout_ms > 0) {
    base.set_deadline_unix_ms(clock_.NowUnixMs() + options_.request_timeout_ms);
  }

  // The chain: encoder -> prefill -> decode, with absent pools skipped.
  std::vector<std::pair<WorkerInfo, epd::v1::Pool>> chain;
  if (plan.encoder) chain.emplace_back(*plan.encoder, epd::v1::POOL_ENCODER);
  if (plan.prefill) chain.emplace_back(*plan.prefill, epd::v1::POOL_PREFILL);
  chain.emplace_back(plan.decode, epd::v1::POOL_DECODE);
  std::vector<epd::v1::Job> jobs(chain.size(), base);
  for (size_t i = 0; i < chain.size(); ++i) {
    jobs[i].set_stage(chain[i].second);
    jobs[i].set_final_stage(i + 1 == chain.size());
    if (i > 0) {
      jobs[i].set_prev_worker_id(chain[i - 1].first.id);
      jobs[i].set_prev_transfer_address(chain[i - 1].first.transfer_address);
    }
    if (i + 1 < chain.size()) {
      jobs[i].set_next_worker_id(chain[i + 1].first.id);
      jobs[i].set_next_transfer_address(chain[i + 1].first.transfer_address);
    }
  }

  // Every stage gets its job now (decode first: it is the one that waits longest); a stage
  // waits for its inbound hand-off keyed by request_id.
  std::unique_ptr<JobStream> decode = client_.Submit(plan.decode, jobs.back());
  absl::Mutex mu;
  absl::Status side_error;   // guarded by mu
  bool decode_done = false;  // guarded by mu
  // The prefix the encoder actually reused (its messages carry it, docs/workers.md); it replaces
  // the scheduler's hint in usage. Guarded by mu.
  std::optional<int32_t> encoder_cached;
  struct Side {
    WorkerInfo worker;
    std::unique_ptr<JobStream> stream;
    std::thread thread;
  };
  std::vector<Side> sides(chain.size() - 1);
  for (size_t i = chain.size() - 1; i-- > 0;) {
    sides[i].worker = chain[i].first;
    sides[i].stream = client_.Submit(chain[i].first, jobs[i]);
  }
  for (auto& side : sides) {
    side.thread = std::thread([&, s = &side] {
      epd::v1::SubmitResponse m;
      absl::Status st;
      bool handed_off = false;
      while (s->stream->Read(&m)) {
        if (!m.error().empty()) {
          st = absl::InternalError(absl::StrCat(PoolName(s->worker.pool), " worker '", s->worker.id,
                                                "' failed: ", m.error()));
        }
        if (m.finish_reason() == "handoff") handed_off = true;
        if (s->worker.pool == PoolKind::kEncoder && m.has_cached_tokens()) {
          absl::MutexLock lock(&mu);
          encoder_cached = m.cached_tokens();
        }
      }
      absl::Status fin = s->stream->Finish();
      absl::MutexLock lock(&mu);
      if (decode_done) return;
      if (st.ok() && !fin.ok()) {
        st = absl::Status(fin.code(), absl::StrCat(PoolName(s->worker.pool), " worker '",
                                                   s->worker.id, "' failed: ", fin.message()));
        if (fin.code() == absl::StatusCode::kUnavailable) {
          registry_.MarkFailed(s->worker.id, std::string(fin.message()));
          client_.Forget(s->worker);
        }
      }
      if (st.ok() && !handed_off) {
        st = absl::InternalError(absl::StrCat(PoolName(s->worker.pool), " worker '", s->worker.id,
                                              "' ended its stream without a hand-off"));
      }
      if (!st.ok()) {
        if (side_error.ok()) side_error = st;
        decode->Cancel();
      }
    });
  }

  Outcome out;
  out.prompt_tokens = static_cast<int32_t>(req.prompt_ids.size());
  // Only the encoder reuses a stored prefix; it reports what it used (below).
  out.cached_tokens = plan.encoder ? plan.cached_tokens : 0;
  out.decode_worker = plan.decode.id;
  const bool thinking = req.thinking;
  // One state per choice (sampling.n > 1: the decode worker forks the sequence after the one
  // hand-off and tags each message with its choice's index).
  const int n = std::max(1, req.spec.sampling.n());
  struct ChoiceRun {
    ChoiceRun(const TextCodec& codec, std::vector<std::string> stops, bool thinking,
              bool parse_tools)
        : detok(codec.NewDetokenizer()),
          stop(std::move(stops)),
          splitter(codec.Markers(), thinking, parse_tools) {}
    std::unique_ptr<Detokenizer> detok;
    StopMatcher stop;
    AssistantSplitter splitter;
    std::string full_text;  // after stop strings
    std::string streamed_content;
    std::string finish_reason;
    std::string raw;  // all detokenized text (reasoning_tokens: tokens up to </think>)
    bool stopped = false, done = false, think_ended = false;
    int32_t reasoning_tokens = 0;
    std::vector<int32_t> token_ids;
    std::vector<TokenLogprobs> logprobs;
  };
  std::vector<std::unique_ptr<ChoiceRun>> choices;
  const std::vector<std::string> stop_strings(req.spec.sampling.stop().begin(),
                                              req.spec.sampling.stop().end());
  for (int i = 0; i < n; ++i) {
    choices.push_back(
        std::make_unique<ChoiceRun>(codec_, stop_strings, thinking, req.spec.parse_tools));
  }
  const std::string think_end = codec_.Markers().think_end;
  absl::Status error;
  bool cancelled = false, stopped = false;  // stopped: every choice ended, the last by a stop
  int64_t last_token_ns = 0;
  const auto cancel_all = [&] {
    decode->Cancel();
    for (auto& side : sides) side.stream->Cancel();
  };
  ActiveRun run;
  run.cancel = cancel_all;
  {
    absl::MutexLock lock(&runs_mu_);
    for (const auto& [w, pool] : chain) runs_.emplace(w.id, &run);
  }

  epd::v1::SubmitResponse m;
  while (decode->Read(&m)) {
    if (!m.error().empty()) {
      error = absl::InternalError(
          absl::StrCat("decode worker '", plan.decode.id, "' failed: ", m.error()));
      cancel_all();
      break;
    }
    if (m.has_cached_tokens()) out.cached_tokens = m.cached_tokens();
    if (m.index() < 0 || m.index() >= n) {
      error = absl::InternalError(absl::StrCat("decode worker '", plan.decode.id,
                                               "' sent choice ", m.index(), " of ", n));
      cancel_all();
      break;
    }
    ChoiceRun& ch = *choices[static_cast<size_t>(m.index())];
    if (ch.done) continue;  // a choice cut by a stop string: the rest of it is dropped
    std::string text;
    for (int32_t id : m.token_ids()) {
      ch.token_ids.push_back(id);
      const std::string t = ch.detok->Push(id);
      text += t;
      if (thinking && !ch.think_ended) {
        ++ch.reasoning_tokens;
        ch.raw += t;
        ch.think_ended = ch.raw.find(think_end) != std::string::npos;
      }
    }
    std::vector<TokenLogprobs> lps;
    if (req.logprobs_top >= 0) {
      // Per token: the chosen entry, then the worker's top max(1, n) (we asked for that many).
      const int per = 1 + std::max(1, req.logprobs_top);
      if (m.top_logprobs_size() != per * m.token_ids_size()) {
        error = absl::InternalError(absl::StrCat(
            "decode worker '", plan.decode.id, "' sent ", m.top_logprobs_size(),
            " logprob entries for ", m.token_ids_size(), " tokens (expected ", per, " each)"));
        cancel_all();
        break;
      }
      for (int i = 0; i < m.token_ids_size(); ++i) {
        const auto& chosen = m.top_logprobs(i * per);
        TokenLogprobs t{chosen.token_id(), chosen.logprob(), {}};
        for (int j = 1; j <= req.logprobs_top; ++j) {
          const auto& e = m.top_logprobs(i * per + j);
          t.top.emplace_back(e.token_id(), e.logprob());
        }
        lps.push_back(std::move(t));
      }
      ch.logprobs.insert(ch.logprobs.end(), lps.begin(), lps.end());
    }
    if (!m.finish_reason().empty()) ch.finish_reason = m.finish_reason();
    if (m.token_ids_size() > 0) {
      const int64_t now = clock_.NowMonoNs();
      if (last_token_ns == 0) {
        ttft_.Observe((now - start_ns) / 1e9);
      } else {
        const double gap = (now - last_token_ns) / 1e9 / m.token_ids_size();
        for (int k = 0; k < m.token_ids_size(); ++k) itl_.Observe(gap);
      }
      last_token_ns = now;
      generated_tokens_.Increment(m.token_ids_size());
    }
    const std::string released = ch.stop.Push(text, &ch.stopped);
    ch.full_text += released;
    Delta d = ch.splitter.Push(released);
    d.index = m.index();
    d.token_ids.assign(m.token_ids().begin(), m.token_ids().end());
    d.logprobs = std::move(lps);
    ch.streamed_content += d.content;
    if (!DeltaEmpty(d)) {
      *streamed_any = true;
      if (!observer->OnDelta(d)) {
        cancelled = true;
        cancel_all();
        break;
      }
    }
    if (ch.stopped) {
      ch.finish_reason = "stop";
      ch.done = true;
      bool all = true;
      for (const auto& c : choices) all = all && c->done;
      if (all) {
        stopped = true;
        cancel_all();  // the worker need not generate past the stop string
        break;
      }
      continue;
    }
    if (!m.finish_reason().empty()) ch.done = true;
  }
  absl::Status fin = decode->Finish();
  {
    absl::MutexLock lock(&mu);
    decode_done = true;
  }
  for (auto& side : sides) {
    side.stream->Cancel();  // no-op for a stage that already handed off
    side.thread.join();
  }
  std::string lost;
  {
    absl::MutexLock lock(&runs_mu_);
    lost = run.lost;
    for (auto it = runs_.begin(); it != runs_.end();) {
      it = it->second == &run ? runs_.erase(it) : std::next(it);
    }
  }
  out.completion_tokens = 0;
  for (const auto& c : choices) {
    out.completion_tokens += static_cast<int32_t>(c->token_ids.size());
    out.reasoning_tokens += c->reasoning_tokens;
  }
  {
    absl::MutexLock lock(&mu);
    if (encoder_cached) out.cached_tokens = *encoder_cached;
  }
  if (cancelled) return absl::CancelledError("client disconnected");
  if (!lost.empty()) {
    return ApiError(absl::StatusCode::kUnavailable,
                    absl::StrCat(lost, *streamed_any ? " mid-generation" : ""), "",
                    "worker_failed");
  }
  if (!side_error.ok()) return side_error;
  if (!error.ok()) return error;
  if (!stopped && !fin.ok()) {
    if (fin.code() == absl::StatusCode::kUnavailable) {
      registry_.MarkFailed(plan.decode.id, std::string(fin.message()));
      client_.Forget(plan.decode);
    }
    return ApiError(absl::StatusCode::kUnavailable,
                    absl::StrCat("decode worker '", plan.decode.id, "' failed",
                                 *streamed_any ? " mid-generation" : "", ": ", fin.message()),
                    "", "worker_failed");
  }
  for (const auto& c : choices) {
    if (!stopped && !c->stopped && c->finish_reason.empty()) {
      return absl::InternalError(absl::StrCat("decode worker '", plan.decode.id,
                                              "' ended the stream without a finish reason"));
    }
  }
  for (int idx = 0; idx < n; ++idx) {
    ChoiceRun& ch = *choices[static_cast<size_t>(idx)];
    // Drain what the detokenizer, stop matcher and splitter still hold.
    std::string tail;
    if (!ch.stopped) {
      tail = ch.stop.Push(ch.detok->Flush(), &ch.stopped);
      if (!ch.stopped) tail += ch.stop.Flush();
    }
    ch.full_text += tail;
    Delta last = ch.splitter.Push(tail);
    last.index = idx;
    Delta fin_delta = ch.splitter.Finish();
    last.reasoning += fin_delta.reasoning;
    last.content += fin_delta.content;
    Choice c;
    c.parsed = codec_.ParseAssistant(ch.full_text, thinking, req.spec.parse_tools);
    // Whatever the final parse put in content beyond what was streamed (e.g. a tool-call block
    // that did not parse) goes out now.
    ch.streamed_content += last.content;
    if (c.parsed.content.size() > ch.streamed_content.size() &&
        c.parsed.content.compare(0, ch.streamed_content.size(), ch.streamed_content) == 0) {
      last.content += c.parsed.content.substr(ch.streamed_content.size());
    }
    c.finish_reason = ch.finish_reason;
    if (!c.parsed.tool_calls.empty()) {
      c.finish_reason = "tool_calls";
      for (size_t i = 0; i < c.parsed.tool_calls.size(); ++i) {
        if (c.parsed.tool_calls[i].id.empty()) {
          c.parsed.tool_calls[i].id =
              idx == 0 ? absl::StrCat("call_", req.spec.request_id, "_", i)
                       : absl::StrCat("call_", req.spec.request_id, "_", idx, "_", i);
        }
      }
    }
    c.token_ids = std::move(ch.token_ids);
    c.logprobs = std::move(ch.logprobs);
    c.reasoning_tokens = ch.reasoning_tokens;
    if (!DeltaEmpty(last)) observer->OnDelta(last);
    out.choices.push_back(std::move(c));
  }
  out.finish_reason = out.choices[0].finish_reason;
  out.parsed = out.choices[0].parsed;
  out.token_ids = out.choices[0].token_ids;
  out.logprobs = out.choices[0].logprobs;
  return out;
}

}  // namespace epd::services::router
