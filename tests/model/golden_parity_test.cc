// Parity of the CPU reference forward pass with the golden set v41-tiny-a (official model.py run
// on a tiny checkpoint), following the checks its README recommends.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kernels/backend.h"
#include "kernels/cpu/numerics.h"
#include "model/model.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

const char kDir[] = "tests/data/golden/v41-tiny-a/";

std::string ReadText(const std::string& rel) {
  std::ifstream in(testing::SourcePath(std::string(kDir) + rel), std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
std::vector<float> ReadF32(const std::string& rel) {
  std::string s = ReadText(rel);
  std::vector<float> v(s.size() / 4);
  std::memcpy(v.data(), s.data(), v.size() * 4);
  return v;
}
std::vector<int32_t> ReadI32(const std::string& rel) {
  std::string s = ReadText(rel);
  std::vector<int32_t> v(s.size() / 4);
  std::memcpy(v.data(), s.data(), v.size() * 4);
  return v;
}
std::vector<float> ReadBf16(const std::string& rel) {
  std::string s = ReadText(rel);
  std::vector<float> v(s.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, s.data() + 2 * i, 2);
    v[i] = kernels::cpu::Bf16BitsToF32(b);
  }
  return v;
}
double RelRms(const float* x, const float* g, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(x[i]) - g[i]) * (double(x[i]) - g[i]);
    den += double(g[i]) * g[i];
  }
  return std::sqrt(num / n) / std::sqrt(den / n);
}
double RelRms(const std::vector<float>& x, const std::vector<float>& g) {
  EXPECT_EQ(x.size(), g.size());
  return RelRms(x.data(), g.data(), std::min(x.size(), g.size()));
}
int Argmax(const float* v, int n) { return static_cast<int>(std::max_element(v, v + n) - v); }

class GoldenParityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    backend_ = kernels::MakeCpuBackend().release();
    auto cfg = LoadModelConfig(testing::SourcePath(std::string(kDir) + "config.json"));
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    auto store =
        TensorStore::Open(testing::SourcePath(std::string(kDir) + "model.safetensors"), false);
    ASSERT_TRUE(store.ok()) << store.status();
    auto w = ModelWeights::Load(*cfg, std::shared_ptr<const TensorStore>(std::move(*store)));
    ASSERT_TRUE(w.ok()) << w.status();
    auto k = ParseEngramConstantsJson(ReadText("manifest.json"));
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE(ValidateEngramConstants(*k, *cfg).ok()) << ValidateEngramConstants(*k, *cfg);
    model_ = new Model(std::move(*cfg), std::move(*w), std::move(*k), *backend_);
    auto prompt = nlohmann::json::parse(ReadText("prompt.json"));
    prompt_ = new std::vector<int32_t>(prompt["prompt_ids"].get<std::vector<int32_t>>());
    auto man = nlohmann::json::parse(ReadText("manifest.json"));
    generated_ =
        new std::vector<int32_t>(man["results"]["generated_ids"].get<std::vector<int32_t>>());
    draft_ids_ = new std::vector<std::vector<int32_t>>(
        man["results"]["dspark_output_ids"].get<std::vector<std::vector<int32_t>>>());
  }
  void SetUp() override { ASSERT_NE(model_, nullptr) << "golden model failed to load"; }
  static void TearDownTestSuite() {
    delete model_;
    delete backend_;
    delete prompt_;
    delete generated_;
    delete draft_ids_;
  }
  static kernels::Backend* backend_;
  static Model* model_;
  static std::vector<int32_t>* prompt_;
  static std::vector<int32_t>* generated_;
  static std::vector<std::vector<int32_t>>* draft_ids_;
};
kernels::Backend* GoldenParityTest::backend_ = nullptr;
Model* GoldenParityTest::model_ = nullptr;
std::vector<int32_t>* GoldenParityTest::prompt_ = nullptr;
std::vector<int32_t>* GoldenParityTest::generated_ = nullptr;
std::vector<std::vector<int32_t>>* GoldenParityTest::draft_ids_ = nullptr;

TEST_F(GoldenParityTest, EngramHashIdsExact) {
  auto state = model_->NewSequence();
  std::vector<int32_t> ids = *prompt_;
  ids.insert(ids.end(), generated_->begin(), generated_->end() - 1);
  std::vector<int64_t> got = model_->EngramHashes(*state, ids);
  std::vector<int32_t> want = ReadI32("debug/engram_hash_ids.bin");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "at " << i;
}

TEST_F(GoldenParityTest, ModuleTeacherForcing) {
  const ModelConfig& c = model_->config();
  const int64_t P = static_cast<int64_t>(prompt_->size()), D = c.dim;
  auto state = model_->NewSequence();
  Model::Call call;
  call.rows = P;
  std::vector<int64_t> hashes = model_->EngramHashes(*state, *prompt_);
  const int per = (c.engram_max_ngram_size - 1) * c.engram_n_heads;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string ls = std::to_string(l);
    std::vector<float> x = ReadBf16("debug/attn_in_layer" + ls + "_prefill.bin"), out(P * D);
    ASSERT_TRUE(model_->Attention(l, x.data(), call, *state, out.data()).ok());
    const double ar = RelRms(out, ReadBf16("debug/attn_out_layer" + ls + "_prefill.bin"));
    EXPECT_LE(ar, 3e-3) << "attention layer " << l;
    std::vector<float> f = ReadBf16("debug/ffn_in_layer" + ls + "_prefill.bin");
    ASSERT_TRUE(model_->Moe(l, f.data(), P, out.data()).ok());
    const double mr = RelRms(out, ReadBf16("debug/ffn_out_layer" + ls + "_prefill.bin"));
    EXPECT_LE(mr, 1e-3) << "MoE layer " << l;
    std::printf("layer %d: attention rel_rms %.3g, MoE rel_rms %.3g\n", l, ar, mr);
  }
  for (size_t li = 0; li < c.engram_layer_ids.size(); ++li) {
    const int l = c.engram_layer_ids[li];
    std::vector<float> in = ReadBf16("debug/engram_in_layer" + std::to_string(l) + "_prefill.bin");
    std::vector<float> want =
        ReadBf16("debug/engram_out_layer" + std::to_string(l) + "_prefill.bin");
    std::vector<float> h = in;
    ASSERT_TRUE(model_
                    ->Engram(l, hashes.data() + li * per,
                             static_cast<int64_t>(c.engram_layer_ids.size()) * per, P, h.data())
                    .ok());
    std::vector<float> d(h.size()), dw(h.size());
    for (size_t i = 0; i < h.size(); ++i) {
      d[i] = h[i] - in[i];
      dw[i] = want[i] - in[i];
    }
    const double er = RelRms(d, dw);
    EXPECT_LE(er, 1e-3) << "engram layer " << l;
    std::printf("engram layer %d: delta rel_rms %.3g\n", l, er);
  }
}

TEST_F(GoldenParityTest, PrefillDecodeAndDSpark) {
  const ModelConfig& c = model_->config();
  const int64_t P = static_cast<int64_t>(prompt_->size()), V = c.vocab_size;
  auto state = model_->NewSequence();
  ForwardTrace trace;
  auto pre = model_->Prefill(*state, *prompt_, /*all_logits=*/true, &trace);
  ASSERT_TRUE(pre.ok()) << pre.status();
  ASSERT_EQ(pre->rows, P);
  const double f0 = RelRms(trace.ffn_in[0], ReadBf16("debug/ffn_in_layer0_prefill.bin"));
  const double a1 = RelRms(trace.attn_in[1], ReadBf16("debug/attn_in_layer1_prefill.bin"));
  EXPECT_LE(f0, 5e-4);
  EXPECT_LE(a1, 1e-3);
  for (int l = 0; l < c.n_layers; ++l) {
    std::printf("free-running layer %d: attn_in %.3g ffn_in %.3g\n", l,
                RelRms(trace.attn_in[l],
                       ReadBf16("debug/attn_in_layer" + std::to_string(l) + "_prefill.bin")),
                RelRms(trace.ffn_in[l],
                       ReadBf16("debug/ffn_in_layer" + std::to_string(l) + "_prefill.bin")));
  }
  const std::vector<float> all = ReadF32("logits_prefill_all.bin");
  const double pr = RelRms(pre->logits, all);
  std::printf("prefill logits rel_rms %.4g\n", pr);
  EXPECT_LE(pr, 0.06);
  const std::vector<float> steps = ReadF32("logits_steps.bin");
  EXPECT_EQ(Argmax(pre->logits.data() + (P - 1) * V, V), (*generated_)[0]);
  const std::vector<float> dl = ReadF32("dspark_logits.bin"), dc = ReadF32("dspark_confidence.bin");
  const int64_t B = c.dspark_block_size;
  const std::vector<int32_t> tk2 = ReadI32("debug/topk_idxs_layer2_decode.bin");
  int topk2_equal = 0;
  for (int s = 1; s <= 8; ++s) {
    ForwardTrace dt;
    auto r = model_->Decode(*state, (*generated_)[s - 1], &dt);
    ASSERT_TRUE(r.ok());
    const int64_t k = c.index_topk;
    bool same = true;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t g = tk2[(s - 1) * k + j];  // golden: compressed position + 128, -1 = none
      same = same && dt.topk[2][j] == (g < 0 ? -1 : g - c.window_size);
    }
    topk2_equal += same;

    ASSERT_TRUE(r.ok()) << r.status();
    const double sr = RelRms(r->logits.data(), steps.data() + s * V, V);
    std::printf("decode step %d: logits rel_rms %.4g\n", s, sr);
    EXPECT_LE(sr, 0.06) << "step " << s;
    EXPECT_EQ(Argmax(r->logits.data(), V), (*generated_)[s]) << "step " << s;
    const std::vector<int32_t>& gd = (*draft_ids_)[s - 1];
    std::vector<int32_t> forced(gd.begin() + 1, gd.end());
    auto d = model_->Draft(*state, (*generated_)[s], forced);
    ASSERT_TRUE(d.ok()) << d.status();
    const float* g = dl.data() + (s - 1) * B * V;
    const double d0 = RelRms(d->logits.data(), g, V);
    const double dall = RelRms(d->logits.data(), g, B * V);
    std::printf("  dspark row0 rel_rms %.4g, rows 0-4 %.4g, confidence %.4f vs %.4f\n", d0, dall,
                d->confidence[0], dc[(s - 1) * B]);
    EXPECT_LE(d0, 0.03) << "step " << s;
    EXPECT_LE(dall, 0.06) << "step " << s;
    EXPECT_EQ(d->ids[1], gd[1]) << "step " << s;
    for (int64_t i = 0; i < B; ++i)
      EXPECT_NEAR(d->confidence[i], dc[(s - 1) * B + i], 0.25) << s << "," << i;
  }
  // Odd positions use layer 2's own keys; even ones the stale layer-4 keys (reference quirk), whose
  // inputs drift more. Measured: the 4 odd steps match exactly and the even ones overlap mostly.
  std::printf("layer-2 decode top-k rows equal to golden: %d/8\n", topk2_equal);
  EXPECT_GE(topk2_equal, 4);
}

}  // namespace
}  // namespace epd::model

namespace epd::model {
namespace {

// Overlap of layer-2 decode top-k with the golden one at even decode positions, where the
// reference scores against stale index keys (MODEL.md §3).
int EvenStepOverlap(const Model& m, const std::vector<int32_t>& prompt,
                    const std::vector<int32_t>& generated) {
  const ModelConfig& c = m.config();
  const std::vector<int32_t> golden = ReadI32("debug/topk_idxs_layer2_decode.bin");
  auto st = m.NewSequence();
  EXPECT_TRUE(m.Prefill(*st, prompt, false).ok());
  int overlap = 0;
  for (int s = 1; s <= 8; ++s) {
    const int64_t pos = st->pos;
    ForwardTrace t;
    EXPECT_TRUE(m.Decode(*st, generated[s - 1], &t).ok());
    if (pos % 2 != 0) continue;
    for (int j = 0; j < c.index_topk; ++j) {
      const int32_t g = golden[(s - 1) * c.index_topk + j];
      if (g < 0) continue;
      const std::vector<int32_t>& ours = t.topk[2];
      overlap += std::count(ours.begin(), ours.end(), g - c.window_size) > 0;
    }
  }
  return overlap;
}

TEST_F(GoldenParityTest, StaleIndexKeysQuirkMatchesGoldenBetterThanOwnKeys) {
  auto cfg = LoadModelConfig(testing::SourcePath(std::string(kDir) + "config.json"));
  auto store =
      TensorStore::Open(testing::SourcePath(std::string(kDir) + "model.safetensors"), false);
  ASSERT_TRUE(cfg.ok() && store.ok());
  auto w = ModelWeights::Load(*cfg, std::shared_ptr<const TensorStore>(std::move(*store)));
  auto k = ParseEngramConstantsJson(ReadText("manifest.json"));
  ASSERT_TRUE(w.ok() && k.ok());
  ModelOptions own;
  own.stale_index_keys = false;
  Model own_keys(std::move(*cfg), std::move(*w), std::move(*k), *backend_, own);
  const int stale = EvenStepOverlap(*model_, *prompt_, *generated_);
  const int fixed = EvenStepOverlap(own_keys, *prompt_, *generated_);
  std::printf("even-step layer-2 top-k overlap with golden: stale keys %d/64, own keys %d/64\n",
              stale, fixed);
  EXPECT_GT(stale, fixed + 8);
}

}  // namespace
}  // namespace epd::model
