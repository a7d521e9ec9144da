// ModelOptions::unquantized_kv (benchmark switch, tests/bench/ced_bench.cc): false is the
// reference numerics (bit-identical to the default options); true keeps the compressed KV and
// index keys in full precision, which changes the logits only slightly.
#include <cmath>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

TEST(ModelUnquantizedKvTest, FalseChangesNothingTrueChangesLittle) {
  testing::TempDir dir;
  ASSERT_TRUE(GenerateNanoModel(dir.path()).ok());
  auto backend = kernels::MakeCpuBackend();
  ModelOptions off, on;
  off.unquantized_kv = false;
  on.unquantized_kv = true;
  auto def = Model::Load(dir.path(), *backend);
  auto m_off = Model::Load(dir.path(), *backend, off);
  auto m_on = Model::Load(dir.path(), *backend, on);
  ASSERT_TRUE(def.ok() && m_off.ok() && m_on.ok());
  std::vector<int32_t> ids;
  for (int i = 0; i < 200; ++i) ids.push_back(3 + (i * 37) % 1900);
  auto run = [&](const Model& m) {
    auto st = m.NewSequence();
    auto pre = m.Prefill(*st, ids, true);
    EXPECT_TRUE(pre.ok());
    auto dec = m.Decode(*st, 42);
    EXPECT_TRUE(dec.ok());
    std::vector<float> out = pre->logits;
    out.insert(out.end(), dec->logits.begin(), dec->logits.end());
    return std::make_pair(out, st->sources);
  };
  auto [l_def, s_def] = run(**def);
  auto [l_off, s_off] = run(**m_off);
  auto [l_on, s_on] = run(**m_on);
  EXPECT_EQ(l_def, l_off);  // bit-identical
  for (const auto& [layer, src] : s_def) {
    EXPECT_EQ(src.kv, s_off.at(layer).kv);
    EXPECT_EQ(src.keys, s_off.at(layer).keys);
  }
  // Full-precision KV differs from the FP4 KV, but only by quantization noise.
  bool kv_differs = false;
  for (const auto& [layer, src] : s_def) kv_differs |= src.kv != s_on.at(layer).kv;
  EXPECT_TRUE(kv_differs);
  double num = 0, den = 0;
  for (size_t i = 0; i < l_def.size(); ++i) {
    num += (l_on[i] - l_def[i]) * (l_on[i] - l_def[i]);
    den += l_def[i] * l_def[i];
  }
  EXPECT_GT(num, 0.0);
  EXPECT_LT(std::sqrt(num / den), 0.2);
}

}  // namespace
}  // namespace epd::model
