// Overload (docs/router.md, Overload): the real epd-router with small admission bounds and a
// slow epd-fake-worker. A burst of four times the capacity: the requests beyond running + queued
// get 429 + Retry-After (HTTP, OpenAI error shape) or RESOURCE_EXHAUSTED (gRPC) before any
// admitted request finished, every admitted request completes correctly, and the refusals are
// counted.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

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

constexpr int kRunning = 2;
constexpr int kQueued = 2;
constexpr int kCapacity = kRunning + kQueued;
constexpr int kMaxTokens = 30;
// 40 bytes; the fake worker streams them reversed, one token per 100 ms: 3 s a request.
const std::string kPrompt = "0123456789abcdefghijklmnopqrstuvwxyzABCD";

std::string Expected() {
  std::string r(kPrompt.rbegin(), kPrompt.rend());
  return r.substr(0, kMaxTokens);
}

bool WaitForGauges(RouterCluster& c, int running, int queued) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = ScrapeMetric(c.router().metrics, "epd_router_admission_running");
    auto q = ScrapeMetric(c.router().metrics, "epd_router_admission_queued");
    if (r && q && *r == running && *q == queued) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(RouterOverloadTest, BurstBeyondTheQueueIsRefusedAtOnceAndAdmittedRequestsSucceed) {
  RouterCluster c({"--max-running-requests", std::to_string(kRunning), "--max-queued-requests",
                   std::to_string(kQueued), "--retry-after-s", "3", "--http-threads", "64"});
  ASSERT_NE(c.AddWorker("decode", "d0", {"--token-interval-ms", "100"}), nullptr);

  // Fill the capacity: 2 running, 2 queued behind them.
  std::atomic<int> finished{0};
  std::vector<epd::testing::SseResult> admitted(kCapacity);
  std::vector<std::thread> admitted_threads;
  for (int i = 0; i < kCapacity; ++i) {
    admitted_threads.emplace_back([&, i] {
      admitted[i] = c.Stream("/v1/completions", json{{"model", "epd-nano"},
                                                     {"prompt", kPrompt},
                                                     {"max_tokens", kMaxTokens},
                                                     {"stream", true}}
                                                    .dump());
      ++finished;
    });
  }
  ASSERT_TRUE(WaitForGauges(c, kRunning, kQueued));

  // The burst: 3x the capacity more over HTTP (chat, completions, streaming) and gRPC at once.
  constexpr int kHttpBurst = 8;
  constexpr int kGrpcBurst = 4;
  struct Refusal {
    int status = 0;
    std::string retry_after;
    json body;
    bool before_any_admitted_finished = false;
  };
  std::vector<Refusal> http(kHttpBurst);
  std::vector<grpc::Status> grpc_status(kGrpcBurst);
  std::vector<std::string> grpc_retry(kGrpcBurst);
  std::vector<bool> grpc_early(kGrpcBurst, false);
  std::vector<std::thread> burst;
  const auto burst_start = std::chrono::steady_clock::now();
  std::atomic<int64_t> slowest_http_ms{0}, slowest_grpc_ms{0};
  auto note_latency = [&](std::atomic<int64_t>& slowest_ms) {
    const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::steady_clock::now() - burst_start)
                           .count();
    int64_t cur = slowest_ms.load();
    while (ms > cur && !slowest_ms.compare_exchange_weak(cur, ms)) {
    }
  };
  for (int i = 0; i < kHttpBurst; ++i) {
    burst.emplace_back([&, i] {
      const bool chat = i % 2 == 0;
      json body = {{"model", "epd-nano"}, {"max_tokens", 5}, {"stream", i % 3 == 0}};
      if (chat) {
        body["messages"] = {{{"role", "user"}, {"content", "hi"}}};
      } else {
        body["prompt"] = "hi";
      }
      httplib::Client cli("127.0.0.1", c.http_port());
      cli.set_read_timeout(60, 0);
      auto res = cli.Post(chat ? "/v1/chat/completions" : "/v1/completions", body.dump(),
                          "application/json");
      http[i].before_any_admitted_finished = finished.load() == 0;
      note_latency(slowest_http_ms);
      if (!res) return;
      http[i].status = res->status;
      http[i].retry_after = res->get_header_value("Retry-After");
      http[i].body = json::parse(res->body, nullptr, false);
    });
  }
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(c.grpc_port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = epd::v1::Inference::NewStub(channel);
  for (int i = 0; i < kGrpcBurst; ++i) {
    burst.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      epd::v1::GenerateRequest req;
      req.set_model("epd-nano");
      req.set_prompt("hi");
      auto reader = stub->Generate(&ctx, req);
      epd::v1::GenerateResponse m;
      while (reader->Read(&m)) {
      }
      grpc_status[i] = reader->Finish();
      grpc_early[i] = finished.load() == 0;
      note_latency(slowest_grpc_ms);
      auto md = ctx.GetServerTrailingMetadata();
      if (auto it = md.find("retry-after"); it != md.end()) {
        grpc_retry[i] = std::string(it->second.data(), it->second.size());
      }
    });
  }
  for (auto& t : burst) t.join();
  // A figure, not an assertion (the machine may be loaded): the time to the last refusal.
  std::printf("burst of %d: slowest HTTP refusal after %lld ms, slowest gRPC after %lld ms\n",
              kHttpBurst + kGrpcBurst, static_cast<long long>(slowest_http_ms.load()),
              static_cast<long long>(slowest_grpc_ms.load()));

  for (int i = 0; i < kHttpBurst; ++i) {
    SCOPED_TRACE("http " + std::to_string(i));
    EXPECT_EQ(http[i].status, 429) << http[i].body.dump();
    EXPECT_EQ(http[i].retry_after, "3");
    ASSERT_TRUE(http[i].body.is_object() && http[i].body.contains("error"));
    const auto& e = http[i].body["error"];
    EXPECT_EQ(e["code"], "overloaded");
    EXPECT_EQ(e["type"], "rate_limit_error");
    EXPECT_TRUE(e.contains("param"));
    EXPECT_NE(e["message"].get<std::string>().find("overloaded"), std::string::npos);
    // At once: not after waiting for a slot (the first admitted request needs >= 3 s).
    EXPECT_TRUE(http[i].before_any_admitted_finished);
  }
  for (int i = 0; i < kGrpcBurst; ++i) {
    SCOPED_TRACE("grpc " + std::to_string(i));
    EXPECT_EQ(grpc_status[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << grpc_status[i].error_message();
    EXPECT_EQ(grpc_retry[i], "3");
    EXPECT_TRUE(grpc_early[i]);
  }

  for (auto& t : admitted_threads) t.join();
  for (int i = 0; i < kCapacity; ++i) {
    SCOPED_TRACE("admitted " + std::to_string(i));
    EXPECT_EQ(admitted[i].status, 200) << admitted[i].raw;
    EXPECT_TRUE(admitted[i].done);
    EXPECT_EQ(StreamText(admitted[i]), Expected());
  }

  const int m = c.router().metrics;
  EXPECT_EQ(ScrapeMetric(m, "epd_router_overload_rejections_total{api=\"http\"}"), kHttpBurst);
  EXPECT_EQ(ScrapeMetric(m, "epd_router_overload_rejections_total{api=\"grpc\"}"), kGrpcBurst);
  EXPECT_EQ(ScrapeMetric(m, "epd_request_rejections_total{reason=\"overloaded\"}"),
            kHttpBurst + kGrpcBurst);
  EXPECT_EQ(ScrapeMetric(m, "epd_router_admission_running"), 0);
  EXPECT_EQ(ScrapeMetric(m, "epd_router_admission_queued"), 0);

  // Capacity is back: the next request is served.
  auto r = c.Post("/v1/completions",
                  json{{"model", "epd-nano"}, {"prompt", "ok!"}, {"max_tokens", 3}}.dump());
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["choices"][0]["text"], "!ko");
}

TEST(RouterOverloadTest, FlagsAreCheckedAtStartup) {
  // More admitted + queued requests than HTTP threads could hold: refused with a clear error.
  epd::testing::TempDir dir;
  auto p = epd::testing::Subprocess::Start(
      {epd::testing::BinaryPath("epd-router"), "--metrics-port", "0", "--http-port", "0",
       "--grpc-port", "0", "--http-threads", "16", "--max-running-requests", "16"},
      dir.File("router.log"));
  const auto rc = p.Wait(std::chrono::seconds(20));
  EXPECT_EQ(rc, std::optional<int>(1));
  EXPECT_NE(p.ReadLog().find("--http-threads must be at least"), std::string::npos)
      << p.ReadLog();
}

}  // namespace
}  // namespace epd
