// Layer-streamed encoder -> prefill hand-offs between real processes (docs/transfer.md): the same
// prompts through a cluster whose encoder streams (--handoff-streaming on, the default) and one
// whose encoder sends the whole hand-off (off) give identical tokens, equal to the monolithic
// reference, and the prefill worker counts which way each hand-off came.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"

namespace epd {
namespace {

using epd::testing::Generate;
using epd::testing::Generation;
using epd::testing::Prompt;
using epd::testing::ScrapeMetric;

class StreamedHandoffE2ETest : public testing::NanoModelDirTest {};

TEST_F(StreamedHandoffE2ETest, StreamingOnAndOffGiveIdenticalTokens) {
  // Shorter than the tail, longer, and a long one (2,000 tokens) whose global KV dominates.
  const std::vector<std::pair<int, int>> prompts = {{1, 90}, {2, 333}, {3, 2000}};
  std::map<std::string, std::vector<std::vector<int32_t>>> outputs;
  for (const char* flag : {"on", "off"}) {
    const std::string mode = flag;
    testing::RealCluster c(
        {.model_dir = model_dir(), .encoder_args = {"--handoff-streaming", mode}});
    for (const auto& [salt, length] : prompts) {
      Generation g = Generate(c.grpc_port(), Prompt(length, salt), 12);
      ASSERT_TRUE(g.status.ok()) << mode << ": " << g.status.error_message() << "\n" << c.Logs();
      EXPECT_FALSE(g.ids.empty());
      outputs[mode].push_back(g.ids);
    }
    const double n = static_cast<double>(prompts.size());
    const int m = c.metrics("prefill");
    EXPECT_EQ(ScrapeMetric(m, "epd_handoff_receives_total{mode=\"streamed\"}"),
              mode == "on" ? n : 0.0)
        << c.Logs();
    EXPECT_EQ(ScrapeMetric(m, "epd_handoff_receives_total{mode=\"whole\"}"),
              mode == "on" ? 0.0 : n);
    // Every group was a transfer of its own with its own accounting: no failure anywhere.
    EXPECT_EQ(ScrapeMetric(c.metrics("encoder"),
                           "epd_worker_requests_total{outcome=\"ok\",pool=\"encoder\"}"),
              n);
  }
  ASSERT_EQ(outputs["on"].size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(outputs["on"][i], outputs["off"][i]) << "prompt " << i;
    EXPECT_EQ(outputs["on"][i], testing::BoundedReferenceGreedy(testing::NanoModelDirTest::model_dir(),
                                            Prompt(prompts[i].second, prompts[i].first), 12))
        << "prompt " << i;
  }
}

}  // namespace
}  // namespace epd
