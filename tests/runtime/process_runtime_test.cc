// Real processes: an epd binary's /metrics is scraped by a real Prometheus server, its exposition
// passes promtool, and SIGTERM drains it to a clean exit.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::BinaryPath;
using epd::testing::HttpGet;
using epd::testing::Subprocess;
using epd::testing::TempDir;

struct RunningRouter {
  TempDir dir;
  Subprocess proc;
  int metrics_port = 0;
};

void StartRouter(RunningRouter* r) {
  r->proc = Subprocess::Start({BinaryPath("epd-router"), "--metrics-port", "0", "--port-file",
                               r->dir.File("ports.json")},
                              r->dir.File("router.log"));
  auto port = epd::testing::WaitForPortFile(r->dir.File("ports.json"), "metrics",
                                            std::chrono::seconds(20));
  ASSERT_TRUE(port.has_value()) << r->proc.ReadLog();
  r->metrics_port = *port;
}

TEST(ProcessRuntimeTest, SigtermDrainsToCleanExit) {
  RunningRouter r;
  StartRouter(&r);
  int status = 0;
  ASSERT_TRUE(HttpGet(r.metrics_port, "/health", &status).has_value());
  EXPECT_EQ(status, 200);
  r.proc.Signal(SIGTERM);
  auto rc = r.proc.Wait(std::chrono::seconds(15));
  ASSERT_TRUE(rc.has_value()) << "did not exit after SIGTERM; its threads:\n"
                              << epd::testing::DescribeThreads(r.proc.pid()) << "its log:\n"
                              << r.proc.ReadLog();
  EXPECT_EQ(*rc, 0) << r.proc.ReadLog();
  EXPECT_NE(r.proc.ReadLog().find("draining"), std::string::npos);
}

TEST(ProcessRuntimeTest, ExpositionPassesPromtool) {
  if (epd::testing::RunCommand("command -v promtool >/dev/null") != 0) {
    GTEST_FAIL() << "promtool missing: run deploy/install_deps.sh";
  }
  RunningRouter r;
  StartRouter(&r);
  auto body = HttpGet(r.metrics_port, "/metrics");
  ASSERT_TRUE(body.has_value());
  EXPECT_NE(body->find("epd_build_info"), std::string::npos);
  std::ofstream(r.dir.File("scrape.txt")) << *body;
  std::string out;
  int rc = epd::testing::RunCommand("promtool check metrics < " + r.dir.File("scrape.txt") + " 2>&1",
                                    &out);
  EXPECT_EQ(rc, 0) << out;
}

TEST(ProcessRuntimeTest, RealPrometheusScrapesAnEpdProcess) {
  if (epd::testing::RunCommand("command -v prometheus >/dev/null") != 0) {
    GTEST_FAIL() << "prometheus missing: run deploy/install_deps.sh";
  }
  RunningRouter r;
  StartRouter(&r);
  const int prom_port = epd::testing::PickFreePort();
  {
    std::ofstream cfg(r.dir.File("prometheus.yml"));
    cfg << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        << "scrape_configs:\n  - job_name: epd\n    static_configs:\n"
        << "      - targets: ['127.0.0.1:" << r.metrics_port << "']\n";
  }
  Subprocess prom = Subprocess::Start(
      {"/usr/bin/prometheus", "--config.file=" + r.dir.File("prometheus.yml"),
       "--storage.tsdb.path=" + r.dir.File("tsdb"),
       "--web.listen-address=127.0.0.1:" + std::to_string(prom_port)},
      r.dir.File("prometheus.log"));

  // The first scrape comes several seconds after start; poll the targets API.
  bool up = false;
  std::string last;
  for (int i = 0; i < 150 && !up; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto body = HttpGet(prom_port, "/api/v1/targets");
    if (!body) continue;
    last = *body;
    auto j = nlohmann::json::parse(*body, nullptr, false);
    if (j.is_discarded()) continue;
    for (const auto& t : j["data"]["activeTargets"]) {
      if (t["health"] == "up") up = true;
    }
  }
  ASSERT_TRUE(up) << "target never up: " << last << "\n" << prom.ReadLog();

  bool series = false;
  for (int i = 0; i < 50 && !series; ++i) {
    auto body = HttpGet(prom_port, "/api/v1/query?query=epd_build_info");
    if (body) {
      auto j = nlohmann::json::parse(*body, nullptr, false);
      if (!j.is_discarded() && j["status"] == "success" && !j["data"]["result"].empty()) {
        series = j["data"]["result"][0]["metric"]["__name__"] == "epd_build_info";
      }
    }
    if (!series) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_TRUE(series) << "no epd_ series in Prometheus";
  prom.Stop();
}

}  // namespace
}  // namespace epd
