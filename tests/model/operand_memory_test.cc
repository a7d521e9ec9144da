// Issue 12, step 5: the forward hands its backend only backend memory. On a CPU backend with
// TestCpuBackendOptions::check_operands every op fails unless each pointer it gets lies in memory
// that backend allocated; the whole serving surface of the model (prefill, decode, multi-token
// verification, the staged encoder / decoder replay / batched decode, DSpark drafts, the Markov
// bias) runs on it, with report_device_memory (so the KV pool's slabs are that backend's memory,
// read and written by its PackRows / UnpackRows ops, and the host copies at the pool's edge take
// their staging path, upload / download), and gives the same bits as the plain CPU backend. What
// a device backend needs, checked without a GPU.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/serving_surface.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::model {
namespace {

using testing::BitEqual;

TEST(OperandCheckTest, AHostPointerIsRejectedNamingTheOpAndTheOperand) {
  auto b = testing::MakeTestCpuBackend({.check_operands = true});
  auto x = b->Allocate(4 * sizeof(float));
  auto w = b->Allocate(8 * sizeof(float));
  auto y = b->Allocate(2 * sizeof(float));
  ASSERT_TRUE(x.ok() && w.ok() && y.ok());
  std::vector<float> host(4, 1.f), wh(8, 0.5f);
  ASSERT_TRUE(b->Upload(host.data(), 16, *x, 0).ok());
  ASSERT_TRUE(b->Upload(wh.data(), 32, *w, 0).ok());
  EXPECT_TRUE(b->LinearF32(x->as<float>(), 1, w->as<float>(), 2, 4, y->as<float>()).ok());
  // An interior pointer of a live buffer is backend memory too.
  EXPECT_TRUE(b->Add(x->as<float>() + 2, x->as<float>() + 1, 2).ok());
  absl::Status s = b->LinearF32(host.data(), 1, w->as<float>(), 2, 4, y->as<float>());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("LinearF32"), std::string::npos) << s;
  EXPECT_NE(s.message().find("operand x"), std::string::npos) << s;
  s = b->LinearF32(x->as<float>(), 1, w->as<float>(), 2, 4, wh.data());
  EXPECT_NE(s.message().find("operand y"), std::string::npos) << s;
  // Freed memory is not the backend's any more.
  const float* stale = x->as<float>();
  *x = kernels::Buffer();
  s = b->RoundBf16(const_cast<float*>(stale), 1);
  EXPECT_NE(s.message().find("operand x"), std::string::npos) << s;
  // The plain backend takes host pointers (the CPU reference's memory is host memory).
  auto plain = kernels::MakeCpuBackend();
  EXPECT_TRUE(plain->RoundBf16(host.data(), 4).ok());
}

class OperandMemoryTest : public testing::NanoModelDirTest,
                          public ::testing::WithParamInterface<std::string> {};

TEST_P(OperandMemoryTest, TheForwardGivesItsBackendOnlyBackendMemory) {
  auto plain = kernels::MakeCpuBackend();
  auto want_model = testing::LoadModelInto(*plain, GetParam());
  ASSERT_TRUE(want_model.ok()) << want_model.status();
  auto want = testing::RunServingSurface(**want_model);
  ASSERT_TRUE(want.ok()) << want.status();
  // Device labels (report_device_memory): the weights are all copied in (a host backend reads
  // the Engram tables from the checkpoint's mapping, which is not backend memory), and the KV
  // pool lives in the backend's memory.
  auto checked =
      testing::MakeTestCpuBackend({.report_device_memory = true, .check_operands = true});
  auto m = testing::LoadModelInto(*checked, GetParam());
  ASSERT_TRUE(m.ok()) << m.status();
  auto got = testing::RunServingSurface(**m);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(BitEqual(got->logits, want->logits));
  EXPECT_EQ(got->ids, want->ids);
  EXPECT_GT(got->logits.size(), 150u * static_cast<size_t>((*m)->config().vocab_size));
  // The KV the surface wrote is in the backend's memory: every slab of the pool is.
  int slabs = 0;
  (*m)->kv_pool().ForEachSlab([&](const KvPool::Slab& slab) {
    ++slabs;
    EXPECT_EQ(slab.kind, kernels::MemoryKind::kDevice);
  });
  EXPECT_GT(slabs, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, OperandMemoryTest,
                         ::testing::Values("nano", "v41-tiny-a", "v41-tiny-c"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

}  // namespace
}  // namespace epd::model
