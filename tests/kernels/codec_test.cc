// The codecs shared by the host and the CUDA kernels (kernels/codec.h) against the host
// reference definitions of kernels/format.cc: every E4M3/E8M0/E2M1 code, and RoundE4M3 /
// Pow2Ceil / EncodeE2M1 / EncodeE4M3 / EncodeE8M0 (of Pow2Ceil's powers) / bf16 rounding on
// boundary and random fp32 values.
#include "kernels/codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/format.h"
#include "kernels/row_codec.h"

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
    EXPECT_EQ(codec::EncodeE4M3(x), format::EncodeE4M3(x)) << x;
    const float ax = std::fabs(x);
    if (std::isfinite(ax) && ax > 0) {
      EXPECT_TRUE(Same(codec::Pow2Ceil(ax), format::Pow2Ceil(ax))) << x;
      const float p = codec::Pow2Ceil(ax);
      EXPECT_GE(p, std::fmin(ax, 0x1p127f)) << x;
      EXPECT_EQ(codec::EncodeE8M0Pow2(p), format::EncodeE8M0(p)) << x;
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

// The row codecs the CUDA kernels run (kernels/row_codec.h, block by block and element by element)
// give the bytes of format.cc's Pack* and the values of its Unpack* (its SIMD paths included), on
// rows at every magnitude: the scale floors, saturation, zeros, ties, NaN and infinities.
TEST(CodecTest, RowCodecsMatchTheHostPackedFormats) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  const float mags[] = {0.f, 1e-30f, 1e-7f, 1e-3f, 1.f, 6.f, 448.f, 3e4f, 1e38f};
  for (RowCodec codec : {RowCodec::kKvEntry, RowCodec::kIndexKey, RowCodec::kSwaSlot}) {
    const int64_t dim = 128, rb = row_codec::RowBytes(codec, dim), block = row_codec::Block(codec);
    for (int trial = 0; trial < 400; ++trial) {
      std::vector<float> x(dim);
      const float mag = mags[trial % 9];
      for (float& v : x) v = nd(rng) * mag;
      if (trial % 5 == 0) {
        for (int64_t d = 0; d < dim; d += 4) x[d] = 0.25f * static_cast<float>(d % 13) * mag;
      }
      if (trial == 7) x[3] = NAN;
      if (trial == 8) x[40] = INFINITY;
      std::vector<uint8_t> want(rb), got(rb, 0xa5);
      format::PackRow(codec, x.data(), dim, want.data());
      for (int64_t b = 0; b < dim / block; ++b)
        row_codec::PackBlock(codec, x.data(), dim, b, got.data());
      ASSERT_EQ(got, want) << "codec " << static_cast<int>(codec) << " trial " << trial;
      std::vector<float> unpacked(dim);
      format::UnpackRow(codec, want.data(), dim, unpacked.data());
      for (int64_t d = 0; d < dim; ++d) {
        ASSERT_TRUE(Same(row_codec::UnpackElement(codec, want.data(), dim, d), unpacked[d]))
            << "codec " << static_cast<int>(codec) << " trial " << trial << " element " << d;
      }
    }
  }
  // kF32: the bytes as they are.
  const float v[2] = {1.5f, -0.f};
  uint8_t bytes[8];
  row_codec::PackBlock(RowCodec::kF32, v, 2, 0, bytes);
  row_codec::PackBlock(RowCodec::kF32, v, 2, 1, bytes);
  EXPECT_EQ(std::memcmp(bytes, v, 8), 0);
  EXPECT_TRUE(Same(row_codec::UnpackElement(RowCodec::kF32, bytes, 2, 1), -0.f));
}

}  // namespace
}  // namespace epd::kernels
