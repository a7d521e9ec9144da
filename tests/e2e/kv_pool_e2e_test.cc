// Admission and preemption by the decode worker's KV pool (decode_pool/decode_server.cc,
// model/kv_pool.h) in the real chain: epd-router + epd-encoder + epd-prefill + epd-decode
// processes, the decode worker started with a --kv-pool-bytes that holds two long requests at
// most. More long requests than that, submitted at once, all complete; each output equals its
// output when run alone; the worker counts preemptions on /metrics
// (epd_kv_pool_preemptions_total) and exports its pool's blocks by state; the pool's slabs are
// registered with the worker's UCX wire.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "model/model.h"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"

namespace epd {
namespace {

using epd::testing::Generate;
using epd::testing::Generation;
using epd::testing::ScrapeMetric;

class KvPoolE2eTest : public testing::NanoModelTest {};

std::vector<int32_t> LongPrompt(int n, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 10 + (i * 29 + salt * 131 + i / 7) % 400;
  return p;
}

TEST_F(KvPoolE2eTest, MoreLongRequestsThanThePoolHoldsAllCompleteAsAlone) {
  // A 256-token prompt holds 4 blocks, 5 after its first decode step and one more per 64 tokens:
  // 8 at 512, and its SWA rings (R bytes, from the hand-off on). A request is admitted when its 4
  // blocks + R plus 2 headroom blocks per live sequence (itself included) are free: with 16 blocks
  // + 2R a second request always gets in while the first runs (<= 8 + 4 + 4 blocks + 2R), a third
  // never does (>= 5 + 4 + 4 + 6 blocks + 3R), and once the two hold more than 12 blocks (they do
  // before the older one ends) the headroom is gone and the younger is swapped out, to resume when
  // the older finishes.
  const int64_t block = model_->KvBlockBytes();
  const int64_t pool_bytes = 16 * block + 2 * model_->FixedStateBytes();
  // epd_kv_pool_blocks counts the pool's bytes in 64-token blocks of global KV.
  const double pool_blocks = static_cast<double>(pool_bytes) / static_cast<double>(block);
  ASSERT_EQ(model_->KvBytesFor(256), 4 * block);
  // (A generous heartbeat miss limit: this test is about the pool, and a loaded 2-core machine
  // may delay a heartbeat past the 3 x 200 ms default.)
  testing::RealCluster cluster(
      {.model_dir = model_dir(),
       // (--step-graphs: accepted; the CPU records no graphs.)
       .decode_args = {"--kv-pool-bytes", std::to_string(pool_bytes), "--step-graphs", "off"},
       .router_args = {"--heartbeat-miss-limit", "25"}});
  const int dm = cluster.metrics("decode");
  ASSERT_GT(dm, 0);
  EXPECT_EQ(ScrapeMetric(dm, "epd_kv_pool_preemptions_total").value_or(-1), 0.0);
  EXPECT_NEAR(ScrapeMetric(dm, "epd_kv_pool_blocks{state=\"free\"}").value_or(-1), pool_blocks,
              1e-3);
  EXPECT_EQ(ScrapeMetric(dm, "epd_kv_pool_blocks{state=\"used\"}").value_or(-1), 0.0);

  constexpr int kRequests = 4, kTokens = 256;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kRequests; ++i) prompts.push_back(LongPrompt(256, i));
  // Alone: one at a time (one fits).
  std::vector<Generation> alone;
  for (const auto& p : prompts) {
    alone.push_back(
        Generate(cluster.grpc_port(), p, kTokens, {.deadline = std::chrono::seconds(120)}));
    ASSERT_TRUE(alone.back().status.ok()) << alone.back().status.error_message() << "\n"
                                          << cluster.Logs();
    ASSERT_FALSE(alone.back().ids.empty());
  }
  EXPECT_EQ(ScrapeMetric(dm, "epd_kv_pool_preemptions_total").value_or(-1), 0.0);
  // Sealed blocks of the finished requests stay cached (evictable) for later prefixes.
  EXPECT_GT(ScrapeMetric(dm, "epd_kv_pool_blocks{state=\"cached\"}").value_or(-1), 0.0);

  // All at once.
  std::vector<Generation> together(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      together[i] = Generate(cluster.grpc_port(), prompts[i], kTokens,
                             {.deadline = std::chrono::seconds(180)});
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(together[i].status.ok()) << i << ": " << together[i].status.error_message() << "\n"
                                         << cluster.Logs();
    EXPECT_EQ(together[i].ids, alone[i].ids) << "request " << i;
    EXPECT_EQ(together[i].finish, alone[i].finish) << "request " << i;
  }
  const double preemptions = ScrapeMetric(dm, "epd_kv_pool_preemptions_total").value_or(-1);
  EXPECT_GE(preemptions, 1.0) << cluster.Logs();
  // The decode step graph counters are exported; a CPU worker records no graphs, so its steps
  // count under neither mode and no capture failed.
  EXPECT_EQ(ScrapeMetric(dm, "epd_decode_step_graph_steps_total{mode=\"graph\"}").value_or(-1),
            0.0);
  EXPECT_EQ(ScrapeMetric(dm, "epd_decode_step_graph_failures_total").value_or(-1), 0.0);
  // Idle again: nothing is in use; free + cached = the whole pool.
  const double used = ScrapeMetric(dm, "epd_kv_pool_blocks{state=\"used\"}").value_or(-1);
  const double free = ScrapeMetric(dm, "epd_kv_pool_blocks{state=\"free\"}").value_or(-1);
  const double cached = ScrapeMetric(dm, "epd_kv_pool_blocks{state=\"cached\"}").value_or(-1);
  EXPECT_EQ(used, 0.0);
  EXPECT_NEAR(free + cached, pool_blocks, 1e-3);
  // The pool's memory is slabs from the backend, kept at their high-water while idle, each
  // registered with the worker's UCX wire (an idle engine holds no registration of its own).
  EXPECT_GT(ScrapeMetric(dm, "epd_kv_pool_bytes{state=\"slabs\"}").value_or(-1), 0.0);
  EXPECT_GE(
      ScrapeMetric(dm, "epd_transfer_outstanding{resource=\"registrations\"}").value_or(-1), 1.0)
      << cluster.Logs();
}

// A request whose state can never fit the pool fails with a clear error; the worker stays up and
// serves the next request.
TEST_F(KvPoolE2eTest, ARequestLargerThanThePoolIsRefused) {
  const int64_t block = model_->KvBlockBytes(), rings = model_->FixedStateBytes();
  testing::RealCluster cluster(
      {.model_dir = model_dir(),
       .decode_args = {"--kv-pool-bytes", std::to_string(8 * block + rings)}});
  Generation big = Generate(cluster.grpc_port(), LongPrompt(640, 9), 4);  // 10 blocks + R + 2
  EXPECT_FALSE(big.status.ok());
  EXPECT_NE(big.status.error_message().find("KV pool"), std::string::npos)
      << big.status.error_message();
  Generation small = Generate(cluster.grpc_port(), LongPrompt(64, 3), 4);
  EXPECT_TRUE(small.status.ok()) << small.status.error_message() << "\n" << cluster.Logs();
  EXPECT_FALSE(small.ids.empty());
}

}  // namespace
}  // namespace epd
