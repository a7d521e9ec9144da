// The `epd` command: one entry point for operators and developers.
#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

#include "model/config.h"
#include "model/nano/nano_generator.h"
#include "services/cli/bench.h"
#include "services/cli/chaos.h"
#include "services/cli/eval.h"
#include "services/cli/generate.h"
#include "services/cli/serve.h"
#include "services/cli/tokenize.h"
#include "runtime/version.h"

int main(int argc, char** argv) {
  CLI::App app{"epd: Encoder-Prefill-Decode serving for DeepSeek-V4.1-Flash-architecture models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", epd::runtime::kVersion);

  auto* version = app.add_subcommand("version", "Print the version and build facts");

  epd::services::ServeOptions serve_options;
  auto* serve = app.add_subcommand(
      "serve", "Start kvstore, router and one worker per pool on 127.0.0.1 with the demo model");
  epd::services::AddServeFlags(*serve, &serve_options);

  std::string gen_preset = "nano", gen_out;
  uint64_t gen_seed = epd::model::kNanoDefaultSeed;
  auto* gen = app.add_subcommand(
      "gen-model", "Write a deterministic random checkpoint in the official format + tokenizer");
  gen->add_option("--preset", gen_preset, "Model preset")->check(CLI::IsMember({"nano"}));
  gen->add_option("--out", gen_out, "Output directory")->required();
  gen->add_option("--seed", gen_seed, "Random seed (same seed, same bytes)");
  std::string gen_corpus;
  gen->add_option("--tokenizer-corpus", gen_corpus,
                  "Train the tokenizer on this UTF-8 file instead of the built-in corpus "
                  "(tools/train/)");

  epd::services::TokenizeOptions tokenize_options;
  auto* tokenize =
      app.add_subcommand("tokenize", "Encode a text file with a model's tokenizer (int32 ids)");
  epd::services::AddTokenizeFlags(*tokenize, &tokenize_options);

  std::string layout_config;
  auto* layout = app.add_subcommand("kv-layout", "Print the per-token KV byte accounting");
  layout->add_option("--config", layout_config, "Path to config.json")->required();

  auto* generate = app.add_subcommand("generate", "Offline generation through the staged path");
  epd::services::GenerateOptions generate_options;
  epd::services::AddGenerateFlags(*generate, &generate_options);

  epd::services::EvalOptions eval_options;
  auto* eval = app.add_subcommand(
      "eval", "Held-out perplexity through the serving path (exact/bounded replay, FP4/full KV)");
  epd::services::AddEvalFlags(*eval, &eval_options);

  epd::services::BenchOptions bench_options;
  auto* bench = app.add_subcommand("bench", "Drive a multi-turn agent workload at an endpoint");
  epd::services::AddBenchFlags(*bench, &bench_options);

  epd::services::ChaosOptions chaos_options;
  auto* chaos = app.add_subcommand(
      "chaos", "Seeded fault campaign against an `epd serve` cluster under agent load");
  epd::services::AddChaosFlags(*chaos, &chaos_options);

  CLI11_PARSE(app, argc, argv);

  if (*version) {
    std::cout << "epd " << epd::runtime::kVersion << "\n";
#ifdef __VERSION__
    std::cout << "compiler: " << __VERSION__ << "\n";
#endif
    return 0;
  }
  if (*serve) {
    if (auto s = epd::services::ApplyServeConfigFile(*serve, &serve_options); !s.ok()) {
      std::cerr << "epd serve: " << s.message() << "\n";
      return 2;
    }
    return epd::services::RunServe(serve_options);
  }
  if (*chaos) return epd::services::RunChaos(chaos_options);
  if (*gen) {
    std::string corpus;
    if (!gen_corpus.empty()) {
      std::ifstream in(gen_corpus, std::ios::binary);
      if (!in) {
        std::cerr << "epd gen-model: cannot read " << gen_corpus << "\n";
        return 1;
      }
      std::stringstream ss;
      ss << in.rdbuf();
      corpus = ss.str();
    }
    auto s = epd::model::GenerateNanoModelFor(
        gen_out, gen_seed,
        gen_corpus.empty() ? std::nullopt : std::optional<std::string_view>(corpus));
    if (!s.ok()) {
      std::cerr << "epd gen-model: " << s.message() << "\n";
      return 1;
    }
    std::cout << "epd gen-model: wrote the " << gen_preset << " model to " << gen_out << "\n";
    return 0;
  }
  if (*layout) {
    auto config = epd::model::LoadModelConfig(layout_config);
    if (!config.ok()) {
      std::cerr << "epd kv-layout: " << config.status().message() << "\n";
      return 1;
    }
    std::cout << epd::model::FormatKvLayout(*config);
    return 0;
  }
  if (*generate) return epd::services::RunGenerateCommand(generate_options);
  if (*eval) return epd::services::RunEvalCommand(eval_options);
  if (*tokenize) return epd::services::RunTokenizeCommand(tokenize_options);
  if (*bench) return epd::services::RunBenchCommand(bench_options);
  return 0;
}
