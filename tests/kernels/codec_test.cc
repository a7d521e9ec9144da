// The codecs shared by the host and the CUDA kernels (kernels/codec.h) against the host
// reference definitions of kernels/format.cc: every E4M3/E8M0/E2M1 code, and RoundE4M3 /
// Pow2Ceil / EncodeE2M1 / bf16 rounding on boundary and random fp32 values.
#include "kernels/codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/format.h"

namespace epd::kernels {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
bool Same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || Bits(a) == Bits(b); }

TEST(CodecTest, EveryCodeDecodesAsTheHostReference) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    EXPECT_TRUE(Same(codec::DecodeE4M3(code), format::DecodeE4M3(code))) << "E4M3 " << c;
    EXPECT_TRUE(Same(codec::DecodeE8M0(code), format::DecodeE8M0(code))) << "E8M0 " << c;
    EXPECT_TRUE(Same(codec::DecodeE2M1(code), format::DecodeE2M1(code))) << "E2M1 " << c;
  }
  EXPECT_TRUE(std::isnan(codec::DecodeE4M3(0x7f)));
  EXPECT_TRUE(std::isnan(codec::DecodeE4M3(0xff)));
  EXPECT_EQ(Bits(codec::DecodeE2M1(8)), 0x80000000u);  // -0
}

TEST(CodecTest, RoundingAndEncodingMatchTheHostReference) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> xs = {0.f,      -0.f,    448.f,       464.f,      -465.f, 0x1p-6f,  0x1p-7f,
                           0x1p-10f, 0x1p-9f, 0.25f,       0.75f,      1.25f,  1.75f,    2.5f,
                           3.5f,     5.f,     6.f,         7.f,        NAN,    INFINITY, -INFINITY,
                           1e-45f,   3.4e38f, 1.00390625f, 1.01171875f};
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    xs.push_back(f);
    xs.push_back(std::ldexp(static_cast<float>(u % 4096) / 512.f, static_cast<int>(u >> 28) - 8));
  }
  for (float x : xs) {
    EXPECT_TRUE(Same(codec::RoundE4M3(x), format::RoundE4M3Reference(x))) << x;
    EXPECT_EQ(codec::EncodeE2M1(x), format::EncodeE2M1(x)) << x;
    const float ax = std::fabs(x);
    if (std::isfinite(ax) && ax > 0) {
      EXPECT_TRUE(Same(codec::Pow2Ceil(ax), format::Pow2Ceil(ax))) << x;
      const float p = codec::Pow2Ceil(ax);
      EXPECT_GE(p, std::fmin(ax, 0x1p127f)) << x;
    }
    // bf16: RNE of the top 16 bits, NaN stays NaN.
    const float r = codec::RoundBf16(x);
    EXPECT_EQ(Bits(r) & 0xffffu, 0u) << x;
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(r));
    } else if (std::fabs(x) < 3.38e38f) {
      // The nearer of the two bf16 neighbours (by magnitude), the even one on a tie.
      const uint32_t lo = Bits(x) & 0xffff0000u, hi = lo + 0x10000u;
      float flo, fhi;
      std::memcpy(&flo, &lo, 4);
      std::memcpy(&fhi, &hi, 4);
      const double dlo = std::fabs(static_cast<double>(x) - flo);
      const double dhi = std::fabs(static_cast<double>(fhi) - x);
      const uint32_t want = dlo < dhi ? lo : (dhi < dlo ? hi : ((lo >> 16) & 1 ? hi : lo));
      EXPECT_EQ(Bits(r), want) << x;
    }
  }
}

}  // namespace
}  // namespace epd::kernels
