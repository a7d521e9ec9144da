// Model reference-forward benchmark on the golden tiny checkpoint (CPU backend).
// Prints prefill tokens/s, decode ms/step, DSpark draft ms, the ratio of one 5-position
// verification step (Model::Extend) to 5 sequential decodes, and the ratio of a decode step of 8
// sequences in one batched forward (DecodeStep -> Model::ExtendBatch) to the same 8 sequences
// stepped one at a time, all measured in the same run; and the CPU's plain linear on a weight
// larger than the caches held as bf16 bits against the same weight as fp32 values.
// Usage: model_bench [model_dir] [--scalar]   (default: tests/data/golden/v41-tiny-a; --scalar
// forces the scalar CPU kernels, which give the same results)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "kernels/format.h"
#include "model/model.h"
#include "model/stages.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_cpu_backend.h"

namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
std::string Read(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace epd::model;
  std::string dir = epd::testing::SourcePath("tests/data/golden/v41-tiny-a");
  bool scalar = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--scalar") {
      scalar = true;  // same results, scalar kernels
    } else {
      dir = argv[i];
    }
  }
  auto backend = epd::testing::MakeTestCpuBackend({.simd = !scalar});
  auto cfg = LoadModelConfig(dir + "/config.json");
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str());
    return 1;
  }
  auto store = TensorStore::Open(dir + "/model.safetensors", false);
  if (!store.ok()) return 1;
  auto w = ModelWeights::Load(*cfg, std::shared_ptr<const TensorStore>(std::move(*store)));
  auto k = ParseEngramConstantsJson(Read(dir + "/manifest.json"));
  if (!w.ok() || !k.ok()) return 1;
  Model model(std::move(*cfg), std::move(*w), std::move(*k), *backend);
  auto prompt =
      nlohmann::json::parse(Read(dir + "/prompt.json"))["prompt_ids"].get<std::vector<int32_t>>();
  const int reps = 3;
  double prefill_ms = 1e30, decode_ms = 1e30, draft_ms = 1e30, seq5_ms = 1e30, ext5_ms = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto st = model.NewSequence();
    auto t0 = Clock::now();
    (void)model.Prefill(*st, prompt, false);
    auto t1 = Clock::now();
    prefill_ms = std::min(prefill_ms, Ms(t0, t1));
    auto base = std::make_unique<SequenceState>(*st);
    t0 = Clock::now();
    for (int i = 0; i < 5; ++i) (void)model.Decode(*st, 10 + i);
    t1 = Clock::now();
    seq5_ms = std::min(seq5_ms, Ms(t0, t1));
    decode_ms = std::min(decode_ms, Ms(t0, t1) / 5);
    t0 = Clock::now();
    (void)model.Draft(*st, 20);
    t1 = Clock::now();
    draft_ms = std::min(draft_ms, Ms(t0, t1));
    std::vector<int32_t> block = {10, 11, 12, 13, 14};
    t0 = Clock::now();
    (void)model.Extend(*base, block, true);
    t1 = Clock::now();
    ext5_ms = std::min(ext5_ms, Ms(t0, t1));
  }
  std::printf("model_bench (%s backend, %s kernels, %zu-token prompt, best of %d)\n",
              std::string(backend->Name()).c_str(),
              !scalar && epd::kernels::cpu::SimdEnabled() ? "SIMD" : "scalar", prompt.size(), reps);
  std::printf("prefill: %.1f ms, %.0f tokens/s\n", prefill_ms, prompt.size() / prefill_ms * 1e3);
  std::printf("decode: %.2f ms/step\n", decode_ms);
  std::printf("dspark draft (5 positions): %.2f ms\n", draft_ms);
  std::printf(
      "verify step, 5 positions in one Extend: %.2f ms; 5 sequential decodes: %.2f ms; "
      "ratio %.2f\n",
      ext5_ms, seq5_ms, ext5_ms / seq5_ms);
  // Decode steps of kBatch sequences: one batched forward per step vs one forward per sequence
  // (median of 5 runs of 4 steps each).
  constexpr int kBatch = 8, kSteps = 4, kRuns = 5;
  auto seed_seq = model.NewSequence();
  (void)model.Prefill(*seed_seq, prompt, false);
  std::vector<double> batched_ms, alone_ms;
  for (int r = 0; r < kRuns; ++r) {
    for (int mode = 0; mode < 2; ++mode) {
      std::vector<std::unique_ptr<SequenceState>> seqs;
      std::vector<SequenceState*> ptrs;
      for (int b = 0; b < kBatch; ++b) {
        seqs.push_back(std::make_unique<SequenceState>(*seed_seq));
        ptrs.push_back(seqs.back().get());
      }
      auto t0 = Clock::now();
      for (int step = 0; step < kSteps; ++step) {
        std::vector<std::vector<int32_t>> toks;
        for (int b = 0; b < kBatch; ++b) toks.push_back({static_cast<int32_t>(10 + b + step)});
        if (mode == 0) {
          (void)DecodeStep(model, ptrs, toks);
        } else {
          for (int b = 0; b < kBatch; ++b) {
            (void)DecodeStep(model, std::span<SequenceState* const>(&ptrs[b], 1),
                             std::span<const std::vector<int32_t>>(&toks[b], 1));
          }
        }
      }
      (mode == 0 ? batched_ms : alone_ms).push_back(Ms(t0, Clock::now()) / kSteps);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double bm = median(batched_ms), am = median(alone_ms);
  std::printf(
      "decode step of %d sequences: batched %.2f ms (%.0f tokens/s), one at a time %.2f ms "
      "(%.0f tokens/s), median of %d\n",
      kBatch, bm, kBatch / bm * 1e3, am, kBatch / am * 1e3, kRuns);
  std::printf("model_bench ratio: %.2f\n", bm / am);

  // The CPU's plain linear on a weight too large for the caches (a decode step's LM head is
  // 129,280 x 5,120; here 32,768 x 4,096, 512 MiB as fp32 values), one row: the weight as bf16
  // bits (the model's form since 2026-12-05: widened block by block into a scratch) against the
  // same values as fp32, in the same run.
  {
    const int64_t out = 32768, in = 4096;
    std::vector<float> wf(static_cast<size_t>(out * in)), x(in), y(out);
    std::vector<uint16_t> wb(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) {
      wb[i] = epd::kernels::format::F32ToBf16Bits(static_cast<float>(i % 61) * 0.01f - 0.3f);
      wf[i] = epd::kernels::format::Bf16BitsToF32(wb[i]);
    }
    for (int64_t i = 0; i < in; ++i) x[i] = static_cast<float>(i % 7) * 0.125f;
    std::vector<double> f32_ms, bf16_ms;
    for (int run = 0; run < 7; ++run) {
      for (int form = 0; form < 2; ++form) {
        const epd::kernels::PlainWeight pw = form == 0 ? epd::kernels::PlainWeight(wf.data())
                                                       : epd::kernels::PlainWeight::Bf16(wb.data());
        const auto t0 = Clock::now();
        if (!backend->LinearF32(x.data(), 1, pw, out, in, y.data()).ok()) return 1;
        (form == 0 ? f32_ms : bf16_ms).push_back(Ms(t0, Clock::now()));
      }
    }
    const double f = median(f32_ms), b = median(bf16_ms);
    std::printf(
        "plain linear 1 x %lld x %lld (LinearF32): fp32 weights %.1f ms (%.2f GB/s), bf16 weights "
        "%.1f ms (%.2f GB/s), median of 7; bf16/fp32 time ratio: %.2f\n",
        static_cast<long long>(out), static_cast<long long>(in), f, out * in * 4.0 / f / 1e6, b,
        out * in * 2.0 / b / 1e6, b / f);
  }
  return 0;
}
