// Decode throughput of the model on the CUDA backend (issue 12): tokens/s of one batched decode
// step (DecodeStep -> Model::ExtendBatch, the decode worker's path) at batch 1, 32 and 128, on
// each golden set (weights in device memory), against the same steps on the CPU backend in the
// same run, and against a physical limit: a step must read every weight once, so
// batch / (checkpoint bytes / 4.8 TB/s) bounds its tokens/s (the KV read, small on these
// prompts, is left out, so the bound is optimistic and the ratio an upper estimate).
// Output: `BENCH decode <set> batch=<b> ...` lines (tests/gpu/device_check.sh collects them).
// Usage: cuda_model_bench [--quick]   (--quick: batch 1 and 32, fewer steps)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/model.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kHbmBytesPerSecond = 4.8e12;  // H200 SXM datasheet

// Median tokens/s of `runs` runs of `steps` decode steps of `batch` copies of `seed`.
double DecodeTokensPerSecond(const epd::model::Model& m, const epd::model::SequenceState& seed,
                             int batch, int steps, int runs) {
  using epd::model::SequenceState;
  std::vector<double> tps;
  for (int r = 0; r < runs + 1; ++r) {  // the first run warms up (scratch, pool blocks)
    std::vector<std::unique_ptr<SequenceState>> seqs;
    std::vector<SequenceState*> ptrs;
    for (int b = 0; b < batch; ++b) {
      seqs.push_back(std::make_unique<SequenceState>(seed));
      ptrs.push_back(seqs.back().get());
    }
    const auto t0 = Clock::now();
    for (int step = 0; step < steps; ++step) {
      std::vector<std::vector<int32_t>> toks;
      for (int b = 0; b < batch; ++b) toks.push_back({static_cast<int32_t>(10 + b + step)});
      auto out = epd::model::DecodeStep(m, ptrs, toks);
      if (!out.ok()) {
        std::fprintf(stderr, "decode step: %s\n", std::string(out.status().message()).c_str());
        return 0;
      }
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) tps.push_back(batch * steps / s);
  }
  std::sort(tps.begin(), tps.end());
  return tps[tps.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) quick = quick || std::strcmp(argv[i], "--quick") == 0;
  auto cuda = epd::kernels::MakeCudaBackend(0);
  if (!cuda.ok()) {
    std::printf("skipped: no GPU (%s)\n", std::string(cuda.status().message()).c_str());
    return 0;
  }
  auto cpu = epd::kernels::MakeCpuBackend();
  std::vector<int> batches = {1, 32};
  if (!quick) batches.push_back(128);
  const int steps = quick ? 4 : 8, runs = 3;
  for (const std::string& set : epd::testing::GoldenSets()) {
    auto gpu_model = epd::testing::LoadGoldenModel(**cuda, set, {}, /*weights_in_backend=*/true);
    auto cpu_model = epd::testing::LoadGoldenModel(*cpu, set, {}, /*weights_in_backend=*/true);
    if (!gpu_model.ok() || !cpu_model.ok()) {
      std::fprintf(stderr, "%s: cannot load\n", set.c_str());
      return 1;
    }
    const double weight_bytes =
        static_cast<double>(std::filesystem::file_size(epd::testing::SourcePath(
            std::string(epd::testing::kGoldenRoot) + set + "/model.safetensors")));
    const std::vector<int32_t> prompt = epd::testing::GoldenPrompt(set);
    auto gpu_seed = (*gpu_model)->NewSequence();
    auto cpu_seed = (*cpu_model)->NewSequence();
    if (!(*gpu_model)->Prefill(*gpu_seed, prompt, false).ok() ||
        !(*cpu_model)->Prefill(*cpu_seed, prompt, false).ok()) {
      std::fprintf(stderr, "%s: prefill failed\n", set.c_str());
      return 1;
    }
    for (int batch : batches) {
      const double g = DecodeTokensPerSecond(**gpu_model, *gpu_seed, batch, steps, runs);
      const double c = DecodeTokensPerSecond(**cpu_model, *cpu_seed, batch, quick ? 2 : 4, 1);
      const double limit = batch / (weight_bytes / kHbmBytesPerSecond);
      std::printf(
          "BENCH decode %s batch=%d ctx=%zu  %.0f tokens/s  ratio=%.5f (of %.3g tokens/s: the "
          "weights read once per step at 4.8 TB/s)  cpu %.0f tokens/s (gpu/cpu %.2f)\n",
          set.c_str(), batch, prompt.size(), g, g / limit, limit, c, c > 0 ? g / c : 0.0);
      std::fflush(stdout);
    }
  }
  return 0;
}
