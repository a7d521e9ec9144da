#include "model/sequence_state.h"

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "model/model.h"
#include "tests/testing/golden_model.h"

namespace epd::model {
namespace {

std::unique_ptr<Model> LoadGolden(kernels::Backend& backend) {
  auto m = testing::LoadGoldenModel(backend);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

TEST(SequenceStateTest, PackedRoundTripIsBitExactAndBytesAreAccounted) {
  for (const std::string& set : testing::GoldenSets()) {
    SCOPED_TRACE(set);
    auto backend = kernels::MakeCpuBackend();
    auto m = testing::LoadGoldenModel(*backend, set);
    ASSERT_TRUE(m.ok()) << m.status();
    auto model = std::move(*m);
    const ModelConfig& c = model->config();
    auto prompt = testing::GoldenPrompt(set);
    prompt.resize(200);  // enough to fill the 128-slot rings; keeps the test fast
    auto st = model->NewSequence();
    ASSERT_TRUE(model->Prefill(*st, prompt, false).ok());
    for (int32_t t : {5, 77, 300}) {
      // Serialize at this point (odd and even positions: ratio-2 tails full and empty).
      std::vector<StateSegment> segs = SerializeState(c, *st);
      int64_t total = 0;
      for (const auto& s : segs) total += static_cast<int64_t>(s.bytes.size());
      auto acct = StateByteAccounting(c, st->pos);
      EXPECT_EQ(acct.back().first, "total");
      EXPECT_EQ(total, acct.back().second) << "pos " << st->pos;
      // SWA: every layer incl. DSpark x 128 slots x (128 + 4) bytes at head_dim 128.
      EXPECT_EQ(acct[1].second, c.total_layers() * c.window_size * (c.head_dim + c.head_dim / 32));
      auto restored = DeserializeState(*model, segs);
      ASSERT_TRUE(restored.ok()) << restored.status();
      auto a = model->Decode(*st, t);
      auto b = model->Decode(**restored, t);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->logits, b->logits) << "pos " << st->pos;
      auto da = model->Draft(*st, t);
      auto db = model->Draft(**restored, t);
      ASSERT_TRUE(da.ok() && db.ok());
      EXPECT_EQ(da->logits, db->logits);
      EXPECT_EQ(da->confidence, db->confidence);
    }
  }
}

TEST(SequenceStateTest, CorruptSegmentsAreNamed) {
  auto backend = kernels::MakeCpuBackend();
  auto model = LoadGolden(*backend);
  auto st = model->NewSequence();
  std::vector<int32_t> ids = {0, 5, 6, 7, 8};
  ASSERT_TRUE(model->Prefill(*st, ids, false).ok());
  std::vector<StateSegment> segs = SerializeState(model->config(), *st);
  auto trunc = segs;
  for (auto& s : trunc) {
    if (s.name == "kv.4") s.bytes.pop_back();
  }
  auto r = DeserializeState(*model, trunc);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.status().message()).find("kv.4"), std::string::npos) << r.status();
  auto missing = segs;
  missing.erase(missing.begin() + 3);
  auto m = DeserializeState(*model, missing);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(std::string(m.status().message()).find(segs[3].name), std::string::npos) << m.status();
}

TEST(ModelApiTest, RejectsBadCalls) {
  auto backend = kernels::MakeCpuBackend();
  auto model = LoadGolden(*backend);
  auto st = model->NewSequence();
  EXPECT_FALSE(model->Decode(*st, 3).ok());  // before prefill
  std::vector<int32_t> bad = {0, 9999};
  EXPECT_FALSE(model->Prefill(*st, bad, false).ok());
  EXPECT_FALSE(model->Draft(*st, 3).ok());
}

TEST(ModelApiTest, PrefillRowsDoNotDependOnLaterTokens) {
  // Causality + batch invariance: the logits of a prefix are identical whether or not more
  // tokens follow it in the same prefill call.
  auto backend = kernels::MakeCpuBackend();
  auto model = LoadGolden(*backend);
  std::vector<int32_t> ids = {0, 11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122};
  auto s1 = model->NewSequence();
  auto s2 = model->NewSequence();
  auto full = model->Prefill(*s1, ids, true);
  std::vector<int32_t> head(ids.begin(), ids.begin() + 7);
  auto part = model->Prefill(*s2, head, true);
  ASSERT_TRUE(full.ok() && part.ok());
  const int64_t V = model->config().vocab_size;
  EXPECT_EQ(std::vector<float>(full->logits.begin(), full->logits.begin() + 7 * V), part->logits);
}

}  // namespace
}  // namespace epd::model
