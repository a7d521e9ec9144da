// Workers on a device, as real processes: epd-<pool>-emulated with `--device cuda` is the worker
// built against the emulated CUDA runtime (tests/gpu/emulated: the CUDA backend's host code and
// kernels run on the host), started beside a real epd-router (and CPU workers, an epd-kvstore).
// What only real worker processes show, and a GPU is not needed for (docs/cuda.md, "Workers on
// the emulated device"):
// - workers take hand-offs into device memory and send them from it, write and read the store
//   from it, decode in batched steps with graphs, and serve the CPU reference's greedy tokens;
// - a lost device (a kernel's illegal address: the context is gone for the process) makes the
//   worker exit with status 4 before it answers, and the router moves the stream to another
//   decode worker: the client sees no error, and the continuation is a fresh request's
//   (docs/workers.md, docs/router.md "Request migration").
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/worker/worker_runtime.h"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using testing::Generate;
using testing::GenerateOptions;
using testing::Generation;
using testing::Prompt;
using testing::ScrapeMetric;

using worker::kExitDeviceLost;

// The emulated decode worker: its KV pool sized by hand (the emulation reports a 16 GiB device,
// and the default pool is 90 % of that, in host memory here).
testing::WorkerSpec EmulatedDecode(std::map<std::string, std::string> env = {}) {
  return {.binary = "epd-decode-emulated",
          .args = {"--device", "cuda", "--kv-pool-bytes", std::to_string(64 << 20)},
          .env = std::move(env)};
}
// Any worker of `pool` on the emulated device.
testing::WorkerSpec Emulated(const std::string& pool) {
  if (pool == "decode") return EmulatedDecode();
  return {.binary = "epd-" + pool + "-emulated", .args = {"--device", "cuda"}};
}

std::vector<int32_t> Reference(const std::vector<int32_t>& prompt, int max_tokens) {
  return testing::BoundedReferenceGreedy(testing::NanoModelDirTest::model_dir(), prompt,
                                         max_tokens);
}

class EmulatedWorkerE2ETest : public testing::NanoModelDirTest {};

TEST_F(EmulatedWorkerE2ETest, ADecodeWorkerOnTheDeviceServesTheCpuReferenceTokens) {
  testing::RealCluster c({.model_dir = model_dir(), .start_decode = false});
  c.Add("decode", "decode-0", EmulatedDecode());
  // Shorter than the decoder tail and longer (bounded replay); not multiples of the block sizes.
  for (const auto& [length, salt] : std::vector<std::pair<int, int>>{{100, 1}, {301, 3}}) {
    const std::vector<int32_t> prompt = Prompt(length, salt);
    const std::vector<int32_t> want = Reference(prompt, 8);
    Generation g = Generate(c.grpc_port(), prompt, 8, {.deadline = std::chrono::seconds(240)});
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
    ASSERT_FALSE(want.empty());
    EXPECT_EQ(g.ids, want) << c.Logs();
  }
  // Three at once share the worker's batched steps (row counts 1 to 3), whose row-independent
  // parts run as recorded graphs after each row count's first step.
  std::vector<std::vector<int32_t>> prompts, want(3);
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(Prompt(80 + 10 * i, 10 + i));
    want[i] = Reference(prompts[i], 16);
  }
  std::vector<Generation> got(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      got[i] = Generate(c.grpc_port(), prompts[i], 16, {.deadline = std::chrono::seconds(240)});
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message() << "\n" << c.Logs();
    EXPECT_EQ(got[i].ids, want[i]) << i;
  }
  const int decode = c.metrics("decode");
  EXPECT_EQ(ScrapeMetric(decode, "epd_worker_requests_total{outcome=\"ok\",pool=\"decode\"}"), 5.0);
  const double graph_steps =
      ScrapeMetric(decode, "epd_decode_step_graph_steps_total{mode=\"graph\"}").value_or(0);
  std::printf(
      "decode steps launched as graphs: %.0f, op by op: %.0f\n", graph_steps,
      ScrapeMetric(decode, "epd_decode_step_graph_steps_total{mode=\"op_by_op\"}").value_or(0));
  EXPECT_GT(graph_steps, 0);
  EXPECT_EQ(ScrapeMetric(decode, "epd_decode_step_graph_failures_total").value_or(-1), 0.0);
  const std::string log = c.worker("decode").proc.ReadLog();
  EXPECT_NE(log.find("the model runs on cuda:0"), std::string::npos) << log;
}

// Every stage on the device, with the kvstore and DSpark: the encoder and prefill hand their state
// off from device memory (staged through host memory) and write the store from it, the decode
// worker takes it into device memory and verifies drafts there; an agent's second turn reads turn
// 1's blocks from the store into the encoder's device memory. Both turns equal the CPU reference.
TEST_F(EmulatedWorkerE2ETest, EveryStageOnTheDeviceWithTheStoreServesTheCpuReferenceTokens) {
  // DSpark drafts 3 tokens every step: the decode worker verifies them and rolls its state
  // back on the device (lossless: the output is still the reference's).
  testing::WorkerSpec decode = Emulated("decode");
  decode.args.insert(decode.args.end(), {"--dspark-k", "3"});
  testing::RealCluster c({.model_dir = model_dir(),
                          .store = true,
                          .dspark = true,
                          .first = {{"encoder", Emulated("encoder")},
                                    {"prefill", Emulated("prefill")},
                                    {"decode", decode}}});
  auto tokens = [](int n, int salt) {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = 10 + (i * 31 + salt * 7 + i / 5) % 400;
    return p;
  };
  const GenerateOptions slow{.deadline = std::chrono::seconds(300)};
  const std::vector<int32_t> turn1 = tokens(300, 1);  // 4 whole blocks of 64 + 44
  Generation g1 = Generate(c.grpc_port(), turn1, 12, slow);
  ASSERT_TRUE(g1.status.ok()) << g1.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g1.ids, Reference(turn1, 12)) << c.Logs();
  EXPECT_EQ(g1.cached, 0);
  // Turn 1 stored its 4 whole blocks and the sliding-window snapshot at 256, from device memory.
  const int encoder = c.metrics("encoder");
  EXPECT_EQ(ScrapeMetric(encoder, "epd_kv_worker_writes_total{pool=\"encoder\",tier=\"g3\"}"), 4.0);
  EXPECT_EQ(ScrapeMetric(encoder, "epd_kv_worker_writes_total{pool=\"encoder\",tier=\"g2\"}"), 1.0);
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), g1.ids.begin(), g1.ids.end());
  const std::vector<int32_t> more = tokens(200, 2);  // more than the tail rows and a block
  turn2.insert(turn2.end(), more.begin(), more.end());
  Generation g2 = Generate(c.grpc_port(), turn2, 12, slow);
  ASSERT_TRUE(g2.status.ok()) << g2.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(g2.cached, 256) << c.Logs();
  EXPECT_EQ(ScrapeMetric(encoder, "epd_kv_worker_prefix_tokens_total{pool=\"encoder\"}"), 256.0);
  EXPECT_EQ(g2.ids, Reference(turn2, 12)) << c.Logs();
  const double drafted =
      ScrapeMetric(c.metrics("decode"), "epd_dspark_drafted_tokens_total").value_or(-1);
  std::printf("DSpark on the device: %.0f drafted, %.0f accepted\n", drafted,
              ScrapeMetric(c.metrics("decode"), "epd_dspark_accepted_tokens_total").value_or(-1));
  EXPECT_GT(drafted, 0);
  EXPECT_EQ(ScrapeMetric(c.metrics("decode"), "epd_dspark_handoff_mismatch_total"), 0.0);
  for (const char* pool : {"encoder", "prefill", "decode"}) {
    const std::string log = c.worker(pool).proc.ReadLog();
    EXPECT_NE(log.find("the model runs on cuda:0"), std::string::npos) << pool << "\n" << log;
  }
}

// Every "migrating with <k> streamed" the router logged, in order.
std::vector<size_t> Migrations(const std::string& logs) {
  std::vector<size_t> out;
  const std::regex re("migrating with (\\d+) streamed");
  for (auto it = std::sregex_iterator(logs.begin(), logs.end(), re); it != std::sregex_iterator();
       ++it) {
    out.push_back(std::stoul((*it)[1]));
  }
  return out;
}

// What a worker whose device was lost leaves, once `status` (its exit) is known: status 4 and the
// reason in its log, the router's count of failed workers, and no failed request (the one the
// worker held was migrated or run again elsewhere).
void ExpectExitedOnALostDevice(testing::RealCluster& c, testing::RealProc& worker, int status) {
  EXPECT_EQ(status, kExitDeviceLost) << c.Logs();
  const std::string log = worker.proc.ReadLog();
  EXPECT_NE(log.find("exiting (status 4)"), std::string::npos) << log;
  EXPECT_NE(log.find("cudaErrorIllegalAddress"), std::string::npos) << log;
  EXPECT_GE(ScrapeMetric(c.router_metrics(), "epd_router_worker_failures_total").value_or(0), 1.0)
      << c.Logs();
  for (const char* outcome : {"error", "unavailable"}) {
    EXPECT_EQ(ScrapeMetric(c.router_metrics(),
                           std::string("epd_requests_total{outcome=\"") + outcome + "\"}")
                  .value_or(0),
              0.0)
        << outcome;
  }
}

// The decode worker on the device loses it mid-stream (the emulation's context is lost at its
// next launch once the test creates a file): the worker exits with status 4 before it answers, the
// router migrates the stream to the CPU decode worker, and the client's stream ends normally.
TEST_F(EmulatedWorkerE2ETest, ALostDeviceExitsTheWorkerAndItsStreamMigrates) {
  constexpr int kMaxTokens = 32;
  // A prompt whose greedy answer runs to max_tokens, so the worker is still decoding when the
  // first chunk reaches the client (the nano model ends some answers after a few tokens).
  std::vector<int32_t> prompt, want;
  for (int salt = 2; salt < 40 && want.size() < kMaxTokens; ++salt) {
    prompt = Prompt(150, salt);
    want = Reference(prompt, kMaxTokens);
  }
  ASSERT_EQ(want.size(), kMaxTokens) << "no prompt of 38 has a greedy answer of 32 tokens";

  testing::TempDir dir;
  const std::string trigger = dir.File("lose-the-device");
  testing::RealCluster c({.model_dir = model_dir(), .start_decode = false});
  testing::RealProc* device =
      c.Add("decode", "decode-0", EmulatedDecode({{"EPD_EMU_LOSE_CONTEXT_FILE", trigger}}));
  c.Add("decode", "decode-1");
  auto busy = [](const testing::RealProc* p) {
    return ScrapeMetric(p->metrics, "epd_queue_depth{pool=\"decode\"}").value_or(0) > 0;
  };

  // The router rotates between the two idle workers, so one of the first two requests runs on the
  // device; when its first chunk arrives, the device is lost. Should that worker finish the stream
  // before its next launch (a loaded machine can delay the client that long), its next request
  // meets the lost device at its first launch instead, and is re-dispatched or migrated the same.
  bool touched = false;
  std::optional<int> status;
  for (int attempt = 0; attempt < 6 && !status; ++attempt) {
    GenerateOptions opts{.deadline = std::chrono::seconds(240)};
    opts.on_first = [&] {
      if (touched || !busy(device)) return;
      std::ofstream(trigger) << "now\n";
      touched = true;
    };
    const size_t migrated_before = Migrations(c.Logs()).size();
    Generation g = Generate(c.grpc_port(), prompt, kMaxTokens, opts);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
    const std::vector<size_t> migrated = Migrations(c.Logs());
    if (migrated.size() == migrated_before) {
      EXPECT_EQ(g.ids, want) << c.Logs();
    } else {
      // The tokens streamed before the device was lost are the reference's; the rest equal a
      // fresh request of the prompt plus them.
      ASSERT_EQ(migrated.size(), migrated_before + 1) << c.Logs();
      const size_t k = migrated.back();
      std::printf("the device was lost after %zu streamed tokens; the stream ended '%s' with %zu\n",
                  k, g.finish.c_str(), g.ids.size());
      ASSERT_LE(k, g.ids.size());
      EXPECT_EQ(std::vector<int32_t>(g.ids.begin(), g.ids.begin() + k),
                std::vector<int32_t>(want.begin(), want.begin() + k));
      std::vector<int32_t> continued = prompt;
      continued.insert(continued.end(), g.ids.begin(), g.ids.begin() + k);
      Generation fresh = Generate(c.grpc_port(), continued, kMaxTokens - static_cast<int>(k));
      ASSERT_TRUE(fresh.status.ok()) << fresh.status.error_message();
      EXPECT_EQ(std::vector<int32_t>(g.ids.begin() + k, g.ids.end()), fresh.ids);
    }
    // The router moved the request only once the worker's streams broke: it has exited.
    if (touched) status = device->proc.Wait(std::chrono::seconds(migrated.size() > 0 ? 30 : 5));
  }
  ASSERT_TRUE(touched) << "no request ran on the device worker\n" << c.Logs();
  ASSERT_TRUE(status.has_value()) << "the worker whose device was lost is still running\n"
                                  << testing::DescribeThreads(device->proc.pid()) << c.Logs();
  ExpectExitedOnALostDevice(c, *device, *status);
}

// A side stage's device is lost: the prefill worker on the device meets it at its job's first
// launch, exits with status 4 before it answers, and the router runs the request again on the
// CPU prefill worker (nothing was streamed yet), so the request still ends normally.
TEST_F(EmulatedWorkerE2ETest, ALostDeviceOnAPrefillWorkerExitsItAndTheRequestRunsElsewhere) {
  testing::TempDir dir;
  const std::string trigger = dir.File("lose-the-device");
  testing::WorkerSpec prefill = Emulated("prefill");
  prefill.env["EPD_EMU_LOSE_CONTEXT_FILE"] = trigger;
  testing::RealCluster c({.model_dir = model_dir(), .first = {{"prefill", prefill}}});
  testing::RealProc* device = &c.worker("prefill");
  c.Add("prefill", "prefill-1");
  std::ofstream(trigger) << "now\n";
  // The router rotates between the two idle prefill workers: one of the first two requests meets
  // the lost device.
  std::optional<int> status;
  for (int i = 0; i < 4 && !status; ++i) {
    const std::vector<int32_t> prompt = Prompt(150 + i, 60 + i);
    Generation g = Generate(c.grpc_port(), prompt, 8, {.deadline = std::chrono::seconds(240)});
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << c.Logs();
    EXPECT_EQ(g.ids, Reference(prompt, 8)) << c.Logs();
    status = device->proc.Wait(std::chrono::milliseconds(500));
  }
  ASSERT_TRUE(status.has_value()) << "the prefill worker on the lost device is still running\n"
                                  << c.Logs();
  ExpectExitedOnALostDevice(c, *device, *status);
}

}  // namespace
}  // namespace epd
