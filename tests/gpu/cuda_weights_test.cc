// The model's weights on a CUDA device (issue 12, step 5's first half): ModelWeights::Load on the
// CUDA backend puts every piece (packed FP8/FP4 codes and scales, float arrays, the Engram tables)
// in device memory, and each piece's bytes equal the host-loaded weights' bytes. Skips with
// "skipped: no GPU" where no CUDA device is present (CI).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/config.h"
#include "model/nano/nano_generator.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

TEST(CudaWeightsTest, NanoWeightsLoadIntoDeviceMemoryWithTheirHostBytes) {
  auto cuda = kernels::MakeCudaBackend(0);
  if (!cuda.ok()) GTEST_SKIP() << "skipped: no GPU (" << cuda.status().message() << ")";
  testing::TempDir dir;
  ASSERT_TRUE(GenerateNanoModel(dir.path()).ok());
  auto cfg = LoadModelConfig(dir.path() + "/config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto store = TensorStore::Open(dir.path(), false);
  ASSERT_TRUE(store.ok()) << store.status();
  std::shared_ptr<const TensorStore> shared(std::move(*store));
  auto host_backend = kernels::MakeCpuBackend();
  auto host = ModelWeights::Load(*cfg, shared, host_backend.get());
  auto dev = ModelWeights::Load(*cfg, shared, cuda->get());
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE(dev.ok()) << dev.status();

  std::map<std::string, std::vector<uint8_t>> expected;
  (*host)->ForEachPiece([&](const ModelWeights::Piece& p) {
    const auto* b = static_cast<const uint8_t*>(p.data);
    expected[p.name].assign(b, b + p.bytes);
  });
  int checked = 0;
  (*dev)->ForEachPiece([&](const ModelWeights::Piece& p) {
    ASSERT_EQ(p.kind, kernels::MemoryKind::kDevice) << p.name;
    auto it = expected.find(p.name);
    ASSERT_NE(it, expected.end()) << p.name;
    ASSERT_EQ(static_cast<size_t>(p.bytes), it->second.size()) << p.name;
    // Device -> a fresh device buffer -> host.
    auto staging = (*cuda)->Allocate(p.bytes);
    ASSERT_TRUE(staging.ok()) << staging.status();
    ASSERT_TRUE((*cuda)->Copy(staging->data(), p.data, p.bytes).ok()) << p.name;
    std::vector<uint8_t> got(p.bytes);
    ASSERT_TRUE((*cuda)->Download(*staging, 0, p.bytes, got.data()).ok()) << p.name;
    EXPECT_EQ(got, it->second) << p.name;
    ++checked;
  });
  EXPECT_EQ(checked, static_cast<int>(expected.size()));
  EXPECT_EQ((*dev)->ResidentBytes(), (*host)->ResidentBytes());
}

}  // namespace
}  // namespace epd::model
