#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/rms_norm.h"

namespace epd::kernels::cpu {
namespace {

TEST(RmsNormTest, MatchesHandComputedValues) {
  std::vector<float> x = {3.f, 4.f, 0.f, 0.f, 1.f, 1.f, 1.f, 1.f};
  std::vector<float> w = {1.f, 2.f, 1.f, 1.f};
  std::vector<float> y(8);
  RmsNormF32(x, w, y, 2, 4, 1e-20f);
  const float inv0 = 1.f / std::sqrt(25.f / 4.f);
  EXPECT_FLOAT_EQ(y[0], 3.f * inv0);
  EXPECT_FLOAT_EQ(y[1], 8.f * inv0);
  EXPECT_FLOAT_EQ(y[4], 1.f);
  EXPECT_FLOAT_EQ(y[5], 2.f);
}

}  // namespace
}  // namespace epd::kernels::cpu
