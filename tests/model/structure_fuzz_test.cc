// Structural fuzz: random legal layer structures drawn by the nano generator
// (model::RandomStructureConfig: ratios 1/2/4, Full/Reindex/Reuse roles, SWA layers, the
// candidate source, Engram layers incl. layer 0 and the split layer, DSpark stages and targets),
// over a fixed seed list. On each structure:
// - staged (EncoderPass in two chunks -> DecoderReplay -> DecodeStep) == the bounded monolithic
//   reference (Model::Prefill with decoder_tail_rows), bit for bit: logits, every state field,
//   the decode continuation and the DSpark drafts;
// - batch invariance: a sequence's DecodeStep logits are the same alone and batched;
// - DSpark losslessness: greedy speculative decoding (drafts verified by one Extend, rejected
//   positions rolled back) emits the plain greedy ids with bit-identical logits.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

using testing::BitEqual;

int32_t Argmax(const float* v, int64_t n) {
  return static_cast<int32_t>(std::max_element(v, v + n) - v);
}

void ExpectSameState(const SequenceState& a, const SequenceState& b, const std::string& what) {
  EXPECT_EQ(a.pos, b.pos) << what;
  EXPECT_EQ(a.published_keys, b.published_keys) << what;
  EXPECT_EQ(a.engram_history, b.engram_history) << what;
  EXPECT_TRUE(BitEqual(a.main_hidden, b.main_hidden)) << what << " main_hidden";
  for (size_t l = 0; l < a.swa.size(); ++l)
    EXPECT_TRUE(BitEqual(a.swa[l], b.swa[l])) << what << " ring " << l;
  for (const auto& [l, src] : a.sources) {
    const SequenceState::Source& o = b.sources.at(l);
    EXPECT_EQ(src.n, o.n) << what << " source " << l;
    EXPECT_TRUE(BitEqual(src.kv, o.kv)) << what << " kv " << l;
    EXPECT_TRUE(BitEqual(src.keys, o.keys)) << what << " keys " << l;
    EXPECT_TRUE(BitEqual(src.tail.Kv(), o.tail.Kv())) << what << " kv_state " << l;
    EXPECT_TRUE(BitEqual(src.tail.Score(), o.tail.Score())) << what << " score_state " << l;
  }
}

std::string Describe(const ModelConfig& c) {
  std::vector<std::string> layers;
  const std::vector<LayerRole> roles = c.Roles();
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerRole& r = roles[l];
    std::string s =
        r.compress_ratio == 0 ? "SWA"
        : r.mode == LayerMode::kFull
            ? absl::StrCat("Full", r.compress_ratio)
            : absl::StrCat(r.mode == LayerMode::kReindex ? "Reindex" : "Reuse", r.compress_ratio);
    if (r.is_candidate_source) s += "*";
    if (r.has_engram) s += "+E";
    if (r.is_dspark_target) s += "+T";
    layers.push_back(s);
  }
  return absl::StrCat("[", absl::StrJoin(layers, " "), "] mtp ", c.n_mtp_layers);
}

class StructureFuzzTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(StructureFuzzTest, StagedBatchAndDSparkInvariants) {
  const uint64_t seed = GetParam();
  testing::TempDir dir;
  ASSERT_TRUE(GenerateStructureModel(dir.path(), seed).ok());
  auto backend = kernels::MakeCpuBackend();
  auto loaded = Model::Load(dir.path(), *backend);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& m = **loaded;
  const ModelConfig& c = m.config();
  const int64_t V = c.vocab_size;
  std::printf("seed %llu: %s\n", static_cast<unsigned long long>(seed), Describe(c).c_str());

  // A prompt longer than the decoder tail (window 16 + DSpark block), so the replay is bounded.
  const int64_t N = 40 + static_cast<int64_t>(seed % 23);
  std::vector<int32_t> prompt(N);
  uint64_t x = seed + 1;
  for (int64_t i = 0; i < N; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    prompt[i] = i == 0 ? 0 : static_cast<int32_t>(3 + (x >> 33) % (V - 16));
  }
  const int64_t tail = DecoderTailRows(c);
  ASSERT_LT(tail, N);

  // 1. Staged == bounded monolithic.
  auto ref = m.NewSequence();
  PrefillOptions opt;
  opt.decoder_tail_rows = tail;
  auto want = m.Prefill(*ref, prompt, /*all_logits=*/false, opt);
  ASSERT_TRUE(want.ok()) << want.status();
  auto st = m.NewSequence();
  const int64_t cut = N / 3 + static_cast<int64_t>(seed % 5);
  std::span<const int32_t> p(prompt);
  auto e1 = EncoderPass(m, *st, p.subspan(0, cut), tail);
  ASSERT_TRUE(e1.ok()) << e1.status();
  auto e2 = EncoderPass(m, *st, p.subspan(cut), tail, &*e1);
  ASSERT_TRUE(e2.ok()) << e2.status();
  auto got = DecoderReplay(m, *st, *e2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(BitEqual(got->logits, want->logits)) << "staged prefill logits";
  ExpectSameState(*ref, *st, "after the prefill");
  int32_t t = Argmax(want->logits.data(), V);
  for (int step = 0; step < 6; ++step) {
    auto a = m.Decode(*ref, t);
    std::vector<SequenceState*> batch = {st.get()};
    std::vector<std::vector<int32_t>> toks = {{t}};
    auto b = DecodeStep(m, batch, toks);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(BitEqual(a->logits, (*b)[0].logits)) << "decode step " << step;
    auto da = m.Draft(*ref, t);
    auto db = m.Draft(*st, t);
    ASSERT_TRUE(da.ok() && db.ok()) << da.status() << db.status();
    EXPECT_TRUE(BitEqual(da->logits, db->logits)) << "draft at step " << step;
    t = Argmax(a->logits.data(), V);
  }
  ExpectSameState(*ref, *st, "after 6 decode steps");

  // 2. Batch invariance: each sequence's logits alone == in a batch (any order).
  const std::vector<int64_t> lens = {N / 2, N - 3, N};
  const std::vector<std::vector<int32_t>> steps = {{5, 6, 7}, {8}, {9, 10, 11, 12, 13}};
  auto fresh = [&](int i) {
    auto s = m.NewSequence();
    EXPECT_TRUE(m.Prefill(*s, p.subspan(0, lens[i]), false).ok());
    return s;
  };
  std::vector<std::vector<float>> alone(3);
  for (int i = 0; i < 3; ++i) {
    auto s = fresh(i);
    std::vector<SequenceState*> b = {s.get()};
    std::vector<std::vector<int32_t>> tk = {steps[i]};
    auto r = DecodeStep(m, b, tk);
    ASSERT_TRUE(r.ok());
    alone[i] = (*r)[0].logits;
  }
  std::vector<std::unique_ptr<SequenceState>> owned;
  std::vector<SequenceState*> b;
  std::vector<std::vector<int32_t>> tk;
  for (int i : {2, 0, 1}) {
    owned.push_back(fresh(i));
    b.push_back(owned.back().get());
    tk.push_back(steps[i]);
  }
  auto batched = DecodeStep(m, b, tk);
  ASSERT_TRUE(batched.ok());
  EXPECT_TRUE(BitEqual((*batched)[0].logits, alone[2]));
  EXPECT_TRUE(BitEqual((*batched)[1].logits, alone[0]));
  EXPECT_TRUE(BitEqual((*batched)[2].logits, alone[1]));

  // 3. DSpark losslessness: plain greedy vs speculative greedy with verification + rollback.
  // Drafts alternate between the DSpark head's own and oracle drafts (the plain run's next
  // tokens, one of them corrupted), so that full, partial and no acceptance all occur.
  constexpr int kTokens = 12;
  auto plain = m.NewSequence();
  auto first = m.Prefill(*plain, prompt, false);
  ASSERT_TRUE(first.ok());
  std::vector<int32_t> plain_ids = {Argmax(first->logits.data(), V)};
  std::vector<std::vector<float>> plain_logits;
  for (int i = 0; i < kTokens; ++i) {
    auto r = m.Decode(*plain, plain_ids.back());
    ASSERT_TRUE(r.ok());
    plain_logits.push_back(r->logits);
    plain_ids.push_back(Argmax(r->logits.data(), V));
  }
  auto spec = m.NewSequence();
  ASSERT_TRUE(m.Prefill(*spec, prompt, false).ok());
  std::vector<int32_t> spec_ids = {plain_ids[0]};
  int iteration = 0, accepted_drafts = 0;
  while (static_cast<int>(spec_ids.size()) <= kTokens) {
    const int done = static_cast<int>(spec_ids.size()) - 1;  // decode steps taken
    const int k = std::min<int>(c.dspark_block_size - 1, kTokens - done - 1);
    std::vector<int32_t> fed = {spec_ids.back()};
    if (iteration % 2 == 0) {
      auto d = m.Draft(*spec, spec_ids.back());
      ASSERT_TRUE(d.ok()) << d.status();
      fed.insert(fed.end(), d->ids.begin() + 1, d->ids.begin() + 1 + k);
    } else {
      for (int j = 0; j < k; ++j) fed.push_back(plain_ids[done + 1 + j]);
      if (k > 0 && iteration % 4 == 1) fed[1 + (iteration / 4) % k] ^= 1;  // corrupt one draft
    }
    StepCheckpoint cp = m.Checkpoint(*spec, static_cast<int64_t>(fed.size()));
    auto step = m.Extend(*spec, fed, /*all_logits=*/true);
    ASSERT_TRUE(step.ok()) << step.status();
    int keep = 1;
    while (keep < static_cast<int>(fed.size()) &&
           Argmax(step->logits.data() + (keep - 1) * V, V) == fed[keep]) {
      ++keep;
    }
    accepted_drafts += keep - 1;
    for (int i = 0; i < keep; ++i) {
      const int at = done + i;
      EXPECT_TRUE(
          BitEqual(std::span<const float>(step->logits).subspan(i * V, V), plain_logits[at]))
          << "verified logits of decode step " << at << ", iteration " << iteration;
      spec_ids.push_back(Argmax(step->logits.data() + i * V, V));
    }
    ASSERT_TRUE(m.Rollback(*spec, cp, std::span<const int32_t>(fed).first(keep), *step).ok());
    ++iteration;
  }
  spec_ids.resize(plain_ids.size());
  EXPECT_EQ(spec_ids, plain_ids);
  EXPECT_GT(accepted_drafts, 0);
  ExpectSameState(*plain, *spec, "speculative vs plain");
}

// A fixed seed list (>= 20 structures); each runs in well under a second without sanitizers.
INSTANTIATE_TEST_SUITE_P(Seeds, StructureFuzzTest, ::testing::Range<uint64_t>(1, 25));

}  // namespace
}  // namespace epd::model
