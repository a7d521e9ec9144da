// CUDA backend checks. They run on a GPU machine and skip, saying so, everywhere else.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/rms_norm.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/rms_norm.h"

namespace {

#define SKIP_WITHOUT_GPU()                                          \
  do {                                                              \
    std::string why;                                                \
    if (epd::kernels::cuda::DeviceCount(&why) == 0) {               \
      GTEST_SKIP() << "skipped: no GPU (" << why << ")";            \
    }                                                               \
  } while (0)

TEST(CudaKernelsTest, RmsNormMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 7, dim = 5120;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(rows * dim), w(dim), y_cpu(rows * dim), y_gpu(rows * dim);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = nd(rng);
  epd::kernels::cpu::RmsNormF32(x, w, y_cpu, rows, dim, 1e-20f);
  std::string err;
  ASSERT_TRUE(epd::kernels::cuda::RmsNormF32Host(x.data(), w.data(), y_gpu.data(), rows, dim,
                                                 1e-20f, &err))
      << err;
  double num = 0, den = 0;
  for (int64_t i = 0; i < rows * dim; ++i) {
    num += (y_gpu[i] - y_cpu[i]) * (y_gpu[i] - y_cpu[i]);
    den += y_cpu[i] * y_cpu[i];
  }
  EXPECT_LT(std::sqrt(num / den), 1e-6) << epd::kernels::cuda::DeviceSummary();
}

}  // namespace
