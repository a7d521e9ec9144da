// deploy/grafana/epd-dashboard.json against the processes that exist: every metric a panel
// queries must be exposed by some real process (epd-kvstore, epd-router, and the real workers once
// their binaries are built), with every label the query groups, joins or matches on. A misspelt
// metric or label fails here instead of drawing an empty panel in production.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "services/cli/bench.h"
#include "tests/e2e/router_cluster.h"

namespace epd {
namespace {

using epd::testing::BinaryPath;
using epd::testing::Proc;
using epd::testing::RouterCluster;
using epd::testing::SourcePath;
using epd::testing::Subprocess;
using nlohmann::json;

// Dashboard metrics whose series exist only after an event this test does not cause: a transfer
// failure (reason label) and an accounting error. Everything else is created at start (the
// workers' transfer self-test sets the bandwidth gauge) or by the one good request below, which
// runs the whole encoder -> prefill -> decode chain. An entry that is absent is tolerated; one that
// is exposed is checked like any other metric (labels included). Every entry must still appear in
// the dashboard.
constexpr std::string_view kPendingWorkerMetrics[] = {
    "epd_transfer_accounting_errors_total",  // {segment}
    "epd_transfer_failures_total",           // {segment,transport,reason}
};

bool IsPending(const std::string& name) {
  for (auto p : kPendingWorkerMetrics) {
    if (p == name) return true;
  }
  return false;
}

// One PromQL query of one panel, with what it needs from the exposition.
struct Query {
  std::string panel;
  std::string expr;
  std::string legend;
  std::set<std::string> metrics;
  std::set<std::string> labels;  // by / without / on / ignoring / group_* and label matchers
  std::set<std::string> grouping_labels;  // by (...) only: what a legend may name
};

std::set<std::string> SplitLabels(const std::string& list) {
  std::set<std::string> out;
  static const std::regex kIdent("[A-Za-z_][A-Za-z0-9_]*");
  for (std::sregex_iterator it(list.begin(), list.end(), kIdent), end; it != end; ++it) {
    out.insert(it->str());
  }
  return out;
}

Query ParseQuery(const std::string& panel, const std::string& expr, const std::string& legend) {
  Query q{panel, expr, legend, {}, {}, {}};
  // Range selectors ([5m], [$__rate_interval]) and string literals hold no names.
  static const std::regex kMetric(R"(\bepd_[A-Za-z0-9_]+)");
  static const std::regex kClause(
      R"(\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\))");
  static const std::regex kMatchers(R"(\{([^}]*)\})");
  static const std::regex kMatcher(R"re(([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*")re");
  for (std::sregex_iterator it(expr.begin(), expr.end(), kMetric), end; it != end; ++it) {
    q.metrics.insert(it->str());
  }
  for (std::sregex_iterator it(expr.begin(), expr.end(), kClause), end; it != end; ++it) {
    auto names = SplitLabels((*it)[2].str());
    q.labels.insert(names.begin(), names.end());
    if ((*it)[1].str() == "by") q.grouping_labels.insert(names.begin(), names.end());
  }
  for (std::sregex_iterator it(expr.begin(), expr.end(), kMatchers), end; it != end; ++it) {
    const std::string inner = (*it)[1].str();
    for (std::sregex_iterator m(inner.begin(), inner.end(), kMatcher); m != end; ++m) {
      q.labels.insert((*m)[1].str());
    }
  }
  return q;
}

json LoadDashboard() {
  std::ifstream f(SourcePath("deploy/grafana/epd-dashboard.json"));
  return json::parse(f, nullptr, /*allow_exceptions=*/false);
}

std::vector<Query> DashboardQueries(const json& dash) {
  std::vector<Query> out;
  std::vector<const json*> panels;
  for (const auto& p : dash["panels"]) {
    panels.push_back(&p);
    if (p.contains("panels")) {
      for (const auto& inner : p["panels"]) panels.push_back(&inner);  // collapsed rows
    }
  }
  for (const json* p : panels) {
    if (!p->contains("targets")) continue;
    for (const auto& t : (*p)["targets"]) {
      out.push_back(ParseQuery((*p)["title"].get<std::string>(), t.value("expr", ""),
                               t.value("legendFormat", "")));
    }
  }
  return out;
}

TEST(DashboardTest, IsAGrafanaModelWithAPrometheusDatasourceVariable) {
  json dash = LoadDashboard();
  ASSERT_TRUE(dash.is_object()) << "deploy/grafana/epd-dashboard.json is not valid JSON";
  EXPECT_GE(dash["schemaVersion"].get<int>(), 36);  // Grafana 9+
  EXPECT_FALSE(dash["uid"].get<std::string>().empty());
  bool has_ds_var = false;
  for (const auto& v : dash["templating"]["list"]) {
    if (v["type"] == "datasource" && v["query"] == "prometheus") {
      has_ds_var = v["name"] == "datasource";
    }
  }
  ASSERT_TRUE(has_ds_var) << "templating needs a 'datasource' variable of type prometheus";
  std::set<int> ids;
  for (const auto& p : dash["panels"]) {
    EXPECT_TRUE(ids.insert(p["id"].get<int>()).second) << "duplicate panel id " << p["id"];
    const auto& g = p["gridPos"];
    EXPECT_LE(g["x"].get<int>() + g["w"].get<int>(), 24) << p["title"];
    if (p["type"] == "row") continue;
    EXPECT_EQ(p["datasource"]["uid"], "${datasource}") << p["title"];
    ASSERT_FALSE(p["targets"].empty()) << p["title"];
    for (const auto& t : p["targets"]) {
      EXPECT_EQ(t["datasource"]["uid"], "${datasource}") << p["title"];
      EXPECT_FALSE(t.value("expr", "").empty()) << p["title"];
    }
  }
}

TEST(DashboardTest, CoversTheIssueAndLegendsNameGroupedLabels) {
  json dash = LoadDashboard();
  ASSERT_TRUE(dash.is_object());
  auto queries = DashboardQueries(dash);
  std::set<std::string> used;
  for (const auto& q : queries) {
    used.insert(q.metrics.begin(), q.metrics.end());
    EXPECT_FALSE(q.metrics.empty()) << q.panel << ": " << q.expr;
    // A legend {{x}} is empty unless the query keeps label x.
    static const std::regex kLegend(R"(\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\})");
    for (std::sregex_iterator it(q.legend.begin(), q.legend.end(), kLegend), end; it != end; ++it) {
      const std::string label = (*it)[1].str();
      const bool plain_selector = q.expr.find('(') == std::string::npos;
      EXPECT_TRUE(plain_selector || q.grouping_labels.count(label))
          << q.panel << ": legend names '" << label
          << "' that the query aggregates away: " << q.expr;
    }
  }
  for (const char* m :
       {"epd_kv_hits_total", "epd_kv_lookups_total", "epd_swa_replay_total",
        "epd_ttft_seconds_bucket", "epd_itl_seconds_bucket", "epd_e2e_latency_seconds_bucket",
        "epd_transfer_bytes_total", "epd_transfer_accounting_errors_total", "epd_queue_depth",
        "epd_batch_size", "epd_router_workers", "epd_dspark_accepted_tokens_total",
        "epd_dspark_drafted_tokens_total", "epd_dspark_verify_length_tokens_bucket",
        "epd_requests_total"}) {
    EXPECT_TRUE(used.count(m)) << "the dashboard has no panel over " << m;
  }
  for (auto p : kPendingWorkerMetrics) {
    EXPECT_TRUE(used.count(std::string(p)))
        << p << " is in kPendingWorkerMetrics but no panel uses it: delete it from the list";
  }
}

// Every query is valid PromQL: a real Prometheus (installed by deploy/install_deps.sh) evaluates
// each with $__rate_interval set to 1m and must answer "success", not a parse error.
TEST(DashboardTest, EveryQueryParsesInPrometheus) {
  std::string prometheus;
  if (epd::testing::RunCommand("command -v prometheus 2>/dev/null", &prometheus) != 0 ||
      prometheus.empty()) {
    GTEST_SKIP() << "prometheus is not installed";
  }
  while (!prometheus.empty() && std::isspace(static_cast<unsigned char>(prometheus.back()))) {
    prometheus.pop_back();
  }
  json dash = LoadDashboard();
  ASSERT_TRUE(dash.is_object());
  epd::testing::TempDir dir;
  {
    std::ofstream cfg(dir.File("prometheus.yml"));
    cfg << "global:\n  scrape_interval: 15s\n";
  }
  const int port = epd::testing::PickFreePort();
  Subprocess prom = Subprocess::Start({prometheus, "--config.file=" + dir.File("prometheus.yml"),
                                       "--storage.tsdb.path=" + dir.File("data"),
                                       "--web.listen-address=127.0.0.1:" + std::to_string(port)},
                                      dir.File("prometheus.log"));
  bool ready = false;
  for (int i = 0; i < 300 && !ready; ++i) {
    int status = 0;
    ready = epd::testing::HttpGet(port, "/-/ready", &status).has_value() && status == 200;
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(ready) << prom.ReadLog();
  httplib::Client cli("127.0.0.1", port);
  for (const auto& q : DashboardQueries(dash)) {
    std::string expr = q.expr;
    for (size_t at; (at = expr.find("$__rate_interval")) != std::string::npos;) {
      expr.replace(at, std::string("$__rate_interval").size(), "1m");
    }
    auto res = cli.Post("/api/v1/query", httplib::Params{{"query", expr}});
    ASSERT_TRUE(res) << "prometheus did not answer";
    EXPECT_EQ(res->status, 200) << q.panel << ": " << q.expr << "\n" << res->body;
  }
}

// Label names exposed per metric (sample) name, over every scraped process.
using Exposed = std::map<std::string, std::set<std::string>>;

void AddScrape(int port, const std::string& who, Exposed* exposed) {
  auto body = epd::testing::HttpGet(port, "/metrics");
  ASSERT_TRUE(body.has_value()) << "cannot scrape " << who;
  auto samples = epd::services::ParsePrometheusText(*body);
  ASSERT_TRUE(samples.ok()) << who << ": " << samples.status();
  for (const auto& s : *samples) {
    auto& labels = (*exposed)[s.name];
    for (const auto& [k, v] : s.labels) labels.insert(k);
  }
}

TEST(DashboardMetricsTest, EveryQueriedMetricAndLabelIsExposedByARealProcess) {
  json dash = LoadDashboard();
  ASSERT_TRUE(dash.is_object());
  const auto queries = DashboardQueries(dash);
  ASSERT_FALSE(queries.empty());

  // With the real workers built, they serve the requests (they refuse to pair with a fake
  // worker's fingerprint); otherwise a fake decode worker does.
  bool real_workers = std::filesystem::exists(BinaryPath("epd"));
  for (const char* name : {"epd-encoder", "epd-prefill", "epd-decode"}) {
    real_workers = real_workers && std::filesystem::exists(BinaryPath(name));
  }
  epd::testing::TempDir model_dir;
  if (real_workers) {
    std::string gen_out;
    ASSERT_EQ(epd::testing::RunCommand(
                  BinaryPath("epd") + " gen-model --out " + model_dir.path() + " 2>&1", &gen_out),
              0)
        << gen_out;
  }
  // The router serves the workers' model only when it reads the same model directory.
  RouterCluster cluster(real_workers ? std::vector<std::string>{"--model", model_dir.path()}
                                     : std::vector<std::string>{});
  ASSERT_GT(cluster.http_port(), 0);
  if (!real_workers) {
    ASSERT_NE(cluster.AddWorker("decode", "d0"), nullptr);
  }

  Proc kvstore;
  kvstore.port_file = cluster.dir().File("kvstore.json");
  kvstore.proc = Subprocess::Start(
      {BinaryPath("epd-kvstore"), "--data-dir", cluster.dir().File("kv"), "--grpc-port", "0",
       "--metrics-port", "0", "--port-file", kvstore.port_file},
      cluster.dir().File("kvstore.log"));
  auto kv_metrics =
      epd::testing::WaitForPortFile(kvstore.port_file, "metrics", std::chrono::seconds(30));
  ASSERT_TRUE(kv_metrics.has_value()) << kvstore.proc.ReadLog();
  auto kv_grpc = epd::testing::WaitForPortFile(kvstore.port_file, "grpc", std::chrono::seconds(5));
  ASSERT_TRUE(kv_grpc.has_value());

  // The real workers (flags as in docs/workers.md and tests/e2e/epd_e2e_test.cc) on the nano
  // model, once their binaries exist.
  std::vector<std::unique_ptr<Proc>> workers;
  std::vector<std::pair<std::string, int>> targets = {{"epd-router", cluster.router().metrics},
                                                      {"epd-kvstore", *kv_metrics}};
  if (real_workers) {
    for (const char* pool : {"encoder", "prefill", "decode"}) {
      const std::string name = std::string("epd-") + pool;
      auto w = std::make_unique<Proc>();
      w->port_file = cluster.dir().File(name + ".json");
      w->proc =
          Subprocess::Start({BinaryPath(name), "--metrics-port", "0", "--port-file", w->port_file,
                             "--router", "127.0.0.1:" + std::to_string(cluster.grpc_port()),
                             "--kvstore", "127.0.0.1:" + std::to_string(*kv_grpc), "--model",
                             model_dir.path(), "--worker-id", std::string(pool) + "-0"},
                            cluster.dir().File(name + ".log"), {{"UCX_NET_DEVICES", "lo"}});
      auto port = epd::testing::WaitForPortFile(w->port_file, "metrics", std::chrono::seconds(30));
      ASSERT_TRUE(port.has_value()) << name << " did not publish its metrics port:\n"
                                    << w->proc.ReadLog();
      auto reg =
          epd::testing::WaitForPortFile(w->port_file, "registered", std::chrono::seconds(30));
      EXPECT_TRUE(reg.has_value()) << name << " did not register:\n" << w->proc.ReadLog();
      targets.emplace_back(name, *port);
      workers.push_back(std::move(w));
    }
  }

  // Rejections are counted per error code, so that family has a series only after one: send one
  // bad request, and one good one.
  auto bad =
      cluster.Post("/v1/chat/completions",
                   R"({"model":"no-such-model","messages":[{"role":"user","content":"x"}]})");
  EXPECT_EQ(bad.status, 404) << bad.body;
  {
    auto good = cluster.Post(
        "/v1/chat/completions",
        R"({"model":"epd-nano","max_tokens":3,"messages":[{"role":"user","content":"hello"}]})");
    EXPECT_EQ(good.status, 200) << good.body;
  }

  Exposed exposed;
  for (const auto& [who, port] : targets) AddScrape(port, who, &exposed);

  std::set<std::string> pending_exposed;
  for (const auto& q : queries) {
    for (const auto& m : q.metrics) {
      auto it = exposed.find(m);
      if (IsPending(m)) {
        if (it == exposed.end()) continue;  // its worker is not built yet, or creates it lazily
        pending_exposed.insert(m);
      }
      ASSERT_TRUE(it != exposed.end())
          << "panel '" << q.panel << "' queries " << m
          << ", which no process exposes (misspelt? or add it to kPendingWorkerMetrics if only "
             "a worker will expose it): "
          << q.expr;
      for (const auto& label : q.labels) {
        EXPECT_TRUE(it->second.count(label))
            << "panel '" << q.panel << "' uses label '" << label << "' on " << m
            << ", which has no such label: " << q.expr;
      }
    }
  }
  for (const auto& m : pending_exposed) {
    std::cout << "note: " << m << " is exposed now; it can leave kPendingWorkerMetrics\n";
  }
}

}  // namespace
}  // namespace epd
