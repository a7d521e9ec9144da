// What an operator sees, end to end: `epd serve` (kvstore, router, one real encoder, prefill and
// decode worker), a real Prometheus started with the shipped deploy/prometheus/prometheus.yml
// (only its intervals shortened and its target-file path made absolute), ordinary traffic over
// the OpenAI HTTP API, then every query of deploy/grafana/epd-dashboard.json evaluated through
// Prometheus' HTTP API. A panel that is not failure-only (the dashboard's description names those)
// must have data: a series nobody exposes, a label Prometheus rewrites, a scrape target that is
// missing, or a gauge a worker sets on another registry shows up here as an empty panel.
#include <gtest/gtest.h>
#include <signal.h>

#include <cctype>
#include <chrono>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/serve_cluster.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::ServeCluster;
using epd::testing::SourcePath;
using epd::testing::Subprocess;
using epd::testing::TempDir;
using nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Replaces the one occurrence of `from`; fails (returns false) when the shipped file changed.
bool ReplaceOnce(std::string* s, const std::string& from, const std::string& to) {
  const size_t at = s->find(from);
  if (at == std::string::npos || s->find(from, at + 1) != std::string::npos) return false;
  s->replace(at, from.size(), to);
  return true;
}

struct PanelQuery {
  std::string panel;
  std::string expr;
};

// Titles the description names as failure-only: the quoted titles after "failure-only panels".
std::set<std::string> FailureOnlyPanels(const json& dash) {
  std::set<std::string> out;
  const std::string desc = dash.value("description", "");
  const size_t at = desc.find("failure-only panels");
  if (at == std::string::npos) return out;
  const std::string tail = desc.substr(at);
  static const std::regex kQuoted("\"([^\"]+)\"");
  for (std::sregex_iterator it(tail.begin(), tail.end(), kQuoted), end; it != end; ++it) {
    out.insert((*it)[1].str());
  }
  return out;
}

std::vector<PanelQuery> Queries(const json& dash) {
  std::vector<PanelQuery> out;
  std::vector<const json*> panels;
  for (const auto& p : dash["panels"]) {
    panels.push_back(&p);
    if (p.contains("panels")) {
      for (const auto& inner : p["panels"]) panels.push_back(&inner);
    }
  }
  for (const json* p : panels) {
    if (!p->contains("targets")) continue;
    for (const auto& t : (*p)["targets"]) {
      std::string expr = t.value("expr", "");
      // Grafana's $__rate_interval, as it would be for a short range: one minute covers every
      // sample of this test, and rate() needs two samples in it.
      for (size_t i; (i = expr.find("$__rate_interval")) != std::string::npos;) {
        expr.replace(i, std::string("$__rate_interval").size(), "1m");
      }
      out.push_back({(*p)["title"].get<std::string>(), expr});
    }
  }
  return out;
}

// The instant-query result vector, or nullopt when Prometheus did not answer "success".
std::optional<json> Query(httplib::Client& prom, const std::string& expr, std::string* error) {
  auto res = prom.Post("/api/v1/query", httplib::Params{{"query", expr}});
  if (!res) {
    *error = "prometheus did not answer";
    return std::nullopt;
  }
  json j = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
  if (res->status != 200 || !j.is_object() || j.value("status", "") != "success") {
    *error = res->body;
    return std::nullopt;
  }
  return j["data"]["result"];
}

TEST(PrometheusDashboardTest, EveryPanelHasDataUnderOrdinaryTraffic) {
  std::string prometheus;
  if (epd::testing::RunCommand("command -v prometheus 2>/dev/null", &prometheus) != 0 ||
      prometheus.empty()) {
    GTEST_SKIP() << "prometheus is not installed (deploy/install_deps.sh installs it)";
  }
  while (!prometheus.empty() && std::isspace(static_cast<unsigned char>(prometheus.back()))) {
    prometheus.pop_back();
  }
  const json dash =
      json::parse(ReadFile(SourcePath("deploy/grafana/epd-dashboard.json")), nullptr, false);
  ASSERT_TRUE(dash.is_object());
  const std::set<std::string> failure_only = FailureOnlyPanels(dash);
  const std::vector<PanelQuery> queries = Queries(dash);
  ASSERT_FALSE(queries.empty());
  {
    std::set<std::string> titles;
    for (const auto& q : queries) titles.insert(q.panel);
    for (const auto& f : failure_only) {
      EXPECT_TRUE(titles.count(f)) << "the description names '" << f << "', no such panel";
    }
  }

  // 1. epd serve, as the README starts it.
  TempDir dir;
  ServeCluster cluster;
  const std::string data = cluster.data_dir();
  Subprocess& serve = cluster.serve();
  ASSERT_TRUE(cluster.WaitReady()) << serve.ReadLog();
  const int http_port = cluster.http_port();

  // 2. Prometheus with the shipped config: shorter intervals, the target list of this data dir.
  std::string config = ReadFile(SourcePath("deploy/prometheus/prometheus.yml"));
  ASSERT_TRUE(ReplaceOnce(&config, "scrape_interval: 5s", "scrape_interval: 1s")) << config;
  ASSERT_TRUE(ReplaceOnce(&config, "evaluation_interval: 5s", "evaluation_interval: 1s"));
  ASSERT_TRUE(ReplaceOnce(&config, "refresh_interval: 5s", "refresh_interval: 1s"));
  ASSERT_TRUE(ReplaceOnce(&config, "../../data/run/prometheus_targets.json",
                          data + "/run/prometheus_targets.json"))
      << config;
  { std::ofstream(dir.File("prometheus.yml")) << config; }
  const int prom_port = epd::testing::PickFreePort();
  Subprocess prom =
      Subprocess::Start({prometheus, "--config.file=" + dir.File("prometheus.yml"),
                         "--storage.tsdb.path=" + dir.File("tsdb"),
                         "--web.listen-address=127.0.0.1:" + std::to_string(prom_port)},
                        dir.File("prometheus.log"));
  bool prom_ready = false;
  for (int i = 0; i < 600 && !prom_ready && prom.running(); ++i) {
    int status = 0;
    prom_ready = epd::testing::HttpGet(prom_port, "/-/ready", &status).has_value() && status == 200;
    if (!prom_ready) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(prom_ready) << prom.ReadLog();
  httplib::Client pcli("127.0.0.1", prom_port);
  pcli.set_read_timeout(30, 0);

  // Every component of epd serve is a healthy target (kvstore, router, 3 workers).
  bool all_up = false;
  std::string targets_body;
  for (int i = 0; i < 300 && !all_up; ++i) {
    auto res = pcli.Get("/api/v1/targets?state=active");
    if (res && res->status == 200) {
      targets_body = res->body;
      json t = json::parse(res->body, nullptr, false);
      int up = 0;
      for (const auto& a : t["data"]["activeTargets"]) up += a.value("health", "") == "up";
      all_up = up == 5;
    }
    if (!all_up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(all_up) << targets_body << "\n" << prom.ReadLog();

  // 3. Ordinary traffic, all of it good: chat completions (one streamed, one repeated so the store
  // can serve a prefix) and a text completion. (The rejections panel has its series from start.)
  httplib::Client cli("127.0.0.1", http_port);
  cli.set_read_timeout(120, 0);
  const std::string long_turn =
      "Operators read dashboards; this paragraph is long enough to fill a few KV blocks so that "
      "the second identical request can reuse what the first one stored in the kvstore tiers.";
  for (int i = 0; i < 3; ++i) {
    json req = {{"model", "epd-nano"},
                {"messages", {{{"role", "user"}, {"content", long_turn}}}},
                {"max_tokens", 12}};
    if (i == 1) req["stream"] = true;
    auto r = cli.Post("/v1/chat/completions", req.dump(), "application/json");
    ASSERT_TRUE(r) << serve.ReadLog();
    ASSERT_EQ(r->status, 200) << r->body;
  }
  {
    auto r = cli.Post("/v1/completions",
                      json{{"model", "epd-nano"}, {"prompt", "hello"}, {"max_tokens", 8}}.dump(),
                      "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
  }

  // 4. Every query, until each non-failure-only one has data (two scrapes after the traffic are
  // enough for rate(); the deadline only bounds a failure).
  std::map<std::string, std::string> empty;  // expr -> panel, still without data
  std::map<std::string, json> results;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  do {
    empty.clear();
    for (const auto& q : queries) {
      std::string error;
      auto result = Query(pcli, q.expr, &error);
      ASSERT_TRUE(result.has_value()) << q.panel << ": " << q.expr << "\n" << error;
      results[q.expr] = *result;
      if (result->empty() && !failure_only.count(q.panel)) empty[q.expr] = q.panel;
    }
    if (!empty.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  } while (!empty.empty() && std::chrono::steady_clock::now() < deadline);
  for (const auto& [expr, panel] : empty) {
    ADD_FAILURE() << "panel '" << panel << "' has no data: " << expr;
  }

  // The pool a panel groups by is the metric's own (router: epd_router_workers{pool}), not the
  // scrape target's label, which would fold every pool into "router".
  std::set<std::string> pools;
  for (const auto& s : results["sum by (pool) (epd_router_workers)"]) {
    pools.insert(s["metric"].value("pool", ""));
  }
  EXPECT_EQ(pools, (std::set<std::string>{"encoder", "prefill", "decode"}))
      << results["sum by (pool) (epd_router_workers)"].dump();
  // Every worker reports its batch size, and the self-test bandwidth is a positive figure.
  std::set<std::string> batch_pools;
  for (const auto& s : results["avg by (pool) (epd_batch_size)"]) {
    batch_pools.insert(s["metric"].value("pool", ""));
  }
  EXPECT_EQ(batch_pools, (std::set<std::string>{"encoder", "prefill", "decode"}));
  for (const auto& s :
       results["max by (transport) (epd_transfer_selftest_bandwidth_bytes_per_second)"]) {
    EXPECT_GT(std::stod(s["value"][1].get<std::string>()), 0) << s.dump();
  }

  // DSpark per draft position (epd serve runs DSpark on; whether its k policy drafts on this CPU
  // depends on timing, so only the bookkeeping is checked here; dspark_e2e_test forces drafts):
  // once the decode worker's scrape holds all four requests, the per-position counters summed
  // over positions are the totals of the same scrape, and position 1 counts when anything does.
  auto scalar = [&](const std::string& expr) -> double {
    std::string error;
    auto r = Query(pcli, expr, &error);
    if (!r || r->empty()) {
      ADD_FAILURE() << expr << ": no data " << error;
      return -1;
    }
    return std::stod((*r)[0]["value"][1].get<std::string>());
  };
  const std::string decode_done =
      "sum(epd_worker_requests_total{pool=\"decode\",outcome=\"ok\"})";
  double done = 0;
  for (int i = 0; i < 60 && done < 4; ++i) {
    done = scalar(decode_done);
    if (done < 4) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_EQ(done, 4);
  const double drafted = scalar("sum(epd_dspark_drafted_tokens_total)");
  EXPECT_EQ(scalar("sum(epd_dspark_position_drafted_tokens_total)"), drafted);
  EXPECT_EQ(scalar("sum(epd_dspark_position_accepted_tokens_total)"),
            scalar("sum(epd_dspark_accepted_tokens_total)"));
  if (drafted > 0) {
    EXPECT_GT(scalar("sum(epd_dspark_position_drafted_tokens_total{position=\"1\"})"), 0);
  }
  // With the traffic done every worker's batch is empty again.
  double running = -1;
  for (int i = 0; i < 60 && running != 0; ++i) {
    running = scalar("sum(epd_batch_size)");
    if (running != 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_EQ(running, 0) << "epd_batch_size stays up on an idle worker";

  serve.Signal(SIGINT);
  auto rc = serve.Wait(std::chrono::seconds(60));
  EXPECT_TRUE(rc.has_value()) << serve.ReadLog();
  prom.Signal(SIGTERM);
  (void)prom.Wait(std::chrono::seconds(30));
}

}  // namespace
}  // namespace epd
