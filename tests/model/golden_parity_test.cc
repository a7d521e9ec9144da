// Parity of the CPU reference forward pass with every golden set in tests/data/golden/ (the
// official model.py run on tiny checkpoints), following the checks their READMEs recommend. Set-
// specific numbers (prompt, generated ids, layer roles, envelopes) come from each set's config and
// manifest.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/format.h"
#include "model/model.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/module_teacher_forcing.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::model {
namespace {

using testing::GoldenSet;

using testing::RelRms;
int Argmax(const float* v, int64_t n) { return static_cast<int>(std::max_element(v, v + n) - v); }

class GoldenParityTest : public testing::GoldenModelTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(GoldenModelTest::SetUp());
    g_ = GoldenSet::Load(set_);
    ASSERT_EQ(g_.prompt.size(), g_.manifest["prompt"]["length"].get<size_t>());
  }
  std::vector<float> Bf16(const std::string& rel) { return testing::ReadGoldenBf16(set_, rel); }
  std::vector<float> F32(const std::string& rel) { return testing::ReadGoldenF32(set_, rel); }
  std::vector<int32_t> I32(const std::string& rel) { return testing::ReadGoldenI32(set_, rel); }
  GoldenSet g_;
};
INSTANTIATE_TEST_SUITE_P(Sets, GoldenParityTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

TEST(GoldenSets, BothSetsArePresent) {
  const std::vector<std::string> sets = testing::GoldenSets();
  EXPECT_NE(std::find(sets.begin(), sets.end(), "v41-tiny-a"), sets.end());
  EXPECT_NE(std::find(sets.begin(), sets.end(), "v41-tiny-c"), sets.end());
}

TEST_P(GoldenParityTest, EngramHashIdsExact) {
  auto state = model_->NewSequence();
  std::vector<int32_t> ids = g_.prompt;
  ids.insert(ids.end(), g_.generated.begin(), g_.generated.end() - 1);
  std::vector<int64_t> got = model_->EngramHashes(*state, ids);
  std::vector<int32_t> want = I32("debug/engram_hash_ids.bin");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "at " << i;
}

TEST_P(GoldenParityTest, ModuleTeacherForcing) {
  testing::ExpectModulesMatchGolden(*model_, set_, prompt_);
}

// The same checks the way a GPU runs them (tests/gpu/cuda_model_test): weights, inputs and
// outputs in backend memory that the model must not read as host memory (every op's operands
// checked), through a device-labelled CPU backend.
TEST_P(GoldenParityTest, ModuleTeacherForcingInDeviceLabelledMemory) {
  auto backend =
      testing::MakeTestCpuBackend({.report_device_memory = true, .check_operands = true});
  auto m = testing::LoadGoldenModel(*backend, set_, {}, /*weights_in_backend=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  testing::ExpectModulesMatchGolden(**m, set_, prompt_);
}

// Teacher-forced prefill + decode + DSpark on the monolithic path and on the staged path
// (EncoderPass -> DecoderReplay of the whole prompt -> DecodeStep), which must agree bit for bit;
// both equal to the reference bit for bit: every recorded intermediate (attention and MoE inputs
// and outputs, Engram in/out, the LM-head input, each call's last-position residual after every
// block, the routing, every index source's decode top-k, DSpark's main_hidden), every logit of
// the prefill and the decode steps, and the DSpark logits and confidences (draft ids forced). Not
// compared directly, because the model does not expose them: the routing weights and margins
// (the MoE outputs they produce are compared) and the DSpark stages' routing (their logits are).
TEST_P(GoldenParityTest, TeacherForcedDecodeStagedAndMonolithic) {
  const ModelConfig& c = model_->config();
  const int64_t P = static_cast<int64_t>(prompt_.size()), V = c.vocab_size, W = c.window_size;
  const int64_t B = c.dspark_block_size, nt = c.dspark_target_layer_ids.size();
  const int steps = g_.decode_steps();
  auto mono = model_->NewSequence();
  ForwardTrace trace;
  auto pre = model_->Prefill(*mono, prompt_, /*all_logits=*/true, &trace);
  ASSERT_TRUE(pre.ok()) << pre.status();
  ASSERT_EQ(pre->rows, P);
  // The reference's summation orders throughout (issue 55): every intermediate the set records
  // and every logit is the reference's, bit for bit, free running (only the input ids forced).
  auto expect_bits = [&](const std::vector<float>& ours, const std::vector<float>& want,
                         const std::string& what) {
    EXPECT_TRUE(testing::BitEqual(ours, want))
        << what << ": rel_rms " << RelRms(ours, want) << " (sizes " << ours.size() << ", "
        << want.size() << ")";
  };
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string ls = std::to_string(l);
    for (const auto& [name, got] :
         {std::pair{"attn_in", &trace.attn_in}, std::pair{"ffn_in", &trace.ffn_in},
          std::pair{"attn_out", &trace.attn_out}, std::pair{"ffn_out", &trace.ffn_out}}) {
      expect_bits((*got)[l], Bf16(absl::StrCat("debug/", name, "_layer", ls, "_prefill.bin")),
                  absl::StrCat(name, " layer ", ls));
    }
    // Routing: the prefill rows of moe_layer<l>_experts.
    const std::vector<int32_t> ge = I32("debug/moe_layer" + ls + "_experts.bin");
    const std::vector<int32_t>& oe = trace.experts[l];
    ASSERT_EQ(oe.size(), static_cast<size_t>(P * c.n_activated_experts)) << "layer " << l;
    ASSERT_LE(oe.size(), ge.size());
    EXPECT_TRUE(std::equal(oe.begin(), oe.end(), ge.begin())) << "routing of layer " << l;
  }
  for (int l : c.engram_layer_ids) {
    const std::string ls = std::to_string(l);
    expect_bits(trace.engram_in[l], Bf16("debug/engram_in_layer" + ls + "_prefill.bin"),
                "engram_in layer " + ls);
    expect_bits(trace.engram_out[l], Bf16("debug/engram_out_layer" + ls + "_prefill.bin"),
                "engram_out layer " + ls);
  }
  expect_bits(trace.final_norm, Bf16("debug/final_norm_prefill.bin"), "final_norm");
  const double pr = RelRms(pre->logits, F32("logits_prefill_all.bin"));
  std::printf("[%s] prefill logits rel_rms %.4g (envelope of a valid alternative %.4g)\n",
              set_.c_str(), pr, g_.prefill_rel_rms);
  expect_bits(pre->logits, F32("logits_prefill_all.bin"), "logits_prefill_all");
  expect_bits(std::vector<float>(pre->logits.end() - V, pre->logits.end()),
              F32("logits_prefill_last.bin"), "logits_prefill_last");
  EXPECT_EQ(Argmax(pre->logits.data() + (P - 1) * V, V), g_.generated[0]);

  // The staged path on the same prompt (tail = whole prompt: exact).
  auto staged = model_->NewSequence();
  auto enc = EncoderPass(*model_, *staged, prompt_, P);
  ASSERT_TRUE(enc.ok()) << enc.status();
  auto rep = DecoderReplay(*model_, *staged, *enc);
  ASSERT_TRUE(rep.ok()) << rep.status();
  ASSERT_EQ(rep->logits.size(), static_cast<size_t>(V));
  EXPECT_TRUE(std::equal(rep->logits.begin(), rep->logits.end(), pre->logits.end() - V))
      << "staged prefill != monolithic";

  const std::vector<float> steps_golden = F32("logits_steps.bin");
  const std::vector<float> dl = F32("dspark_logits.bin"), dc = F32("dspark_confidence.bin");
  const std::vector<float> mh = F32("debug/dspark_main_hidden.bin");
  // Last-position residual after every block, per call (prefill, then each step): localizes a
  // divergence to a layer.
  const std::vector<float> blocks = F32("debug/block_out_last.bin");
  const int64_t blk = c.hc_mult * c.dim;
  auto block_report = [&](int call, ForwardTrace& t, int64_t row) {
    if (blocks.size() != static_cast<size_t>((steps + 1) * c.n_layers * blk)) return;
    std::string line;
    for (int l = 0; l < c.n_layers; ++l) {
      const float* want = blocks.data() + (call * c.n_layers + l) * blk;
      const double e = RelRms(t.block_out[l].data() + row * blk, want, blk);
      EXPECT_TRUE(testing::BitEqual({t.block_out[l].data() + row * blk, static_cast<size_t>(blk)},
                                    {want, static_cast<size_t>(blk)}))
          << "block_out of layer " << l << ", call " << call;
      line += absl::StrCat(" ", std::to_string(e).substr(0, 7));
    }
    std::printf("[%s] call %d block_out rel_rms per layer:%s\n", set_.c_str(), call, line.c_str());
  };
  block_report(0, trace, P - 1);
  ASSERT_EQ(steps_golden.size(), static_cast<size_t>((steps + 1) * V));
  std::map<int, std::vector<int32_t>> golden_topk;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string f = "debug/topk_idxs_layer" + std::to_string(l) + "_decode.bin";
    if (testing::GoldenFileExists(set_, f)) golden_topk[l] = I32(f);
  }
  ASSERT_FALSE(golden_topk.empty());
  const int first_index_source = golden_topk.begin()->first;
  std::map<int, int> equal_rows;
  for (int s = 1; s <= steps; ++s) {
    const int32_t in = g_.generated[s - 1];
    ForwardTrace dt;
    auto r = model_->Decode(*mono, in, &dt);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<SequenceState*> batch = {staged.get()};
    std::vector<std::vector<int32_t>> toks = {{in}};
    auto sr = DecodeStep(*model_, batch, toks);
    ASSERT_TRUE(sr.ok()) << sr.status();
    EXPECT_EQ((*sr)[0].logits, r->logits) << "staged decode != monolithic at step " << s;

    for (auto& [l, gt] : golden_topk) {
      const int64_t k = static_cast<int64_t>(gt.size()) / steps;
      const std::vector<int32_t>& ours = dt.topk[l];
      bool same = static_cast<int64_t>(ours.size()) == k;
      for (int64_t j = 0; same && j < k; ++j) {
        const int32_t gv = gt[(s - 1) * k + j];  // compressed position + window, -1 = none
        same = ours[j] == (gv < 0 ? -1 : gv - W);
      }
      equal_rows[l] += same;
      if (!same && l == first_index_source) {
        std::string d;
        for (int64_t j = 0; j < k && j < static_cast<int64_t>(ours.size()); ++j) {
          const int32_t gv = gt[(s - 1) * k + j];
          absl::StrAppend(&d, " ", ours[j], "/", gv < 0 ? -1 : gv - W);
        }
        std::printf("[%s] step %d layer %d top-k ours/golden:%s\n", set_.c_str(), s, l, d.c_str());
      }
      EXPECT_TRUE(same) << "layer " << l << " top-k, step " << s;
    }
    block_report(s, dt, 0);
    const double rr = RelRms(r->logits.data(), steps_golden.data() + s * V, V);
    const int am = Argmax(r->logits.data(), V);
    double mhr = 0;
    if (nt > 0 && mh.size() == static_cast<size_t>(steps * nt * c.dim))
      mhr = RelRms(mono->main_hidden.data(), mh.data() + (s - 1) * nt * c.dim, nt * c.dim);
    std::printf(
        "[%s] decode step %d: logits rel_rms %.4g argmax %d (golden %d), dspark input "
        "rel_rms %.3g\n",
        set_.c_str(), s, rr, am, g_.generated[s], mhr);
    // Free running (only the input ids forced): the reference's bits.
    EXPECT_TRUE(testing::BitEqual(r->logits, {steps_golden.data() + s * V, static_cast<size_t>(V)}))
        << "logits of step " << s << ": rel_rms " << rr;
    EXPECT_EQ(am, g_.generated[s]) << "step " << s;
    for (int l = 0; l < c.n_layers; ++l) {
      const std::vector<int32_t> ge = I32("debug/moe_layer" + std::to_string(l) + "_experts.bin");
      const std::vector<int32_t>& oe = dt.experts[l];
      const size_t at = (P + s - 1) * oe.size();
      ASSERT_LE(at + oe.size(), ge.size());
      EXPECT_TRUE(std::equal(oe.begin(), oe.end(), ge.begin() + at))
          << "routing of layer " << l << ", step " << s;
    }
    if (nt > 0 && mh.size() == static_cast<size_t>(steps * nt * c.dim)) {
      EXPECT_TRUE(testing::BitEqual(
          mono->main_hidden, {mh.data() + (s - 1) * nt * c.dim, static_cast<size_t>(nt * c.dim)}))
          << "DSpark main_hidden, step " << s;
    }

    if (c.n_mtp_layers == 0) continue;
    const std::vector<int32_t>& gd = g_.draft_ids[s - 1];
    std::vector<int32_t> forced(gd.begin() + 1, gd.end() - 1);
    auto d = model_->Draft(*mono, g_.generated[s], forced);
    ASSERT_TRUE(d.ok()) << d.status();
    auto ds = model_->Draft(*staged, g_.generated[s], forced);
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_EQ(ds->logits, d->logits) << "staged DSpark != monolithic at step " << s;
    const float* gl = dl.data() + (s - 1) * B * V;
    const double d0 = RelRms(d->logits.data(), gl, V);
    const double dall = RelRms(d->logits.data(), gl, B * V);
    double cmax = 0;
    for (int64_t i = 0; i < B; ++i)
      cmax = std::max<double>(cmax, std::fabs(d->confidence[i] - dc[(s - 1) * B + i]));
    std::printf(
        "[%s]   dspark row0 rel_rms %.4g (envelope %.4g), rows 0-4 (ids forced) %.4g, "
        "confidence max |diff| %.4f\n",
        set_.c_str(), d0, g_.dspark_row0_rel_rms, dall, cmax);
    // Every draft row (ids forced to the reference's) and the confidences: the reference's bits.
    EXPECT_TRUE(testing::BitEqual(d->logits, {gl, static_cast<size_t>(B * V)}))
        << "DSpark logits, step " << s << ": rel_rms " << dall;
    EXPECT_TRUE(testing::BitEqual(d->confidence, {dc.data() + (s - 1) * B, static_cast<size_t>(B)}))
        << "DSpark confidence, step " << s;
    EXPECT_EQ(Argmax(d->logits.data(), V), gd[1]) << "DSpark row 0 argmax, step " << s;
  }
  for (const auto& [l, n] : equal_rows) {
    std::printf("[%s] layer %d decode top-k rows equal to golden: %d/%d\n", set_.c_str(), l, n,
                steps);
    EXPECT_EQ(n, steps) << "layer " << l;
  }
}

// The first ratio-2 index source at even decode positions scores against stale index keys
// (MODEL.md §3): the quirk must match the golden top-k better than the layer's own keys.
int EvenStepOverlap(const Model& m, const GoldenSet& g, int layer) {
  const ModelConfig& c = m.config();
  const std::vector<int32_t> golden = testing::ReadGoldenI32(
      g.name, "debug/topk_idxs_layer" + std::to_string(layer) + "_decode.bin");
  const int steps = g.decode_steps();
  const int64_t k = static_cast<int64_t>(golden.size()) / steps;
  auto st = m.NewSequence();
  EXPECT_TRUE(m.Prefill(*st, g.prompt, false).ok());
  int overlap = 0;
  for (int s = 1; s <= steps; ++s) {
    const int64_t pos = st->pos;
    ForwardTrace t;
    EXPECT_TRUE(m.Decode(*st, g.generated[s - 1], &t).ok());
    if (pos % 2 != 0) continue;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t gv = golden[(s - 1) * k + j];
      if (gv < 0) continue;
      const std::vector<int32_t>& ours = t.topk[layer];
      overlap += std::count(ours.begin(), ours.end(), gv - c.window_size) > 0;
    }
  }
  return overlap;
}

TEST_P(GoldenParityTest, StaleIndexKeysQuirkMatchesGoldenBetterThanOwnKeys) {
  const ModelConfig& c = model_->config();
  int layer = -1;
  for (int l : c.index_source_layers) {
    if (c.compress_ratios[l] == 2 &&
        std::count(c.kv_source_layers.begin(), c.kv_source_layers.end(), l) > 0) {
      layer = l;
      break;
    }
  }
  if (layer < 0) GTEST_SKIP() << set_ << " has no ratio-2 index source";
  ModelOptions own;
  own.stale_index_keys = false;
  auto own_keys = testing::LoadGoldenModel(*backend_, set_, own);
  ASSERT_TRUE(own_keys.ok()) << own_keys.status();
  const int stale = EvenStepOverlap(*model_, g_, layer);
  const int fixed = EvenStepOverlap(**own_keys, g_, layer);
  std::printf("[%s] even-step layer-%d top-k overlap with golden: stale keys %d, own keys %d\n",
              set_.c_str(), layer, stale, fixed);
  EXPECT_GT(stale, fixed + 8);
}

}  // namespace
}  // namespace epd::model

namespace epd::model {
namespace {

// Decode-time module teacher forcing: the caches are built from the golden prefill attention
// inputs (as in ModuleTeacherForcing), and at every decode step each layer's input residual is the
// golden one (debug/block_out_last.bin of the previous layer; the delayed pre-mix is ours, from the
// previous layer's golden-fed block). Each layer's decode computation then sees (nearly) the
// reference's inputs, so its decode-time top-k must equal the reference's on every row and a
// layer's output error isolates its own decode arithmetic.
TEST_P(GoldenParityTest, DecodeModuleTeacherForcing) {
  const ModelConfig& c = model_->config();
  const ModelWeights& wt = model_->weights();
  kernels::Backend& be = *backend_;
  const int64_t P = static_cast<int64_t>(prompt_.size()), D = c.dim, hc = c.hc_mult,
                W = c.window_size;
  const int steps = g_.decode_steps();
  const std::vector<float> blocks = F32("debug/block_out_last.bin");
  ASSERT_EQ(blocks.size(), static_cast<size_t>((steps + 1) * c.n_layers * hc * D));
  auto state = model_->NewSequence();
  {
    Model::Call call;
    call.rows = P;
    std::vector<float> out(P * D);
    for (int l = 0; l < c.n_layers; ++l) {
      std::vector<float> x = Bf16("debug/attn_in_layer" + std::to_string(l) + "_prefill.bin");
      ASSERT_TRUE(model_->Attention(l, x.data(), call, *state, out.data()).ok());
    }
    Model::Hidden none;
    ASSERT_TRUE(model_->Commit(*state, prompt_, P, none).ok());
  }
  std::map<int, std::vector<int32_t>> golden_topk;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string f = "debug/topk_idxs_layer" + std::to_string(l) + "_decode.bin";
    if (testing::GoldenFileExists(set_, f)) golden_topk[l] = I32(f);
  }
  std::map<int, int> equal_rows;
  for (int s = 1; s <= steps; ++s) {
    const int32_t id = g_.generated[s - 1];
    const int32_t ids[1] = {id};
    std::vector<int64_t> hashes = model_->EngramHashes(*state, ids);
    const int per = (c.engram_max_ngram_size - 1) * c.engram_n_heads;
    Model::Call call;
    call.start_pos = state->pos;
    call.rows = 1;
    call.prefill = false;
    call.per_row_keys = true;
    call.published_at_start = state->published_keys;
    std::vector<float> h(hc * D), pre(hc, 0.f), aP(hc), aQ(hc), aC(hc * hc), fQ(hc), fC(hc * hc),
        x(D), y(D);
    // The embedding row (bf16 bits in the host backend's memory), widened as Backend::Embed does.
    const auto* row = static_cast<const uint16_t*>(wt.embed.plain().data) + id * D;
    for (int64_t j = 0; j < hc; ++j) kernels::format::Bf16BitsToF32N(row, D, h.data() + j * D);
    pre[0] = 1.f;
    std::string errs;
    for (int l = 0; l < c.n_layers; ++l) {
      if (l > 0) {
        const float* g = blocks.data() + (s * c.n_layers + l - 1) * hc * D;
        std::copy_n(g, hc * D, h.data());
      }
      for (size_t li = 0; li < c.engram_layer_ids.size(); ++li) {
        if (c.engram_layer_ids[li] != l) continue;
        ASSERT_TRUE(model_
                        ->Engram(l, hashes.data() + li * per,
                                 static_cast<int64_t>(c.engram_layer_ids.size()) * per, 1, h.data(),
                                 /*single_token_calls=*/true)
                        .ok());
      }
      const LayerWeights& L = wt.layers[l];
      ASSERT_TRUE(be.HcMixesSingleToken(1, h.data(), hc, D, L.hc_attn_fn.data(),
                                        L.hc_attn_scale.data(), L.hc_attn_base.data(),
                                        c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, aP.data(),
                                        aQ.data(), aC.data())
                      .ok());
      ASSERT_TRUE(be.HcPre(1, h.data(), hc, D, pre.data(), x.data()).ok());
      ASSERT_TRUE(be.RmsNorm(x.data(), L.attn_norm.data(), 1, D, c.norm_eps, x.data()).ok());
      ForwardTrace t;
      ASSERT_TRUE(model_->Attention(l, x.data(), call, *state, y.data(), &t).ok());
      ASSERT_TRUE(be.HcPost(1, y.data(), h.data(), hc, D, aQ.data(), aC.data(), h.data()).ok());
      ASSERT_TRUE(be.HcMixesSingleToken(1, h.data(), hc, D, L.hc_ffn_fn.data(),
                                        L.hc_ffn_scale.data(), L.hc_ffn_base.data(),
                                        c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, pre.data(),
                                        fQ.data(), fC.data())
                      .ok());
      ASSERT_TRUE(be.HcPre(1, h.data(), hc, D, aP.data(), x.data()).ok());
      ASSERT_TRUE(be.RmsNorm(x.data(), L.ffn_norm.data(), 1, D, c.norm_eps, x.data()).ok());
      ASSERT_TRUE(model_->Moe(l, x.data(), 1, y.data()).ok());
      ASSERT_TRUE(be.HcPost(1, y.data(), h.data(), hc, D, fQ.data(), fC.data(), h.data()).ok());
      const double e = RelRms(h.data(), blocks.data() + (s * c.n_layers + l) * hc * D, hc * D);
      errs += absl::StrCat(" ", std::to_string(e).substr(0, 7));
      EXPECT_EQ(e, 0.0) << "layer " << l << " step " << s;
      if (golden_topk.count(l)) {
        const std::vector<int32_t>& gt = golden_topk[l];
        const int64_t k = static_cast<int64_t>(gt.size()) / steps;
        const std::vector<int32_t>& ours = t.topk[l];
        bool same = static_cast<int64_t>(ours.size()) == k;
        std::string d;
        for (int64_t j = 0; j < k && j < static_cast<int64_t>(ours.size()); ++j) {
          const int32_t gv = gt[(s - 1) * k + j];
          same = same && ours[j] == (gv < 0 ? -1 : gv - W);
          absl::StrAppend(&d, " ", ours[j], "/", gv < 0 ? -1 : gv - W);
        }
        equal_rows[l] += same;
        if (!same)
          std::printf("[%s] step %d layer %d top-k ours/golden:%s\n", set_.c_str(), s, l,
                      d.c_str());
      }
    }
    std::printf("[%s] forced decode step %d: block_out rel_rms per layer:%s\n", set_.c_str(), s,
                errs.c_str());
    // (state->published_keys is already the last emitter, as RunStage leaves it.)
    Model::Hidden none;
    ASSERT_TRUE(model_->Commit(*state, ids, call.start_pos + 1, none).ok());
  }
  for (const auto& [l, n] : equal_rows) {
    std::printf("[%s] forced decode: layer %d top-k rows equal to golden: %d/%d\n", set_.c_str(), l,
                n, steps);
    EXPECT_EQ(n, steps) << "layer " << l;
  }
}

}  // namespace
}  // namespace epd::model
