// model/scratch.h: a call's arrays in backend memory, the copies at the forward's edges, and the
// pool that keeps backend buffers between calls (a device allocation synchronizes the device).
#include "model/scratch.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/stages.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::model {
namespace {

TEST(ScratchPoolTest, BuffersAreReusedBySizeClassUpToTheCap) {
  auto b = kernels::MakeCpuBackend();
  ScratchPool pool(*b, 16384);
  auto x = pool.Take(5000);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(x->bytes(), 8192);
  const void* p = x->data();
  pool.Give(std::move(*x));
  EXPECT_EQ(pool.cached_bytes(), 8192);
  auto y = pool.Take(6000);  // same class: the same buffer, no new allocation
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(y->data(), p);
  EXPECT_EQ(pool.allocations(), 1);
  auto z = pool.Take(100);  // smallest class: 4 KiB
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(z->bytes(), 4096);
  auto w = pool.Take(9000);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->bytes(), 16384);
  EXPECT_EQ(pool.allocations(), 3);
  pool.Give(std::move(*y));
  pool.Give(std::move(*z));
  pool.Give(std::move(*w));  // over the 16 KiB cap: freed
  EXPECT_EQ(pool.cached_bytes(), 8192 + 4096);
}

// CopyAll: several host arrays of different types in one allocation and one Upload, each part
// 16-byte aligned and with its own values; an empty part still has an address in the allocation.
TEST(ScratchTest, CopyAllUploadsSeveralArraysOnce) {
  std::map<std::string, int64_t> calls;
  auto b = testing::MakeTestCpuBackend({.report_device_memory = true, .op_calls = &calls});
  Scratch s(*b);
  const std::vector<int32_t> rows = {5, -1, 7};
  const std::vector<const uint8_t*> tables = {nullptr, reinterpret_cast<const uint8_t*>(&rows)};
  const std::vector<int64_t> none;
  const std::vector<double> values = {0.5, 2.25};
  auto up = s.CopyAll(rows, tables, none, values);
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(calls["Upload"], 1);
  const auto [r, t, n, v] = *up;
  EXPECT_EQ(*s.ToHost(r, 3), rows);
  EXPECT_EQ(*s.ToHost(t, 2), tables);
  EXPECT_EQ(*s.ToHost(v, 2), values);
  auto at = [&](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  for (const void* p : {static_cast<const void*>(r), static_cast<const void*>(t),
                        static_cast<const void*>(n), static_cast<const void*>(v)})
    EXPECT_EQ(at(p) % 16, 0u);
  // In order, each after the one before (the empty part takes 16 bytes of its own).
  EXPECT_EQ(at(t) - at(r), 16u);
  EXPECT_EQ(at(n) - at(t), 16u);
  EXPECT_EQ(at(v) - at(n), 16u);
}

// UploadPacked: host arrays into an array the caller laid out with PackingOf (a decode step's
// inputs, in an array its graphs keep), in one Upload, each part where the layout put it; arrays
// whose sizes give another layout are refused, and nothing is written.
TEST(ScratchTest, UploadPackedFillsACallersPackedArrayOnceOrRefusesAnotherLayout) {
  std::map<std::string, int64_t> calls;
  auto b = testing::MakeTestCpuBackend({.report_device_memory = true, .op_calls = &calls});
  Scratch s(*b);
  const std::vector<int32_t> ids = {3, 4, 5};
  const std::vector<int64_t> positions = {10, 11, 12}, none;
  const auto layout = Scratch::PackingOf<3>({12, 24, 0});
  EXPECT_EQ(layout.at, (std::array<int64_t, 3>{0, 16, 48}));
  EXPECT_EQ(layout.bytes, 64);
  auto array = s.Alloc<uint8_t>(layout.bytes);
  ASSERT_TRUE(array.ok()) << array.status();
  ASSERT_TRUE(s.UploadPacked(*array, layout, ids, positions, none).ok());
  EXPECT_EQ(calls["Upload"], 1);
  EXPECT_EQ(*s.ToHost(reinterpret_cast<const int32_t*>(*array + layout.at[0]), 3), ids);
  EXPECT_EQ(*s.ToHost(reinterpret_cast<const int64_t*>(*array + layout.at[1]), 3), positions);
  const std::vector<int32_t> longer = {1, 2, 3, 4, 5};  // 20 bytes: positions would move
  const absl::Status refused = s.UploadPacked(*array, layout, longer, positions, none);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInternal) << refused;
  EXPECT_EQ(calls["Upload"], 1);
  EXPECT_EQ(*s.ToHost(reinterpret_cast<const int32_t*>(*array + layout.at[0]), 3), ids);
}

TEST(ScratchTest, CopiesReachOwnAndParentArraysOnlyAndStageOnADevice) {
  for (const bool device : {false, true}) {
    SCOPED_TRACE(device ? "device memory (staged)" : "host memory (in place)");
    auto b = testing::MakeTestCpuBackend({.report_device_memory = device});
    ScratchPool pool(*b, 1 << 20);
    Scratch outer(*b, &pool);
    auto a = outer.Copy(std::vector<float>{1, 2, 3, 4});
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(outer.host_visible(), !device);
    {
      Scratch inner(*b, &pool, &outer);
      auto c = inner.Filled<int32_t>(3, 7);
      ASSERT_TRUE(c.ok());
      EXPECT_EQ(*inner.ToHost(*c, 3), (std::vector<int32_t>{7, 7, 7}));
      // The parent's arrays are reachable from the inner scratch, at an offset too.
      const float two[2] = {9, 8};
      ASSERT_TRUE(inner.Upload(*a + 1, two, 2).ok());
      EXPECT_EQ(*inner.ToHost(static_cast<const float*>(*a), 4), (std::vector<float>{1, 9, 8, 4}));
      // Fill / Read: in place on host memory, through a staging copy on a device.
      ASSERT_TRUE(inner
                      .Fill(*a, 4,
                            [](float* d) {
                              for (int i = 0; i < 4; ++i) d[i] = 10.f + i;
                              return absl::OkStatus();
                            })
                      .ok());
      float sum = 0;
      ASSERT_TRUE(inner
                      .Read(static_cast<const float*>(*a), 4,
                            [&](const float* v) {
                              for (int i = 0; i < 4; ++i) sum += v[i];
                              return absl::OkStatus();
                            })
                      .ok());
      EXPECT_EQ(sum, 46.f);
    }
    // The inner scratch gave its chunk (small arrays share 64 KiB chunks) back to the pool.
    EXPECT_EQ(pool.cached_bytes(), 64 << 10);
    // Memory that is not scratch memory, or a range past the end of the buffer holding an array,
    // is refused.
    std::vector<float> host(32 << 10);
    EXPECT_FALSE(outer.Download(host.data(), 4, host.data()).ok());
    EXPECT_FALSE(outer.Download(static_cast<const float*>(*a), 32 << 10, host.data()).ok());
    // Small arrays share a chunk, each at a multiple of 256 bytes from its start.
    auto b2 = outer.Alloc<uint8_t>(1);
    ASSERT_TRUE(b2.ok());
    const auto gap = reinterpret_cast<uintptr_t>(*b2) - reinterpret_cast<uintptr_t>(*a);
    EXPECT_EQ(gap, 256u);
  }
}

using ScratchModelTest = testing::NanoModelTest;

TEST_F(ScratchModelTest, ADecodeStepInItsSteadyStateAllocatesNothing) {
  auto st = model_->NewSequence();
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back(5 + i);
  ASSERT_TRUE(model_->Prefill(*st, prompt, false).ok());
  ASSERT_TRUE(model_->Decode(*st, 11).ok());
  ASSERT_TRUE(model_->Draft(*st, 11).ok());
  const int64_t warm = model_->scratch_pool().allocations();
  EXPECT_GT(warm, 0);
  for (int32_t t : {12, 13, 14, 15}) {
    ASSERT_TRUE(model_->Decode(*st, t).ok());
    ASSERT_TRUE(model_->Draft(*st, t).ok());
  }
  EXPECT_EQ(model_->scratch_pool().allocations(), warm);
  EXPECT_GT(model_->scratch_pool().cached_bytes(), 0);
}

// A T > 0 DSpark step (a drawn draft chain whose distributions stay in backend memory until the
// step verifies its drafts there) allocates nothing in its steady state either.
TEST_F(ScratchModelTest, ASampledDraftAndVerificationStepAllocatesNothingOnceWarm) {
  auto st = model_->NewSequence();
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back(5 + i);
  ASSERT_TRUE(model_->Prefill(*st, prompt, false).ok());
  const int64_t block = model_->config().dspark_block_size;
  SampleRequest draw;
  draw.params.temperature = 0.8f;
  draw.params.top_k = 20;
  for (int64_t i = 0; i < block; ++i) draw.uniforms.push_back(0.1 + 0.15 * static_cast<double>(i));
  SampleRequest check;  // the step's 3 rows
  check.params = draw.params;
  check.uniforms = {0.4, 0.7, 0.2};
  int64_t warm = -1;
  int32_t last = 11;
  for (int step = 0; step < 5; ++step) {
    if (step == 1) warm = model_->scratch_pool().allocations();
    ASSERT_TRUE(model_->Decode(*st, last).ok());
    auto d = model_->Draft(*st, last, {}, LogitsOut::kSample, nullptr, &draw);
    ASSERT_TRUE(d.ok()) << d.status();
    DraftVerification v{d->q, {d->ids[1], d->ids[2]}};
    const LogitsRequest out(LogitsOut::kVerify, nullptr, &check, &v);
    SequenceState* states[] = {st.get()};
    const std::vector<std::vector<int32_t>> tokens = {{last + 1, d->ids[1], d->ids[2]}};
    auto r = DecodeStep(*model_, states, tokens, nullptr, std::span(&out, 1));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ((*r)[0].tokens.size(), 2u);
    EXPECT_GE((*r)[0].tokens[0], 0);
    EXPECT_LE((*r)[0].tokens[0], 2);
    last = (*r)[0].tokens[1];
    // The distributions are a buffer of the pool, given back with their last holder.
    const int64_t held = model_->scratch_pool().cached_bytes();
    v.q.reset();
    d->q.reset();
    EXPECT_GE(model_->scratch_pool().cached_bytes() - held,
              block * model_->config().vocab_size * static_cast<int64_t>(sizeof(float)));
  }
  EXPECT_EQ(model_->scratch_pool().allocations(), warm);
}

}  // namespace
}  // namespace epd::model
