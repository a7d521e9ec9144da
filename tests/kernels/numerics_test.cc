#include "kernels/cpu/numerics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"

namespace epd::kernels::cpu {
namespace {

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(RoundBf16(1.f), 1.f);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(RoundBf16(1.f + 0x1p-8f), 1.f);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even).
  EXPECT_EQ(RoundBf16(1.f + 3 * 0x1p-8f), 1.f + 0x1p-6f);
  EXPECT_EQ(RoundBf16(1.f + 0x1p-8f + 0x1p-20f), 1.f + 0x1p-7f);
  EXPECT_TRUE(std::isnan(RoundBf16(NAN)));
  EXPECT_EQ(F32ToBf16Bits(-2.f), 0xc000);
}

TEST(E2M1Test, TableAndCodes) {
  const float expect[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.f, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(DecodeE2M1(c), expect[c]) << c;
    EXPECT_EQ(std::signbit(DecodeE2M1(c)), c >= 8) << c;
    if (c != 8) {
      EXPECT_EQ(EncodeE2M1(expect[c]), c) << c;
    }
  }
  // Ties go to the even code.
  EXPECT_EQ(EncodeE2M1(0.25f), 0);
  EXPECT_EQ(EncodeE2M1(0.75f), 2);
  EXPECT_EQ(EncodeE2M1(1.25f), 2);
  EXPECT_EQ(EncodeE2M1(1.75f), 4);
  EXPECT_EQ(EncodeE2M1(2.5f), 4);
  EXPECT_EQ(EncodeE2M1(3.5f), 6);
  EXPECT_EQ(EncodeE2M1(5.f), 6);
  EXPECT_EQ(EncodeE2M1(5.01f), 7);
  EXPECT_EQ(EncodeE2M1(100.f), 7);  // saturates
  EXPECT_EQ(EncodeE2M1(-2.6f), 0x8 | 5);
}

TEST(E2M1Test, NibbleOrderLowIsEven) {
  EXPECT_EQ(PackE2M1Pair(0x1, 0x7), 0x71);
  // A packed FP4 index key: element 0 = 0.5 (code 1), element 1 = 6 (code 7) with scale 1.
  std::vector<float> x(128, 0.f);
  x[0] = 0.5f;
  x[1] = 6.f;
  x[2] = -1.f;
  std::vector<uint8_t> packed(PackedIndexKeyBytes(128));
  PackIndexKey(x.data(), 128, packed.data());
  EXPECT_EQ(packed[0], 0x71);
  EXPECT_EQ(packed[1] & 0xf, 0xa);  // -1 = code 10 in the low nibble of byte 1
  EXPECT_EQ(packed[64], 127);       // UE8M0 scale 2^0 for amax 6
}

TEST(E4M3Test, EdgeCases) {
  EXPECT_EQ(EncodeE4M3(0.f), 0x00);
  EXPECT_EQ(EncodeE4M3(-0.f), 0x80);
  EXPECT_EQ(DecodeE4M3(0x7e), 448.f);
  EXPECT_EQ(EncodeE4M3(448.f), 0x7e);
  EXPECT_EQ(EncodeE4M3(1000.f), 0x7e);  // saturation
  EXPECT_EQ(EncodeE4M3(-1000.f), 0xfe);
  EXPECT_EQ(DecodeE4M3(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(DecodeE4M3(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(DecodeE4M3(0x08), 0x1p-6f);             // smallest normal
  EXPECT_EQ(RoundE4M3(0x1p-10f), 0.f);              // half the smallest subnormal: ties to even (0)
  EXPECT_EQ(RoundE4M3(3 * 0x1p-10f), 2 * 0x1p-9f);  // 1.5 quanta -> 2 (even)
  EXPECT_EQ(RoundE4M3(1.0625f), 1.f);               // tie between 1 and 1.125 -> 1 (even mantissa)
  EXPECT_EQ(RoundE4M3(1.1875f), 1.25f);             // tie between 1.125 and 1.25 -> 1.25
  EXPECT_EQ(RoundE4M3(464.f), 448.f);
  EXPECT_TRUE(std::isnan(DecodeE4M3(0x7f)));
  // Every finite code round-trips.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(EncodeE4M3(DecodeE4M3(c)), c == 0x80 ? 0x80 : c) << c;
  }
}

TEST(E4M3Test, FastRoundEqualsEncodeDecode) {
  std::mt19937 rng(123);
  std::uniform_real_distribution<float> mant(1.f, 2.f);
  std::uniform_int_distribution<int> expo(-14, 10);
  for (int i = 0; i < 300000; ++i) {
    const float x = std::ldexp(mant(rng), expo(rng)) * (i % 2 ? -1.f : 1.f);
    ASSERT_EQ(RoundE4M3(x), RoundE4M3Reference(x)) << x;
  }
  // Every midpoint between adjacent E4M3 values, and its float neighbours.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = DecodeE4M3(c), hi = DecodeE4M3(c + 1), mid = (lo + hi) / 2;
    for (float x : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1000.f), lo, hi}) {
      ASSERT_EQ(RoundE4M3(x), RoundE4M3Reference(x)) << x;
      ASSERT_EQ(RoundE4M3(-x), RoundE4M3Reference(-x)) << -x;
    }
  }
  for (float x : {0.f, -0.f, 448.f, 449.f, 463.99f, 464.f, 1e9f, 0x1p-10f, 0x1p-11f}) {
    ASSERT_EQ(RoundE4M3(x), RoundE4M3Reference(x)) << x;
    ASSERT_EQ(std::signbit(RoundE4M3(x)), std::signbit(RoundE4M3Reference(x))) << x;
  }
}

TEST(E8M0Test, Values) {
  EXPECT_EQ(DecodeE8M0(127), 1.f);
  EXPECT_EQ(DecodeE8M0(120), 0x1p-7f);
  EXPECT_EQ(DecodeE8M0(0), 0x1p-127f);
  EXPECT_TRUE(std::isnan(DecodeE8M0(255)));
  EXPECT_EQ(EncodeE8M0(0x1p-7f), 120);
  EXPECT_EQ(Pow2Ceil(1.f), 1.f);
  EXPECT_EQ(Pow2Ceil(1.0001f), 2.f);
  EXPECT_EQ(Pow2Ceil(0.3f), 0.5f);
}

TEST(QuantTest, Fp8ActivationScalesArePow2Ceil) {
  std::vector<float> x(32, 0.f);
  x[0] = 448.f * 3.f;  // amax/448 = 3 -> scale 4
  x[1] = 5.f;
  std::vector<float> q(32), s(1);
  QuantizeFp8Row(x.data(), 32, q.data(), s.data());
  EXPECT_EQ(s[0], 4.f);
  EXPECT_EQ(q[0], 320.f);  // 1344/4 = 336 is a tie between 320 and 352 -> even mantissa
  EXPECT_EQ(q[1], 1.25f);
  // All-zero block uses amax 1e-4.
  std::vector<float> z(32, 0.f);
  QuantizeFp8Row(z.data(), 32, q.data(), s.data());
  EXPECT_EQ(s[0], Pow2Ceil(1e-4f / 448.f));
}

std::vector<float> RandomBf16(int n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = RoundBf16(d(rng));
  return v;
}

TEST(PackedLayoutTest, SizesMatchModelMd) {
  EXPECT_EQ(PackedKvEntryBytes(512), 288);
  EXPECT_EQ(PackedIndexKeyBytes(128), 68);
  EXPECT_EQ(PackedSwaSlotBytes(512), 528);
}

TEST(PackedLayoutTest, RoundTripsEqualQuantDequant) {
  for (uint32_t seed = 1; seed < 20; ++seed) {
    std::vector<float> x = RandomBf16(512, seed, seed * 0.37f);
    std::vector<float> ref = x, out(512);
    std::vector<uint8_t> buf(PackedKvEntryBytes(512));
    Fp4KvQuantDequantRow(ref.data(), 512);
    PackKvEntry(x.data(), 512, buf.data());
    UnpackKvEntry(buf.data(), 512, out.data());
    EXPECT_EQ(out, ref);

    std::vector<float> k(x.begin(), x.begin() + 128), kref = k, kout(128);
    std::vector<uint8_t> kb(PackedIndexKeyBytes(128));
    Fp4IndexQuantDequantRow(kref.data(), 128);
    PackIndexKey(k.data(), 128, kb.data());
    UnpackIndexKey(kb.data(), 128, kout.data());
    EXPECT_EQ(kout, kref);

    std::vector<float> sref = x, sout(512);
    std::vector<uint8_t> sb(PackedSwaSlotBytes(512));
    Fp8QuantDequantRow(sref.data(), 512);
    PackSwaSlot(x.data(), 512, sb.data());
    UnpackSwaSlot(sb.data(), 512, sout.data());
    EXPECT_EQ(sout, sref);
  }
}

// The SWA slot decode (table path; the model reads every window slot through it) is the codec
// for every E4M3 code under every UE8M0 scale code, bit for bit (NaNs included).
TEST(PackedLayoutTest, SwaSlotUnpackIsTheCodecForEveryCode) {
  std::vector<uint8_t> slot(PackedSwaSlotBytes(256));
  for (int c = 0; c < 256; ++c) slot[c] = static_cast<uint8_t>(c);
  std::vector<float> out(256);
  for (int s = 0; s < 256; ++s) {
    for (int b = 0; b < 8; ++b) slot[256 + b] = static_cast<uint8_t>((s + 37 * b) % 256);
    UnpackSwaSlot(slot.data(), 256, out.data());
    for (int c = 0; c < 256; ++c) {
      const float want = RoundBf16(DecodeE4M3(slot[c]) * DecodeE8M0(slot[256 + c / 32]));
      ASSERT_EQ(0, std::memcmp(&out[c], &want, sizeof(float))) << "code " << c << " scale " << s;
    }
  }
}

TEST(QuantTest, Fp4KvScaleIsE4M3) {
  std::vector<float> x(16, 0.f);
  x[3] = 6.f;  // amax 6 -> scale RoundE4M3(1) = 1
  x[4] = 2.6f;
  Fp4KvQuantDequantRow(x.data(), 16);
  EXPECT_EQ(x[3], 6.f);
  EXPECT_EQ(x[4], 3.f);
  EXPECT_EQ(x[0], 0.f);
}

TEST(TopKTest, StableDescendingTiesToLowerIndex) {
  std::vector<float> v = {1, 3, 3, -INFINITY, 2, 3, -INFINITY};
  EXPECT_EQ(StableTopK(v.data(), 7, 4), (std::vector<int32_t>{1, 2, 5, 4}));
  EXPECT_EQ(StableTopK(v.data(), 7, 7), (std::vector<int32_t>{1, 2, 5, 4, 0, 3, 6}));
}

TEST(LinearQuantTest, RowsAreIndependent) {
  QuantWeight w;
  w.out = 40;
  w.in = 64;
  std::vector<float> wv = RandomBf16(40 * 64, 7, 1.f);
  for (float& f : wv) f = RoundE4M3(f);
  w.values = wv;
  w.scales.assign(2 * 2, 0.25f);
  std::vector<float> x = RandomBf16(5 * 64, 9, 2.f);
  std::vector<float> y_all(5 * 40), y_one(40);
  LinearQuant(x.data(), 5, w, y_all.data());
  for (int r = 0; r < 5; ++r) {
    LinearQuant(x.data() + r * 64, 1, w, y_one.data());
    EXPECT_EQ(std::vector<float>(y_all.begin() + r * 40, y_all.begin() + (r + 1) * 40), y_one);
  }
}

TEST(RopeTest, YarnFrequenciesMatchSpec) {
  // Ratio>0 layers: theta 160000, YaRN factor 16, low 15, high 25.
  std::vector<float> f = RopeFrequencies(64, 160000.0, true, 16, 65536, 32, 1);
  std::vector<float> p = RopeFrequencies(64, 160000.0, false, 1, 1, 1, 1);
  for (int i = 0; i <= 15; ++i) EXPECT_EQ(f[i], p[i]) << i;
  for (int i = 25; i < 32; ++i) EXPECT_FLOAT_EQ(f[i], p[i] / 16) << i;
  EXPECT_GT(f[20], p[20] / 16);
  EXPECT_LT(f[20], p[20]);
}

TEST(HcMixesTest, CombIsDoublyStochastic) {
  const int hc = 4, dim = 32;
  std::vector<float> h = RandomBf16(hc * dim, 3, 1.f);
  std::vector<float> fn = RandomBf16(24 * hc * dim, 4, 0.1f);
  std::vector<float> base = RandomBf16(24, 5, 1.f), scale = {0.5f, 0.7f, 1.3f};
  float pre[4], post[4], comb[16];
  HcMixes(h.data(), hc, dim, fn.data(), scale.data(), base.data(), 20, 1e-6f, 1e-20f, pre, post,
          comb);
  for (int k = 0; k < hc; ++k) {
    float col = 0, row = 0;
    for (int j = 0; j < hc; ++j) {
      col += comb[j * hc + k];
      row += comb[k * hc + j];
    }
    EXPECT_NEAR(col, 1.f, 1e-5);
    EXPECT_NEAR(row, 1.f, 1e-3);
    EXPECT_GT(pre[k], 0.f);
    EXPECT_LT(post[k], 2.f);
  }
}

// SparseAttention's arguments for one row and one head of q.size() dims, scale 1.
SparseAttentionArgs OneHeadArgs(const std::vector<float>& q, const std::vector<float>& kv,
                                const std::vector<int32_t>& idx, const float* sink,
                                std::vector<float>& out) {
  SparseAttentionArgs a;
  a.q = q.data();
  a.kv = kv.data();
  a.sink = sink;
  a.idx = idx.data();
  a.rows = 1;
  a.heads = 1;
  a.head_dim = static_cast<int>(q.size());
  a.list_len = static_cast<int64_t>(idx.size());
  a.scale = 1.f;
  a.out = out.data();
  return a;
}

TEST(SparseAttentionTest, SinkOnlyInDenominatorAndSkips) {
  // One head, dim 2, two KV rows; idx lists row 1 and a skipped entry.
  std::vector<float> q = {1.f, 0.f}, kv = {5.f, 5.f, 2.f, 4.f}, out(2);
  std::vector<int32_t> idx = {1, -1};
  float sink = 0.f;
  SparseAttention(OneHeadArgs(q, kv, idx, &sink, out));
  // p = exp(2 - 2) = 1; den = 1 + exp(0 - 2).
  const float den = 1.f + std::exp(-2.f);
  EXPECT_EQ(out[0], RoundBf16(2.f / den));
  EXPECT_EQ(out[1], RoundBf16(4.f / den));
}


// The reference sums each 32-element block of an FP8/FP4 GEMM in K order in fp32 (MODEL.md; golden
// set d). Block products here: 256*16 = 4096, 16*1 = 16, then thirty of 2^-12, each half an fp32
// ulp of 4112 (ties to even: lost). In K order the block is 4112, times the act scale 2^-4 = 257,
// a bf16 midpoint that rounds to even: 256. Summed in 8 interleaved lanes combined pairwise (the
// old order), the small products survive in the other lanes: 4112 + 7 * 2^-10, bf16 258.
TEST(LinearQuantTest, BlockSumsInKOrder) {
  QuantWeight w;
  w.out = 8;  // 8 outputs: the SIMD path's lanes
  w.in = 32;
  std::vector<float> crafted(32, 0x1p-8f);
  crafted[0] = 16.f;
  crafted[1] = 1.f;
  std::vector<float> wv = RandomBf16(8 * 32, 11, 1.f);
  for (float& f : wv) f = RoundE4M3(f);
  std::copy(crafted.begin(), crafted.end(), wv.begin() + 3 * 32);
  w.values = wv;
  w.scales = {1.f};
  std::vector<float> x = RandomBf16(5 * 32, 12, 1.f);
  for (int r : {1, 4})  // row 1: the 4-row SIMD group; row 4: a row alone
    std::copy(crafted.begin(), crafted.end(), x.begin() + r * 32);
  for (bool scalar : {false, true}) {
    ScopedScalarKernels mode(scalar);
    std::vector<float> y(5 * 8);
    LinearQuant(x.data(), 5, w, y.data());
    EXPECT_EQ(y[1 * 8 + 3], 256.f) << "scalar " << scalar;
    EXPECT_EQ(y[4 * 8 + 3], 256.f) << "scalar " << scalar;
    // Every other output: the K-order sum written out.
    std::vector<float> q(32);
    float sc;
    for (int r = 0; r < 5; ++r) {
      QuantizeFp8Row(x.data() + r * 32, 32, q.data(), &sc);
      for (int o = 0; o < 8; ++o) {
        float d = 0.f;
        for (int i = 0; i < 32; ++i) d += q[i] * wv[o * 32 + i];
        EXPECT_EQ(y[r * 8 + o], RoundBf16(0.f + d * sc * 1.f)) << r << " " << o;
      }
    }
  }
}

// The reference forms each 64-entry chunk's numerator sum_j bf16(p_j) kv_j first (fp32, in list
// order from +0) and adds it to the rescaled numerator: num = num * alpha + chunk_sum. q = 0, so
// every p is 1 and the denominator is exactly 128 (sink -inf). Dim 0: chunk 1 sums to 257; chunk
// 2 holds 64 x 2^-16 = 2^-10, so the numerator is 257 + 2^-10 and the output bf16(2.0078125 +
// 2^-17) = 2.015625. Added one entry at a time (the old order) each 2^-16 is half an ulp of 257
// and lost: bf16(257 / 128), a midpoint, rounds to 2.
TEST(SparseAttentionTest, ChunkNumeratorIsSummedBeforeTheRescale) {
  const int hd = 8;
  std::vector<float> q(hd, 0.f), kv(128 * hd, 0.f), out(hd);
  kv[0] = 256.f;
  kv[1 * hd] = 1.f;
  for (int t = 64; t < 128; ++t) kv[t * hd] = 0x1p-16f;
  for (int t = 0; t < 128; ++t) kv[t * hd + 1] = 1.f;  // dim 1: 128 / 128 = 1
  std::vector<int32_t> idx(128);
  for (int t = 0; t < 128; ++t) idx[t] = t;
  const float sink = -INFINITY;
  const SparseAttentionArgs a = OneHeadArgs(q, kv, idx, &sink, out);
  for (bool scalar : {false, true}) {
    ScopedScalarKernels mode(scalar);
    SparseAttention(a);
    EXPECT_EQ(out[0], 2.015625f) << "scalar " << scalar;
    EXPECT_EQ(out[1], 1.f) << "scalar " << scalar;
  }
}

}  // namespace
}  // namespace epd::kernels::cpu
