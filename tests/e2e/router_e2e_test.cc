// The real epd-router with real epd-fake-worker processes: the OpenAI HTTP API end to end, error
// handling, worker registration, failure and cancellation, and the gRPC API.
#include <grpcpp/grpcpp.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "epd/v1/inference.grpc.pb.h"
#include "tests/e2e/router_cluster.h"

namespace epd {
namespace {

using epd::testing::RouterCluster;
using epd::testing::ScrapeMetric;
using epd::testing::StreamText;
using nlohmann::json;

std::string Chat(const std::string& content, json extra = json::object()) {
  json j = {{"model", "epd-nano"}, {"messages", {{{"role", "user"}, {"content", content}}}}};
  j.update(extra);
  return j.dump();
}

void ExpectError(const epd::testing::HttpResult& r, int status, const std::string& code,
                 const std::string& param = "") {
  EXPECT_EQ(r.status, status) << r.body;
  ASSERT_TRUE(r.json.is_object()) << r.body;
  ASSERT_TRUE(r.json.contains("error")) << r.body;
  const auto& e = r.json["error"];
  EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << r.body;
  EXPECT_TRUE(e["type"].is_string()) << r.body;
  EXPECT_TRUE(e.contains("param") && e.contains("code")) << r.body;
  if (!code.empty()) {
    EXPECT_EQ(e["code"], code) << r.body;
  }
  if (!param.empty()) {
    EXPECT_EQ(e["param"], param) << r.body;
  }
}

TEST(RouterE2ETest, CompletionsStreamReversedPromptWithUsage) {
  RouterCluster c;
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  auto r = c.Post("/v1/completions",
                  json{{"model", "epd-nano"}, {"prompt", "hello world"}, {"max_tokens", 5}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["object"], "text_completion");
  EXPECT_EQ(r.json["choices"][0]["text"], "dlrow");
  EXPECT_EQ(r.json["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r.json["usage"]["prompt_tokens"], 11);
  EXPECT_EQ(r.json["usage"]["completion_tokens"], 5);
  EXPECT_EQ(r.json["usage"]["total_tokens"], 16);
  EXPECT_EQ(r.json["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

  // Whole prompt fits: the worker stops by itself.
  auto s = c.Stream("/v1/completions", json{{"model", "epd-nano"},
                                            {"prompt", "abc"},
                                            {"stream", true},
                                            {"stream_options", {{"include_usage", true}}}}
                                           .dump());
  EXPECT_EQ(s.status, 200);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(StreamText(s), "cba");
  ASSERT_GE(s.events.size(), 2u);
  EXPECT_EQ(s.events[s.events.size() - 2]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(s.events.back()["usage"]["completion_tokens"], 3);
}

TEST(RouterE2ETest, ChatStreamingAndNonStreamingProduceTheSameTokens) {
  RouterCluster c;
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  // Non-ASCII text: reversed bytes exercise the detokenizer's UTF-8 handling.
  const std::string content = "Grüße, 世界! tell me something";
  auto r = c.Post("/v1/chat/completions", Chat(content, {{"max_tokens", 40}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["object"], "chat.completion");
  const auto& msg = r.json["choices"][0]["message"];
  EXPECT_EQ(msg["role"], "assistant");
  const std::string text = msg["content"].get<std::string>();
  EXPECT_EQ(r.json["usage"]["completion_tokens"], 40);

  auto s = c.Stream("/v1/chat/completions",
                    Chat(content, {{"max_tokens", 40},
                                   {"stream", true},
                                   {"stream_options", {{"include_usage", true}}}}));
  ASSERT_EQ(s.status, 200);
  ASSERT_TRUE(s.done);
  EXPECT_EQ(s.events.front()["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(s.events.front()["object"], "chat.completion.chunk");
  EXPECT_EQ(StreamText(s), text);
  EXPECT_EQ(s.events.back()["usage"], r.json["usage"]);
  EXPECT_EQ(s.events[s.events.size() - 2]["choices"][0]["finish_reason"], "length");
  // The output is the tail of the rendered prompt reversed: it starts with ">kniht/<".
  EXPECT_EQ(text.rfind(">kniht/<", 0), 0u) << text;
}

TEST(RouterE2ETest, BadRequestsGetOpenAiErrorsAndTheNextRequestSucceeds) {
  RouterCluster c({"--api-key", "sekret", "--context-length", "128", "--max-tokens-limit", "32"});
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  const httplib::Headers auth = {{"Authorization", "Bearer sekret"}};
  const auto good = [&] {
    auto r = c.Post("/v1/chat/completions", Chat("hi", {{"max_tokens", 4}}), auth);
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.json["usage"]["completion_tokens"], 4) << r.body;
  };
  good();
  ExpectError(c.Post("/v1/chat/completions", "{\"model\": ", auth), 400, "invalid_json");
  good();
  ExpectError(c.Post("/v1/chat/completions", json{{"model", "epd-nano"}, {"messages", "hi"}}.dump(),
                     auth),
              400, "invalid_type", "messages");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat("hi", {{"max_tokens", "ten"}}), auth), 400,
              "invalid_type", "max_tokens");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat("hi", {{"temperature", 7}}), auth), 400,
              "invalid_value", "temperature");
  good();
  ExpectError(c.Post("/v1/chat/completions",
                     json{{"model", "epd-nano"}, {"messages", {{{"role", "robot"}, {"content", "x"}}}}}
                         .dump(),
                     auth),
              400, "invalid_value", "messages[0].role");
  good();
  ExpectError(c.Post("/v1/chat/completions",
                     "{\"model\":\"epd-nano\",\"messages\":[{\"role\":\"user\",\"content\":\"\xC3\x28\"}]}",
                     auth),
              400, "invalid_utf8");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat(std::string(200, 'x')), auth), 400,
              "context_length_exceeded", "messages");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat("hi", {{"max_tokens", 33}}), auth), 400,
              "max_tokens_exceeded", "max_tokens");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat("hi", {{"max_completion_tokens", 33}}), auth),
              400, "max_tokens_exceeded", "max_completion_tokens");
  good();
  ExpectError(c.Post("/v1/completions",
                     json{{"model", "epd-nano"}, {"prompt", std::string(100, 'y')}, {"max_tokens", 30}}
                         .dump(),
                     auth),
              400, "context_length_exceeded", "max_tokens");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat("hi", {{"model", "gpt-4o"}}), auth), 404,
              "model_not_found", "model");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat("hi")), 401, "invalid_api_key");
  good();
  ExpectError(c.Post("/v1/chat/completions", Chat("hi"), {{"Authorization", "Bearer nope"}}), 401,
              "invalid_api_key");
  good();
  ExpectError(c.Get("/v1/models"), 401, "invalid_api_key");
  auto models = c.Get("/v1/models", auth);
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(models.json["data"][0]["id"], "epd-nano");
  // Every refusal was counted; the router is still healthy.
  auto rejected = ScrapeMetric(c.router().metrics, "epd_requests_total{outcome=\"rejected\"}");
  ASSERT_TRUE(rejected.has_value());
  EXPECT_EQ(*rejected, 14);
  EXPECT_EQ(*ScrapeMetric(c.router().metrics, "epd_requests_total{outcome=\"ok\"}"), 14);
  EXPECT_TRUE(c.router().proc.running());
}

TEST(RouterE2ETest, NoDecodeWorkerIs503UntilOneRegisters) {
  RouterCluster c;
  ExpectError(c.Post("/v1/chat/completions", Chat("hi")), 503, "no_workers");
  EXPECT_EQ(c.Get("/health").status, 503);
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  EXPECT_EQ(c.Get("/health").status, 200);
  EXPECT_EQ(c.Post("/v1/chat/completions", Chat("hi")).status, 200);
}

TEST(RouterE2ETest, SecondWorkerRegisteredLaterTakesWork) {
  RouterCluster c;
  auto* a = c.AddWorker("decode", "d-a");
  ASSERT_NE(a, nullptr);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(c.Post("/v1/chat/completions", Chat("hi")).status, 200);
  auto* b = c.AddWorker("decode", "d-b");
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(c.WaitForWorkerCount("decode", 2));
  EXPECT_EQ(*ScrapeMetric(c.router().metrics, "epd_router_workers{pool=\"decode\"}"), 2);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(c.Post("/v1/chat/completions", Chat("hi")).status, 200);
  const double jobs_b = *ScrapeMetric(b->metrics, "epd_fake_jobs_total");
  const double jobs_a = *ScrapeMetric(a->metrics, "epd_fake_jobs_total");
  EXPECT_GE(jobs_b, 2) << "the new worker got too little work";
  EXPECT_EQ(jobs_a + jobs_b, 8);
}

// Six streams on two decode workers; one worker is SIGKILLed mid-generation. With migration
// (docs/router.md, Request migration) its streams continue on the other worker and end with
// [DONE], no error event and every token; with --migration-limit 0 only its streams fail.
void KillOneOfTwoDecodeWorkersMidGeneration(int migration_limit) {
  RouterCluster c({"--migration-limit", std::to_string(migration_limit)});
  auto* a = c.AddWorker("decode", "d-a", {"--token-interval-ms", "10"});
  auto* b = c.AddWorker("decode", "d-b", {"--token-interval-ms", "10"});
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(c.WaitForWorkerCount("decode", 2));
  const int kRequests = 6;
  std::vector<epd::testing::SseResult> results(kRequests);
  std::vector<std::thread> threads;
  const std::string body =
      Chat(std::string(300, 'q'), {{"max_tokens", 200},
                                   {"stream", true},
                                   {"stream_options", {{"include_usage", true}}}});
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] { results[i] = c.Stream("/v1/chat/completions", body); });
  }
  // Wait until every request runs on a worker, then kill one worker mid-generation.
  double active_a = 0, active_b = 0;
  for (int i = 0; i < 500; ++i) {
    active_a = ScrapeMetric(a->metrics, "epd_fake_active_jobs").value_or(0);
    active_b = ScrapeMetric(b->metrics, "epd_fake_active_jobs").value_or(0);
    if (active_a + active_b == kRequests) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(active_a + active_b, kRequests);
  ASSERT_GT(active_a, 0);
  ASSERT_GT(active_b, 0);
  // Mid-generation: every request already streamed tokens (before the first token the router
  // would re-dispatch instead, see FullChainGivesEveryStageItsJob).
  for (int i = 0; i < 500; ++i) {
    if (ScrapeMetric(a->metrics, "epd_fake_tokens_total").value_or(0) >= 10 * active_a &&
        ScrapeMetric(b->metrics, "epd_fake_tokens_total").value_or(0) >= 10 * active_b) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  a->proc.Signal(SIGKILL);
  for (auto& t : threads) t.join();
  int failed = 0, ok = 0;
  for (const auto& r : results) {
    EXPECT_EQ(r.status, 200);
    EXPECT_TRUE(r.done) << r.raw;
    const auto& last = r.events.back();
    if (migration_limit == 0 && last.contains("error")) {
      ++failed;
      EXPECT_EQ(last["error"]["code"], "worker_failed") << last.dump();
      EXPECT_NE(last["error"]["message"].get<std::string>().find("d-a"), std::string::npos);
    } else {
      ++ok;
      EXPECT_EQ(last["usage"]["completion_tokens"], 200);
      EXPECT_EQ(r.events[r.events.size() - 2]["choices"][0]["finish_reason"], "length");
    }
  }
  const std::string migrations = "epd_request_migrations_total{outcome=\"";
  if (migration_limit == 0) {
    EXPECT_EQ(failed, active_a) << c.router().proc.ReadLog() << a->proc.ReadLog();
    EXPECT_EQ(ok, active_b);
    EXPECT_EQ(*ScrapeMetric(c.router().metrics, migrations + "limit\"}"), active_a);
  } else {
    EXPECT_EQ(failed, 0) << c.router().proc.ReadLog();
    EXPECT_EQ(ok, kRequests);
    EXPECT_EQ(*ScrapeMetric(c.router().metrics, migrations + "ok\"}"), active_a);
  }
  // The router stopped routing to the dead worker at once (no heartbeat expiry needed).
  EXPECT_EQ(c.WorkerCount("decode"), 1);
  const double before_b = *ScrapeMetric(b->metrics, "epd_fake_jobs_total");
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c.Post("/v1/chat/completions", Chat("again", {{"max_tokens", 3}})).status, 200);
  }
  EXPECT_EQ(*ScrapeMetric(b->metrics, "epd_fake_jobs_total"), before_b + 4);
  EXPECT_TRUE(c.router().proc.running());
}

TEST(RouterE2ETest, KilledDecodeWorkersStreamsMigrateAndEndWithDone) {
  KillOneOfTwoDecodeWorkersMidGeneration(1);
}

TEST(RouterE2ETest, WithoutMigrationAKilledDecodeWorkerFailsOnlyItsRequests) {
  KillOneOfTwoDecodeWorkersMidGeneration(0);
}

TEST(RouterE2ETest, FingerprintMismatchIsRefused) {
  RouterCluster c;
  ASSERT_NE(c.AddWorker("decode", "d-good", {"--fingerprint", "fp-one"}), nullptr);
  auto* bad = c.AddWorker("prefill", "p-bad", {"--fingerprint", "fp-two"}, /*wait=*/false);
  ASSERT_NE(bad, nullptr);
  auto rc = bad->proc.Wait(std::chrono::seconds(20));
  ASSERT_TRUE(rc.has_value());
  EXPECT_EQ(*rc, 3) << bad->proc.ReadLog();
  EXPECT_NE(bad->proc.ReadLog().find("fingerprint"), std::string::npos) << bad->proc.ReadLog();
  auto h = c.Health();
  EXPECT_EQ(h["pools"]["prefill"]["count"], 0);
  EXPECT_EQ(h["config_fingerprint"], "fp-one");
  ASSERT_EQ(h["registration_refusals"].size(), 1u) << h.dump();
  const std::string why = h["registration_refusals"][0];
  EXPECT_NE(why.find("p-bad"), std::string::npos) << why;
  EXPECT_NE(why.find("fp-two"), std::string::npos) << why;
  EXPECT_NE(c.router().proc.ReadLog().find("fp-two"), std::string::npos);
  EXPECT_EQ(*ScrapeMetric(c.router().metrics,
                          "epd_router_registrations_total{outcome=\"fingerprint_mismatch\"}"),
            1);
  // Requests still run on the good worker alone.
  EXPECT_EQ(c.Post("/v1/chat/completions", Chat("hi")).status, 200);
}

TEST(RouterE2ETest, ClientDisconnectCancelsTheJobOnTheWorker) {
  RouterCluster c;
  auto* w = c.AddWorker("decode", "d0", {"--token-interval-ms", "5"});
  ASSERT_NE(w, nullptr);
  auto s = c.Stream("/v1/chat/completions",
                    Chat(std::string(900, 'z'), {{"max_tokens", 800}, {"stream", true}}),
                    /*stop_after_events=*/5);
  EXPECT_EQ(s.events.size(), 5u);
  EXPECT_FALSE(s.done);
  bool cancelled = false;
  for (int i = 0; i < 300 && !cancelled; ++i) {
    cancelled = ScrapeMetric(w->metrics, "epd_fake_cancels_total").value_or(0) == 1 &&
                ScrapeMetric(w->metrics, "epd_fake_active_jobs").value_or(1) == 0;
    if (!cancelled) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(cancelled) << "the worker never saw the cancel";
  EXPECT_LT(ScrapeMetric(w->metrics, "epd_fake_tokens_total").value_or(800), 400);
  EXPECT_EQ(*ScrapeMetric(c.router().metrics, "epd_requests_total{outcome=\"cancelled\"}"), 1);
  EXPECT_EQ(c.Post("/v1/chat/completions", Chat("hi")).status, 200);
}

TEST(RouterE2ETest, FullChainGivesEveryStageItsJob) {
  RouterCluster c;
  auto* e = c.AddWorker("encoder", "e0");
  auto* p = c.AddWorker("prefill", "p0");
  auto* d = c.AddWorker("decode", "d0", {"--first-token-delay-ms", "300"});
  ASSERT_TRUE(e && p && d);
  auto r = c.Post("/v1/completions",
                  json{{"model", "epd-nano"}, {"prompt", "pools"}, {"max_tokens", 10}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["choices"][0]["text"], "sloop");
  for (auto* w : {e, p, d}) EXPECT_EQ(*ScrapeMetric(w->metrics, "epd_fake_jobs_total"), 1);
  EXPECT_EQ(*ScrapeMetric(c.router().metrics, "epd_route_decisions_total{route=\"epd\"}"), 1);
  // The decode worker was told where its hand-off comes from.
  EXPECT_NE(d->proc.ReadLog().find("prev 'p0'"), std::string::npos) << d->proc.ReadLog();
  EXPECT_NE(e->proc.ReadLog().find("next 'p0'"), std::string::npos) << e->proc.ReadLog();
  // A dead encoder fails the request with an error (not a hang) and is dropped.
  e->proc.Signal(SIGKILL);
  e->proc.Wait(std::chrono::seconds(5));
  auto r2 = c.Post("/v1/completions",
                   json{{"model", "epd-nano"}, {"prompt", "pools"}, {"max_tokens", 10}}.dump());
  EXPECT_EQ(r2.status, 200) << r2.body;  // re-dispatched without the encoder before any token
  EXPECT_EQ(c.WorkerCount("encoder"), 0);
  // The failed attempt's decode job is cancelled; the cancel travels beside the re-dispatched
  // attempt, so it may reach the worker after the response (a loaded machine): wait for it.
  std::optional<double> cancels;
  for (int i = 0; i < 500; ++i) {
    cancels = ScrapeMetric(d->metrics, "epd_fake_cancels_total");
    if (cancels.value_or(0) >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(cancels.value_or(0), 1);
}

TEST(RouterE2ETest, SilentWorkerExpiresAndComesBackWhenItBeatsAgain) {
  RouterCluster c;  // heartbeat interval 200 ms, 3 missed beats
  auto* w = c.AddWorker("decode", "d0");
  ASSERT_NE(w, nullptr);
  w->proc.Signal(SIGSTOP);
  EXPECT_TRUE(c.WaitForWorkerCount("decode", 0, std::chrono::seconds(5)));
  EXPECT_EQ(*ScrapeMetric(c.router().metrics, "epd_router_worker_expiries_total"), 1);
  w->proc.Signal(SIGCONT);
  EXPECT_TRUE(c.WaitForWorkerCount("decode", 1, std::chrono::seconds(5)));
  EXPECT_EQ(c.Post("/v1/chat/completions", Chat("hi")).status, 200);
}

TEST(RouterE2ETest, HungDecodeWorkerFailsItsStreamWhenItExpires) {
  RouterCluster c;  // heartbeat interval 200 ms, 3 missed beats
  auto* w = c.AddWorker("decode", "d0", {"--token-interval-ms", "5"});
  ASSERT_NE(w, nullptr);
  epd::testing::SseResult s;
  std::thread t([&] {
    s = c.Stream("/v1/chat/completions",
                 Chat(std::string(900, 'h'), {{"max_tokens", 800}, {"stream", true}}));
  });
  for (int i = 0; i < 300; ++i) {
    if (ScrapeMetric(w->metrics, "epd_fake_tokens_total").value_or(0) >= 5) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  w->proc.Signal(SIGSTOP);  // alive but silent: its stream neither ends nor fails
  const auto start = std::chrono::steady_clock::now();
  t.join();
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_LT(waited, std::chrono::seconds(5));
  ASSERT_FALSE(s.events.empty());
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.events.back()["error"]["code"], "worker_failed") << s.raw.substr(s.raw.size() - 300);
  EXPECT_NE(s.events.back()["error"]["message"].get<std::string>().find("missed heartbeats"),
            std::string::npos);
  w->proc.Signal(SIGCONT);
}

TEST(RouterE2ETest, ReasoningAndToolCallsReachTheClient) {
  RouterCluster c;
  const std::string reply =
      "let me look</think>Checking.<\xEF\xBD\x9C" "DSML\xEF\xBD\x9C calls>\n"
      "<\xEF\xBD\x9C" "DSML\xEF\xBD\x9C invoke name=\"get_weather\">\n"
      "<\xEF\xBD\x9C" "DSML\xEF\xBD\x9C parameter name=\"city\" string=\"true\">Paris"
      "</\xEF\xBD\x9C" "DSML\xEF\xBD\x9C parameter>\n"
      "<\xEF\xBD\x9C" "DSML\xEF\xBD\x9C parameter name=\"days\" string=\"false\">3"
      "</\xEF\xBD\x9C" "DSML\xEF\xBD\x9C parameter>\n"
      "</\xEF\xBD\x9C" "DSML\xEF\xBD\x9C invoke>\n</\xEF\xBD\x9C" "DSML\xEF\xBD\x9C calls>";
  ASSERT_NE(c.AddWorker("decode", "d0", {"--reply", reply, "--token-interval-ms", "1"}), nullptr);
  const json tools = json::array(
      {{{"type", "function"},
        {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}}});
  const json extra = {{"tools", tools}, {"reasoning_effort", "high"}, {"max_tokens", 1000}};
  auto r = c.Post("/v1/chat/completions", Chat("weather?", extra));
  ASSERT_EQ(r.status, 200) << r.body;
  const auto& choice = r.json["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["reasoning_content"], "let me look");
  EXPECT_EQ(choice["message"]["content"], "Checking.");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u);
  const auto& call = choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()),
            json({{"city", "Paris"}, {"days", 3}}));

  json stream_extra = extra;
  stream_extra["stream"] = true;
  auto s = c.Stream("/v1/chat/completions", Chat("weather?", stream_extra));
  ASSERT_TRUE(s.done);
  EXPECT_EQ(StreamText(s, "reasoning_content"), "let me look");
  EXPECT_EQ(StreamText(s, "content"), "Checking.");
  json streamed_call;
  for (const auto& ev : s.events) {
    if (ev["choices"][0]["delta"].contains("tool_calls")) streamed_call = ev["choices"][0]["delta"];
  }
  ASSERT_FALSE(streamed_call.is_null()) << s.raw;
  EXPECT_EQ(streamed_call["tool_calls"][0]["index"], 0);
  EXPECT_EQ(streamed_call["tool_calls"][0]["function"], call["function"]);
  EXPECT_EQ(s.events.back()["choices"][0]["finish_reason"], "tool_calls");
}

TEST(RouterE2ETest, GrpcGenerateListModelsAndHealth) {
  RouterCluster c;
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(c.grpc_port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = epd::v1::Inference::NewStub(channel);
  {
    grpc::ClientContext ctx;
    epd::v1::GenerateRequest req;
    req.set_model("epd-nano");
    req.set_prompt("gRPC!");
    auto reader = stub->Generate(&ctx, req);
    epd::v1::GenerateResponse m;
    std::string text;
    std::vector<int32_t> ids;
    std::string finish;
    epd::v1::Usage usage;
    while (reader->Read(&m)) {
      text += m.text();
      ids.insert(ids.end(), m.token_ids().begin(), m.token_ids().end());
      if (!m.finish_reason().empty()) {
        finish = m.finish_reason();
        usage = m.usage();
      }
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(text, "!CPRg");
    EXPECT_EQ(ids.size(), 5u);
    EXPECT_EQ(finish, "stop");
    EXPECT_EQ(usage.prompt_tokens(), 5);
    EXPECT_EQ(usage.completion_tokens(), 5);
    EXPECT_EQ(usage.total_tokens(), 10);
  }
  {
    grpc::ClientContext ctx;
    epd::v1::GenerateRequest req;
    req.set_model("nope");
    req.set_prompt("x");
    auto reader = stub->Generate(&ctx, req);
    epd::v1::GenerateResponse m;
    while (reader->Read(&m)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    epd::v1::ListModelsResponse resp;
    ASSERT_TRUE(stub->ListModels(&ctx, {}, &resp).ok());
    ASSERT_EQ(resp.models_size(), 1);
    EXPECT_EQ(resp.models(0).id(), "epd-nano");
    EXPECT_EQ(resp.models(0).config_fingerprint(), "fp-test");
  }
  {
    grpc::ClientContext ctx;
    epd::v1::HealthResponse resp;
    ASSERT_TRUE(stub->Health(&ctx, {}, &resp).ok());
    EXPECT_TRUE(resp.serving());
    EXPECT_NE(resp.detail().find("\"d0\""), std::string::npos);
  }
}

TEST(RouterE2ETest, SigtermLetsARunningStreamFinish) {
  RouterCluster c;
  ASSERT_NE(c.AddWorker("decode", "d0", {"--token-interval-ms", "5"}), nullptr);
  epd::testing::SseResult s;
  std::thread t([&] {
    s = c.Stream("/v1/chat/completions",
                 Chat(std::string(200, 'w'), {{"max_tokens", 100},
                                              {"stream", true},
                                              {"stream_options", {{"include_usage", true}}}}));
  });
  for (int i = 0; i < 300; ++i) {
    if (ScrapeMetric(c.router().metrics, "epd_router_inflight_requests").value_or(0) == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  c.router().proc.Signal(SIGTERM);
  t.join();
  EXPECT_TRUE(s.done);
  ASSERT_FALSE(s.events.empty()) << s.raw;
  EXPECT_EQ(s.events.back()["usage"]["completion_tokens"], 100) << s.raw;
  auto rc = c.router().proc.Wait(std::chrono::seconds(15));
  ASSERT_TRUE(rc.has_value());
  EXPECT_EQ(*rc, 0) << c.router().proc.ReadLog();
}

// The API key is checked before the body is read (docs/security.md): a request that announces a
// 60 MB body without the key gets its 401 while the client has sent only the headers, and the
// router does not wait for (or buffer) the body.
TEST(RouterE2ETest, AMissingApiKeyGets401BeforeTheBodyIsRead) {
  RouterCluster c({"--api-key", "sekret"});
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(c.http_port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string head =
      "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Content-Type: application/json\r\nContent-Length: 60000000\r\n\r\n";
  ASSERT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  // Not one byte of the body: the answer must come anyway.
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const auto start = std::chrono::steady_clock::now();
  std::string reply;
  char buf[4096];
  while (reply.find("\r\n\r\n") == std::string::npos) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    reply.append(buf, static_cast<size_t>(n));
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  close(fd);
  EXPECT_EQ(reply.rfind("HTTP/1.1 401", 0), 0u) << reply;
  EXPECT_LT(waited, std::chrono::seconds(3));
  // With the key the same route still works.
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  auto ok = c.Post("/v1/chat/completions", Chat("hi", {{"max_tokens", 2}}),
                   {{"Authorization", "Bearer sekret"}});
  EXPECT_EQ(ok.status, 200) << ok.body;
  // Without the key, /health says only live/ready (no workers, addresses or fingerprint).
  auto health = c.Health();
  EXPECT_TRUE(health.contains("serving")) << health.dump();
  EXPECT_FALSE(health.contains("pools")) << health.dump();
}

// The router owns request identity: a client's gRPC request_id is only a label, echoed as given
// on each of two requests that run at once with it (fake workers: the collision of hand-offs that
// real workers would show is OutsiderE2ETest.TwoConcurrentRequestsWithTheSameGrpcRequestId...).
TEST(RouterE2ETest, TwoConcurrentGrpcRequestsWithTheSameRequestIdEachGetTheirOwnOutput) {
  RouterCluster c;
  ASSERT_NE(c.AddWorker("decode", "d0", {"--token-interval-ms", "40"}), nullptr);
  auto stub = epd::v1::Inference::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(c.grpc_port()), grpc::InsecureChannelCredentials()));
  auto run = [&](const std::string& prompt, std::string* text, std::string* id, bool* ok) {
    grpc::ClientContext ctx;
    epd::v1::GenerateRequest req;
    req.set_model("epd-nano");
    req.set_prompt(prompt);
    req.set_request_id("same-id");
    auto reader = stub->Generate(&ctx, req);
    epd::v1::GenerateResponse m;
    while (reader->Read(&m)) {
      *text += m.text();
      *id = m.request_id();
    }
    *ok = reader->Finish().ok();
  };
  std::string text_a, text_b, id_a, id_b;
  bool ok_a = false, ok_b = false;
  std::thread a([&] { run("alpha!", &text_a, &id_a, &ok_a); });
  std::thread b([&] { run("bravo?", &text_b, &id_b, &ok_b); });
  a.join();
  b.join();
  EXPECT_TRUE(ok_a);
  EXPECT_TRUE(ok_b);
  EXPECT_EQ(text_a, "!ahpla");
  EXPECT_EQ(text_b, "?ovarb");
  EXPECT_EQ(id_a, "same-id");  // the label comes back as given
  EXPECT_EQ(id_b, "same-id");
}

}  // namespace
}  // namespace epd
