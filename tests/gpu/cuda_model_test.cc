// The model forward on a CUDA device (issue 12, step 5): every op gets device memory (weights
// loaded onto the device, a call's arrays in model::Scratch; the KV pool stays host memory and
// its rows are copied up and down at its edge). On each golden set:
// - the prefill's logits of every row are within the golden envelope of the official reference;
// - the whole serving surface (decode, verification + rollback, DSpark drafts, staged encoder /
//   decoder replay / batched decode; tests/testing/serving_surface.h) is within the same
//   envelope of the CPU reference backend's run, with the same draft ids.
// Skips with "skipped: no GPU" where no CUDA device is present (CI).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/serving_surface.h"

namespace epd::model {
namespace {

double RelRms(const std::vector<float>& x, const std::vector<float>& g) {
  double num = 0, den = 0;
  const size_t n = std::min(x.size(), g.size());
  for (size_t i = 0; i < n; ++i) {
    num += (double{x[i]} - g[i]) * (double{x[i]} - g[i]);
    den += double{g[i]} * g[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

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

INSTANTIATE_TEST_SUITE_P(Sets, CudaModelTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

}  // namespace
}  // namespace epd::model
