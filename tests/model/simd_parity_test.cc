// The CPU kernels' SIMD paths (kernels/cpu/ops.h: AVX2 without FMA) give bit-identical results to
// the scalar code: the whole golden forward (prefill, decode, draft) and the ops on odd shapes.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "model/model.h"
#include "tests/testing/golden_model.h"

namespace epd::model {
namespace {

using testing::BitEqual;

namespace kc = kernels::cpu;

class SimdParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kc::SimdEnabled()) GTEST_SKIP() << "no SIMD path on this CPU";
  }
  // Runs f with the SIMD paths on, then off; returns both outputs.
  template <typename F>
  std::pair<std::vector<float>, std::vector<float>> Both(F f) {
    std::vector<float> a = f();
    kc::ScopedScalarKernels scalar(true);
    std::vector<float> b = f();
    return {a, b};
  }
};

std::vector<float> Bf16Random(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = kc::RoundBf16(d(rng));
  return v;
}

TEST_F(SimdParityTest, GoldenForwardIsBitIdentical) {
  for (const std::string& set : testing::GoldenSets()) {
    SCOPED_TRACE(set);
    auto backend = kernels::MakeCpuBackend();
    auto m = testing::LoadGoldenModel(*backend, set);
    ASSERT_TRUE(m.ok()) << m.status();
    const Model& model = **m;
    const std::vector<int32_t> prompt = testing::GoldenPrompt(set);
    auto [simd, scalar] = Both([&] {
      auto st = model.NewSequence();
      auto pre = model.Prefill(*st, prompt, /*all_logits=*/true);
      EXPECT_TRUE(pre.ok());
      std::vector<float> out = pre->logits;
      for (int32_t t : {5, 77}) {
        auto d = model.Decode(*st, t);
        EXPECT_TRUE(d.ok());
        out.insert(out.end(), d->logits.begin(), d->logits.end());
      }
      auto dr = model.Draft(*st, 9);
      EXPECT_TRUE(dr.ok());
      out.insert(out.end(), dr->logits.begin(), dr->logits.end());
      return out;
    });
    EXPECT_TRUE(BitEqual(simd, scalar));
  }
}

TEST_F(SimdParityTest, OpsOnOddShapes) {
  // Linear ops with out % 8 != 0 and in % 8 != 0.
  // 3 rows (weight tiles transposed in registers) and 6 (transposed once for all rows).
  for (int64_t rows : {3, 6}) {
    for (auto [out, in] : {std::pair<int64_t, int64_t>{13, 37}, {16, 64}, {9, 256}}) {
      const auto x = Bf16Random(rows * in, 1), w = Bf16Random(out * in, 2, 0.1f);
      auto [a, b] = Both([&] {
        std::vector<float> y(rows * out), z(rows * out);
        kc::LinearBf16(x.data(), rows, w.data(), out, in, y.data());
        kc::LinearF32(x.data(), rows, w.data(), out, in, z.data());
        y.insert(y.end(), z.begin(), z.end());
        return y;
      });
      EXPECT_TRUE(BitEqual(a, b)) << rows << " rows, " << out << "x" << in;
    }
  }
  // torch's exp: scalar TorchExp vs its AVX2+FMA lanes, incl. -inf, NaN, the cut-offs and a tail.
  {
    std::vector<float> v = Bf16Random(37, 11, 30.f);
    v[0] = -std::numeric_limits<float>::infinity();
    v[1] = std::numeric_limits<float>::quiet_NaN();
    v[2] = -104.f;
    v[3] = -104.5f;
    v[4] = 100.f;
    v[5] = 100.5f;
    auto [a, b] = Both([&] {
      std::vector<float> y(v.size());
      kc::TorchExpN(v.data(), y.data(), static_cast<int64_t>(v.size()));
      return y;
    });
    EXPECT_TRUE(BitEqual(a, b));
  }
  // mHC pre/post mixes (incl. a NaN and infinities in the residual, rounded like the scalar code).
  {
    const int hc = 4;
    const int64_t dim = 64;
    auto h = Bf16Random(hc * dim, 6), y = Bf16Random(dim, 7), pre = Bf16Random(hc, 8),
         comb = Bf16Random(hc * hc, 9);
    h[3] = std::numeric_limits<float>::quiet_NaN();
    h[70] = std::numeric_limits<float>::infinity();
    h[71] = -std::numeric_limits<float>::infinity();
    auto [a, b] = Both([&] {
      std::vector<float> o(dim), p(hc * dim);
      kc::HcPre(h.data(), hc, dim, pre.data(), o.data());
      kc::HcPost(y.data(), h.data(), hc, dim, pre.data(), comb.data(), p.data());
      o.insert(o.end(), p.begin(), p.end());
      return o;
    });
    EXPECT_TRUE(BitEqual(a, b));
  }
  // Indexer scores: 4 and 8 heads, key counts that are and are not multiples of 8.
  for (int heads : {4, 8, 3}) {
    for (int64_t n : {1, 8, 21}) {
      const int64_t dim = 128;
      const auto q = Bf16Random(heads * dim, 3), k = Bf16Random(n * dim, 4),
                 w = Bf16Random(heads, 5);
      auto [a, b] = Both([&] {
        std::vector<float> s(n);
        kc::IndexerScores(q.data(), w.data(), heads, k.data(), n, dim, s.data());
        return s;
      });
      EXPECT_TRUE(BitEqual(a, b)) << heads << " heads, " << n << " keys";
    }
  }
}

}  // namespace
}  // namespace epd::model
