// Packed weights (issue 11): FP8/FP4 weights stay in the checkpoint's format in backend memory and
// the kernels dequantize them on the fly. The linears give the same bits as on the decoded
// weights (SIMD and scalar), and the weights' resident bytes stay close to the checkpoint's bytes
// on the golden checkpoint and on the nano model (goal <= 1.3).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/format.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/nano_model.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;
using kernels::QuantWeight;
using kernels::WeightFormat;

// A random packed weight and the same weight decoded. Codes avoid the E4M3 NaN code.
std::pair<QuantWeight, QuantWeight> RandomWeight(kernels::Backend& b, WeightFormat f, int64_t out,
                                                 int64_t in, uint32_t seed) {
  std::mt19937 rng(seed);
  QuantWeight p, d;
  for (QuantWeight* w : {&p, &d}) {
    w->out = out;
    w->in = in;
    w->format = f;
    w->block_rows = f == WeightFormat::kFp8E4M3 ? 32 : 1;
    w->block_cols = 32;
  }
  std::vector<uint8_t> codes(p.code_bytes()), sc(p.scale_rows() * p.scale_cols());
  for (uint8_t& c : codes) {
    c = static_cast<uint8_t>(rng());
    if (f == WeightFormat::kFp8E4M3 && (c & 0x7f) == 0x7f) c ^= 1;
  }
  for (uint8_t& s : sc) s = static_cast<uint8_t>(120 + rng() % 10);
  p.codes = *b.Allocate(static_cast<int64_t>(codes.size()));
  p.scale_codes = *b.Allocate(static_cast<int64_t>(sc.size()));
  EXPECT_TRUE(b.Upload(codes.data(), static_cast<int64_t>(codes.size()), p.codes).ok());
  EXPECT_TRUE(b.Upload(sc.data(), static_cast<int64_t>(sc.size()), p.scale_codes).ok());
  d.values.resize(out * in);
  for (int64_t i = 0; i < out * in; ++i) {
    d.values[i] = f == WeightFormat::kFp8E4M3
                      ? kf::DecodeE4M3(codes[i])
                      : kf::DecodeE2M1(i % 2 ? codes[i / 2] >> 4 : codes[i / 2] & 0xf);
  }
  for (uint8_t s : sc) d.scales.push_back(kf::DecodeE8M0(s));
  return {std::move(p), std::move(d)};
}

TEST(PackedWeightsTest, LinearQuantOnPackedEqualsDecodedBitForBit) {
  auto simd = kernels::MakeCpuBackend(), scalar = kernels::MakeCpuBackend({.simd = false});
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (WeightFormat f : {WeightFormat::kFp8E4M3, WeightFormat::kFp4E2M1}) {
    for (auto [out, in] : {std::pair<int64_t, int64_t>{40, 64}, {13, 96}, {64, 256}, {9, 48}}) {
      auto [p, d] = RandomWeight(*simd, f, out, in, static_cast<uint32_t>(out * in));
      for (int64_t rows : {1, 3}) {
        std::vector<float> x(rows * in);
        for (float& v : x) v = kf::RoundBf16(nd(rng));
        std::vector<float> want(rows * out), got(rows * out), got_scalar(rows * out);
        ASSERT_TRUE(scalar->LinearQuant(x.data(), rows, d, want.data()).ok());
        ASSERT_TRUE(simd->LinearQuant(x.data(), rows, p, got.data()).ok());
        ASSERT_TRUE(scalar->LinearQuant(x.data(), rows, p, got_scalar.data()).ok());
        EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * 4), 0)
            << (f == WeightFormat::kFp8E4M3 ? "fp8 " : "fp4 ") << out << "x" << in;
        EXPECT_EQ(std::memcmp(want.data(), got_scalar.data(), want.size() * 4), 0)
            << (f == WeightFormat::kFp8E4M3 ? "fp8 " : "fp4 ") << out << "x" << in;
      }
    }
  }
}

TEST(PackedWeightsTest, BadPackedWeightIsAnError) {
  auto b = kernels::MakeCpuBackend();
  auto [p, d] = RandomWeight(*b, WeightFormat::kFp8E4M3, 40, 64, 1);
  p.out = 41;  // codes no longer match the shape
  std::vector<float> x(64, 1.f), y(41);
  absl::Status s = b->LinearQuant(x.data(), 1, p, y.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

double ResidentRatio(const std::string& dir, const std::string& checkpoint) {
  auto cfg = LoadModelConfig(dir + "/config.json");
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  auto store = TensorStore::Open(checkpoint, false);
  EXPECT_TRUE(store.ok()) << store.status();
  const int64_t ckpt = (*store)->total_bytes();
  auto backend = kernels::MakeCpuBackend();
  auto w = ModelWeights::Load(*cfg, std::shared_ptr<const TensorStore>(std::move(*store)),
                              backend.get());
  EXPECT_TRUE(w.ok()) << w.status();
  const int64_t resident = (*w)->ResidentBytes();
  std::printf("%s: resident weight bytes %lld, checkpoint bytes %lld, ratio %.3f\n", dir.c_str(),
              static_cast<long long>(resident), static_cast<long long>(ckpt),
              static_cast<double>(resident) / static_cast<double>(ckpt));
  return static_cast<double>(resident) / static_cast<double>(ckpt);
}

TEST(PackedWeightsTest, GoldenResidentBytesNearCheckpointBytes) {
  const std::string dir =
      testing::SourcePath(std::string(testing::kGoldenRoot) + testing::kDefaultGoldenSet + "/");
  const double r = ResidentRatio(dir, dir + "model.safetensors");
  EXPECT_LE(r, 1.3);
  EXPECT_GE(r, 0.9);  // every tensor is held once
}

class PackedNanoTest : public testing::NanoModelDirTest {};

TEST_F(PackedNanoTest, NanoResidentBytesNearCheckpointBytes) {
  const double r = ResidentRatio(model_dir(), model_dir());
  EXPECT_LE(r, 1.3);
  EXPECT_GE(r, 0.9);
}

}  // namespace
}  // namespace epd::model
