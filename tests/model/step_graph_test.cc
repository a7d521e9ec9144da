// Issue 12: the decode step graphs (model/step_graph.h; docs/cuda.md, "Decode step graphs"). A
// batched decode step runs the row-independent parts of each layer as recorded segments; on the
// CPU backend with TestCpuBackendOptions::graphs the segments are recorded as closures and launched
// as a CUDA graph would be: the same pointers and scalars every launch, only the memory they
// point at changes. So a segment that bakes in something of its step (a host upload, a position,
// a pointer that moves) gives different bits than the op-by-op step, which these tests compare
// over steps whose row counts come and go (sequences joining and leaving, multi-token steps).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/step_schedule.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::model {
namespace {

using testing::BitEqual;
using testing::DefaultStepSchedule;
using testing::StepsRun;

StepsRun RunSteps(const std::string& set, testing::TestCpuBackendOptions backend_options,
                  ModelOptions model_options = {}, std::vector<int> prompts = {40, 63, 86}) {
  std::map<std::string, int64_t> calls;
  backend_options.op_calls = &calls;
  auto backend = testing::MakeTestCpuBackend(backend_options);
  auto m = testing::LoadModelInto(*backend, set, model_options);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {};
  return testing::RunStepSchedule(**m, DefaultStepSchedule(), &calls, std::move(prompts));
}

int64_t Count(const std::map<std::string, int64_t>& calls, const char* op) {
  const auto it = calls.find(op);
  return it == calls.end() ? 0 : it->second;
}

// Ops the model called on the backend itself (not inside a launched graph).
int64_t DirectOps(const std::map<std::string, int64_t>& calls) {
  int64_t n = 0;
  for (const auto& [op, k] : calls) {
    if (op != "graph ops" && op != "LaunchGraph" && op != "Upload" && op != "Download") n += k;
  }
  return n;
}

class StepGraphTest : public testing::NanoModelDirTest,
                      public ::testing::WithParamInterface<std::string> {};

TEST_P(StepGraphTest, GraphStepsGiveTheOpByOpStepsBits) {
  const StepsRun plain = RunSteps(GetParam(), {});
  const StepsRun graphs = RunSteps(GetParam(), {.graphs = true});
  ASSERT_FALSE(plain.logits.empty());
  EXPECT_TRUE(BitEqual(graphs.logits, plain.logits));
  EXPECT_EQ(graphs.tokens, plain.tokens);
  // The plain backend records no graphs: the model runs every step op by op.
  EXPECT_EQ(plain.stats.captured, 0);
  EXPECT_EQ(plain.stats.sets, 0);
  // Three row counts, each used at least twice: each recorded once, n_layers + 1 segments.
  const int64_t segments = plain.layers + 1;
  EXPECT_EQ(graphs.stats.failures, 0);
  EXPECT_EQ(graphs.stats.sets, 3);
  EXPECT_EQ(graphs.stats.captured, 3 * segments);
  EXPECT_EQ(graphs.stats.eager_steps, 3);  // each row count's first step sizes its arena
  EXPECT_EQ(graphs.stats.graph_steps, static_cast<int64_t>(DefaultStepSchedule().size()) - 3);
  EXPECT_EQ(graphs.stats.launched, graphs.stats.graph_steps * segments);
}

// The same on a device-labelled, operand-checking backend: the step's device paths (the DSpark
// inputs kept on the backend, staged uploads), and every pointer a recorded op holds is memory
// the backend allocated and has not freed when the graph is launched.
TEST_P(StepGraphTest, GraphStepsOnADeviceLabelledBackendGiveTheSameBits) {
  const StepsRun plain = RunSteps(GetParam(), {.report_device_memory = true});
  const StepsRun graphs =
      RunSteps(GetParam(), {.report_device_memory = true, .check_operands = true, .graphs = true});
  ASSERT_FALSE(plain.logits.empty());
  EXPECT_TRUE(BitEqual(graphs.logits, plain.logits));
  EXPECT_EQ(graphs.tokens, plain.tokens);
  EXPECT_EQ(graphs.stats.failures, 0);
  EXPECT_GT(graphs.stats.graph_steps, 0);
}

// A launched step makes n_layers + 1 launches in place of most of its op calls: what it still
// calls itself is each sequence's attention and the logits' processing.
TEST_P(StepGraphTest, ALaunchedStepCallsOnlyTheAttentionItself) {
  // Counted by the same backend (a test backend counts each call once), op by op.
  const StepsRun plain = RunSteps(GetParam(), {.graphs = true}, ModelOptions{.step_graphs = false});
  const StepsRun graphs = RunSteps(GetParam(), {.graphs = true});
  ASSERT_EQ(graphs.calls.size(), DefaultStepSchedule().size());
  const int64_t segments = graphs.layers + 1;
  const auto& eager = graphs.calls[0];     // row count 3, first step: op by op
  const auto& recorded = graphs.calls[1];  // second: recorded, then launched
  const auto& launched = graphs.calls[2];
  EXPECT_EQ(Count(eager, "LaunchGraph"), 0);
  EXPECT_EQ(Count(recorded, "LaunchGraph"), segments);
  EXPECT_EQ(Count(launched, "LaunchGraph"), segments);
  // The op-by-op step is the plain backend's step, op for op.
  EXPECT_EQ(DirectOps(eager), DirectOps(plain.calls[0]));
  // Launched, the same ops run (inside the graphs and outside), fewer of them called directly.
  EXPECT_EQ(DirectOps(launched) + Count(launched, "graph ops"), DirectOps(plain.calls[2]));
  EXPECT_LT(DirectOps(launched) * 2, DirectOps(plain.calls[2]));
  // Only the inputs go up, before the segments: no more uploads than op by op.
  EXPECT_LE(Count(launched, "Upload"), Count(plain.calls[2], "Upload"));
  std::printf(
      "[%s] a 3-sequence decode step: %lld backend calls op by op; launched: %lld calls + "
      "%lld graph launches running %lld ops\n",
      GetParam().c_str(), static_cast<long long>(DirectOps(plain.calls[2])),
      static_cast<long long>(DirectOps(launched)),
      static_cast<long long>(Count(launched, "LaunchGraph")),
      static_cast<long long>(Count(launched, "graph ops")));
}

// The step's sequences share the attention's buffers (Model::StepKv): consecutive sequences
// whose lists have the same length run in one SparseAttention. Against each sequence's own call
// (device_list_rows = 0: the compact path, no shared buffers), the same bits: with the default
// prompts (every top-k full: one call per layer), and with prompts of 9, 40 and 13 tokens, whose
// index layers' top-k are shorter than index_topk and differ at first (calls split into runs).
TEST_P(StepGraphTest, SharedAttentionGivesEachSequencesOwnCallsBits) {
  for (const std::vector<int>& prompts : {std::vector<int>{40, 63, 86}, {9, 40, 13}}) {
    const StepsRun shared = RunSteps(GetParam(), {.graphs = true}, {}, prompts);
    const StepsRun own =
        RunSteps(GetParam(), {.graphs = true}, ModelOptions{.device_list_rows = 0}, prompts);
    ASSERT_FALSE(shared.logits.empty());
    EXPECT_TRUE(BitEqual(shared.logits, own.logits));
    EXPECT_EQ(shared.tokens, own.tokens);
    const int64_t layers = shared.layers;
    const int64_t calls = Count(shared.calls[0], "SparseAttention");
    EXPECT_EQ(Count(own.calls[0], "SparseAttention"), 3 * layers);
    if (prompts[0] == 40) {
      EXPECT_EQ(calls, layers);
    } else {
      EXPECT_GT(calls, layers);
      EXPECT_LT(calls, 3 * layers);
    }
    std::printf(
        "[%s] prompts %d, %d, %d: a 3-sequence step's %lld layers, %lld SparseAttention "
        "calls\n",
        GetParam().c_str(), prompts[0], prompts[1], prompts[2], static_cast<long long>(layers),
        static_cast<long long>(calls));
  }
}

// Copies of a sequence share its ring blocks (SwaRing's copy): in one batched step, each copy's
// ring is made writable (copied) before the step's one PackRows writes every ring, so each copy
// sees the window as it was and keeps its own rows. Each step gives each copy the logits it
// gets alone, and so do the steps after.
TEST_P(StepGraphTest, CopiesOfASequenceInOneStepKeepTheirOwnRings) {
  auto backend = kernels::MakeCpuBackend();
  auto m = testing::LoadModelInto(*backend, GetParam(), {});
  ASSERT_TRUE(m.ok()) << m.status();
  const Model& model = **m;
  auto base = model.NewSequence();
  std::vector<int32_t> prompt(50);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i % 40);
  ASSERT_TRUE(model.Prefill(*base, prompt, false).ok());
  SequenceState a = *base, b = *base, alone_a = *base, alone_b = *base;
  for (int step = 0; step < 4; ++step) {
    std::vector<SequenceState*> both = {&a, &b};
    std::vector<std::vector<int32_t>> toks = {{int32_t(5 + step)}, {int32_t(20 + 3 * step)}};
    auto out = DecodeStep(model, both, toks);
    ASSERT_TRUE(out.ok()) << out.status();
    std::vector<SequenceState*> one_a = {&alone_a}, one_b = {&alone_b};
    auto want_a = DecodeStep(model, one_a, std::span(toks).first(1));
    auto want_b = DecodeStep(model, one_b, std::span(toks).last(1));
    ASSERT_TRUE(want_a.ok() && want_b.ok());
    EXPECT_TRUE(BitEqual((*out)[0].logits, (*want_a)[0].logits)) << "step " << step;
    EXPECT_TRUE(BitEqual((*out)[1].logits, (*want_b)[0].logits)) << "step " << step;
    EXPECT_FALSE(BitEqual((*out)[0].logits, (*out)[1].logits)) << "step " << step;
  }
}

// With room for one row count only, each new row count evicts the last one's graphs; the bits do
// not change. With step_graphs off, a backend that records graphs is used op by op.
TEST_P(StepGraphTest, EvictedAndDisabledGraphsGiveTheSameBits) {
  const StepsRun plain = RunSteps(GetParam(), {});
  const StepsRun one_set =
      RunSteps(GetParam(), {.graphs = true}, ModelOptions{.step_graph_sets = 1});
  EXPECT_TRUE(BitEqual(one_set.logits, plain.logits));
  EXPECT_EQ(one_set.tokens, plain.tokens);
  EXPECT_EQ(one_set.stats.sets, 1);
  EXPECT_EQ(one_set.stats.evicted, 3);  // 3 -> 4 -> 1 -> 3
  EXPECT_GT(one_set.stats.graph_steps, 0);
  const StepsRun off = RunSteps(GetParam(), {.graphs = true}, ModelOptions{.step_graphs = false});
  EXPECT_TRUE(BitEqual(off.logits, plain.logits));
  EXPECT_EQ(off.stats.captured, 0);
  // A row count over step_graph_max_rows runs op by op.
  const StepsRun small =
      RunSteps(GetParam(), {.graphs = true}, ModelOptions{.step_graph_max_rows = 2});
  EXPECT_TRUE(BitEqual(small.logits, plain.logits));
  EXPECT_EQ(small.stats.sets, 1);  // row count 1 only
  EXPECT_EQ(small.stats.captured, small.stats.sets * (plain.layers + 1));
}

INSTANTIATE_TEST_SUITE_P(Models, StepGraphTest,
                         ::testing::Values("nano", "v41-tiny-a", "v41-tiny-c"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

// ---- The test CPU backend's recording (TestCpuBackendOptions::graphs) ----

TEST(GraphRecordingTest, ALaunchRunsTheRecordedOpsOnTheMemorysContentsThen) {
  auto b = testing::MakeTestCpuBackend({.graphs = true});
  ASSERT_TRUE(b->supports_graphs());
  auto x = b->Allocate(4 * sizeof(float));
  auto y = b->Allocate(4 * sizeof(float));
  ASSERT_TRUE(x.ok() && y.ok());
  std::vector<float> host = {1.f, 2.f, 3.f, 4.f};
  ASSERT_TRUE(b->Upload(host.data(), 16, *x, 0).ok());
  ASSERT_TRUE(b->Upload(host.data(), 16, *y, 0).ok());
  // Host data cannot enter a recording: the refused calls fail the capture.
  ASSERT_TRUE(b->BeginCapture().ok());
  EXPECT_EQ(b->BeginCapture().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<float> back(4);
  EXPECT_EQ(b->Download(*x, 0, 16, back.data()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->Upload(host.data(), 16, *y, 0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->Synchronize().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->EndCapture().status().code(), absl::StatusCode::kFailedPrecondition);
  // Recorded, not run.
  ASSERT_TRUE(b->BeginCapture().ok());
  ASSERT_TRUE(b->Add(x->as<float>(), y->as<float>(), 4).ok());
  ASSERT_TRUE(b->ScaleRoundBf16(x->as<float>(), 4, 0.5f).ok());
  auto g = b->EndCapture();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->ops(), 2);
  ASSERT_TRUE(b->Download(*x, 0, 16, back.data()).ok());
  EXPECT_EQ(back, host);  // nothing ran at capture
  ASSERT_TRUE(b->LaunchGraph(**g).ok());
  ASSERT_TRUE(b->Download(*x, 0, 16, back.data()).ok());
  EXPECT_EQ(back, (std::vector<float>{1.f, 2.f, 3.f, 4.f}));  // (x + y) / 2
  // New contents of y: the next launch reads them.
  std::vector<float> y2 = {3.f, 2.f, 1.f, 0.f};
  ASSERT_TRUE(b->Upload(y2.data(), 16, *y, 0).ok());
  ASSERT_TRUE(b->LaunchGraph(**g).ok());
  ASSERT_TRUE(b->Download(*x, 0, 16, back.data()).ok());
  EXPECT_EQ(back, (std::vector<float>{2.f, 2.f, 2.f, 2.f}));
  // A graph of another backend, and ends without a beginning, are refused.
  auto other = testing::MakeTestCpuBackend({.graphs = true});
  EXPECT_EQ(other->LaunchGraph(**g).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->EndCapture().status().code(), absl::StatusCode::kFailedPrecondition);
  // Without the option, the CPU backend records nothing.
  auto plain = kernels::MakeCpuBackend();
  EXPECT_FALSE(plain->supports_graphs());
  EXPECT_EQ(plain->BeginCapture().code(), absl::StatusCode::kUnimplemented);
}

// A recorded op's checks that read operand contents run at launch and fail it, naming the op.
TEST(GraphRecordingTest, AnOpThatFailsAtLaunchFailsTheLaunch) {
  auto b = testing::MakeTestCpuBackend({.graphs = true});
  auto x = b->Allocate(4 * sizeof(float));
  auto rows = b->Allocate(sizeof(int64_t));
  ASSERT_TRUE(x.ok() && rows.ok());
  const int64_t bad = -1;
  ASSERT_TRUE(b->Upload(&bad, sizeof bad, *rows, 0).ok());
  ASSERT_TRUE(b->BeginCapture().ok());
  ASSERT_TRUE(
      b->CopyRows(x->as<float>(), rows->as<int64_t>(), x->as<float>() + 2, nullptr, 1, 1).ok());
  auto g = b->EndCapture();
  ASSERT_TRUE(g.ok());
  const absl::Status s = b->LaunchGraph(**g);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("CopyRows"), std::string::npos) << s;
}

}  // namespace
}  // namespace epd::model
