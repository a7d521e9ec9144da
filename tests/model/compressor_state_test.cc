// A compressor's state between calls in the backend's memory (model/compressor_state.h): the
// tail block (fresh values, copy-on-write, host bytes, slot copies, a full pool) and the log of a
// call's rows (reuse, runs, gathers, lookups), on a CPU backend labelled as a device that refuses
// every operand it did not allocate, against a host pool; and, through the model, a decode step
// whose compressors keep their rows on the backend: the same tails and logits as a host pool,
// with no compressor row downloaded.
#include "model/compressor_state.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "tests/testing/backend_buffer.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::model {
namespace {

using testing::OnBackend;

std::vector<float> Rows(int64_t n, int64_t dim, int salt) {
  std::vector<float> v(static_cast<size_t>(n * dim));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<float>((static_cast<int64_t>(i) * 7 + salt * 31) % 41 - 20) * 0.125f;
  return v;
}

std::vector<float> Slot(const std::vector<float>& a, int64_t slot, int64_t dim) {
  return {a.begin() + slot * dim, a.begin() + (slot + 1) * dim};
}

TEST(CompressorTailTest, FreshValuesCopyOnWriteAndHostBytesOnADevicePool) {
  auto checked =
      testing::MakeTestCpuBackend({.report_device_memory = true, .check_operands = true});
  auto pool = std::make_shared<KvPool>(0, 0, checked.get());
  ASSERT_FALSE(pool->host_memory());
  const int ratio = 4;
  const int64_t dim = 32;
  const std::vector<float> kv = Rows(3, dim, 1), score = Rows(3, dim, 2);
  kernels::Buffer kv_dev = OnBackend(*checked, kv), score_dev = OnBackend(*checked, score);

  CompressorTail t(pool, ratio, dim);
  EXPECT_FALSE(t.allocated());
  EXPECT_EQ(t.held_bytes(), 0);
  EXPECT_EQ(t.bytes(), 2 * ratio * dim * 4);
  for (float v : t.Kv()) EXPECT_EQ(v, 0.f);
  for (float v : t.Score()) EXPECT_TRUE(std::isinf(v) && v < 0);

  // Slots 1..2 from backend rows; the others keep the fresh values.
  ASSERT_TRUE(t.WriteSlotsFrom(1, 2, kv_dev.as<float>(), score_dev.as<float>()).ok());
  EXPECT_TRUE(t.allocated());
  EXPECT_EQ(pool->stats().used_bytes, t.bytes());
  EXPECT_EQ(Slot(t.Kv(), 1, dim), Slot(kv, 0, dim));
  EXPECT_EQ(Slot(t.Kv(), 2, dim), Slot(kv, 1, dim));
  EXPECT_EQ(Slot(t.Score(), 2, dim), Slot(score, 1, dim));
  EXPECT_EQ(Slot(t.Kv(), 3, dim), std::vector<float>(dim, 0.f));
  // A host pointer is not backend memory: refused, the tail unchanged.
  EXPECT_FALSE(t.WriteSlotsFrom(0, 1, kv.data(), score.data()).ok());
  EXPECT_EQ(Slot(t.Kv(), 0, dim), std::vector<float>(dim, 0.f));
  // Out of the ring of slots: refused.
  EXPECT_FALSE(t.WriteSlotsFrom(3, 2, kv_dev.as<float>(), score_dev.as<float>()).ok());

  // A copy shares the block until it writes; the original keeps its values.
  CompressorTail c = t;
  EXPECT_EQ(pool->stats().used_bytes, t.bytes());
  ASSERT_TRUE(c.WriteSlotsFrom(0, 1, kv_dev.as<float>() + 2 * dim, score_dev.as<float>()).ok());
  EXPECT_EQ(pool->stats().used_bytes, 2 * t.bytes());
  EXPECT_EQ(Slot(c.Kv(), 0, dim), Slot(kv, 2, dim));
  EXPECT_EQ(Slot(t.Kv(), 0, dim), std::vector<float>(dim, 0.f));
  EXPECT_EQ(Slot(c.Kv(), 1, dim), Slot(kv, 0, dim));  // copied with the block

  // Slot copies: from another tail, and from a fresh one (its fresh values).
  ASSERT_TRUE(t.CopySlotFrom(3, c, 0).ok());
  EXPECT_EQ(Slot(t.Kv(), 3, dim), Slot(kv, 2, dim));
  CompressorTail fresh(pool, ratio, dim);
  ASSERT_TRUE(t.CopySlotFrom(1, fresh, 1).ok());
  EXPECT_EQ(Slot(t.Kv(), 1, dim), std::vector<float>(dim, 0.f));
  EXPECT_TRUE(std::isinf(t.Score()[1 * dim]));
  EXPECT_FALSE(t.CopySlotFrom(0, CompressorTail(pool, 2, dim), 0).ok());  // another shape

  // Host bytes: kv then score, as the hand-off's tail segment; a round trip is exact.
  std::vector<uint8_t> bytes(static_cast<size_t>(t.bytes()));
  ASSERT_TRUE(t.CopyBytes(bytes.data()).ok());
  std::vector<float> both = t.Kv(), sc = t.Score();
  both.insert(both.end(), sc.begin(), sc.end());
  EXPECT_EQ(std::memcmp(bytes.data(), both.data(), bytes.size()), 0);
  CompressorTail r(pool, ratio, dim);
  ASSERT_TRUE(r.WriteBytes(bytes.data()).ok());
  EXPECT_EQ(r.Kv(), t.Kv());
  EXPECT_EQ(std::memcmp(r.Score().data(), t.Score().data(), t.Score().size() * 4), 0);

  t = CompressorTail();
  c = CompressorTail();
  r = CompressorTail();
  EXPECT_EQ(pool->stats().used_bytes, 0);
}

TEST(CompressorTailTest, AFullPoolFailsTheWriteAndLeavesTheTail) {
  const int ratio = 4;
  const int64_t dim = 32, bytes = 2 * ratio * dim * 4;
  auto pool = std::make_shared<KvPool>(bytes);  // room for one block
  const std::vector<float> kv = Rows(1, dim, 3), score = Rows(1, dim, 4);
  CompressorTail a(pool, ratio, dim);
  ASSERT_TRUE(a.WriteSlotsFrom(2, 1, kv.data(), score.data()).ok());
  CompressorTail b = a;
  absl::Status s = b.WriteSlotsFrom(0, 1, kv.data(), score.data());  // copy on write: no room
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(b.Kv(), a.Kv());
  EXPECT_EQ(Slot(b.Kv(), 0, dim), std::vector<float>(dim, 0.f));
}

TEST(CompressorLogTest, RunsGathersLookupsAndReuse) {
  auto checked =
      testing::MakeTestCpuBackend({.report_device_memory = true, .check_operands = true});
  const int64_t dim = 16;
  const std::vector<float> kv = Rows(10, dim, 5), score = Rows(10, dim, 6);
  kernels::Buffer kv_dev = OnBackend(*checked, kv), score_dev = OnBackend(*checked, score);

  auto log = CompressorLog::Make(*checked, dim, 6, nullptr);
  ASSERT_TRUE(log.ok()) << log.status();
  // Rows 0..2 at positions 100..102, then rows 5, 7, 9 at 110, 113, 120 (a gather).
  ASSERT_TRUE((*log)->Append(100, 3, kv_dev.as<float>(), score_dev.as<float>()).ok());
  const std::vector<int64_t> rows = {5, 7, 9};
  kernels::Buffer rows_dev;
  {
    auto b = checked->Allocate(3 * 8);
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE(checked->Upload(rows.data(), 3 * 8, *b).ok());
    rows_dev = std::move(*b);
  }
  ASSERT_TRUE((*log)
                  ->AppendGathered({110, 113, 120}, rows_dev.as<int64_t>(), kv_dev.as<float>(),
                                   score_dev.as<float>())
                  .ok());
  EXPECT_EQ((*log)->rows(), 6);
  EXPECT_EQ((*log)->positions(), (std::vector<int64_t>{100, 101, 102, 110, 113, 120}));
  EXPECT_EQ((*log)->Find(113), 4);
  EXPECT_EQ((*log)->Find(103), -1);
  std::vector<float> k(dim), s(dim);
  ASSERT_TRUE((*log)->ReadRow(4, k.data(), s.data()).ok());
  EXPECT_EQ(k, Slot(kv, 7, dim));
  EXPECT_EQ(s, Slot(score, 7, dim));
  ASSERT_TRUE((*log)->ReadRow(1, k.data(), s.data()).ok());
  EXPECT_EQ(k, Slot(kv, 1, dim));
  // Full, or not past the last position: refused.
  auto small = CompressorLog::Make(*checked, dim, 1, nullptr);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE((*small)->Append(5, 1, kv_dev.as<float>(), score_dev.as<float>()).ok());
  EXPECT_FALSE((*small)->Append(5, 1, kv_dev.as<float>(), score_dev.as<float>()).ok());

  // Reuse: the same buffer when nobody else holds the log, a new one when a copy does.
  CompressorLog* first = log->get();
  auto again = CompressorLog::Make(*checked, dim, 4, std::move(*log));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), first);
  EXPECT_EQ((*again)->rows(), 0);
  std::shared_ptr<CompressorLog> held = *again;  // e.g. a copied sequence state
  auto other = CompressorLog::Make(*checked, dim, 4, *again);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->get(), first);
}

TEST(CompressorLogTest, ItKeepsTheRecentRowsAndTheTailBeforeEachCutBlock) {
  const int64_t last = 1000;
  // The last 64 positions.
  EXPECT_TRUE(CompressorLog::LogsPosition(last, last, 4, 64));
  EXPECT_TRUE(CompressorLog::LogsPosition(last - 63, last, 4, 64));
  // Before them, only the `ratio` positions before each multiple of the block.
  EXPECT_FALSE(CompressorLog::LogsPosition(last - 64, last, 4, 64));  // 936 % 64 = 40
  EXPECT_TRUE(CompressorLog::LogsPosition(895, last, 4, 64));         // 895 % 64 = 63
  EXPECT_TRUE(CompressorLog::LogsPosition(892, last, 4, 64));
  EXPECT_FALSE(CompressorLog::LogsPosition(891, last, 4, 64));
  EXPECT_TRUE(CompressorLog::LogsPosition(30, last, 2, 32));
  EXPECT_FALSE(CompressorLog::LogsPosition(30, last, 4, 0));  // no cut block
  int64_t kept = 0;
  for (int64_t q = 0; q <= 8191; ++q) kept += CompressorLog::LogsPosition(q, 8191, 4, 64) ? 1 : 0;
  EXPECT_EQ(kept, 8192 / 16 + 64 - 4);  // a 8K-token prefill logs 1/16 of its rows, + the last 64
}

// The model's compressors on a device pool (a CPU backend labelled as a device, refusing host
// operands): the same tails, logs and logits as on a host pool, and a decode step downloads no
// compressor row (before, each ratio > 1 source downloaded the step's kv and score rows). Counted
// with the test backend's op_calls (tests/testing/test_cpu_backend.h); each golden set.
class CompressorModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CompressorModelTest, ADecodeStepsCompressorsStayOnTheBackend) {
  auto plain = kernels::MakeCpuBackend();
  std::map<std::string, int64_t> calls;
  auto dev = testing::MakeTestCpuBackend(
      {.report_device_memory = true, .check_operands = true, .op_calls = &calls});
  auto host_model = testing::LoadGoldenModel(*plain, GetParam());
  auto dev_model = testing::LoadGoldenModel(*dev, GetParam(), {}, /*weights_in_backend=*/true);
  ASSERT_TRUE(host_model.ok() && dev_model.ok());
  std::vector<int32_t> prompt(150);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + static_cast<int32_t>((i * 37) % 500);
  auto a = (*host_model)->NewSequence();
  auto b = (*dev_model)->NewSequence();
  ASSERT_TRUE((*host_model)->Prefill(*a, prompt, false).ok());
  ASSERT_TRUE((*dev_model)->Prefill(*b, prompt, false).ok());
  int compressors = 0;
  for (const auto& [l, src] : b->sources) {
    if (src.ratio <= 1) continue;
    ++compressors;
    EXPECT_EQ(src.tail.Kv(), a->sources.at(l).tail.Kv()) << l;
    ASSERT_NE(src.log, nullptr);
    EXPECT_EQ(src.log->positions(), a->sources.at(l).log->positions()) << l;
  }
  ASSERT_GT(compressors, 0) << GetParam() << " has ratio > 1 compressors";
  for (int step = 0; step < 5; ++step) {
    calls.clear();
    auto rb = (*dev_model)->Decode(*b, 42 + step);
    const int64_t n = calls["Download"];
    auto ra = (*host_model)->Decode(*a, 42 + step);
    ASSERT_TRUE(ra.ok() && rb.ok()) << rb.status();
    EXPECT_EQ(ra->logits, rb->logits) << step;
    for (const auto& [l, src] : b->sources) {
      if (src.ratio <= 1) continue;
      EXPECT_EQ(src.tail.Kv(), a->sources.at(l).tail.Kv()) << l;
      EXPECT_EQ(src.log->positions(), std::vector<int64_t>{b->pos - 1}) << l;
    }
    // A step downloads its DSpark inputs (main_hidden: host state) and its logits, nothing
    // else: no compressor row (before, each ratio > 1 source downloaded the step's kv and score
    // rows) and no residual (it stays on the backend from the last layer to the head). A step
    // that fills a 64-token block also downloads it to hash it (sealing).
    if (b->pos % kKvBlockTokens != 0) {
      EXPECT_EQ(n, 2) << "step " << step;
    }
    std::printf("[%s] decode step %d: %lld Downloads\n", GetParam().c_str(), step,
                static_cast<long long>(n));
  }
}

INSTANTIATE_TEST_SUITE_P(Sets, CompressorModelTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

}  // namespace
}  // namespace epd::model
