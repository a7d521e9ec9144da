// Decode throughput of the model on the CUDA backend (issue 12): tokens/s of one batched decode
// step (DecodeStep -> Model::ExtendBatch, the decode worker's path) at batch 1, 32 and 128, on
// each golden set (weights in device memory), against the same steps on the CPU backend in the
// same run, and against a physical limit: a step must read every weight once, so
// batch / (checkpoint bytes / 4.8 TB/s) bounds its tokens/s (the KV read, small on these
// prompts, is left out, so the bound is optimistic and the ratio an upper estimate).
// Then the same for one layer of the release config (tests/data/configs/deepseek-v4.1-flash) with
// random weights (model::GenerateCheckpoint into a temporary folder): the candidate-source
// layer's structure (ratio 1, its own KV, index and candidate source), without Engram (its tables
// have 384M rows) and without MTP layers (DSpark off), a 1024-token prompt. Its limit counts the
// bytes a step must read: every weight but the embedding table and the routed experts, plus the
// routed experts the batch can reach (min(384, 6 x batch)).
// Each figure is the decode step graphs' (model/step_graph.h: the row-independent parts of each
// layer launched as one CUDA graph, ModelOptions::step_graphs, the default), beside the same
// steps op by op (step_graphs off) and their ratio.
// Output: `BENCH decode <set> batch=<b> ...` lines (tests/gpu/device_check.sh collects them), and
// `PROFILE ...` lines: where an op-by-op step's device time goes (PrintOpProfile) at batch 1 of
// each golden set and at the release layer's smallest and largest batch.
// Usage: cuda_model_bench [--quick] [--release-experts N] [--skip-golden] [--cpu]
//   (--quick: batch 1 and 32, fewer steps; --release-experts: routed experts of the release layer,
//   384 as released, 0 to skip it; --cpu: only the release layer, on the CPU backend, batch 1 and
//   4: the path checked where there is no GPU)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "model/safetensors.h"
#include "model/stages.h"
#include "nlohmann/json.hpp"
#include "tests/testing/golden_model.h"
#include "tests/testing/subprocess.h"

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

// Where a decode step's time goes (kernels/cuda/cuda_backend.h, SetCudaOpProfiling): the steps of
// DecodeTokensPerSecond(m, seed, batch, steps, 1) (its warm-up run and one timed run) with each
// op waited for and timed, printed per step, the ops with the most device time first. The waits
// serialize host and device, so the sums exceed the step's time. No-op on a CPU backend.
void PrintOpProfile(epd::kernels::Backend& backend, const std::string& what,
                    const epd::model::Model& m, const epd::model::SequenceState& seed, int batch,
                    int steps) {
  if (!epd::kernels::SetCudaOpProfiling(backend, true).ok()) return;
  DecodeTokensPerSecond(m, seed, batch, steps, 1);
  auto table = epd::kernels::CudaOpProfile(backend);
  if (!epd::kernels::SetCudaOpProfiling(backend, false).ok() || !table.ok()) return;
  const double per = 1.0 / (2.0 * steps);
  double device = 0, host = 0, calls = 0;
  for (const auto& t : *table) {
    device += t.device_ms;
    host += t.host_ms;
    calls += static_cast<double>(t.calls);
  }
  std::printf(
      "PROFILE %s batch=%d op by op: %.0f calls/step, device %.0f us/step, host %.0f "
      "us/step (each op waited for)\n",
      what.c_str(), batch, calls * per, device * 1e3 * per, host * 1e3 * per);
  for (size_t i = 0; i < table->size() && i < 12; ++i) {
    const auto& t = (*table)[i];
    std::printf(
        "PROFILE %s batch=%d   %-20s %6.1f calls/step %9.1f us/step device (%4.1f%%) "
        "%9.1f us/step host\n",
        what.c_str(), batch, t.op.c_str(), static_cast<double>(t.calls) * per,
        t.device_ms * 1e3 * per, device > 0 ? 100.0 * t.device_ms / device : 0.0,
        t.host_ms * 1e3 * per);
  }
  std::fflush(stdout);
}

// The release config cut to one layer (see the header).
nlohmann::json ReleaseLayerConfig(int routed_experts) {
  std::ifstream in(epd::testing::SourcePath("tests/data/configs/deepseek-v4.1-flash/config.json"));
  nlohmann::json config = nlohmann::json::parse(in);
  nlohmann::json& tc = config.contains("text_config") ? config["text_config"] : config;
  tc["num_hidden_layers"] = 1;
  tc["num_nextn_predict_layers"] = 0;
  tc["compress_ratios"] = {1};
  tc["kv_source_layer_ids"] = {0};
  tc["index_source_layer_ids"] = {0};
  tc["candidate_source_layer_id"] = 0;
  tc["engram_layer_ids"] = nlohmann::json::array();
  tc["engram_num_embeddings"] = nlohmann::json::array();
  tc["dspark_target_layer_ids"] = nlohmann::json::array();
  tc["n_routed_experts"] = routed_experts;
  return config;
}

int ReleaseLayer(epd::kernels::Backend& cuda, int experts, const std::vector<int>& batches,
                 int steps, int runs) {
  namespace fs = std::filesystem;
  const std::string dir = (fs::temp_directory_path() / "epd-release-layer").string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  const nlohmann::json config = ReleaseLayerConfig(experts);
  const auto t0 = Clock::now();
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (auto s = epd::model::GenerateCheckpoint(config, 7, dir, threads); !s.ok()) {
    std::fprintf(stderr, "release layer: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::ofstream(dir + "/config.json") << config.dump(2) << "\n";
  auto m = epd::model::Model::Load(dir, cuda);
  auto op_by_op =
      epd::model::Model::Load(dir, cuda, epd::model::ModelOptions{.step_graphs = false});
  if (!m.ok() || !op_by_op.ok()) {
    std::fprintf(stderr, "release layer: %s\n",
                 std::string((m.ok() ? op_by_op.status() : m.status()).message()).c_str());
    return 1;
  }
  std::printf("release layer: %d routed experts, generated (%d threads) and loaded in %.0f s\n",
              experts, threads, std::chrono::duration<double>(Clock::now() - t0).count());
  // Bytes a step reads: all but the embedding table and the routed experts, plus the experts the
  // batch can reach.
  auto store = epd::model::TensorStore::Open(dir, false);
  if (!store.ok()) return 1;
  double fixed = 0, per_expert = 0;
  for (const std::string& name : (*store)->Names()) {
    auto t = (*store)->Get(name);
    if (!t.ok()) return 1;
    if (name.find("embed") != std::string::npos) continue;
    if (name.find(".experts.") != std::string::npos) {
      if (name.find(".experts.0.") != std::string::npos)
        per_expert += static_cast<double>(t->bytes);
      continue;
    }
    fixed += static_cast<double>(t->bytes);
  }
  const epd::model::ModelConfig& c = (*m)->config();
  std::vector<int32_t> prompt(1024);
  for (size_t i = 0; i < prompt.size(); ++i) {
    prompt[i] = static_cast<int32_t>((i * 7919 + 13) % c.vocab_size);
  }
  auto seed = (*m)->NewSequence();
  auto seed_op = (*op_by_op)->NewSequence();
  for (auto [model, st] :
       {std::pair{m->get(), seed.get()}, std::pair{op_by_op->get(), seed_op.get()}}) {
    if (auto r = model->Prefill(*st, prompt, false); !r.ok()) {
      std::fprintf(stderr, "release layer prefill: %s\n",
                   std::string(r.status().message()).c_str());
      return 1;
    }
  }
  for (int batch : batches) {
    const double g = DecodeTokensPerSecond(**m, *seed, batch, steps, runs);
    const double e = DecodeTokensPerSecond(**op_by_op, *seed_op, batch, steps, runs);
    const double reached =
        std::min<double>(c.n_routed_experts, static_cast<double>(c.n_activated_experts) * batch);
    const double bytes = fixed + reached * per_expert;
    const double limit = batch / (bytes / kHbmBytesPerSecond);
    std::printf(
        "BENCH decode release-layer(%d experts) batch=%d ctx=%zu  %.1f tokens/s  ratio=%.5f (of "
        "%.3g tokens/s: %.0f MB read per step at 4.8 TB/s)  op by op %.1f tokens/s (graphs/op by "
        "op %.2f)\n",
        c.n_routed_experts, batch, prompt.size(), g, g / limit, limit, bytes / 1e6, e,
        e > 0 ? g / e : 0.0);
    std::fflush(stdout);
    if (batch == batches.front() || batch == batches.back()) {
      PrintOpProfile(cuda, "release-layer", **op_by_op, *seed_op, batch, steps);
    }
  }
  seed.reset();
  seed_op.reset();
  m->reset();
  op_by_op->reset();
  fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, golden = true, cpu_only = false;
  int release_experts = 384;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--skip-golden") == 0) golden = false;
    if (std::strcmp(argv[i], "--cpu") == 0) cpu_only = true;
    if (std::strcmp(argv[i], "--release-experts") == 0 && i + 1 < argc) {
      release_experts = std::atoi(argv[++i]);
    }
  }
  if (cpu_only) {  // the release layer on the CPU backend: checks the path where no GPU is
    auto cpu = epd::kernels::MakeCpuBackend();
    return ReleaseLayer(*cpu, release_experts, {1, 4}, 2, 1);
  }
  auto cuda = epd::kernels::MakeCudaBackend(0);
  if (!cuda.ok()) {
    std::printf("skipped: no GPU (%s)\n", std::string(cuda.status().message()).c_str());
    return 0;
  }
  auto cpu = epd::kernels::MakeCpuBackend();
  std::vector<int> batches = {1, 32};
  if (!quick) batches.push_back(128);
  const int steps = quick ? 4 : 8, runs = 3;
  for (const std::string& set : golden ? epd::testing::GoldenSets() : std::vector<std::string>{}) {
    auto gpu_model = epd::testing::LoadGoldenModel(**cuda, set, {}, /*weights_in_backend=*/true);
    auto gpu_op_model = epd::testing::LoadGoldenModel(
        **cuda, set, epd::model::ModelOptions{.step_graphs = false}, /*weights_in_backend=*/true);
    auto cpu_model = epd::testing::LoadGoldenModel(*cpu, set, {}, /*weights_in_backend=*/true);
    if (!gpu_model.ok() || !gpu_op_model.ok() || !cpu_model.ok()) {
      std::fprintf(stderr, "%s: cannot load\n", set.c_str());
      return 1;
    }
    const double weight_bytes =
        static_cast<double>(std::filesystem::file_size(epd::testing::SourcePath(
            std::string(epd::testing::kGoldenRoot) + set + "/model.safetensors")));
    const std::vector<int32_t> prompt = epd::testing::GoldenPrompt(set);
    auto gpu_seed = (*gpu_model)->NewSequence();
    auto gpu_op_seed = (*gpu_op_model)->NewSequence();
    auto cpu_seed = (*cpu_model)->NewSequence();
    if (!(*gpu_model)->Prefill(*gpu_seed, prompt, false).ok() ||
        !(*gpu_op_model)->Prefill(*gpu_op_seed, prompt, false).ok() ||
        !(*cpu_model)->Prefill(*cpu_seed, prompt, false).ok()) {
      std::fprintf(stderr, "%s: prefill failed\n", set.c_str());
      return 1;
    }
    for (int batch : batches) {
      const double g = DecodeTokensPerSecond(**gpu_model, *gpu_seed, batch, steps, runs);
      const double e = DecodeTokensPerSecond(**gpu_op_model, *gpu_op_seed, batch, steps, runs);
      const double c = DecodeTokensPerSecond(**cpu_model, *cpu_seed, batch, quick ? 2 : 4, 1);
      const double limit = batch / (weight_bytes / kHbmBytesPerSecond);
      std::printf(
          "BENCH decode %s batch=%d ctx=%zu  %.0f tokens/s  ratio=%.5f (of %.3g tokens/s: the "
          "weights read once per step at 4.8 TB/s)  op by op %.0f tokens/s (graphs/op by op "
          "%.2f)  cpu %.0f tokens/s (gpu/cpu %.2f)\n",
          set.c_str(), batch, prompt.size(), g, g / limit, limit, e, e > 0 ? g / e : 0.0, c,
          c > 0 ? g / c : 0.0);
      std::fflush(stdout);
      if (batch == 1) PrintOpProfile(**cuda, set, **gpu_op_model, *gpu_op_seed, batch, steps);
    }
  }
  if (release_experts > 0) return ReleaseLayer(**cuda, release_experts, batches, quick ? 2 : 4, 3);
  return 0;
}
