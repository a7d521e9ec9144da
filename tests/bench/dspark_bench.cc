// DSpark verification benchmark on the nano model (or --model DIR): per fixed k, drafted and
// accepted tokens per step, step time, tokens/s and the ratio to plain decoding (k = 0) measured
// in the same run; the step-time model fitted from those rows; the k the policy picks; the
// confidence head's calibration; rollback cost (journal vs full state copy).
//
//   build-dspark/dspark_bench [--model DIR] [--prompt 100] [--tokens 96] [--prompts 3]
//                             [--temperature 0] [--scorer sequential|extend] [--chat]
//
// --chat: the prompts are chat questions rendered as the server renders them (up to 16, the
// model's tokenizer; generation ends at EOS) instead of --prompt synthetic ids: the figures of a
// trained model on the text it answers (docs/dspark.md, trained heads).
#include <time.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "decode_pool/dspark/k_policy.h"
#include "decode_pool/dspark/verifier.h"
#include "kernels/backend.h"
#include "tokenizer/chat_format.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "model/sampling.h"
#include "tokenizer/tokenizer.h"
#include "tests/testing/dspark_reference.h"
#include "tests/testing/dspark_target_scorer.h"
#include "tests/testing/subprocess.h"

namespace {

// Thread CPU time: the benchmark is single-threaded and the machine may be shared, so CPU time is
// the stable measure of work (wall time would include other processes' load).
struct Clock {
  using time_point = std::chrono::duration<double>;
  static time_point now() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return time_point(static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec));
  }
};
using epd::testing::GenerateOptions;
using epd::decode_pool::KPolicy;
using epd::testing::StepStats;
using epd::decode_pool::StepTimeModel;
using epd::decode_pool::StepTimeSample;

struct Row {
  int k = 0;
  int steps = 0, drafted = 0, accepted = 0, tokens = 0;
  double seconds = 0;
  std::map<int, int> k_hist;
  std::vector<StepStats> all;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DSpark verification benchmark"};
  std::string model_dir;
  int prompt_len = 100, tokens = 96, prompts = 3;
  float temperature = 0.f;
  std::string scorer_name = "sequential";
  bool chat = false;
  app.add_flag("--chat", chat, "chat questions through the model's tokenizer as the prompts");
  app.add_option("--model", model_dir, "model directory (default: generate the nano model)");
  app.add_option("--prompt", prompt_len, "prompt tokens");
  app.add_option("--tokens", tokens, "generated tokens per prompt");
  app.add_option("--prompts", prompts, "prompts per k");
  app.add_option("--temperature", temperature, "0 = greedy");
  app.add_option("--scorer", scorer_name,
                 "sequential (k+1 Decode calls) | extend (one Extend call)")
      ->check(CLI::IsMember({"sequential", "extend"}));
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<epd::testing::TempDir> tmp;
  if (model_dir.empty()) {
    tmp = std::make_unique<epd::testing::TempDir>();
    model_dir = tmp->path();
    if (auto s = epd::model::GenerateNanoModel(model_dir); !s.ok()) {
      std::fprintf(stderr, "gen-model: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto backend = epd::kernels::MakeCpuBackend();
  auto loaded = epd::model::Model::Load(model_dir, *backend);
  if (!loaded.ok()) {
    std::fprintf(stderr, "load: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  const epd::model::Model& model = **loaded;
  const int V = static_cast<int>(model.config().vocab_size);
  std::vector<std::vector<int32_t>> chat_prompts;
  if (chat) {
    auto tok = epd::model::Tokenizer::FromFile(model_dir + "/tokenizer.json");
    if (!tok.ok()) {
      std::fprintf(stderr, "tokenizer: %s\n", tok.status().ToString().c_str());
      return 1;
    }
    const char* questions[] = {"Tell me about files.",
                               "What is a list?",
                               "Explain regular expressions.",
                               "How do I install a package?",
                               "What is a dictionary?",
                               "Tell me about the network configuration.",
                               "How does the import system work?",
                               "Explain exceptions.",
                               "What is a socket?",
                               "Tell me about threads.",
                               "How do I read a file?",
                               "What is the shell?",
                               "Explain the logging module.",
                               "What is a tuple?",
                               "Tell me about the package manager.",
                               "How does string formatting work?"};
    prompts = std::min(prompts, 16);
    for (int i = 0; i < prompts; ++i) {
      auto text =
          epd::model::RenderChat({{"user", questions[i]}}, {}, epd::model::ChatRenderOptions{});
      if (!text.ok()) return 1;
      chat_prompts.push_back((*tok)->Encode(*text));
    }
  }
  auto prompt_of = [&](int salt) {
    if (chat) return chat_prompts[static_cast<size_t>(salt)];
    std::vector<int32_t> p(prompt_len);
    for (int i = 0; i < prompt_len; ++i) p[i] = 3 + (i * 37 + salt * 101) % std::min(V - 3, 1500);
    return p;
  };
  epd::model::SamplingParams params;
  params.max_tokens = tokens;
  params.temperature = temperature;
  if (chat) params.stop_token_ids = {static_cast<int32_t>(model.config().eos_token_id)};
  epd::testing::SequentialTargetScorer sequential(model);
  epd::testing::ExtendTargetScorer extend(model);
  epd::testing::TargetScorer& scorer =
      scorer_name == "extend" ? static_cast<epd::testing::TargetScorer&>(extend) : sequential;

  auto run = [&](int k, const KPolicy* policy) {
    Row r;
    r.k = k;
    for (int pi = 0; pi < prompts; ++pi) {
      params.seed = 1000 + pi;
      GenerateOptions opt{.dspark = k != 0, .fixed_k = k, .policy = policy};
      // Time only the decode loop: subtract a prefill measured separately.
      const auto p = prompt_of(pi);
      const auto t0 = Clock::now();
      auto st = model.NewSequence();
      (void)model.Prefill(*st, p, false);
      const auto t1 = Clock::now();
      auto g = epd::testing::Generate(model, scorer, p, params, opt);
      const auto t2 = Clock::now();
      if (!g.ok()) {
        std::fprintf(stderr, "generate: %s\n", g.status().ToString().c_str());
        std::exit(1);
      }
      r.seconds += (t2 - t1).count() - (t1 - t0).count();
      r.tokens += static_cast<int>(g->tokens.size()) - 1;  // the first comes from prefill
      for (const StepStats& s : g->steps) {
        ++r.steps;
        r.drafted += s.k;
        r.accepted += s.accepted;
        ++r.k_hist[s.k];
        r.all.push_back(s);
      }
    }
    return r;
  };

  std::printf(
      "DSpark verification, %s, prompt %d, %d tokens x %d prompts, T=%.2f, "
      "%s target scorer, thread CPU time\n\n",
      tmp ? "nano model" : model_dir.c_str(), chat ? -1 : prompt_len, tokens, prompts, temperature,
      scorer_name.c_str());
  if (chat) {
    std::printf("(chat prompts: the first %d questions; generation ends at EOS)\n\n", prompts);
  }
  std::printf("%4s %8s %10s %10s %12s %10s %10s\n", "k", "steps", "draft/st", "accept/st",
              "step ms", "tok/s", "vs k=0");
  // (step ms and tok/s in thread CPU time)
  std::vector<Row> rows;
  std::vector<StepTimeSample> samples;
  double base_rate = 0;
  for (int k = 0; k <= model.config().dspark_block_size; ++k) {
    Row r = run(k, nullptr);
    const double step_ms = 1e3 * r.seconds / r.steps;
    const double rate = r.tokens / r.seconds;
    if (k == 0) base_rate = rate;
    std::printf("%4d %8d %10.2f %10.3f %12.3f %10.1f %10.3f\n", k, r.steps,
                double(r.drafted) / r.steps, double(r.accepted) / r.steps, step_ms, rate,
                rate / base_rate);
    samples.push_back({1, k, r.seconds / r.steps});
    rows.push_back(std::move(r));
  }
  auto fit = StepTimeModel::Fit(samples);
  if (!fit.ok()) {
    std::fprintf(stderr, "fit: %s\n", fit.status().ToString().c_str());
    return 1;
  }
  std::printf("\nfitted t(b,k) = %.3f ms + %.3f ms * b*(k+1) + %.3f ms * b*[k>0]\n",
              1e3 * fit->base_s, 1e3 * fit->per_token_s, 1e3 * fit->draft_s);

  // Confidence calibration from the k = 5 run: predicted sigmoid(c_i) vs acceptance given reach.
  const Row& r5 = rows.back();
  std::printf(
      "\nconfidence calibration (k=%d run): position, mean sigmoid(c), P(accept | reached)\n",
      r5.k);
  for (int i = 0; i < r5.k; ++i) {
    double pred = 0;
    int reached = 0, acc = 0;
    for (const StepStats& s : r5.all) {
      if (s.accepted < i) continue;
      ++reached;
      pred += epd::decode_pool::AcceptanceEstimate(s.confidence[i]);
      if (s.accepted > i) ++acc;
    }
    if (reached > 0) {
      std::printf("  %d  %.3f  %.3f  (n=%d)\n", i + 1, pred / reached, double(acc) / reached,
                  reached);
    }
  }

  // The policy with the measured time model, and with an illustrative memory-bound model where a
  // verify position costs 2% of the fixed step cost (a batched GPU step).
  KPolicy measured(*fit);
  KPolicy gpu_like(StepTimeModel{.base_s = 1.0, .per_token_s = 0.02, .draft_s = 0.05});
  for (auto [name, pol] :
       {std::pair{"measured", &measured}, std::pair{"memory-bound", &gpu_like}}) {
    Row r = run(-1, pol);
    std::printf(
        "\npolicy (%s time model): steps %d, accepted/step %.3f, tok/s %.1f (%.3f x k=0), "
        "k chosen:",
        name, r.steps, double(r.accepted) / r.steps, r.tokens / r.seconds,
        r.tokens / r.seconds / base_rate);
    for (auto [k, n] : r.k_hist) std::printf(" k=%d:%d", k, n);
    std::printf("\n");
  }
  for (int b : {1, 8, 64, 256}) {
    std::printf("memory-bound model, batch %3d, confidences all +1.0: k = %d\n", b,
                gpu_like.Choose(std::vector<float>(5, 1.f), b));
  }

  // Rollback cost: journal of a 6-position step vs a full state copy.
  {
    auto st = model.NewSequence();
    (void)model.Prefill(*st, prompt_of(7), false);
    const std::vector<int32_t> ids = {5, 6, 7, 8, 9, 10};
    const int reps = 20;
    double t_copy = 0, t_commit = 0;
    int64_t journal_bytes = 0;
    for (int i = 0; i < reps; ++i) {
      auto c0 = Clock::now();
      epd::model::SequenceState copy = *st;
      auto c1 = Clock::now();
      t_copy += (c1 - c0).count();
      (void)sequential.Score(*st, ids);
      journal_bytes = sequential.journal().bytes();
      auto c2 = Clock::now();
      (void)sequential.Commit(*st, 1);
      auto c3 = Clock::now();
      t_commit += (c3 - c2).count();
      *st = std::move(copy);
    }
    std::printf(
        "\nrollback: journal %lld B per 6-position step, commit(keep=1) %.1f us; "
        "full state copy %lld B, %.1f us\n",
        static_cast<long long>(journal_bytes), 1e6 * t_commit / reps,
        static_cast<long long>(epd::testing::StateBytes(*st)), 1e6 * t_copy / reps);
  }
  return 0;
}
