// Scaling a pool under load (issue 16): real epd-router + encoder + prefill + decode processes with
// the nano model; while `epd bench` runs an agent workload through the OpenAI API, the decode pool
// goes from 1 to 3 workers (each new one takes requests) and back to 1, each leaving by SIGTERM
// (it drains: refuses new jobs, tells the router, finishes its running ones). No request fails.
// The router's epd_router_recommended_replicas{pool="decode"} follows the load meanwhile.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/wait_for.h"

namespace epd {
namespace {

using testing::ScrapeMetric;
using testing::WaitFor;

double Metric(int port, const std::string& series) {
  return ScrapeMetric(port, series).value_or(0.0);
}

const char kDecodeOk[] = "epd_worker_requests_total{outcome=\"ok\",pool=\"decode\"}";

class ScaleE2ETest : public testing::NanoModelDirTest {};

TEST_F(ScaleE2ETest, DecodePoolGoesOneToThreeAndBackUnderBenchWithNoFailedRequest) {
  // Drains may take a whole request; the planner aims for one sequence per decode worker. Five
  // processes computing on a shared 2-core box can be starved for a second: the router forgets a
  // worker only after 5 s of missed heartbeats (25 x 200 ms), not 600 ms.
  testing::RealCluster c({.model_dir = model_dir(),
                          .worker_args = {"--drain-timeout-ms", "60000"},
                          .router_args = {"--heartbeat-miss-limit", "25", "--planner-interval-ms",
                                          "200", "--target-queue-decode", "1"}});
  ASSERT_GT(c.http_port(), 0) << c.Logs();
  testing::TempDir dir;
  const std::string json_path = dir.File("bench.json");
  testing::Subprocess bench = testing::Subprocess::Start(
      {testing::BinaryPath("epd"), "bench", "--url",
       "http://127.0.0.1:" + std::to_string(c.http_port()), "--model", "epd-nano", "--sessions",
       "4", "--turns", "40", "--tool-tokens", "24", "--max-tokens", "8", "--seed", "3",
       "--duration-s", "150", "--timeout-s", "120", "--json", json_path},
      dir.File("bench.log"));
  testing::RealProc& d0 = c.worker("decode");
  ASSERT_TRUE(WaitFor([&] { return Metric(d0.metrics, kDecodeOk) > 0; }, std::chrono::seconds(90)))
      << "the first decode worker served nothing\n"
      << bench.ReadLog() << c.Logs();

  // 1 -> 3: each new decode worker registers and takes requests while the bench runs.
  std::vector<testing::RealProc*> added;
  for (const char* id : {"decode-1", "decode-2"}) {
    testing::RealProc* w = c.Add("decode", id);
    ASSERT_NE(w, nullptr);
    ASSERT_GT(w->metrics, 0) << c.Logs();
    added.push_back(w);
  }
  for (testing::RealProc* w : added) {
    EXPECT_TRUE(WaitFor([&] { return Metric(w->metrics, kDecodeOk) > 0; },
                        std::chrono::seconds(90)))
        << w->port_file << " got no request\n"
        << c.Logs();
  }
  EXPECT_EQ(Metric(c.router_metrics(), "epd_router_workers{pool=\"decode\"}"), 3.0);
  // The planner recommends more than one decode worker at some point of this load (4 sessions,
  // one sequence per worker aimed for).
  double most = 0;
  for (int i = 0; i < 50 && most < 2; ++i) {
    most = std::max(most, Metric(c.router_metrics(),
                                 "epd_router_recommended_replicas{pool=\"decode\"}"));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GE(most, 2.0) << "recommended decode replicas stayed at 1 under load";

  // 3 -> 1: SIGTERM each added worker; it drains and exits 0.
  for (testing::RealProc* w : added) {
    w->proc.Signal(SIGTERM);
    auto rc = w->proc.Wait(std::chrono::seconds(90));
    ASSERT_TRUE(rc.has_value()) << w->port_file << " did not exit after SIGTERM";
    EXPECT_EQ(*rc, 0) << w->proc.ReadLog();
    EXPECT_NE(w->proc.ReadLog().find("draining"), std::string::npos);
  }
  EXPECT_TRUE(WaitFor(
      [&] { return Metric(c.router_metrics(), "epd_router_workers{pool=\"decode\"}") == 1.0; },
      std::chrono::seconds(10)));
  ASSERT_TRUE(bench.running()) << "the bench ended before the pool was back to one worker: the "
                                  "scale-down did not happen under load\n"
                               << bench.ReadLog();
  // The last decode worker serves the rest of the run.
  const double d0_before = Metric(d0.metrics, kDecodeOk);
  auto rc = bench.Wait(std::chrono::seconds(240));
  ASSERT_TRUE(rc.has_value()) << "bench did not finish\n" << bench.ReadLog();
  std::ifstream f(json_path);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << bench.ReadLog();
  const nlohmann::json& r = j;
  EXPECT_EQ(r["errors"].get<int64_t>(), 0) << j.dump(2) << "\n" << bench.ReadLog() << c.Logs();
  EXPECT_GT(r["ok"].get<int64_t>(), 6) << j.dump(2);
  EXPECT_EQ(*rc, 0) << bench.ReadLog();
  EXPECT_GT(Metric(d0.metrics, kDecodeOk), d0_before) << "no request after the scale-down";
  EXPECT_EQ(Metric(c.router_metrics(), "epd_requests_total{outcome=\"error\"}"), 0.0);
  EXPECT_EQ(Metric(c.router_metrics(), "epd_requests_total{outcome=\"unavailable\"}"), 0.0);
}

}  // namespace
}  // namespace epd
