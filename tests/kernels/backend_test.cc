// The device-agnostic Backend interface on the CPU backend: memory (allocate, upload, download,
// synchronize) with bounds errors, op argument errors, the per-thread SIMD switch, and the ops
// the forward pass moved onto the interface (top-k, candidate selection, routing).
#include "kernels/backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::kernels {
namespace {

TEST(BackendMemoryTest, UploadDownloadRoundTripAndBounds) {
  auto b = MakeCpuBackend();
  EXPECT_EQ(b->memory_kind(), MemoryKind::kHost);
  auto buf = b->Allocate(100);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(buf->bytes(), 100);
  EXPECT_EQ(buf->kind(), MemoryKind::kHost);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 64, 0u);
  std::vector<uint8_t> in(40), out(40, 0);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE(b->Upload(in.data(), 40, *buf, 60).ok());
  ASSERT_TRUE(b->Synchronize().ok());
  ASSERT_TRUE(b->Download(*buf, 60, 40, out.data()).ok());
  EXPECT_EQ(in, out);
  // Out of bounds: clear errors, nothing written.
  absl::Status up = b->Upload(in.data(), 40, *buf, 61);
  EXPECT_EQ(up.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(up.message().find("Upload"), std::string_view::npos) << up;
  EXPECT_EQ(b->Download(*buf, -1, 4, out.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->Allocate(-5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->Allocate(8, Stream{3}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->Synchronize(Stream{3}).code(), absl::StatusCode::kInvalidArgument);
  // Buffers move; the moved-from one is empty.
  Buffer moved = std::move(*buf);
  EXPECT_EQ(moved.bytes(), 100);
  EXPECT_TRUE(buf->empty());
}

TEST(BackendOpsTest, BadArgumentsAreErrorsNamingTheOp) {
  auto b = MakeCpuBackend();
  std::vector<float> v(8, 1.f);
  std::vector<int32_t> idx(8);
  absl::Status s = b->SelectTopK(v.data(), 4, 5, 4, 0, idx.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("SelectTopK"), std::string_view::npos) << s;
  EXPECT_EQ(b->CompressPool(v.data(), v.data(), 1, 9, 1, v.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->MoeRoute(v.data(), 1, 4, v.data(), 5, 1.f, idx.data(), v.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->Rope(v.data(), 1, 1, 4, 2, 2, v.data(), v.data(), false).code(),
            absl::StatusCode::kInvalidArgument);
  QuantWeight w;
  w.out = 2;
  w.in = 32;  // no values
  EXPECT_EQ(b->LinearQuant(v.data(), 1, w, v.data()).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BackendOpsTest, TopKCandidatesAndSelection) {
  auto b = MakeCpuBackend();
  const std::vector<float> v = {1, 3, 3, -INFINITY, 2, 3, -INFINITY};
  std::vector<int32_t> top(4);
  ASSERT_TRUE(b->StableTopK(v.data(), 7, 4, top.data()).ok());
  EXPECT_EQ(top, (std::vector<int32_t>{1, 2, 5, 4}));
  // SelectTopK: ascending keys, keys >= visible -> -1, others + offset.
  std::vector<int32_t> sel(3);
  ASSERT_TRUE(b->SelectTopK(v.data(), 7, 3, /*visible=*/5, /*offset=*/100, sel.data()).ok());
  EXPECT_EQ(sel, (std::vector<int32_t>{101, 102, -1}));
  // Candidate blocks of 2: block maxima {3, 3, 3, -inf}; the block of key visible-1 = 6 is forced
  // (+inf) but all -inf blocks never mark keys.
  std::vector<uint8_t> mask(7, 9);
  ASSERT_TRUE(b->CandidateMask(v.data(), 7, 2, /*visible=*/5, /*keep=*/2, mask.data()).ok());
  // Block 2 (keys 4, 5) is forced, then block 0 (ties to the lower block).
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 1, 0, 0, 1, 1, 0}));
  std::vector<float> s = {5, 4, 3, 2, 1};
  const uint8_t m[3] = {1, 0, 1};
  ASSERT_TRUE(b->MaskScores(s.data(), 5, 4, m, 3).ok());
  EXPECT_EQ(s[0], 5.f);
  EXPECT_EQ(s[1], -INFINITY);
  EXPECT_EQ(s[2], 3.f);
  EXPECT_EQ(s[3], -INFINITY);  // no mask column
  EXPECT_EQ(s[4], -INFINITY);  // not valid
}

TEST(BackendOpsTest, MoeRouteOrdersByExpertIdAndNormalises) {
  auto b = MakeCpuBackend();
  const std::vector<float> z = {0.f, 3.f, -2.f, 5.f}, bias = {0.f, 0.f, 10.f, 0.f};
  std::vector<int32_t> ex(2), ranked(2);
  std::vector<float> w(2);
  ASSERT_TRUE(
      b->MoeRoute(z.data(), 1, 4, bias.data(), 2, 2.f, ex.data(), w.data(), ranked.data()).ok());
  EXPECT_EQ(ranked, (std::vector<int32_t>{2, 3}));  // bias picks expert 2 first
  EXPECT_EQ(ex, (std::vector<int32_t>{2, 3}));
  // Weights are the unbiased scores, normalised, times route_scale.
  EXPECT_NEAR(w[0] + w[1], 2.f, 1e-5f);
  EXPECT_LT(w[0], w[1]);
}

TEST(BackendSimdTest, ScalarSwitchIsPerThreadAndPerBackend) {
  if (!cpu::SimdEnabled()) GTEST_SKIP() << "no SIMD path on this CPU";
  bool other_thread_simd = false;
  {
    cpu::ScopedScalarKernels scalar(true);
    EXPECT_FALSE(cpu::SimdEnabled());
    std::thread t([&] { other_thread_simd = cpu::SimdEnabled(); });
    t.join();
  }
  EXPECT_TRUE(other_thread_simd);  // another thread keeps its own setting
  EXPECT_TRUE(cpu::SimdEnabled());
  // A scalar backend gives the same bits as the SIMD one.
  auto simd = MakeCpuBackend(), scalar = testing::MakeTestCpuBackend({.simd = false});
  const int64_t out = 16, in = 64;
  std::vector<float> x(3 * in), w(out * in), y1(3 * out), y2(3 * out);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i));
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(static_cast<float>(i) * 0.37f);
  ASSERT_TRUE(simd->LinearF32(x.data(), 3, w.data(), out, in, y1.data()).ok());
  ASSERT_TRUE(scalar->LinearF32(x.data(), 3, w.data(), out, in, y2.data()).ok());
  EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0);
  EXPECT_TRUE(cpu::SimdEnabled());  // the scalar backend restored the thread's setting
}


// The reference's Engram gate: dot = S * (rh * rk) * dim^-0.5, the two rsqrts multiplied first
// (MODEL.md; golden set d). Rows are drawn until stream 0's fp32 gate differs between that order
// and the old one, (S * rh) * rk; the row's value is then set to about -h0 / gate, so that
// h0 + gate * value nearly cancels and the gate's last bit shows in the bf16 output. The backend
// must give the expression written out below bit for bit, and the old order must not.
TEST(BackendOpsTest, EngramGateMultipliesTheNormsFirst) {
  auto b = MakeCpuBackend();
  const int hc = 4;
  const int64_t D = 128, rows = 32;
  const float inv_sqrt_d = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto bf16 = [&](float scale) { return cpu::RoundBf16(nd(rng) * scale); };
  std::vector<float> h(rows * hc * D), e(rows * (hc + 1) * D), qw(hc * D), kw(hc * D), prod(D);
  for (float& v : qw) v = bf16(1.f);
  for (float& v : kw) v = bf16(1.f);
  // The gate of stream j of a row (h_j, key_j), in the new or the old order.
  auto gate = [&](const float* hj, const float* key, int j, bool old_order) {
    for (int64_t d = 0; d < D; ++d) prod[d] = hj[d] * (qw[j * D + d] * kw[j * D + d]) * key[d];
    const float rh = 1.f / std::sqrt(cpu::TorchMeanSquare(hj, D) + 1e-20f);
    const float rk = 1.f / std::sqrt(cpu::TorchMeanSquare(key, D) + 1e-20f);
    const float sum = cpu::TorchSum(prod.data(), D);
    const float dot = (old_order ? sum * rh * rk : sum * (rh * rk)) * inv_sqrt_d;
    const float sg = dot > 0.f ? 1.f : (dot < 0.f ? -1.f : 0.f);
    const float x = sg * std::sqrt(std::max(std::fabs(dot), 1e-6f));
    return 1.f / (1.f + cpu::TorchExp(-x));
  };
  int tries = 0;
  for (int64_t r = 0; r < rows; ++r) {
    float* hr = h.data() + r * hc * D;
    float* er = e.data() + r * (hc + 1) * D;
    float g0 = 0.f;
    do {
      ASSERT_LT(++tries, 100000) << "no order-sensitive row found";
      for (int64_t i = 0; i < hc * D; ++i) hr[i] = bf16(1.f);
      for (int64_t i = 0; i < hc * D; ++i) er[i] = bf16(1.f);
      g0 = gate(hr, er, 0, false);
    } while (g0 == gate(hr, er, 0, true));
    for (int64_t d = 0; d < D; ++d) er[hc * D + d] = cpu::RoundBf16(-hr[d] / g0);
  }
  auto expected = [&](bool old_order) {
    std::vector<float> out = h;
    for (int64_t r = 0; r < rows; ++r) {
      const float* value = e.data() + (r * (hc + 1) + hc) * D;
      for (int j = 0; j < hc; ++j) {
        float* hj = out.data() + (r * hc + j) * D;
        const float g = gate(hj, e.data() + (r * (hc + 1) + j) * D, j, old_order);
        for (int64_t d = 0; d < D; ++d) hj[d] = cpu::RoundBf16(hj[d] + g * value[d]);
      }
    }
    return out;
  };
  const std::vector<float> want = expected(false), old = expected(true);
  ASSERT_NE(want, old) << "no output of this data is sensitive to the order";
  std::vector<float> got = h;
  ASSERT_TRUE(b->EngramGate(got.data(), e.data(), rows, hc, D, qw.data(), kw.data(), 1e-20f).ok());
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace epd::kernels
