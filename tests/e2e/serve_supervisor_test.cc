// `epd serve` as a supervisor (docs/serve.md): with two decode workers, the decode worker serving
// a stream, the encoder, the prefill worker, the kvstore and the router are each SIGKILLed in
// turn during a stream (the decode worker also during an OpenAI SSE stream). epd serve stays up,
// every process comes back under a new pid, the killed decode worker's stream migrates (it ends
// normally, the router counts the migration, and its continuation equals a fresh greedy request of
// prompt + streamed tokens), the next requests succeed, and after Ctrl-C no process of the cluster
// remains. Then the same cluster is started again and `epd serve` itself gets SIGKILL: its children
// die with it (PR_SET_PDEATHSIG). A third test sends SIGTERM to the whole process group, as systemd
// and Kubernetes stop a service. A fourth spends the restart budget: a worker is parked for a
// window and comes back; the router stops everything.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

#include "nlohmann/json.hpp"
#include "tests/e2e/real_cluster.h"
#include "tests/e2e/serve_cluster.h"

namespace epd {
namespace {

using epd::testing::Generate;
using epd::testing::GenerateOptions;
using epd::testing::Generation;
using epd::testing::Prompt;
using epd::testing::ServeCluster;

constexpr int kMaxTokens = 40;

// The decode worker ("epd-decode-<i>") that is running a request now, or "".
std::string BusyDecode(ServeCluster& c) {
  for (int i = 0; i < 2; ++i) {
    const std::string name = "epd-decode-" + std::to_string(i);
    auto port = c.Published(name, "metrics");
    if (!port) continue;
    auto depth = epd::testing::ScrapeMetric(*port, "epd_queue_depth{pool=\"decode\"}");
    if (depth && *depth > 0) return name;
  }
  return "";
}

// A prompt whose greedy answer runs at least `min_tokens` tokens, or {}: the demo model ends
// some answers after a token or two, and a decode worker killed mid-stream must still be
// generating when the first chunk reaches the client.
std::vector<int32_t> LongAnswerPrompt(ServeCluster& c, int min_tokens) {
  for (int salt = 2; salt < 40; ++salt) {
    std::vector<int32_t> p = Prompt(150, salt);
    Generation g = Generate(c.grpc_port(), p, min_tokens);
    if (g.status.ok() && static_cast<int>(g.ids.size()) >= min_tokens) return p;
  }
  return {};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A chat question whose greedy answer through the OpenAI API runs at least `min_tokens` tokens
// (else the longest of the candidates), so that an SSE stream is still running when its decode
// worker is killed after its first chunks.
std::string LongAnswerQuestion(ServeCluster& c, int min_tokens) {
  const char* const questions[] = {
      "tell me a long story about a kvstore",    "explain how a file system works in detail",
      "describe the python standard library",    "how do I list and sort files in the shell",
      "what does the debian package manager do", "explain sockets and network connections",
      "write about the history of unix",         "how do regular expressions work"};
  std::string best;
  int64_t best_tokens = -1;
  const std::string body_file = c.data_dir() + "/probe_body.json";
  for (const char* q : questions) {
    const nlohmann::json body = {{"model", "epd-nano"},
                                 {"messages", {{{"role", "user"}, {"content", q}}}},
                                 {"max_tokens", 200},
                                 {"temperature", 0}};
    std::ofstream(body_file) << body.dump();
    std::string out;
    epd::testing::RunCommand("curl -s --max-time 120 -H 'content-type: application/json' --data @" +
                                 body_file + " http://127.0.0.1:" + std::to_string(c.http_port()) +
                                 "/v1/chat/completions",
                             &out);
    const auto j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("usage")) continue;
    const int64_t n = j["usage"].value("completion_tokens", int64_t{0});
    if (n > best_tokens) {
      best = q;
      best_tokens = n;
    }
    if (n >= min_tokens) break;
  }
  std::printf("SSE question: \"%s\" (greedy answer %lld tokens)\n", best.c_str(),
              static_cast<long long>(best_tokens));
  return best;
}

TEST(ServeSupervisorTest, EveryProcessKilledDuringAStreamComesBackAndCtrlCLeavesNothing) {
  ServeCluster c({"--decodes", "2"});
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  ASSERT_TRUE(c.WaitWorkers({1, 1, 2})) << c.Logs();
  // A warm-up request, so every worker has served once.
  auto warm = Generate(c.grpc_port(), Prompt(150, 1), 4);
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message() << c.Logs();

  // 1. The decode worker serving a stream: the stream migrates to the other one.
  {
    std::string victim;
    pid_t victim_pid = -1;
    GenerateOptions opts;
    opts.deadline = std::chrono::seconds(120);
    opts.on_first = [&] {
      victim = BusyDecode(c);
      victim_pid = c.Pid(victim);
      if (victim_pid > 0) kill(victim_pid, SIGKILL);
    };
    // Long enough that the worker is still generating when the first chunk reaches the client.
    const auto prompt = LongAnswerPrompt(c, 100);
    ASSERT_FALSE(prompt.empty()) << "no prompt of 40 has a greedy answer of 100 tokens";
    const int max_tokens = 200;
    Generation g = Generate(c.grpc_port(), prompt, max_tokens, opts);
    ASSERT_FALSE(victim.empty()) << "no decode worker was busy";
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << c.Logs();
    EXPECT_FALSE(g.finish.empty());
    EXPECT_EQ(c.RouterMetric("epd_request_migrations_total{outcome=\"ok\"}").value_or(0), 1)
        << c.Logs();
    // The continuation equals a fresh greedy request of prompt + the tokens streamed before the
    // worker died (the router logs how many there were).
    std::smatch match;
    const std::string router_log = ReadFile(c.data_dir() + "/logs/epd-router.log");
    ASSERT_TRUE(std::regex_search(router_log, match, std::regex("migrating with (\\d+) streamed")))
        << router_log;
    const size_t k = std::stoul(match[1]);
    std::printf("killed %s (pid %d) after %zu streamed tokens; the stream ended '%s' with %zu\n",
                victim.c_str(), victim_pid, k, g.finish.c_str(), g.ids.size());
    ASSERT_LE(k, g.ids.size());
    std::vector<int32_t> continued = prompt;
    continued.insert(continued.end(), g.ids.begin(), g.ids.begin() + k);
    Generation fresh = Generate(c.grpc_port(), continued, max_tokens - static_cast<int>(k));
    ASSERT_TRUE(fresh.status.ok()) << fresh.status.error_message();
    EXPECT_EQ(std::vector<int32_t>(g.ids.begin() + k, g.ids.end()), fresh.ids);
    ASSERT_TRUE(c.WaitBack(victim, victim_pid, "registered")) << c.Logs();
  }

  // 1b. The same over the OpenAI HTTP API: the SSE stream of a chat completion whose decode
  // worker is SIGKILLed ends with [DONE] and carries no error event.
  {
    ASSERT_TRUE(c.WaitWorkers({1, 1, 2}, std::chrono::seconds(90))) << c.Logs();
    const std::string out = c.data_dir() + "/sse.txt";
    const std::string question = LongAnswerQuestion(c, 100);
    ASSERT_FALSE(question.empty()) << "no chat question got an answer" << c.Logs();
    const nlohmann::json body = {{"model", "epd-nano"},
                                 {"messages", {{{"role", "user"}, {"content", question}}}},
                                 {"max_tokens", 200},
                                 {"temperature", 0},
                                 {"stream", true}};
    std::ofstream(c.data_dir() + "/sse_body.json") << body.dump();
    std::thread curl([&] {
      epd::testing::RunCommand(
          "curl -sN --max-time 120 -H 'content-type: application/json' "
          "--data @" +
          c.data_dir() + "/sse_body.json http://127.0.0.1:" + std::to_string(c.http_port()) +
          "/v1/chat/completions > " + out);
    });
    std::string victim;
    pid_t victim_pid = -1;
    // After a few content chunks (the first one, with the role, precedes any token), kill the
    // decode worker running the request.
    for (int i = 0; i < 20000 && victim.empty(); ++i) {
      const std::string so_far = ReadFile(out);
      if (so_far.find("[DONE]") != std::string::npos) break;  // finished first: reported below
      size_t chunks = 0;
      for (size_t p = so_far.find("data: "); p != std::string::npos;
           p = so_far.find("data: ", p + 1)) {
        ++chunks;
      }
      if (chunks >= 3) victim = BusyDecode(c);
      if (!victim.empty()) {
        victim_pid = c.Pid(victim);
        kill(victim_pid, SIGKILL);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
    curl.join();
    const std::string sse = ReadFile(out);
    ASSERT_FALSE(victim.empty()) << "the stream was not running on a decode worker: " << sse;
    std::printf("killed %s (pid %d) during an SSE stream\n", victim.c_str(), victim_pid);
    EXPECT_NE(sse.find("data: [DONE]"), std::string::npos) << sse << c.Logs();
    EXPECT_EQ(sse.find("\"error\""), std::string::npos) << sse;
    EXPECT_NE(sse.find("\"finish_reason\":\""), std::string::npos) << sse;
    EXPECT_EQ(c.RouterMetric("epd_request_migrations_total{outcome=\"ok\"}").value_or(0), 2);
    ASSERT_TRUE(c.WaitBack(victim, victim_pid, "registered")) << c.Logs();
  }

  // 2. The encoder, the prefill worker and the kvstore during a stream (after the hand-off: the
  // stream is not theirs any more), then the router (the stream is cut; the client retries).
  struct Victim {
    std::string name;
    std::string key;
    bool stream_survives;
  };
  for (const Victim& v :
       {Victim{"epd-encoder-0", "registered", true}, Victim{"epd-prefill-0", "registered", true},
        Victim{"epd-kvstore", "grpc", true}, Victim{"epd-router", "grpc", false}}) {
    SCOPED_TRACE(v.name);
    const pid_t pid = c.Pid(v.name);
    ASSERT_GT(pid, 0);
    GenerateOptions opts;
    opts.deadline = std::chrono::seconds(120);
    opts.on_first = [&] { kill(pid, SIGKILL); };
    Generation g = Generate(c.grpc_port(), Prompt(150, 10 + static_cast<int>(v.name.size())),
                            kMaxTokens, opts);
    std::printf("killed %s (pid %d) mid-stream: stream status %d, %zu tokens\n", v.name.c_str(),
                pid, g.status.error_code(), g.ids.size());
    if (v.stream_survives) {
      EXPECT_TRUE(g.status.ok()) << g.status.error_message() << c.Logs();
    }
    ASSERT_TRUE(c.WaitBack(v.name, pid, v.key)) << c.Logs();
    EXPECT_TRUE(c.serve().running()) << c.Logs();
    ASSERT_TRUE(c.WaitWorkers({1, 1, 2}, std::chrono::seconds(90))) << c.Logs();
    // The next requests succeed (a restarted router first needs the workers to re-register).
    Generation next;
    for (int attempt = 0; attempt < 50; ++attempt) {
      next = Generate(c.grpc_port(), Prompt(150, 100 + attempt), 8);
      if (next.status.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    EXPECT_TRUE(next.status.ok()) << next.status.error_message() << c.Logs();
  }
  EXPECT_NE(c.serve().ReadLog().find("epd-kvstore restarted"), std::string::npos);

  // Ctrl-C: epd serve exits 0 and no process of the cluster remains.
  c.serve().Signal(SIGINT);
  auto rc = c.serve().Wait(std::chrono::seconds(90));
  ASSERT_TRUE(rc.has_value()) << c.Logs();
  EXPECT_EQ(*rc, 0) << c.Logs();
  EXPECT_TRUE(c.WaitNoChildren(std::chrono::seconds(5))) << c.ClusterPids().size();
}

TEST(ServeSupervisorTest, ChildrenDieWithASigkilledServe) {
  ServeCluster c;
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  ASSERT_GE(c.ClusterPids().size(), 5u);  // kvstore, router, encoder, prefill, decode
  GenerateOptions opts;
  opts.on_first = [&] { c.serve().Signal(SIGKILL); };
  Generate(c.grpc_port(), Prompt(100, 3), kMaxTokens, opts);
  ASSERT_TRUE(c.serve().Wait(std::chrono::seconds(10)).has_value());
  EXPECT_TRUE(c.WaitNoChildren(std::chrono::seconds(20))) << c.ClusterPids().size();
  EXPECT_FALSE(epd::testing::HttpGet(c.http_port(), "/health").has_value());
}

TEST(ServeSupervisorTest, GroupSigtermStopsEverythingWithoutARestart) {
  // SIGTERM to the whole process group, as a service manager stops a unit: children exit first
  // or at once, and epd serve must stop, not restart them.
  ServeCluster c({"--decodes", "1"});
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  // A group-wide SIGTERM reaches every process at once (the children live in epd serve's group;
  // the test signals each, since epd serve shares the test's group here).
  const std::vector<pid_t> children = c.ClusterPids();
  ASSERT_GE(children.size(), 5u);
  for (pid_t pid : children) kill(pid, SIGTERM);
  c.serve().Signal(SIGTERM);
  auto rc = c.serve().Wait(std::chrono::seconds(90));
  ASSERT_TRUE(rc.has_value()) << c.Logs();
  EXPECT_EQ(*rc, 0) << c.Logs();
  EXPECT_EQ(c.serve().ReadLog().find("restarted"), std::string::npos) << c.Logs();
  EXPECT_TRUE(c.WaitNoChildren(std::chrono::seconds(10)));
}

// The restart budget (docs/serve.md, Supervision): a worker killed again within the window after
// its one allowed restart is parked, not a reason to stop: epd serve, the router and the other
// pools stay up, and after the window the worker comes back and serves. The router past the same
// budget stops everything (exit 1).
TEST(ServeSupervisorTest, AWorkerPastItsRestartBudgetIsParkedButTheRouterStopsEverything) {
  // Room for a restart and the second kill within the window on a loaded machine.
  constexpr int kWindowS = 10;
  ServeCluster c({"--max-restarts", "1", "--restart-window-s", std::to_string(kWindowS)});
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  const pid_t router = c.Pid("epd-router");
  pid_t decode = c.Pid("epd-decode-0");
  ASSERT_GT(decode, 0);
  kill(decode, SIGKILL);
  ASSERT_TRUE(c.WaitBack("epd-decode-0", decode, "registered")) << c.Logs();
  decode = c.Pid("epd-decode-0");
  kill(decode, SIGKILL);
  // Parked: not restarted for a window, while the others stay up.
  const auto parked_at = std::chrono::steady_clock::now();
  auto logged = [&](const std::string& what) {
    return c.serve().ReadLog().find(what) != std::string::npos;
  };
  const std::string parked = "epd-decode-0 was restarted 1 times within " +
                             std::to_string(kWindowS) + " s; parking it for " +
                             std::to_string(kWindowS) + " s (0 decode worker(s) still running)";
  for (int i = 0; i < 200 && !logged(parked); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(logged(parked)) << c.Logs();
  EXPECT_TRUE(c.serve().running());
  EXPECT_EQ(c.Pid("epd-router"), router);
  EXPECT_TRUE(epd::testing::HttpGet(c.http_port(), "/health").has_value());
  // Back after the window, with a fresh budget, and serving.
  ASSERT_TRUE(c.WaitBack("epd-decode-0", decode, "registered")) << c.Logs();
  EXPECT_GE(std::chrono::steady_clock::now() - parked_at, std::chrono::seconds(kWindowS - 1));
  EXPECT_TRUE(
      logged("epd-decode-0 was parked for " + std::to_string(kWindowS) + " s; trying it again"))
      << c.Logs();
  EXPECT_TRUE(c.WaitWorkers({1, 1, 1})) << c.Logs();
  Generation g = Generate(c.grpc_port(), Prompt(100, 4), 4);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << c.Logs();
  EXPECT_FALSE(g.ids.empty());
  // The router twice: nothing serves without it, so epd serve gives up.
  kill(router, SIGKILL);
  ASSERT_TRUE(c.WaitBack("epd-router", router, "grpc")) << c.Logs();
  kill(c.Pid("epd-router"), SIGKILL);
  auto rc = c.serve().Wait(std::chrono::seconds(60));
  ASSERT_TRUE(rc.has_value()) << c.Logs();
  EXPECT_EQ(*rc, 1) << c.Logs();
  EXPECT_TRUE(logged("epd-router was restarted 1 times within " + std::to_string(kWindowS) +
                     " s; giving up and stopping"))
      << c.Logs();
  EXPECT_TRUE(c.WaitNoChildren(std::chrono::seconds(30))) << c.ClusterPids().size();
}

// The kvstore is a cache: past its restart budget it is parked like a worker, not a reason to stop
// everything, and the cluster keeps answering without it (issue 53: optional state degrades).
TEST(ServeSupervisorTest, AKvstorePastItsRestartBudgetIsParkedAndTheClusterKeepsServing) {
  constexpr int kWindowS = 30;
  ServeCluster c({"--max-restarts", "1", "--restart-window-s", std::to_string(kWindowS)});
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  pid_t kv = c.Pid("epd-kvstore");
  ASSERT_GT(kv, 0);
  kill(kv, SIGKILL);
  ASSERT_TRUE(c.WaitBack("epd-kvstore", kv, "grpc")) << c.Logs();
  kv = c.Pid("epd-kvstore");
  kill(kv, SIGKILL);
  auto logged = [&](const std::string& what) {
    return c.serve().ReadLog().find(what) != std::string::npos;
  };
  const std::string parked = "epd-kvstore was restarted 1 times within " +
                             std::to_string(kWindowS) + " s; parking it for " +
                             std::to_string(kWindowS) +
                             " s (serving without the KV store meanwhile: no prefix reuse)";
  for (int i = 0; i < 200 && !logged(parked); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(logged(parked)) << c.Logs();
  EXPECT_TRUE(c.serve().running());
  // Requests are answered with the kvstore down.
  for (int i = 0; i < 2; ++i) {
    Generation g = Generate(c.grpc_port(), Prompt(100, 4), 4);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << c.Logs();
    EXPECT_FALSE(g.ids.empty());
  }
  EXPECT_TRUE(c.serve().running());
  EXPECT_FALSE(logged("giving up and stopping")) << c.Logs();
}

// A restart whose process hangs while starting (a wedged GPU, a model load that never ends) holds
// up no other restart: the supervisor polls starting processes instead of waiting for each. Here
// the decode worker is a script (--worker-binary) that runs the real one the first time and hangs
// after; with the decode worker's restart hanging, a killed router is back within seconds, not
// after the two-minute start timeout.
TEST(ServeSupervisorTest, AHangingRestartDoesNotHoldUpTheOthers) {
  epd::testing::TempDir dir;
  const std::string script = dir.File("decode.sh"), started = dir.File("started-once");
  std::ofstream(script) << "#!/bin/sh\n"
                        << "if [ -e " << started << " ]; then exec sleep 600; fi\n"
                        << "touch " << started << "\n"
                        << "exec " << epd::testing::BinaryPath("epd-decode") << " \"$@\"\n";
  ASSERT_EQ(chmod(script.c_str(), 0755), 0);
  ServeCluster c({"--worker-binary", "decode=" + script});
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  const pid_t decode = c.Pid("epd-decode-0"), router = c.Pid("epd-router");
  ASSERT_GT(decode, 0);
  kill(decode, SIGKILL);
  // Its restart hangs (the script sleeps): it never publishes a port file.
  const std::string exited = "epd-decode-0 (pid " + std::to_string(decode) + ") exited";
  for (int i = 0; i < 100 && c.serve().ReadLog().find(exited) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_NE(c.serve().ReadLog().find(exited), std::string::npos) << c.Logs();
  std::this_thread::sleep_for(std::chrono::seconds(1));  // past its 100 ms backoff: spawned
  const auto killed_at = std::chrono::steady_clock::now();
  kill(router, SIGKILL);
  ASSERT_TRUE(c.WaitBack("epd-router", router, "grpc", std::chrono::seconds(30))) << c.Logs();
  const double back_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  std::printf("the router was back in %.1f s while the decode worker's restart hung\n", back_s);
  EXPECT_EQ(c.serve().ReadLog().find("epd-decode-0 restarted"), std::string::npos) << c.Logs();
  EXPECT_TRUE(c.serve().running());
  c.serve().Signal(SIGINT);
  auto rc = c.serve().Wait(std::chrono::seconds(90));
  ASSERT_TRUE(rc.has_value()) << c.Logs();
  EXPECT_EQ(*rc, 0) << c.Logs();
  EXPECT_TRUE(c.WaitNoChildren(std::chrono::seconds(10))) << c.ClusterPids().size();
}

}  // namespace
}  // namespace epd
