// The model forward on a CUDA device (issue 12, step 5): weights, a call's arrays (model::Scratch)
// and the KV pool in device memory. On each golden set:
// - the prefill's logits of every row are within the golden envelope of the official reference;
// - the whole serving surface (decode, verification + rollback, DSpark drafts, staged encoder /
//   decoder replay / batched decode; tests/testing/serving_surface.h) is within the same
//   envelope of the CPU reference backend's run, with the same draft ids;
// - module teacher forcing: each module on the reference's own inputs (not run on a GPU yet);
// - staged execution (chunked prefill, multi-token decode) equals monolithic bit for bit;
// - greedy generation through the serving path gives the CPU reference's ids;
// - batched decode steps launched as CUDA graphs (model/step_graph.h) equal the op-by-op steps
//   bit for bit.
// Skips with "skipped: no GPU" where no CUDA device is present (CI).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#if defined(EPD_CUDA_EMULATED)
#include <cuda_runtime.h>  // the emulation's (tests/gpu/emulated): its injected failures
#endif

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/module_teacher_forcing.h"
#include "tests/testing/serving_surface.h"
#include "tests/testing/staged_checks.h"
#include "tests/testing/step_schedule.h"

namespace epd::model {
namespace {

using testing::RelRms;

class CudaModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaModelTest, GoldenPrefillAndTheServingSurfaceMatchTheCpuReference) {
  auto cuda = kernels::MakeCudaBackend(0);
  if (!cuda.ok()) GTEST_SKIP() << "skipped: no GPU (" << cuda.status().message() << ")";
  const std::string set = GetParam();
  const testing::GoldenSet g = testing::GoldenSet::Load(set);
  auto gpu = testing::LoadGoldenModel(**cuda, set, {}, /*weights_in_backend=*/true);
  ASSERT_TRUE(gpu.ok()) << gpu.status();

  auto st = (*gpu)->NewSequence();
  auto r = (*gpu)->Prefill(*st, g.prompt, true);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> want = testing::ReadGoldenF32(set, "logits_prefill_all.bin");
  ASSERT_EQ(r->logits.size(), want.size());
  const double prefill = RelRms(r->logits, want);
  std::printf("%s: prefill rel_rms vs golden %.4g (envelope %.4g)\n", set.c_str(), prefill,
              g.prefill_rel_rms);
  EXPECT_LE(prefill, g.prefill_rel_rms);

  auto cpu_backend = kernels::MakeCpuBackend();
  auto cpu = testing::LoadGoldenModel(*cpu_backend, set, {}, /*weights_in_backend=*/true);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto a = testing::RunServingSurface(**gpu);
  auto b = testing::RunServingSurface(**cpu);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->logits.size(), b->logits.size());
  const double surface = RelRms(a->logits, b->logits);
  std::printf("%s: serving surface rel_rms GPU vs CPU %.4g (envelope %.4g)\n", set.c_str(), surface,
              g.steps_rel_rms);
  EXPECT_LE(surface, g.steps_rel_rms);
  EXPECT_EQ(a->ids, b->ids);
}

// Module teacher forcing on the GPU: each layer's attention, MoE and Engram on the reference's
// own inputs, against the reference's outputs (the CPU golden_parity_test's checks).
TEST_P(CudaModelTest, ModuleTeacherForcingOnTheGpu) {
  auto cuda = kernels::MakeCudaBackend(0);
  if (!cuda.ok()) GTEST_SKIP() << "skipped: no GPU (" << cuda.status().message() << ")";
  auto gpu = testing::LoadGoldenModel(**cuda, GetParam(), {}, /*weights_in_backend=*/true);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  testing::ExpectModulesMatchGolden(**gpu, GetParam(), testing::GoldenPrompt(GetParam()));
}

TEST_P(CudaModelTest, StagedExecutionEqualsMonolithicOnTheGpu) {
  auto cuda = kernels::MakeCudaBackend(0);
  if (!cuda.ok()) GTEST_SKIP() << "skipped: no GPU (" << cuda.status().message() << ")";
  auto gpu = testing::LoadGoldenModel(**cuda, GetParam(), {}, /*weights_in_backend=*/true);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const std::vector<int32_t> prompt =
      testing::ExtendedPrompt(testing::GoldenPrompt(GetParam()), 301);
  testing::ExpectChunkedPrefillEqualsMonolithic(**gpu, prompt);
  testing::ExpectMultiTokenDecodeEqualsSequentialDecode(**gpu, prompt);
}

// Greedy generation through the decode worker's path (the staged encoder and decoder replay,
// then batched decode steps): the GPU's ids are the CPU reference's, and so are its logits.
// The decode step graphs on the GPU: a schedule of batched steps whose row counts come and go,
// each row count recorded as CUDA graphs on its second step and launched after, against the same
// steps op by op (ModelOptions::step_graphs off) on the same device: bit for bit.
TEST_P(CudaModelTest, DecodeStepGraphsEqualOpByOpSteps) {
  auto cuda = kernels::MakeCudaBackend(0);
  if (!cuda.ok()) GTEST_SKIP() << "skipped: no GPU (" << cuda.status().message() << ")";
  ASSERT_TRUE((*cuda)->supports_graphs());
  auto eager = testing::LoadGoldenModel(**cuda, GetParam(), ModelOptions{.step_graphs = false},
                                        /*weights_in_backend=*/true);
  auto graphs = testing::LoadGoldenModel(**cuda, GetParam(), {}, /*weights_in_backend=*/true);
  ASSERT_TRUE(eager.ok() && graphs.ok());
  const testing::StepsRun want = testing::RunStepSchedule(**eager, testing::DefaultStepSchedule());
  const testing::StepsRun got = testing::RunStepSchedule(**graphs, testing::DefaultStepSchedule());
  ASSERT_FALSE(want.logits.empty());
  EXPECT_TRUE(testing::BitEqual(got.logits, want.logits));
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.stats.failures, 0);
  EXPECT_EQ(got.stats.captured, 3 * (got.layers + 1));
  EXPECT_GT(got.stats.graph_steps, 0);
  EXPECT_EQ(want.stats.captured, 0);
  std::printf("%s: %lld decode steps, %lld launched as graphs (%lld segments recorded)\n",
              GetParam().c_str(), static_cast<long long>(testing::DefaultStepSchedule().size()),
              static_cast<long long>(got.stats.graph_steps),
              static_cast<long long>(got.stats.captured));
}

#if defined(EPD_CUDA_EMULATED)
// A step graph launch that fails without losing the context (injected into the emulation: a real
// GPU cannot be made to) fails its step, since how much of the graph ran is unknown; the row
// count's graphs are dropped, and its later steps run op by op, with the same logits as a model
// that never launched graphs.
TEST(CudaModelEmulatedTest, AFailedStepGraphLaunchFailsItsStepThenItsRowCountRunsOpByOp) {
  auto cuda = kernels::MakeCudaBackend(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const std::string set = testing::GoldenSets().front();
  auto graphs = testing::LoadGoldenModel(**cuda, set, {}, /*weights_in_backend=*/true);
  auto eager = testing::LoadGoldenModel(**cuda, set, ModelOptions{.step_graphs = false},
                                        /*weights_in_backend=*/true);
  ASSERT_TRUE(graphs.ok() && eager.ok());
  const int64_t V = (*graphs)->config().vocab_size;
  const std::vector<int32_t> prompt = {5, 17, 33, 2, 41, 8, 12, 29, 3, 50};
  auto new_sequence = [&](const Model& m) {
    auto st = m.NewSequence();
    EXPECT_TRUE(m.Prefill(*st, prompt, false).ok());
    return st;
  };
  // One batched step of one row: its logits, or the error of the step or its row.
  auto step = [&](const Model& m, SequenceState& st, int i) -> absl::StatusOr<std::vector<float>> {
    SequenceState* states[] = {&st};
    std::vector<std::vector<int32_t>> tokens = {{static_cast<int32_t>((7 * i + 3) % V)}};
    std::vector<absl::Status> row_status;
    auto batch = model::DecodeStep(m, states, tokens, &row_status);
    if (!batch.ok()) return batch.status();
    if (!row_status[0].ok()) return row_status[0];
    return std::move((*batch)[0].logits);
  };
  // Steps 0 (op by op), 1 (recorded, launched) and 2 (launched) of the row count 1.
  auto first = new_sequence(**graphs);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(step(**graphs, *first, i).ok()) << i;
  const StepGraphStats before = (*graphs)->step_graph_stats();
  ASSERT_EQ(before.graph_steps, 2);
  ASSERT_EQ(before.failures, 0);
  emu::FailNextGraphLaunch(cudaErrorInvalidValue);
  const absl::StatusOr<std::vector<float>> failed = step(**graphs, *first, 3);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("LaunchGraph: cudaErrorInvalidValue"), std::string::npos)
      << failed.status();
  EXPECT_TRUE(kernels::CudaDeviceLost(**cuda).ok()) << "a failed launch is not a lost device";
  const StepGraphStats after = (*graphs)->step_graph_stats();
  EXPECT_EQ(after.failures, 1);
  // A new sequence of the same row count: op by op now, and the same logits as without graphs.
  auto again = new_sequence(**graphs);
  auto reference = new_sequence(**eager);
  for (int i = 0; i < 3; ++i) {
    auto got = step(**graphs, *again, i);
    auto want = step(**eager, *reference, i);
    ASSERT_TRUE(got.ok() && want.ok()) << i;
    EXPECT_TRUE(testing::BitEqual(*got, *want)) << i;
  }
  const StepGraphStats last = (*graphs)->step_graph_stats();
  EXPECT_EQ(last.launched, after.launched) << "a dropped row count's graphs were launched";
  EXPECT_EQ(last.graph_steps, after.graph_steps);
  EXPECT_EQ(last.captured, before.captured);
  EXPECT_EQ(last.failures, 1);
}
#endif

TEST_P(CudaModelTest, GreedyGenerationEqualsTheCpuReference) {
  auto cuda = kernels::MakeCudaBackend(0);
  if (!cuda.ok()) GTEST_SKIP() << "skipped: no GPU (" << cuda.status().message() << ")";
  const testing::GoldenSet g = testing::GoldenSet::Load(GetParam());
  auto cpu_backend = kernels::MakeCpuBackend();
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> logits;
  for (kernels::Backend* b : {cuda->get(), cpu_backend.get()}) {
    auto m = testing::LoadGoldenModel(*b, GetParam(), {}, /*weights_in_backend=*/true);
    ASSERT_TRUE(m.ok()) << m.status();
    const int64_t V = (*m)->config().vocab_size;
    auto st = (*m)->NewSequence();
    auto enc = model::EncoderPass(**m, *st, g.prompt, static_cast<int64_t>(g.prompt.size()));
    ASSERT_TRUE(enc.ok()) << enc.status();
    auto r = model::DecoderReplay(**m, *st, *enc);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<int32_t> out;
    std::vector<float> all;
    for (size_t step = 0; step < g.generated.size(); ++step) {
      const float* row = r->logits.data() + (r->rows - 1) * V;
      all.insert(all.end(), row, row + V);
      out.push_back(static_cast<int32_t>(std::max_element(row, row + V) - row));
      model::SequenceState* states[] = {st.get()};
      std::vector<std::vector<int32_t>> tokens = {{out.back()}};
      auto batch = model::DecodeStep(**m, states, tokens);
      ASSERT_TRUE(batch.ok()) << batch.status();
      r = std::move((*batch)[0]);
      ASSERT_TRUE(r.ok()) << r.status();
    }
    ids.push_back(std::move(out));
    logits.push_back(std::move(all));
  }
  EXPECT_EQ(ids[0], ids[1]);
  const double rel = RelRms(logits[0], logits[1]);
  size_t golden_prefix = 0;
  while (golden_prefix < ids[0].size() && ids[0][golden_prefix] == g.generated[golden_prefix]) {
    ++golden_prefix;
  }
  std::printf(
      "%s: %zu greedy ids, GPU == CPU: %s, logits rel_rms %.4g; %zu leading ids equal the "
      "official run's\n",
      GetParam().c_str(), ids[0].size(), ids[0] == ids[1] ? "yes" : "no", rel, golden_prefix);
  EXPECT_LE(rel, g.steps_rel_rms);
}

INSTANTIATE_TEST_SUITE_P(Sets, CudaModelTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

}  // namespace
}  // namespace epd::model
