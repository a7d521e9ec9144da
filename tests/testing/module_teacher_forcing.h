#pragma once

// Module teacher forcing on a golden set, on any backend: each layer's attention, MoE and Engram
// run alone on the reference's own inputs of that module (tests/data/golden/<set>/debug), and
// their outputs are compared with the reference's, with the index sources' top-k rows. The
// inputs go up and the outputs come down through a model::Scratch (host memory on the CPU
// backend). Shared by tests/model/golden_parity_test.cc (CPU) and tests/gpu/cuda_model_test.cc.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/scratch.h"
#include "tests/testing/golden_model.h"

namespace epd::testing {

// Attention, MoE and Engram bit for bit equal to the reference on every layer (the reference's
// summation orders: issue 55), and every index source's top-k rows equal.
inline void ExpectModulesMatchGolden(const model::Model& m, const std::string& set,
                                     const std::vector<int32_t>& prompt) {
  const model::ModelConfig& c = m.config();
  const int64_t P = static_cast<int64_t>(prompt.size()), D = c.dim;
  auto state = m.NewSequence();
  model::Model::Call call;
  call.rows = P;
  const std::vector<int64_t> hashes = m.EngramHashes(*state, prompt);
  const int per = (c.engram_max_ngram_size - 1) * c.engram_n_heads;
  model::Scratch ws(m.backend());
  int exact_layers = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string ls = std::to_string(l);
    const std::vector<float> x = ReadGoldenBf16(set, "debug/attn_in_layer" + ls + "_prefill.bin");
    ASSERT_EQ(x.size(), static_cast<size_t>(P * D)) << "layer " << l;
    auto x_dev = ws.Copy(x);
    auto out_dev = ws.Alloc<float>(P * D);
    ASSERT_TRUE(x_dev.ok() && out_dev.ok());
    model::ForwardTrace trace;
    ASSERT_TRUE(m.Attention(l, *x_dev, call, *state, *out_dev, &trace).ok()) << "layer " << l;
    std::vector<float> out;
    ASSERT_TRUE(ws.DownloadTo(static_cast<const float*>(*out_dev), P * D, out).ok());
    const std::vector<float> attn_want =
        ReadGoldenBf16(set, "debug/attn_out_layer" + ls + "_prefill.bin");
    const double ar = RelRms(out, attn_want);
    // The reference's summation orders throughout (issue 55): bit for bit.
    EXPECT_TRUE(BitEqual(out, attn_want)) << "attention layer " << l << ", rel_rms " << ar;
    exact_layers += BitEqual(out, attn_want);
    if (auto it = trace.topk.find(l); it != trace.topk.end()) {
      // The index source's top-k rows (compressed positions) against the reference's (offset by
      // the prefill's window length, P).
      const std::vector<int32_t> want =
          ReadGoldenI32(set, "debug/topk_idxs_layer" + ls + "_prefill.bin");
      const int64_t kg = static_cast<int64_t>(want.size()) / P, k = call.topk_k;
      int64_t equal = 0;
      for (int64_t i = 0; i < P; ++i) {
        bool same = true;
        for (int64_t j = 0; j < kg; ++j) {
          const int32_t g = want[i * kg + j], ours = j < k ? it->second[i * k + j] : -1;
          same = same && (g < 0 ? ours < 0 : ours == g - P);
        }
        equal += same;
      }
      std::printf("[%s] layer %d: top-k rows equal to golden %lld/%lld\n", set.c_str(), l,
                  static_cast<long long>(equal), static_cast<long long>(P));
      EXPECT_EQ(equal, P) << "top-k of layer " << l;
    }
    const std::vector<float> f = ReadGoldenBf16(set, "debug/ffn_in_layer" + ls + "_prefill.bin");
    auto f_dev = ws.Copy(f);
    ASSERT_TRUE(f_dev.ok());
    ASSERT_TRUE(m.Moe(l, *f_dev, P, *out_dev).ok()) << "layer " << l;
    ASSERT_TRUE(ws.DownloadTo(static_cast<const float*>(*out_dev), P * D, out).ok());
    const std::vector<float> moe_want =
        ReadGoldenBf16(set, "debug/ffn_out_layer" + ls + "_prefill.bin");
    const double mr = RelRms(out, moe_want);
    EXPECT_TRUE(BitEqual(out, moe_want)) << "MoE layer " << l << ", rel_rms " << mr;
    std::printf("[%s] layer %d: attention rel_rms %.3g, MoE rel_rms %.3g\n", set.c_str(), l, ar,
                mr);
  }
  for (size_t li = 0; li < c.engram_layer_ids.size(); ++li) {
    const int l = c.engram_layer_ids[li];
    const std::vector<float> in =
        ReadGoldenBf16(set, "debug/engram_in_layer" + std::to_string(l) + "_prefill.bin");
    const std::vector<float> want =
        ReadGoldenBf16(set, "debug/engram_out_layer" + std::to_string(l) + "_prefill.bin");
    ASSERT_EQ(in.size(), static_cast<size_t>(P * c.hc_mult * D));
    auto h_dev = ws.Copy(in);
    ASSERT_TRUE(h_dev.ok());
    ASSERT_TRUE(m.Engram(l, hashes.data() + li * per,
                         static_cast<int64_t>(c.engram_layer_ids.size()) * per, P, *h_dev)
                    .ok());
    std::vector<float> h;
    ASSERT_TRUE(
        ws.DownloadTo(static_cast<const float*>(*h_dev), static_cast<int64_t>(in.size()), h).ok());
    std::vector<float> d(h.size()), dw(h.size());
    for (size_t i = 0; i < h.size(); ++i) {
      d[i] = h[i] - in[i];
      dw[i] = want[i] - in[i];
    }
    const double er = RelRms(d, dw);
    EXPECT_TRUE(BitEqual(h, want)) << "engram layer " << l << ", delta rel_rms " << er;
    std::printf("[%s] engram layer %d: delta rel_rms %.3g\n", set.c_str(), l, er);
  }
  std::printf("[%s] attention bit-exact on %d of %d layers\n", set.c_str(), exact_layers,
              c.n_layers);
  EXPECT_EQ(exact_layers, c.n_layers);
}

}  // namespace epd::testing
