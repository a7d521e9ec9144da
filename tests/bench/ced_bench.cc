// CED (Encoder-Prefill-Decode) model benchmarks on the nano model (CPU backend), issue 7.
// Every figure is printed with its ratio to a baseline measured in the same run (median of
// --repeats runs):
//  1. CED prefill (EncoderPass over the prompt + DecoderReplay on the tail) vs the monolithic
//     Model::Prefill, prompts 1K, 2K, 4K, ... up to --max-prompt.
//  2. Encoder bounded replay (EncoderReplay of the last window) vs an exact SWA rebuild
//     (EncoderPass of the whole prefix on a fresh state), prefixes 1K..min(4K, max).
//  3. DecodeStep time at contexts 4K..--max-context relative to 4K (one prefill, then the context
//     grows by kPrefillChunk Extend; contexts beyond --max-context print "skipped").
//  4. Logit error (rel_rms) and top-1 agreement: decoder bounded replay vs monolithic prefill,
//     encoder bounded replay vs exact rings, FP4 KV vs unquantized KV
//     (ModelOptions::unquantized_kv), each on the prefill's last logits + --steps teacher-forced
//     decode steps.
// Usage: ced_bench [--max-prompt N] [--max-context N] [--repeats R] [--steps S] [--model DIR]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "model/model.h"
#include "model/nano_generator.h"
#include "model/stages.h"
#include "tests/testing/subprocess.h"

namespace {

using epd::model::Model;
using epd::model::SequenceState;
using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(v.status().message()).c_str());
    std::exit(1);
  }
  return std::move(*v);
}
void Must(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

std::vector<int32_t> Prompt(int64_t n, int vocab) {
  std::vector<int32_t> ids(n);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& id : ids) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    id = 3 + static_cast<int32_t>(x % static_cast<uint64_t>(vocab - 16));  // no specials
  }
  return ids;
}

int Argmax(const float* v, int64_t n) { return static_cast<int>(std::max_element(v, v + n) - v); }

// Accumulates rel_rms of logits and top-1 agreement over comparisons.
struct Err {
  double max_rel = 0, sum_rel = 0;
  int n = 0, agree = 0;
  void Add(const std::vector<float>& a, const std::vector<float>& ref, int64_t vocab) {
    const int64_t off_a = static_cast<int64_t>(a.size()) - vocab;
    const int64_t off_r = static_cast<int64_t>(ref.size()) - vocab;  // last row of each
    double num = 0, den = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const double d = a[off_a + i] - ref[off_r + i];
      num += d * d;
      den += static_cast<double>(ref[off_r + i]) * ref[off_r + i];
    }
    const double rel = std::sqrt(num / std::max(den, 1e-30));
    max_rel = std::max(max_rel, rel);
    sum_rel += rel;
    ++n;
    agree += Argmax(a.data() + off_a, vocab) == Argmax(ref.data() + off_r, vocab);
  }
  void Print(const char* name) const {
    std::printf("  %-44s rel_rms mean %.4f max %.4f, top-1 agree %d/%d\n", name, sum_rel / n,
                max_rel, agree, n);
  }
};

// Teacher-forced decode of `next` on both states, comparing each step's logits.
void CompareDecodes(const Model& a_model, SequenceState& a, const Model& r_model, SequenceState& r,
                    const std::vector<int32_t>& next, Err& err) {
  const int64_t vocab = a_model.config().vocab_size;
  for (int32_t t : next) {
    auto la = Must(a_model.Decode(a, t), "decode");
    auto lr = Must(r_model.Decode(r, t), "decode");
    err.Add(la.logits, lr.logits, vocab);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace epd::model;
  CLI::App app{"CED model benchmarks on the nano model"};
  int64_t max_prompt = 4096, max_context = 8192;
  int repeats = 3, steps = 8;
  std::string model_dir;
  app.add_option("--max-prompt", max_prompt, "largest prompt for sections 1, 2 (1K..32K)");
  app.add_option("--max-context", max_context, "largest decode context for section 3");
  app.add_option("--repeats", repeats, "timed repeats (median)")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "teacher-forced decode steps per accuracy comparison");
  app.add_option("--model", model_dir, "model dir (default: a generated nano model)");
  std::string sections = "1234";
  int64_t min_prompt = 1024;
  app.add_option("--sections", sections, "sections to run, e.g. 13 (default 1234)");
  app.add_option("--min-prompt", min_prompt, "smallest prompt for sections 1, 2, 4 (default 1024)");
  bool scalar = false;
  app.add_flag("--scalar", scalar, "force the scalar CPU kernels (no SIMD; same results)");
  CLI11_PARSE(app, argc, argv);
  if (scalar) epd::kernels::cpu::SetSimdEnabled(false);

  std::unique_ptr<epd::testing::TempDir> tmp;
  if (model_dir.empty()) {
    tmp = std::make_unique<epd::testing::TempDir>();
    model_dir = tmp->path() + "/nano";
    Must(GenerateNanoModel(model_dir), "generate nano");
  }
  auto backend = epd::kernels::MakeCpuBackend();
  auto model = Must(Model::Load(model_dir, *backend), "load");
  ModelOptions unq;
  unq.unquantized_kv = true;
  auto model_unq = Must(Model::Load(model_dir, *backend, unq), "load unquantized");
  const Model& m = *model;
  const ModelConfig& c = m.config();
  const int64_t W = c.window_size;
  const int64_t tail_rows = W + c.dspark_block_size;  // window + DSpark block, as the encoder pool
  const int64_t vocab = c.vocab_size;
  const auto all_ids = Prompt(std::max<int64_t>({max_prompt, max_context, 4096}) + 64, vocab);
  std::printf(
      "ced_bench: %s backend (%s kernels), nano model (%d layers, split %d, window %lld), median "
      "of %d\n",
      std::string(backend->Name()).c_str(), epd::kernels::cpu::SimdEnabled() ? "SIMD" : "scalar",
      c.n_layers, DecoderSplitLayer(c), static_cast<long long>(W), repeats);

  std::vector<int64_t> sizes;
  for (int64_t p = min_prompt; p <= max_prompt; p *= 2) sizes.push_back(p);

  const int hist_n = c.engram_max_ngram_size - 1;
  auto run = [&](char section) { return sections.find(section) != std::string::npos; };
  // ---- 1. CED prefill vs monolithic prefill ----
  if (run('1')) {
    std::printf(
        "\n1. CED prefill (EncoderPass + DecoderReplay of %lld tail rows) vs Model::Prefill\n",
        static_cast<long long>(tail_rows));
    std::printf("  %8s %12s %12s %8s\n", "prompt", "mono ms", "ced ms", "ratio");
    for (int64_t P : sizes) {
      std::span<const int32_t> ids(all_ids.data(), P);
      std::vector<double> mono, ced;
      for (int r = 0; r < repeats; ++r) {
        auto s1 = m.NewSequence();
        auto t0 = Clock::now();
        Must(m.Prefill(*s1, ids, false), "prefill");
        auto t1 = Clock::now();
        mono.push_back(Ms(t0, t1));
        auto s2 = m.NewSequence();
        t0 = Clock::now();
        auto enc = Must(EncoderPass(m, *s2, ids, tail_rows), "encoder");
        Must(DecoderReplay(m, *s2, enc), "decoder");
        t1 = Clock::now();
        ced.push_back(Ms(t0, t1));
      }
      std::printf("  %8lld %12.1f %12.1f %8.3f\n", static_cast<long long>(P), Median(mono),
                  Median(ced), Median(ced) / Median(mono));
      std::fflush(stdout);
    }
  }
  // ---- 2. Encoder bounded replay vs exact SWA rebuild ----
  if (run('2')) {
    std::printf(
        "\n2. EncoderReplay of the last %lld tokens vs exact SWA rebuild (EncoderPass of the"
        " whole prefix)\n",
        static_cast<long long>(W));
    std::printf("  %8s %12s %12s %8s\n", "prefix", "exact ms", "replay ms", "ratio");
    for (int64_t P : sizes) {
      if (P > 4096) break;
      std::span<const int32_t> ids(all_ids.data(), P);
      auto base = m.NewSequence();
      Must(EncoderPass(m, *base, ids, 1), "encoder");
      std::span<const int32_t> last(all_ids.data() + P - W, W);
      std::span<const int32_t> hist(all_ids.data() + P - W - hist_n, hist_n);
      std::vector<double> exact, replay;
      for (int r = 0; r < repeats; ++r) {
        auto s1 = m.NewSequence();
        auto t0 = Clock::now();
        Must(EncoderPass(m, *s1, ids, 1), "exact rebuild");
        auto t1 = Clock::now();
        exact.push_back(Ms(t0, t1));
        SequenceState s2 = *base;
        t0 = Clock::now();
        Must(EncoderReplay(m, s2, last, hist), "replay");
        t1 = Clock::now();
        replay.push_back(Ms(t0, t1));
      }
      std::printf("  %8lld %12.1f %12.1f %8.3f\n", static_cast<long long>(P), Median(exact),
                  Median(replay), Median(replay) / Median(exact));
      std::fflush(stdout);
    }
  }
  // ---- 3. Decode step time vs context ----
  if (run('3')) {
    std::printf("\n3. DecodeStep (1 sequence, 1 token) vs context, relative to 4K\n");
    std::printf("  %8s %12s %8s\n", "context", "ms/step", "vs 4K");
    {
      auto st = m.NewSequence();
      double base_ms = 0;
      int64_t ctx = 0;
      for (int64_t C = 4096; C <= 32768; C *= 2) {
        if (C > max_context) {
          std::printf("  %8lld %12s\n", static_cast<long long>(C), "skipped");
          continue;
        }
        std::span<const int32_t> chunk(all_ids.data() + ctx, C - ctx);
        if (ctx == 0) {
          Must(m.Prefill(*st, chunk, false), "prefill");
        } else {
          Must(m.Extend(*st, chunk, false, nullptr, Model::ExtendMode::kPrefillChunk), "extend");
        }
        ctx = C;
        std::vector<double> t;
        for (int r = 0; r < std::max(repeats, 5); ++r) {
          SequenceState s = *st;
          SequenceState* ptr = &s;
          std::vector<std::vector<int32_t>> tok = {{all_ids[C]}};
          auto t0 = Clock::now();
          Must(DecodeStep(m, std::span<SequenceState* const>(&ptr, 1), tok), "decode step");
          t.push_back(Ms(t0, Clock::now()));
        }
        const double ms = Median(t);
        if (C == 4096) base_ms = ms;
        std::printf("  %8lld %12.2f %8.3f\n", static_cast<long long>(C), ms, ms / base_ms);
        std::fflush(stdout);
      }
    }
  }
  // ---- 4. Accuracy ----
  if (run('4')) {
    std::printf(
        "\n4. Logit error (rel_rms of fp32 logits) and top-1 agreement; each row: the\n"
        "   prefill's last logits + %d teacher-forced decode steps\n",
        steps);
    for (int64_t P : sizes) {
      std::span<const int32_t> ids(all_ids.data(), P);
      std::vector<int32_t> next(all_ids.begin() + P, all_ids.begin() + P + steps);
      std::printf(" prompt %lld:\n", static_cast<long long>(P));
      auto mono = m.NewSequence();
      auto mono_out = Must(m.Prefill(*mono, ids, false), "prefill");
      {  // decoder bounded replay vs monolithic
        auto s = m.NewSequence();
        auto enc = Must(EncoderPass(m, *s, ids, tail_rows), "encoder");
        auto out = Must(DecoderReplay(m, *s, enc), "decoder");
        Err e;
        e.Add(out.logits, mono_out.logits, vocab);
        SequenceState ref = *mono;
        CompareDecodes(m, *s, m, ref, next, e);
        e.Print("decoder bounded replay vs monolithic");
      }
      {  // encoder bounded replay vs exact rings: wipe rings of [0, split), replay the last window
        SequenceState s = *mono;
        const int split = DecoderSplitLayer(c);
        for (int l = 0; l < split; ++l) std::fill(s.swa[l].begin(), s.swa[l].end(), 0.0f);
        std::span<const int32_t> last(all_ids.data() + P - W, W);
        std::span<const int32_t> hist(all_ids.data() + P - W - hist_n, hist_n);
        Must(EncoderReplay(m, s, last, hist), "replay");
        Err e;
        SequenceState ref = *mono;
        CompareDecodes(m, s, m, ref, next, e);
        e.Print("encoder bounded replay vs exact rings");
      }
      {  // FP4 KV vs unquantized KV
        auto s = model_unq->NewSequence();
        auto out = Must(model_unq->Prefill(*s, ids, false), "prefill unquantized");
        Err e;
        e.Add(mono_out.logits, out.logits, vocab);
        SequenceState ref = *mono;
        CompareDecodes(m, ref, *model_unq, *s, next, e);
        e.Print("FP4 KV vs unquantized KV");
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
