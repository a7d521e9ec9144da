// RouterCore with in-process scripted workers: validation errors, streaming equals the final
// result, cancellation reaches every stage, a dead decode worker fails only its request and is
// dropped, re-dispatch before the first token, request migration after it (docs/router.md), and
// the OpenAI request parser.
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "services/router/byte_text_codec.h"
#include "services/router/openai_http.h"
#include "services/router/output_assembly.h"
#include "services/router/request_validator.h"

namespace epd::services::router {
namespace {

struct Script {
  std::vector<epd::v1::SubmitResponse> messages;
  absl::Status status;              // the stream's final status
  bool block_until_cancel = false;  // after the messages, wait for Cancel
  bool broken = false;              // Finish reports `status` even after a Cancel (the
                                    // connection had broken before the router cancelled)
};

class ScriptedStream final : public JobStream {
 public:
  explicit ScriptedStream(Script s) : script_(std::move(s)) {}
  bool Read(epd::v1::SubmitResponse* out) override {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return false;
    if (next_ < script_.messages.size()) {
      *out = script_.messages[next_++];
      return true;
    }
    if (script_.block_until_cancel) mu_.Await(absl::Condition(&cancelled_));
    return false;
  }
  absl::Status Finish() override {
    absl::MutexLock lock(&mu_);
    return cancelled_ && !script_.broken ? absl::CancelledError("cancelled") : script_.status;
  }
  void Cancel() override {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) ++*cancels;
    cancelled_ = true;
  }
  std::shared_ptr<int> cancels = std::make_shared<int>(0);

 private:
  absl::Mutex mu_;
  Script script_;
  size_t next_ = 0;
  bool cancelled_ = false;
};

class ScriptedClient final : public WorkerClient {
 public:
  std::function<Script(const WorkerInfo&, const epd::v1::Job&)> script;
  std::unique_ptr<JobStream> Submit(const WorkerInfo& w, const epd::v1::Job& job) override {
    auto s = std::make_unique<ScriptedStream>(script(w, job));
    absl::MutexLock lock(&mu);
    jobs.push_back({w.id, job});
    cancels[w.id] = s->cancels;
    return s;
  }
  void Forget(const WorkerInfo& w) override {
    absl::MutexLock lock(&mu);
    forgotten.push_back(w.id);
  }
  int Cancels(const std::string& id) {
    absl::MutexLock lock(&mu);
    return cancels.count(id) ? *cancels[id] : 0;
  }
  absl::Mutex mu;
  std::vector<std::pair<std::string, epd::v1::Job>> jobs;
  std::map<std::string, std::shared_ptr<int>> cancels;
  std::vector<std::string> forgotten;
};

epd::v1::SubmitResponse Tokens(const std::string& text, const std::string& finish = "") {
  epd::v1::SubmitResponse r;
  for (unsigned char c : text) r.add_token_ids(c);
  r.set_finish_reason(finish);
  return r;
}

// Emits `text` one byte per message.
Script Bytes(const std::string& text, const std::string& finish = "stop") {
  Script s;
  for (size_t i = 0; i < text.size(); ++i) {
    s.messages.push_back(Tokens(text.substr(i, 1), i + 1 == text.size() ? finish : ""));
  }
  return s;
}

class Recorder final : public StreamObserver {
 public:
  bool OnDelta(const Delta& d) override {
    reasoning += d.reasoning;
    content += d.content;
    tokens += d.token_ids.size();
    ++calls;
    return calls < give_up_after;
  }
  std::string reasoning, content;
  size_t tokens = 0;
  int calls = 0;
  int give_up_after = 1 << 30;
};

WorkerInfo Worker(const std::string& id, PoolKind pool) {
  WorkerInfo w;
  w.id = id;
  w.pool = pool;
  w.control_address = "addr-" + id;
  w.transfer_address = "xfer-" + id;
  w.fingerprint = "fp";
  w.model = "m";
  return w;
}

class RouterCoreTest : public ::testing::Test {
 protected:
  RouterCoreTest()
      : registry_(RegistryOptions{}, clock_, metrics_),
        scheduler_(SchedulerOptions{}, registry_, oracle_, metrics_),
        core_(Options(), codec_, registry_, scheduler_, client_, clock_, metrics_) {}
  static CoreOptions Options() {
    CoreOptions o;
    o.model = "m";
    o.context_length = 256;
    o.max_tokens_limit = 16;
    o.default_max_tokens = 8;
    return o;
  }
  GenerateSpec Completion(const std::string& prompt, int max_tokens = 0) {
    GenerateSpec s;
    s.request_id = "r1";
    s.model = "m";
    s.prompt_text = prompt;
    s.sampling.set_max_tokens(max_tokens);
    return s;
  }
  std::string Scrape() { return prometheus::TextSerializer().Serialize(metrics_.Collect()); }

  common::FakeClock clock_;
  prometheus::Registry metrics_;
  ByteTextCodec codec_;
  NoPrefixOracle oracle_;
  ScriptedClient client_;
  Registry registry_;
  Scheduler scheduler_;
  RouterCore core_;
};

TEST_F(RouterCoreTest, PrepareNamesTheParamAndCode) {
  auto e = core_.Prepare(Completion(std::string(256, 'x')));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrorParam(e.status()), "prompt");
  EXPECT_EQ(ErrorCode(e.status()), "context_length_exceeded");
  e = core_.Prepare(Completion("hi", 17));
  EXPECT_EQ(ErrorParam(e.status()), "max_tokens");
  EXPECT_EQ(ErrorCode(e.status()), "max_tokens_exceeded");
  e = core_.Prepare(Completion(std::string(250, 'x'), 15));
  EXPECT_EQ(ErrorCode(e.status()), "context_length_exceeded");
  EXPECT_EQ(ErrorParam(e.status()), "max_tokens");
  auto spec = Completion("hi");
  spec.model = "zzz";
  EXPECT_EQ(core_.Prepare(spec).status().code(), absl::StatusCode::kNotFound);
  spec = Completion("");
  EXPECT_EQ(ErrorParam(core_.Prepare(spec).status()), "prompt");
  spec = Completion("");
  spec.prompt_ids = std::vector<int32_t>{1, 300};
  EXPECT_EQ(ErrorParam(core_.Prepare(spec).status()), "prompt");
  // Default max_tokens: min(default, context - prompt).
  auto ok = core_.Prepare(Completion(std::string(252, 'x')));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->max_tokens, 4);
  EXPECT_EQ(core_.Prepare(Completion("hi"))->max_tokens, 8);
}

TEST_F(RouterCoreTest, NoWorkerIsUnavailable) {
  auto req = core_.Prepare(Completion("hi"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ErrorCode(out.status()), "no_workers");
}

TEST_F(RouterCoreTest, StreamedDeltasEqualTheFinalParseAndUsageCounts) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  const std::string out_text = "ponder</think>Hi \xE4\xB8\x96!" +
                               RenderDsmlToolCalls({{"", "f", R"({"x":1})"}});
  client_.script = [&](const WorkerInfo&, const epd::v1::Job& job) {
    auto s = Bytes(out_text);
    s.messages[0].set_cached_tokens(3);
    return s;
  };
  GenerateSpec spec;
  spec.request_id = "r";
  spec.model = "m";
  spec.chat.emplace();
  spec.chat->thinking = true;
  spec.chat->messages = {{.role = "user", .content = "q"}};
  spec.parse_tools = true;
  auto req = core_.Prepare(spec);
  ASSERT_TRUE(req.ok());
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(rec.reasoning, "ponder");
  EXPECT_EQ(rec.content, "Hi \xE4\xB8\x96!");
  EXPECT_EQ(out->parsed.reasoning, rec.reasoning);
  EXPECT_EQ(out->parsed.content, rec.content);
  ASSERT_EQ(out->parsed.tool_calls.size(), 1u);
  EXPECT_EQ(out->parsed.tool_calls[0].id, "call_r_0");
  EXPECT_EQ(out->finish_reason, "tool_calls");
  EXPECT_EQ(out->completion_tokens, static_cast<int>(out_text.size()));
  EXPECT_EQ(out->cached_tokens, 3);
  EXPECT_EQ(out->prompt_tokens, static_cast<int>(req->prompt_ids.size()));
  // The job carried the prompt and the sampling limits; decode ran alone and is final.
  ASSERT_EQ(client_.jobs.size(), 1u);
  const auto& job = client_.jobs[0].second;
  EXPECT_TRUE(job.final_stage());
  EXPECT_EQ(job.stage(), epd::v1::POOL_DECODE);
  EXPECT_EQ(job.prompt_ids_size(), static_cast<int>(req->prompt_ids.size()));
  EXPECT_EQ(job.sampling().max_tokens(), 8);
  EXPECT_EQ(job.config_fingerprint(), "fp");
  EXPECT_EQ(job.deadline_unix_ms(), clock_.NowUnixMs() + 30 * 60 * 1000);
  const std::string m = Scrape();
  EXPECT_NE(m.find("epd_requests_total{outcome=\"ok\"} 1"), std::string::npos);
  EXPECT_NE(m.find("epd_cached_tokens_total 3"), std::string::npos);
  EXPECT_NE(m.find("epd_ttft_seconds_count 1"), std::string::npos);
}

TEST_F(RouterCoreTest, StopStringEndsTheRequestAndCancelsTheWorker) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    auto s = Bytes("abc END more");
    s.block_until_cancel = true;
    return s;
  };
  auto spec = Completion("hi");
  spec.sampling.add_stop("END");
  auto req = core_.Prepare(spec);
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(rec.content, "abc ");
  EXPECT_EQ(out->finish_reason, "stop");
  EXPECT_EQ(client_.Cancels("d0"), 1);
}

TEST_F(RouterCoreTest, ObserverGivingUpCancelsEveryStage) {
  ASSERT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder)).ok());
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo& w, const epd::v1::Job&) {
    Script s;
    if (w.pool == PoolKind::kDecode) {
      s = Bytes("0123456789");
    }
    s.block_until_cancel = true;  // side stages never hand off in this test
    return s;
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  rec.give_up_after = 3;
  auto out = core_.Run(*req, &rec);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kCancelled);
  for (const char* id : {"e0", "p0", "d0"}) EXPECT_GE(client_.Cancels(id), 1) << id;
  // The chain was wired: e0 -> p0 -> d0.
  std::map<std::string, epd::v1::Job> jobs;
  for (auto& [id, job] : client_.jobs) jobs[id] = job;
  EXPECT_EQ(jobs["e0"].next_worker_id(), "p0");
  EXPECT_EQ(jobs["e0"].next_transfer_address(), "xfer-p0");
  EXPECT_EQ(jobs["p0"].prev_worker_id(), "e0");
  EXPECT_EQ(jobs["p0"].next_worker_id(), "d0");
  EXPECT_EQ(jobs["d0"].prev_worker_id(), "p0");
  EXPECT_EQ(jobs["d0"].prev_transfer_address(), "xfer-p0");
  EXPECT_TRUE(jobs["e0"].prev_worker_id().empty());
  EXPECT_NE(Scrape().find("epd_requests_total{outcome=\"cancelled\"} 1"), std::string::npos);
}

TEST_F(RouterCoreTest, DecodeDeathMidGenerationFailsTheRequestAndDropsTheWorker) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    auto s = Bytes("abc", "");
    s.status = absl::UnavailableError("Socket closed");
    return s;
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ErrorCode(out.status()), "worker_failed");
  EXPECT_NE(out.status().message().find("mid-generation"), absl::string_view::npos);
  EXPECT_EQ(rec.content, "abc");
  EXPECT_EQ(registry_.Count(PoolKind::kDecode), 0);
  EXPECT_EQ(client_.forgotten, std::vector<std::string>{"d0"});
  EXPECT_EQ(client_.jobs.size(), 1u);  // tokens were streamed: no second attempt
}

TEST_F(RouterCoreTest, FailWorkerEndsItsHangingRequests) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    auto s = Bytes("ab", "");
    s.block_until_cancel = true;  // a hung worker: the stream neither ends nor fails
    return s;
  };
  class FailOnFirst final : public StreamObserver {
   public:
    explicit FailOnFirst(RouterCore& core) : core_(core) {}
    bool OnDelta(const Delta&) override {
      if (++n_ == 1) core_.FailWorker("d0", "missed heartbeats");
      return true;
    }

   private:
    RouterCore& core_;
    int n_ = 0;
  } observer(core_);
  auto req = core_.Prepare(Completion("hello"));
  auto out = core_.Run(*req, &observer);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ErrorCode(out.status()), "worker_failed");
  EXPECT_NE(out.status().message().find("missed heartbeats"), absl::string_view::npos);
  EXPECT_EQ(client_.Cancels("d0"), 1);
  core_.FailWorker("d0", "again");  // no run left: a no-op
}

TEST_F(RouterCoreTest, UnreachableWorkerBeforeAnyTokenIsRetriedElsewhere) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo& w, const epd::v1::Job&) {
    if (client_.jobs.empty()) {  // the first pick is dead
      Script s;
      s.status = absl::UnavailableError("connection refused");
      return s;
    }
    return Bytes("ok");
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(rec.content, "ok");
  ASSERT_EQ(client_.jobs.size(), 2u);
  EXPECT_NE(client_.jobs[0].first, client_.jobs[1].first);
  EXPECT_EQ(registry_.Count(PoolKind::kDecode), 1);
}

TEST_F(RouterCoreTest, SideStageErrorFailsTheRequestAndCancelsDecode) {
  ASSERT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder)).ok());
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo& w, const epd::v1::Job&) {
    Script s;
    if (w.pool == PoolKind::kEncoder) {
      epd::v1::SubmitResponse r;
      r.set_finish_reason("handoff");
      s.messages.push_back(r);
    } else if (w.pool == PoolKind::kPrefill) {
      epd::v1::SubmitResponse r;
      r.set_error("manifest mismatch: entry_count");
      s.messages.push_back(r);
    } else {
      s.block_until_cancel = true;  // decode waits for a hand-off that never comes
    }
    return s;
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(out.status().message().find("entry_count"), absl::string_view::npos);
  EXPECT_EQ(client_.Cancels("d0"), 1);
  EXPECT_EQ(registry_.Count(PoolKind::kPrefill), 1);  // a request error is not a dead worker
  EXPECT_EQ(client_.jobs.size(), 3u);                 // and it is not re-dispatched
}

// A hand-off whose peer just died (the worker reports error_code UNAVAILABLE, e.g. "Send: peer 3
// is not connected") is a property of the cluster, not of the request: the request is
// dispatched again, and the decode worker whose stream broke is dropped from the registry.
TEST_F(RouterCoreTest, HandoffToAPeerThatJustDiedIsRedispatched) {
  ASSERT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder)).ok());
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  std::string dead;
  int prefill_jobs = 0;
  client_.script = [&](const WorkerInfo& w, const epd::v1::Job& job) {
    Script s;
    epd::v1::SubmitResponse r;
    if (w.pool == PoolKind::kDecode) {
      if (dead.empty()) {  // the first decode worker dies before its hand-off arrives
        dead = w.id;
        s.status = absl::UnavailableError("Socket closed");
        s.block_until_cancel = true;  // the router notices once the hand-off failed
        s.broken = true;
        return s;
      }
      return Bytes("ok");
    }
    if (w.pool == PoolKind::kPrefill && ++prefill_jobs == 1) {
      EXPECT_EQ(job.next_worker_id(), dead);
      r.set_error("prefill -> decode hand-off: Send: peer 3 is not connected");
      r.set_error_code("UNAVAILABLE");
    } else {
      r.set_finish_reason("handoff");
    }
    s.messages.push_back(r);
    return s;
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(rec.content, "ok");
  EXPECT_EQ(prefill_jobs, 2);
  EXPECT_EQ(registry_.Count(PoolKind::kPrefill), 1);  // the sender is fine
  EXPECT_EQ(registry_.Count(PoolKind::kDecode), 1);   // the dead decode worker is dropped
  EXPECT_NE(out->decode_worker, dead);
}

TEST_F(RouterCoreTest, DecodeReportingUnavailableBeforeAnyTokenIsRedispatched) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    if (client_.jobs.empty()) {
      Script s;
      epd::v1::SubmitResponse r;
      r.set_error("prefill -> decode hand-off: UCX peer is not connected");
      r.set_error_code("UNAVAILABLE");
      r.set_finish_reason("error");
      s.messages.push_back(r);
      return s;
    }
    return Bytes("ok");
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(rec.content, "ok");
  EXPECT_EQ(client_.jobs.size(), 2u);
}

std::vector<int32_t> Ids(const std::string& text) {
  return std::vector<int32_t>(text.begin(), text.end());
}

std::vector<int32_t> JobPrompt(const epd::v1::Job& job) {
  return std::vector<int32_t>(job.prompt_ids().begin(), job.prompt_ids().end());
}

TEST_F(RouterCoreTest, DecodeDeathMidGenerationMigratesWithPromptPlusStreamedTokens) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    if (client_.jobs.empty()) {  // the first decode worker dies after three tokens
      auto s = Bytes("abc", "");
      s.status = absl::UnavailableError("Socket closed");
      return s;
    }
    return Bytes("dEFgh", "length");
  };
  auto spec = Completion("hello");
  spec.sampling.add_stop("EF");  // a stop string the continuation completes
  auto req = core_.Prepare(spec);
  ASSERT_TRUE(req.ok());
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  // One stream: what the first worker streamed, then the continuation, cut at the stop string.
  EXPECT_EQ(rec.content, "abcd");
  EXPECT_EQ(out->parsed.content, "abcd");
  EXPECT_EQ(out->finish_reason, "stop");
  ASSERT_EQ(client_.jobs.size(), 2u);
  EXPECT_NE(client_.jobs[0].first, client_.jobs[1].first);
  // The continuation is a fresh request of prompt + streamed tokens for the remaining budget,
  // with the same sampling and deadline, under its own job id (workers key hand-offs by it).
  const auto& first = client_.jobs[0].second;
  const auto& second = client_.jobs[1].second;
  std::vector<int32_t> expected = JobPrompt(first);
  for (int32_t id : Ids("abc")) expected.push_back(id);
  EXPECT_EQ(JobPrompt(second), expected);
  EXPECT_EQ(second.sampling().max_tokens(), first.sampling().max_tokens() - 3);
  EXPECT_EQ(first.request_id(), "r1");
  EXPECT_EQ(second.request_id(), "r1~2");
  EXPECT_EQ(second.deadline_unix_ms(), first.deadline_unix_ms());
  EXPECT_EQ(out->prompt_tokens, static_cast<int>(req->prompt_ids.size()));
  EXPECT_EQ(out->decode_worker, client_.jobs[1].first);
  EXPECT_EQ(registry_.Count(PoolKind::kDecode), 1);
  const std::string m = Scrape();
  EXPECT_NE(m.find("epd_request_migrations_total{outcome=\"ok\"} 1"), std::string::npos) << m;
  EXPECT_NE(m.find("epd_requests_total{outcome=\"ok\"} 1"), std::string::npos);
}

TEST_F(RouterCoreTest, FailWorkerMidGenerationMigratesTheHungRequest) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  std::string hung;
  client_.script = [&](const WorkerInfo& w, const epd::v1::Job&) {
    if (hung.empty()) {
      hung = w.id;
      auto s = Bytes("ab", "");
      s.block_until_cancel = true;  // stopped (SIGSTOP): neither ends nor fails
      return s;
    }
    return Bytes("cd");
  };
  class FailOnSecond final : public StreamObserver {
   public:
    FailOnSecond(RouterCore& core, const std::string& worker) : core_(core), worker_(worker) {}
    bool OnDelta(const Delta& d) override {
      content += d.content;
      if (++n_ == 2) core_.FailWorker(worker_, "missed heartbeats");
      return true;
    }
    std::string content;

   private:
    RouterCore& core_;
    const std::string& worker_;
    int n_ = 0;
  } observer(core_, hung);
  auto req = core_.Prepare(Completion("hello"));
  auto out = core_.Run(*req, &observer);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(observer.content, "abcd");
  EXPECT_EQ(client_.Cancels(hung), 1);
  EXPECT_NE(Scrape().find("epd_request_migrations_total{outcome=\"ok\"} 1"), std::string::npos);
}

TEST_F(RouterCoreTest, MigrationLimitZeroFailsTheRequestAndCountsIt) {
  prometheus::Registry metrics;
  Registry registry(RegistryOptions{}, clock_, metrics);
  Scheduler scheduler(SchedulerOptions{}, registry, oracle_, metrics);
  CoreOptions options = Options();
  options.migration_limit = 0;
  RouterCore core(options, codec_, registry, scheduler, client_, clock_, metrics);
  ASSERT_TRUE(registry.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry.Register(Worker("d1", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    auto s = Bytes("abc", "");
    s.status = absl::UnavailableError("Socket closed");
    return s;
  };
  auto req = core.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core.Run(*req, &rec);
  EXPECT_EQ(ErrorCode(out.status()), "worker_failed");
  EXPECT_NE(out.status().message().find("mid-generation"), absl::string_view::npos);
  EXPECT_EQ(client_.jobs.size(), 1u);
  const std::string m = prometheus::TextSerializer().Serialize(metrics.Collect());
  EXPECT_NE(m.find("epd_request_migrations_total{outcome=\"limit\"} 1"), std::string::npos) << m;
}

TEST_F(RouterCoreTest, SecondDeathBeyondTheLimitFailsTheRequest) {
  for (const char* id : {"d0", "d1", "d2"}) {
    ASSERT_TRUE(registry_.Register(Worker(id, PoolKind::kDecode)).ok());
  }
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    auto s = Bytes("x", "");
    s.status = absl::UnavailableError("Socket closed");
    return s;
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  EXPECT_EQ(ErrorCode(out.status()), "worker_failed");
  EXPECT_EQ(rec.content, "xx");
  EXPECT_EQ(client_.jobs.size(), 2u);  // --migration-limit 1: one move, not two
  EXPECT_NE(Scrape().find("epd_request_migrations_total{outcome=\"failed\"} 1"),
            std::string::npos);
}

// sampling.n > 1: the decode worker's messages carry their choice's index; every choice keeps
// its own detokenizer, stop matcher, finish reason and token count (OutputAssembler).
TEST_F(RouterCoreTest, NChoicesKeepTheirOwnStateByIndex) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  auto tagged = [](const std::string& text, int index, const std::string& finish = "") {
    auto m = Tokens(text, finish);
    m.set_index(index);
    return m;
  };
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    Script s;
    s.messages = {tagged("ab", 0), tagged("xy", 1), tagged("c", 0, "length"),
                  tagged("Zq", 1)};  // choice 1 completes the stop string: every choice ended
    s.block_until_cancel = true;     // so the router must cut the stream itself
    return s;
  };
  class ByIndex final : public StreamObserver {
   public:
    bool OnDelta(const Delta& d) override {
      content[d.index] += d.content;
      return true;
    }
    std::map<int, std::string> content;
  } rec;
  auto spec = Completion("hello");
  spec.sampling.set_n(2);
  spec.sampling.add_stop("Z");
  auto req = core_.Prepare(spec);
  ASSERT_TRUE(req.ok()) << req.status();
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->choices.size(), 2u);
  EXPECT_EQ(rec.content[0], "abc");
  EXPECT_EQ(rec.content[1], "xy");
  EXPECT_EQ(out->choices[0].parsed.content, "abc");
  EXPECT_EQ(out->choices[0].finish_reason, "length");
  EXPECT_EQ(out->choices[1].parsed.content, "xy");
  EXPECT_EQ(out->choices[1].finish_reason, "stop");
  EXPECT_EQ(out->finish_reason, "length");   // choice 0's, mirrored
  EXPECT_EQ(out->completion_tokens, 3 + 4);  // every choice's tokens, the prompt once
  EXPECT_EQ(out->prompt_tokens, static_cast<int>(req->prompt_ids.size()));
  EXPECT_EQ(client_.Cancels("d0"), 1);
  ASSERT_EQ(client_.jobs.size(), 1u);  // one job (one hand-off) for both choices
  EXPECT_EQ(client_.jobs[0].second.sampling().n(), 2);

  // A message for a choice the request does not have fails it, naming the worker.
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    Script s;
    s.messages = {tagged("a", 0), tagged("b", 5, "stop")};
    return s;
  };
  auto bad = core_.Run(*req, &rec);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(bad.status().message().find("decode worker 'd0' sent choice 5 of 2"),
            absl::string_view::npos)
      << bad.status();
}

// Migration continues n == 1 requests only (docs/router.md): an n > 1 request whose decode worker
// dies mid-generation fails with worker_failed and is counted under outcome="limit".
TEST_F(RouterCoreTest, NChoicesAreNotMigrated) {
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d1", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo&, const epd::v1::Job&) {
    auto s = Bytes("ab", "");
    s.messages[1].set_index(1);
    s.status = absl::UnavailableError("Socket closed");
    return s;
  };
  auto spec = Completion("hello");
  spec.sampling.set_n(2);
  auto req = core_.Prepare(spec);
  ASSERT_TRUE(req.ok()) << req.status();
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  EXPECT_EQ(ErrorCode(out.status()), "worker_failed");
  EXPECT_EQ(rec.content, "ab");
  EXPECT_EQ(client_.jobs.size(), 1u);
  EXPECT_NE(Scrape().find("epd_request_migrations_total{outcome=\"limit\"} 1"),
            std::string::npos);
}

TEST_F(RouterCoreTest, EncoderDeathBeforeTheHandoffIsRetriedOnAnotherEncoder) {
  ASSERT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder)).ok());
  ASSERT_TRUE(registry_.Register(Worker("e1", PoolKind::kEncoder)).ok());
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  std::string dead;
  int decode_jobs = 0;
  client_.script = [&](const WorkerInfo& w, const epd::v1::Job&) {
    Script s;
    if (w.pool == PoolKind::kDecode) {
      if (decode_jobs++ == 0) {  // the first chain's encoder dies: its decode waits in vain
        s.block_until_cancel = true;
        return s;
      }
      return Bytes("ok");
    }
    if (w.pool == PoolKind::kEncoder && dead.empty()) dead = w.id;
    if (w.id == dead) {
      s.status = absl::UnavailableError("Socket closed");
    } else {
      epd::v1::SubmitResponse r;
      r.set_finish_reason("handoff");
      s.messages.push_back(r);
    }
    return s;
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(rec.content, "ok");
  EXPECT_EQ(decode_jobs, 2);
  EXPECT_EQ(registry_.Count(PoolKind::kEncoder), 1);  // the dead one is dropped
  EXPECT_EQ(client_.forgotten, std::vector<std::string>{dead});
}

TEST_F(RouterCoreTest, SideStageDeathAfterItsHandoffCostsTheRequestNothing) {
  ASSERT_TRUE(registry_.Register(Worker("e0", PoolKind::kEncoder)).ok());
  ASSERT_TRUE(registry_.Register(Worker("p0", PoolKind::kPrefill)).ok());
  ASSERT_TRUE(registry_.Register(Worker("d0", PoolKind::kDecode)).ok());
  client_.script = [&](const WorkerInfo& w, const epd::v1::Job&) {
    if (w.pool == PoolKind::kDecode) return Bytes("fine");
    Script s;
    epd::v1::SubmitResponse r;
    r.set_finish_reason("handoff");
    s.messages.push_back(r);
    s.status = absl::UnavailableError("Socket closed");  // killed right after the hand-off
    return s;
  };
  auto req = core_.Prepare(Completion("hello"));
  Recorder rec;
  auto out = core_.Run(*req, &rec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(rec.content, "fine");
  core_.FailWorker("p0", "missed heartbeats");  // not listed any more: a no-op
}

TEST(KeepBestOfTest, KeepsTheHighestMeanLogprobFirstAndReindexes) {
  Outcome out;
  auto choice = [](std::string text, std::vector<float> lps) {
    Choice c;
    c.parsed.content = std::move(text);
    c.finish_reason = "length";
    for (float lp : lps) c.logprobs.push_back({.token = 1, .logprob = lp});
    return c;
  };
  out.choices.push_back(choice("a", {-1.f, -3.f}));       // mean -2
  out.choices.push_back(choice("b", {-0.5f, -0.5f, -2.f}));  // mean -1
  out.choices.push_back(choice("c", {}));                  // no tokens: last
  out.choices.push_back(choice("d", {-1.f}));              // mean -1: tie with b, b is lower
  out.completion_tokens = 6;
  KeepBestOf(&out, 2);
  ASSERT_EQ(out.choices.size(), 2u);
  EXPECT_EQ(out.choices[0].parsed.content, "b");
  EXPECT_EQ(out.choices[1].parsed.content, "d");
  EXPECT_EQ(out.parsed.content, "b");  // choice 0's mirrors follow
  EXPECT_EQ(out.logprobs.size(), 3u);
  EXPECT_EQ(out.completion_tokens, 6);  // every sample stays billed
}

TEST(OpenAiParseTest, AcceptsTheUsualShapesAndNamesBadParams) {
  using nlohmann::json;
  bool stream = false, usage = false;
  json body = {{"model", "m"},
               {"messages",
                {{{"role", "system"}, {"content", "s"}},
                 {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a"}},
                                                 {{"type", "text"}, {"text", "b"}}}}},
                 {{"role", "assistant"},
                  {"content", nullptr},
                  {"tool_calls",
                   {{{"id", "c"},
                     {"type", "function"},
                     {"function", {{"name", "f"}, {"arguments", "{}"}}}}}}},
                 {{"role", "tool"}, {"tool_call_id", "c"}, {"content", "r"}}}},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"max_completion_tokens", 5},
               {"stop", {"x", "y"}},
               {"seed", 7},
               {"thinking", {{"type", "enabled"}}},
               {"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}}};
  auto spec = ParseOpenAiRequest(body, true, &stream, &usage);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(stream && usage);
  EXPECT_EQ(spec->chat->messages[1].content, "ab");
  EXPECT_EQ(spec->chat->messages[2].tool_calls[0].name, "f");
  EXPECT_TRUE(spec->chat->thinking);
  EXPECT_TRUE(spec->parse_tools);
  EXPECT_EQ(spec->sampling.max_tokens(), 5);
  EXPECT_EQ(spec->sampling.stop_size(), 2);
  EXPECT_EQ(spec->sampling.seed(), 7u);

  // The HTTP parse, then the validation it shares with gRPC (request_validator.h).
  CoreOptions options;
  options.model = "m";
  const auto param_of = [&](json b, bool chat = true) {
    auto s = ParseOpenAiRequest(b, chat, &stream, &usage);
    absl::Status st = s.ok() ? ValidateSpec(*s, options) : s.status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.dump();
    return ErrorParam(st);
  };
  const json base = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "q"}}}}};
  auto with = [&](const char* k, json v) {
    json b = base;
    b[k] = v;
    return b;
  };
  EXPECT_EQ(param_of(json::array()), "");
  EXPECT_EQ(param_of({{"messages", base["messages"]}}), "model");
  EXPECT_EQ(param_of(with("model", 3)), "model");
  EXPECT_EQ(param_of(with("messages", json::array())), "messages");
  EXPECT_EQ(param_of(with("messages", {{{"role", "user"}}})), "messages[0].content");
  EXPECT_EQ(param_of(with("stream", "yes")), "stream");
  EXPECT_EQ(param_of(with("top_p", 1.5)), "top_p");
  EXPECT_EQ(param_of(with("n", 0)), "n");
  EXPECT_EQ(param_of(with("n", 129)), "n");
  EXPECT_EQ(param_of({{"model", "m"}, {"prompt", "x"}, {"n", 2}, {"best_of", 129}}, false),
            "best_of");
  EXPECT_EQ(param_of(with("logprobs", "yes")), "logprobs");
  EXPECT_EQ(param_of(with("top_logprobs", 21)), "top_logprobs");
  EXPECT_EQ(param_of(with("top_logprobs", 3)), "top_logprobs");  // without logprobs: true
  EXPECT_EQ(param_of({{"model", "m"}, {"prompt", "x"}, {"logprobs", 21}}, false), "logprobs");
  {
    json lp = with("logprobs", true);
    lp["top_logprobs"] = 5;
    auto p = ParseOpenAiRequest(lp, true, &stream, &usage);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(p->sampling.logprobs());
    EXPECT_EQ(p->sampling.top_logprobs(), 5);
    auto q = ParseOpenAiRequest({{"model", "m"}, {"prompt", "x"}, {"logprobs", 0}}, false, &stream,
                                &usage);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_TRUE(q->sampling.logprobs());
    EXPECT_EQ(q->sampling.top_logprobs(), 0);
  }
  EXPECT_EQ(param_of(with("stop", {1})), "stop");
  EXPECT_EQ(param_of(with("tools", {{{"type", "web"}}})), "tools[0]");
  EXPECT_EQ(param_of(with("tool_choice", "maybe")), "tool_choice");
  EXPECT_EQ(param_of(with("reasoning_effort", 5)), "reasoning_effort");
  EXPECT_EQ(param_of(with("max_tokens", 0)), "max_tokens");
  EXPECT_EQ(param_of(with("max_tokens", -3)), "max_tokens");
  EXPECT_EQ(param_of(with("temperature", 9)), "temperature");
  EXPECT_EQ(param_of(with("top_k", -2)), "top_k");
  EXPECT_EQ(param_of(with("stop", {"a", "b", "c", "d", "e"})), "stop");
  EXPECT_EQ(param_of(with("messages", {{{"role", "robot"}, {"content", "x"}}})),
            "messages[0].role");
  // Fields of the wrong JSON type inside parts and tools are 400s, never exceptions (found by
  // fuzz_openai_request: a part whose "type" is an object threw json::type_error).
  EXPECT_EQ(param_of(with("messages", {{{"role", "user"},
                                        {"content", {{{"type", json::object()}}}}}})),
            "messages[0].content[0]");
  EXPECT_EQ(param_of(with("messages", {{{"role", "user"},
                                        {"content", {{{"type", "text"}, {"text", 3}}}}}})),
            "messages[0].content[0]");
  EXPECT_EQ(param_of(with("tools", {{{"type", {1}}}})), "tools[0]");
  EXPECT_EQ(param_of(with("messages",
                          {{{"role", "assistant"},
                            {"tool_calls", {{{"id", 5}, {"function", {{"name", "f"}}}}}}}})),
            "messages[0].tool_calls[0].id");
  EXPECT_EQ(param_of({{"model", "m"}, {"prompt", {1.5}}}, false), "prompt");
  EXPECT_EQ(param_of({{"model", "m"}, {"prompt", "x"}, {"echo", true}}, false), "echo");
  // Completions best_of: >= n; > n draws best_of samples with logprobs on (hidden unless asked)
  // and is not streamed.
  EXPECT_EQ(param_of({{"model", "m"}, {"prompt", "x"}, {"n", 3}, {"best_of", 2}}, false),
            "best_of");
  EXPECT_EQ(param_of({{"model", "m"}, {"prompt", "x"}, {"best_of", 3}, {"stream", true}}, false),
            "best_of");
  {
    auto b = ParseOpenAiRequest({{"model", "m"}, {"prompt", "x"}, {"best_of", 4}, {"n", 2}}, false,
                                &stream, &usage);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->sampling.n(), 4);
    EXPECT_EQ(b->best_of_keep, 2);
    EXPECT_TRUE(b->sampling.logprobs());
    EXPECT_TRUE(b->hide_logprobs);
    b = ParseOpenAiRequest({{"model", "m"}, {"prompt", "x"}, {"best_of", 2}, {"logprobs", 2}},
                           false, &stream, &usage);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_FALSE(b->hide_logprobs);
    EXPECT_EQ(b->sampling.top_logprobs(), 2);
  }
  // Completions: text, [text] and token ids.
  auto c = ParseOpenAiRequest({{"model", "m"}, {"prompt", {"t"}}}, false, &stream, &usage);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->prompt_text, "t");
  EXPECT_EQ(c->sampling.max_tokens(), 16);  // the OpenAI default for completions
  c = ParseOpenAiRequest({{"model", "m"}, {"prompt", {1, 2}}}, false, &stream, &usage);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c->prompt_ids, (std::vector<int32_t>{1, 2}));
}

}  // namespace
}  // namespace epd::services::router
