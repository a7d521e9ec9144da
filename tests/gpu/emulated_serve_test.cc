// `epd serve --device cuda` over workers on a device, as real processes: epd-emulated (the `epd`
// CLI built against the emulated CUDA runtime, tests/gpu/CMakeLists.txt) starts the real kvstore
// and router and, through --worker-binary, the workers built against the emulation
// (epd-<pool>-emulated). What only the launcher shows (docs/serve.md, docs/cuda.md "Workers on
// the emulated device"):
// - `epd serve --device cuda` passes the device to every worker and serves the CPU reference's
//   greedy tokens;
// - a worker whose device is lost exits with status 4 and is restarted; while the device stays
//   gone (a restarted worker finds no device), the supervisor parks it after its restart budget
//   instead of stopping the cluster: the router and the other pools stay up, and once the device
//   is back the worker returns and serves the reference's tokens again.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e/real_cluster.h"
#include "tests/e2e/serve_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/wait_for.h"

namespace epd {
namespace {

using testing::Generate;
using testing::GenerateOptions;
using testing::Generation;
using testing::Prompt;
using testing::ServeCluster;
using testing::WaitFor;

class EmulatedServeTest : public testing::NanoModelDirTest {};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// How many times `re` matches `text`.
size_t Count(const std::string& text, const std::string& re) {
  const std::regex r(re);
  return std::distance(std::sregex_iterator(text.begin(), text.end(), r), std::sregex_iterator());
}

TEST_F(EmulatedServeTest, ServesTheCpuReferenceAndParksAWorkerWhileItsDeviceStaysLost) {
  testing::TempDir dir;
  const std::string lost = dir.File("device-lost");  // exists while the device is gone
  constexpr int kWindowS = 8;
  ServeCluster c({"--model", model_dir(), "--device", "cuda", "--worker-binary",
                  "encoder=epd-encoder-emulated,prefill=epd-prefill-emulated,"
                  "decode=epd-decode-emulated",
                  // The emulation reports a 16 GiB device; the default pool would take 90 % of it
                  // from host memory.
                  "--kv-pool-bytes", std::to_string(64 << 20), "--max-restarts", "2",
                  "--restart-window-s", std::to_string(kWindowS)},
                 "epd-emulated", {{"EPD_EMU_LOSE_CONTEXT_FILE", lost}});
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  const std::string logs = c.data_dir() + "/logs/";
  for (const char* pool : {"encoder", "prefill", "decode"}) {
    const std::string log = ReadFile(logs + "epd-" + pool + "-0.log");
    EXPECT_NE(log.find("the model runs on cuda:0"), std::string::npos) << pool << "\n" << log;
  }
  const GenerateOptions slow{.deadline = std::chrono::seconds(240)};
  const std::vector<int32_t> prompt = Prompt(100, 1);
  const std::vector<int32_t> want =
      testing::BoundedReferenceGreedy(model_dir(), prompt, /*max_tokens=*/8);
  ASSERT_FALSE(want.empty());
  Generation g = Generate(c.grpc_port(), prompt, 8, slow);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g.ids, want) << c.Logs();

  // The device goes, for every process on it. The next request's first launch is the encoder's:
  // it exits with status 4 (and so does any other worker that touches the device), and its
  // restarts find no device until the supervisor parks it.
  const pid_t encoder = c.Pid("epd-encoder-0");
  const pid_t router = c.Pid("epd-router"), kvstore = c.Pid("epd-kvstore");
  ASSERT_GT(encoder, 0);
  std::ofstream(lost) << "gone\n";
  Generation during = Generate(c.grpc_port(), Prompt(90, 2), 8, slow);
  EXPECT_FALSE(during.status.ok()) << "served with no encoder on a lost device";
  std::printf("a request while the device is gone: %s\n", during.status.error_message().c_str());
  const std::regex parked("epd-encoder-0 was restarted 2 times within 8 s; parking it for 8 s");
  ASSERT_TRUE(WaitFor([&] { return std::regex_search(c.serve().ReadLog(), parked); },
                      std::chrono::seconds(120)))
      << c.Logs();
  const std::string serve_log = c.serve().ReadLog();
  EXPECT_NE(
      serve_log.find("epd-encoder-0 (pid " + std::to_string(encoder) + ") exited with status 4"),
      std::string::npos)
      << serve_log;
  // The restarts found no device, and said so.
  const std::string encoder_log = ReadFile(logs + "epd-encoder-0.log");
  EXPECT_GE(Count(encoder_log, "no CUDA-capable device is detected"), 2u) << encoder_log;
  // The cluster stays up without it: epd serve, and the router and the kvstore under their first
  // pids; the router answers and lists no encoder.
  EXPECT_TRUE(c.serve().running()) << c.Logs();
  EXPECT_EQ(serve_log.find("giving up"), std::string::npos) << serve_log;
  EXPECT_EQ(c.Pid("epd-router"), router);
  EXPECT_EQ(c.Pid("epd-kvstore"), kvstore);
  EXPECT_EQ(kill(router, 0), 0);
  EXPECT_EQ(kill(kvstore, 0), 0);
  EXPECT_TRUE(WaitFor([&] { return c.RouterMetric("epd_router_workers{pool=\"encoder\"}") == 0.0; },
                      std::chrono::seconds(30)))
      << c.Logs();

  // The device is back: after its window the encoder is tried again, comes back and serves. (A try
  // logged before the file went found no device: only a later one counts.)
  const size_t logged_before = c.serve().ReadLog().size();
  ASSERT_EQ(std::remove(lost.c_str()), 0);
  ASSERT_TRUE(WaitFor(
      [&] {
        return c.serve().ReadLog().find("epd-encoder-0 was parked for 8 s; trying it again",
                                        logged_before) != std::string::npos;
      },
      std::chrono::seconds(3 * kWindowS)))
      << c.Logs();
  ASSERT_TRUE(c.WaitBack("epd-encoder-0", encoder, "registered")) << c.Logs();
  EXPECT_TRUE(c.WaitWorkers({1, 1, 1}, std::chrono::seconds(6 * kWindowS))) << c.Logs();
  Generation after = Generate(c.grpc_port(), prompt, 8, slow);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(after.ids, want) << c.Logs();

  // Ctrl-C still stops everything.
  c.serve().Signal(SIGINT);
  auto rc = c.serve().Wait(std::chrono::seconds(90));
  ASSERT_TRUE(rc.has_value()) << c.Logs();
  EXPECT_EQ(*rc, 0) << c.Logs();
  EXPECT_TRUE(c.WaitNoChildren(std::chrono::seconds(10))) << c.ClusterPids().size();
}

// `--device cuda` spreads the workers over the GPUs the launcher sees, round-robin in start order
// (encoders, prefills, decodes): here two emulated GPUs (EPD_EMU_DEVICE_COUNT) and four workers.
// Each decode worker is alone on its GPU, so its default KV pool is not split: 90 % of what the
// emulation reports free (16 GiB) less the scratch cache (256 MiB), a cap its slabs grow to on
// demand (the two decode workers together would be split in half on one GPU).
TEST_F(EmulatedServeTest, DeviceCudaSpreadsTheWorkersOverTheGpus) {
  ServeCluster c({"--model", model_dir(), "--device", "cuda", "--decodes", "2", "--worker-binary",
                  "encoder=epd-encoder-emulated,prefill=epd-prefill-emulated,"
                  "decode=epd-decode-emulated"},
                 "epd-emulated", {{"EPD_EMU_DEVICE_COUNT", "2"}});
  ASSERT_TRUE(c.WaitReady()) << c.Logs();
  const std::vector<std::pair<std::string, std::string>> want_device = {{"epd-encoder-0", "cuda:0"},
                                                                        {"epd-prefill-0", "cuda:1"},
                                                                        {"epd-decode-0", "cuda:0"},
                                                                        {"epd-decode-1", "cuda:1"}};
  for (const auto& [name, dev] : want_device) {
    const std::string log = ReadFile(c.data_dir() + "/logs/" + name + ".log");
    EXPECT_NE(log.find("the model runs on " + dev + " "), std::string::npos) << name << "\n" << log;
  }
  const std::string ready = c.serve().ReadLog();
  EXPECT_NE(ready.find("  cuda:0      epd-encoder-0 epd-decode-0\n"), std::string::npos) << ready;
  EXPECT_NE(ready.find("  cuda:1      epd-prefill-0 epd-decode-1\n"), std::string::npos) << ready;
  const int64_t whole = ((int64_t{16} << 30) - (int64_t{256} << 20)) / 10 * 9;
  for (const char* name : {"epd-decode-0", "epd-decode-1"}) {
    double capacity = -1;
    EXPECT_TRUE(testing::WaitForMetricValue(
        *c.Published(name, "metrics"), "epd_kv_pool_bytes{state=\"capacity\"}",
        static_cast<double>(whole), std::chrono::seconds(10), &capacity))
        << name << " capacity " << capacity << ", want " << whole;
  }
  // Requests at once, over both decode workers: each gives the reference's tokens.
  constexpr int kRequests = 4;
  std::vector<std::vector<int32_t>> prompts, want;
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(Prompt(70 + 10 * i, 20 + i));
    want.push_back(testing::BoundedReferenceGreedy(model_dir(), prompts.back(), 6));
  }
  std::vector<Generation> got(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      got[i] = Generate(c.grpc_port(), prompts[i], 6, {.deadline = std::chrono::seconds(240)});
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message() << "\n" << c.Logs();
    EXPECT_EQ(got[i].ids, want[i]) << i;
  }
  double served = 0;
  for (const char* name : {"epd-decode-0", "epd-decode-1"}) {
    const double n =
        testing::ScrapeMetric(*c.Published(name, "metrics"),
                              "epd_worker_requests_total{outcome=\"ok\",pool=\"decode\"}")
            .value_or(0);
    std::printf("%s served %.0f of %d\n", name, n, kRequests);
    EXPECT_GE(n, 1) << name << " (on its own GPU) served none";  // the router rotates equal loads
    served += n;
  }
  EXPECT_EQ(served, kRequests);
}

// A --worker-binary that names no pool or no executable stops `epd serve` before anything starts,
// with the cause.
TEST_F(EmulatedServeTest, ABadWorkerBinaryIsRefusedBeforeAnythingStarts) {
  for (const auto& [spec, why] : std::vector<std::pair<std::string, std::string>>{
           {"router=epd-router", "is not POOL=PATH"},
           {"decode", "is not POOL=PATH"},
           {"decode=no-such-worker", "not an executable file"},
           {"decode=.", "not an executable file"},  // a folder
           {"decode=epd-decode-emulated,decode=epd-decode-emulated",
            "names the decode pool twice"}}) {
    ServeCluster c({"--model", model_dir(), "--worker-binary", spec}, "epd-emulated");
    auto rc = c.serve().Wait(std::chrono::seconds(30));
    ASSERT_TRUE(rc.has_value()) << spec;
    EXPECT_EQ(*rc, 1) << spec;
    const std::string log = c.serve().ReadLog();
    EXPECT_NE(log.find(why), std::string::npos) << spec << "\n" << log;
    EXPECT_TRUE(c.ClusterPids().empty()) << spec;
  }
}

}  // namespace
}  // namespace epd
