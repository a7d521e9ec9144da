// CED (Encoder-Prefill-Decode) model benchmarks on the nano model (CPU backend), issue 7.
// Every figure is printed with its ratio to a baseline measured in the same run (median of
// --repeats runs):
//  1. CED prefill (EncoderPass over the prompt + DecoderReplay on the tail) vs the monolithic
//     Model::Prefill, prompts 1K, 2K, 4K, ... up to --max-prompt.
//  2. Encoder bounded replay (EncoderReplay of the last window) vs an exact SWA rebuild
//     (EncoderPass of the whole prefix on a fresh state), prefixes 1K..min(4K, max).
//  3. DecodeStep time at contexts --synth-base (real, default 4K) .. --max-context (default
//     256K) relative to the base; larger contexts are synthesized by tiling the real state's
//     global KV entries and index keys (cost depends on the number of entries, not their values);
//     --real-context (default 8K) is also built for real to check the synthesized figure. Each row
//     also prints the keys scored, attention entries and FLOPs of the step (analytic count).
//  4. Logit error (rel_rms) and top-1 agreement: decoder bounded replay vs monolithic prefill,
//     encoder bounded replay vs exact rings, FP4 KV vs unquantized KV
//     (ModelOptions::unquantized_kv), each on the prefill's last logits + --steps teacher-forced
//     decode steps.
//  5. FLOPs per decode step vs context 4K..1M (analytic), nano and --flops-config (default the
//     release config in tests/data/configs), with the reference indexer and a hierarchical one.
// Usage: ced_bench [--sections 12345] [--min-prompt N] [--max-prompt N] [--max-context N]
//                  [--synth-base N] [--real-context N] [--repeats R] [--steps S] [--model DIR]
//                  [--flops-config PATH] [--scalar] [--cpu-time]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "model/stages.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_cpu_backend.h"

namespace {

using epd::model::Model;
using epd::model::SequenceState;
// Wall time, or with --cpu-time the calling thread's CPU time (steadier on a shared machine:
// time the thread waits for a core does not count).
bool g_cpu_time = false;
struct Clock {
  using time_point = double;  // ms
  static time_point now() {
    if (g_cpu_time) {
      timespec ts;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
    }
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

double Ms(Clock::time_point a, Clock::time_point b) { return b - a; }

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

// Work of one decode step at context T (positions 0..T-1 incl. the new token), counted in
// multiply-accumulates from the config: dense (projections, compressor, indexer queries, MoE with
// its routed + shared experts, mHC mixes, Engram, LM head), indexer scoring (keys x heads x dim)
// and sparse attention (QK and PV over window + top-k entries).
struct StepCost {
  double dense_macs = 0, indexer_macs = 0, attn_macs = 0;
  int64_t keys_scored = 0, attn_entries = 0;
  double Flops() const { return 2 * (dense_macs + indexer_macs + attn_macs); }
};

StepCost DecodeStepCost(const epd::model::ModelConfig& c, int64_t T, bool hierarchical) {
  const auto roles = c.Roles();
  StepCost k;
  const double D = static_cast<double>(c.dim), H = c.n_heads, hd = c.head_dim,
               ql = static_cast<double>(c.q_lora_rank), R = static_cast<double>(c.o_lora_rank),
               G = c.o_groups, hc = c.hc_mult, nI = c.index_n_heads, ihd = c.index_head_dim,
               I = static_cast<double>(c.moe_inter_dim);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& role = roles[l];
    k.dense_macs += D * ql + ql * H * hd + D * hd + H * hd * R + G * R * D;  // attention proj.
    k.dense_macs += 2 * (2 + hc) * hc * hc * D;                              // mHC mixes
    k.dense_macs +=
        D * c.n_routed_experts + (c.n_activated_experts + c.n_shared_experts) * 3 * D * I;  // MoE
    int64_t entries = c.window_size;
    if (role.compress_ratio > 0) {
      const int64_t n = T / role.compress_ratio;
      if (role.is_kv_source) {
        k.dense_macs += D * hd * (role.has_wgate ? 2 : 1) + hd * ihd / role.compress_ratio;
      }
      if (role.is_index_source) {
        k.dense_macs += ql * nI * ihd + D * nI;
        const int64_t scored =
            hierarchical && role.uses_candidates
                ? std::min<int64_t>(n, int64_t{c.candidate_topk_blocks} * c.candidate_block_size)
                : n;
        k.indexer_macs += static_cast<double>(scored) * nI * ihd;
        k.keys_scored += scored;
      }
      entries += std::min<int64_t>(c.index_topk, n);
    }
    k.attn_entries += entries;
    k.attn_macs += 2 * H * hd * static_cast<double>(entries);
    if (role.has_engram) {
      k.dense_macs += double{c.engram_max_ngram_size - 1.0} * c.engram_n_heads * c.engram_head_dim *
                      (hc + 1) * D;
    }
  }
  k.dense_macs += D * static_cast<double>(c.vocab_size);  // LM head
  return k;
}

// `base` with its global KV entries and index keys tiled to C / ratio entries and pos = C (the
// rings, compressor tails and Engram history stay: a decode step's cost depends on the number of
// entries, not on their values).
SequenceState SynthesizeContext(const epd::model::ModelConfig& c, const SequenceState& base,
                                int64_t C) {
  SequenceState st = base;
  for (auto& [l, src] : st.sources) {
    const int64_t n = C / src.ratio, nb = base.sources.at(l).n;
    const auto& bkv = base.sources.at(l).kv;
    const auto& bkeys = base.sources.at(l).keys;
    // Rows through the KV pool (packed, paged), as a real state holds them.
    src.kv.Truncate(std::min(n, nb));
    src.keys.Truncate(std::min(n, nb));
    std::vector<float> kv(c.head_dim), key(c.index_head_dim);
    for (int64_t i = nb; i < n; ++i) {
      bkv.Unpack(i % nb, 1, kv.data());
      bkeys.Unpack(i % nb, 1, key.data());
      if (!src.kv.Append(kv.data(), 1).ok() || !src.keys.Append(key.data(), 1).ok()) {
        std::fprintf(stderr, "synthesize: the KV pool is full\n");
        std::exit(1);
      }
    }
    src.n = n;
  }
  st.pos = C;
  if (st.main_hidden_pos >= 0) st.main_hidden_pos = C - 1;
  return st;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace epd::model;
  CLI::App app{"CED model benchmarks on the nano model"};
  int64_t max_prompt = 4096, max_context = 262144;
  int repeats = 3, steps = 8;
  std::string model_dir;
  app.add_option("--max-prompt", max_prompt, "largest prompt for sections 1, 2 (1K..32K)");
  app.add_option("--max-context", max_context,
                 "largest decode context for section 3 (default 256K)");
  app.add_option("--repeats", repeats, "timed repeats (median)")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "teacher-forced decode steps per accuracy comparison");
  app.add_option("--model", model_dir, "model dir (default: a generated nano model)");
  std::string sections = "12345";
  int64_t min_prompt = 1024;
  app.add_option("--sections", sections, "sections to run, e.g. 13 (default 12345)");
  app.add_option("--min-prompt", min_prompt, "smallest prompt for sections 1, 2, 4 (default 1024)");
  int64_t synth_base = 4096, real_context = 8192;
  std::string flops_config =
      epd::testing::SourcePath("tests/data/configs/deepseek-v4.1-flash/config.json");
  app.add_option("--synth-base", synth_base,
                 "section 3: real context length the larger ones are synthesized from");
  app.add_option("--real-context", real_context,
                 "section 3: also build this context for real and compare (0: skip)");
  app.add_option("--flops-config", flops_config, "section 5: a second config.json to count");
  app.add_flag("--cpu-time", g_cpu_time,
               "time with the thread's CPU clock instead of the wall clock (loaded machines)");
  bool scalar = false;
  app.add_flag("--scalar", scalar, "force the scalar CPU kernels (no SIMD; same results)");
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<epd::testing::TempDir> tmp;
  if (model_dir.empty()) {
    tmp = std::make_unique<epd::testing::TempDir>();
    model_dir = tmp->path() + "/nano";
    Must(GenerateNanoModel(model_dir), "generate nano");
  }
  auto backend = epd::testing::MakeTestCpuBackend({.simd = !scalar});
  auto model = Must(Model::Load(model_dir, *backend), "load");
  ModelOptions unq;
  unq.unquantized_kv = true;
  auto model_unq = Must(Model::Load(model_dir, *backend, unq), "load unquantized");
  const Model& m = *model;
  const ModelConfig& c = m.config();
  const int64_t W = c.window_size;
  const int64_t tail_rows = W + c.dspark_block_size;  // window + DSpark block, as the encoder pool
  const int64_t vocab = c.vocab_size;
  const auto all_ids =
      Prompt(std::max<int64_t>({max_prompt, synth_base, real_context, 4096}) + 64, vocab);
  std::printf(
      "ced_bench: %s backend (%s kernels), nano model (%d layers, split %d, window %lld), median "
      "of %d\n",
      std::string(backend->Name()).c_str(),
      !scalar && epd::kernels::cpu::SimdEnabled() ? "SIMD" : "scalar", c.n_layers,
      DecoderSplitLayer(c), static_cast<long long>(W), repeats);

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
    // A real context of --synth-base tokens (Prefill); larger contexts are synthesized from it by
    // tiling its global KV entries and index keys to C / ratio entries and moving pos to C (the
    // step's cost depends on the number of entries, not their values). --real-context builds
    // one larger context for real (Extend kPrefillChunk) to check the synthesized timing.
    std::printf(
        "\n3. DecodeStep (1 sequence, 1 token) vs context, relative to %lld; contexts above %lld"
        " synthesized\n   (global KV entries and index keys tiled from the real %lld-token"
        " state); FLOPs = 2 x MACs per step\n",
        static_cast<long long>(synth_base), static_cast<long long>(synth_base),
        static_cast<long long>(synth_base));
    std::printf("  %8s %6s %10s %8s %12s %12s %10s %10s\n", "context", "kind", "ms/step", "vs base",
                "keys scored", "attn entries", "GFLOP", "vs base");
    auto base = m.NewSequence();
    std::span<const int32_t> prefix(all_ids.data(), synth_base);
    Must(m.Prefill(*base, prefix, false), "prefill");
    auto time_steps = [&](SequenceState& st, int64_t C) {
      std::vector<double> t;
      for (int r = -1; r < std::max(repeats, 5); ++r) {  // r = -1: warm-up, not timed
        SequenceState* ptr = &st;
        std::vector<std::vector<int32_t>> tok = {{all_ids[(C + r + 1) % all_ids.size()]}};
        auto t0 = Clock::now();
        Must(DecodeStep(m, std::span<SequenceState* const>(&ptr, 1), tok), "decode step");
        if (r >= 0) t.push_back(Ms(t0, Clock::now()));
      }
      return Median(t);
    };
    double base_ms = 0, base_flops = 0;
    auto print_row = [&](int64_t C, const char* kind, double ms) {
      const StepCost cost = DecodeStepCost(c, C + 1, /*hierarchical=*/false);
      if (base_ms == 0) {
        base_ms = ms;
        base_flops = cost.Flops();
      }
      std::printf(
          "  %8lld %6s %10.2f %8.3f %12lld %12lld %10.4f %10.3f\n", static_cast<long long>(C), kind,
          ms, ms / base_ms, static_cast<long long>(cost.keys_scored),
          static_cast<long long>(cost.attn_entries), cost.Flops() / 1e9, cost.Flops() / base_flops);
      std::fflush(stdout);
    };
    for (int64_t C = synth_base; C <= max_context; C *= 2) {
      if (C == synth_base) {
        SequenceState st = *base;
        print_row(C, "real", time_steps(st, C));
        continue;
      }
      SequenceState st = SynthesizeContext(c, *base, C);
      print_row(C, "synth", time_steps(st, C));
    }
    if (real_context > synth_base) {
      // The same context built for real, to check the synthesized figure.
      SequenceState st = *base;
      std::span<const int32_t> more(all_ids.data() + synth_base, real_context - synth_base);
      Must(m.Extend(st, more, false, nullptr, Model::ExtendMode::kPrefillChunk), "extend");
      const double real_ms = time_steps(st, real_context);
      SequenceState syn = SynthesizeContext(c, *base, real_context);
      const double syn_ms = time_steps(syn, real_context);
      std::printf("  check at %lld: real context %.2f ms/step, synthesized %.2f ms/step (%.3f)\n",
                  static_cast<long long>(real_context), real_ms, syn_ms, syn_ms / real_ms);
    }
  }
  // ---- 5. FLOPs per decode step vs context (analytic) ----
  if (run('5')) {
    for (const std::string& path : {std::string(), flops_config}) {
      ModelConfig fc = c;
      if (!path.empty()) {
        fc = Must(LoadModelConfig(path), "flops config");
        Must(fc.Validate(), "flops config");
      }
      std::printf(
          "\n5. FLOPs per decode step vs context (analytic count, target model, no DSpark), %s\n"
          "   reference indexer: every index layer scores all compressed keys (model.py and this"
          " CPU backend);\n   hierarchical: layers after the candidate source score only the"
          " candidate blocks (%d x %d keys)\n",
          path.empty() ? "nano model" : path.c_str(), fc.candidate_topk_blocks,
          fc.candidate_block_size);
      std::printf("  %8s %12s %12s %12s %10s | %12s %10s\n", "context", "dense GF", "attn GF",
                  "indexer GF", "ref vs 4K", "hier idx GF", "hier vs 4K");
      const StepCost r0 = DecodeStepCost(fc, 4096, false), h0 = DecodeStepCost(fc, 4096, true);
      for (int64_t C = 4096; C <= (int64_t{1} << 20); C *= 4) {
        const StepCost r = DecodeStepCost(fc, C, false), h = DecodeStepCost(fc, C, true);
        std::printf("  %8lld %12.3f %12.4f %12.4f %10.3f | %12.4f %10.3f\n",
                    static_cast<long long>(C), 2 * r.dense_macs / 1e9, 2 * r.attn_macs / 1e9,
                    2 * r.indexer_macs / 1e9, r.Flops() / r0.Flops(), 2 * h.indexer_macs / 1e9,
                    h.Flops() / h0.Flops());
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
        for (int l = 0; l < split; ++l) s.swa[l].Clear();  // zeros
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
