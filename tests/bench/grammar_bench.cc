// Constrained decoding overhead (docs/api.md, "Structured output"): on the nano model (or
// --model DIR), the decode stage generates --tokens tokens per sequence for --seqs sequences,
// unconstrained and under a nested JSON schema, with DSpark off and on; prints per generated token
// the decode step's CPU time, the grammar-mask CPU time (DecodeSequence::mask_ns) and their ratio.
//
//   build/grammar_bench [--model DIR] [--tokens 96] [--seqs 4] [--temperature 1]
#include <time.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "decode_pool/decode_stage.h"
#include "grammar/grammar.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "tokenizer/tokenizer.h"
#include "tests/testing/subprocess.h"

namespace {

// Thread CPU time (the machine is shared; the benchmark is single-threaded).
double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

constexpr char kSchema[] = R"({"type":"json_schema","schema":{"type":"object","properties":{
  "name":{"type":"string"},"age":{"type":"integer"},
  "tags":{"type":"array","items":{"type":"string"},"maxItems":3},
  "address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string"}},
             "required":["city","zip"],"additionalProperties":false},
  "kind":{"enum":["a","b","c"]},"score":{"anyOf":[{"type":"number"},{"type":"null"}]},
  "ok":{"type":"boolean"}},
  "required":["name","age","tags","address","kind","score","ok"],"additionalProperties":false}})";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"constrained decoding overhead"};
  std::string model_dir;
  int tokens = 96, seqs = 4;
  float temperature = 1.f;
  app.add_option("--model", model_dir, "model directory (default: generate the nano model)");
  app.add_option("--tokens", tokens, "max tokens per sequence");
  app.add_option("--seqs", seqs, "sequences per configuration (run one after another)");
  app.add_option("--temperature", temperature, "sampling temperature");
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
  auto tok = epd::model::Tokenizer::FromFile(model_dir + "/tokenizer.json");
  if (!loaded.ok() || !tok.ok()) {
    std::fprintf(stderr, "load failed\n");
    return 1;
  }
  const epd::model::Model& model = **loaded;
  const int64_t V = model.config().vocab_size;
  std::vector<std::string> bytes(static_cast<size_t>(V));
  std::vector<int32_t> excluded;
  for (int32_t id = 0; id < V; ++id) {
    if (id < (*tok)->vocab_size() && (*tok)->IsAddedToken(id)) excluded.push_back(id);
    const int32_t one[1] = {id};
    if (auto b = (*tok)->Decode(one, false); b.ok()) bytes[static_cast<size_t>(id)] = *b;
  }
  auto masker = std::make_shared<epd::grammar::TokenMasker>(
      bytes, excluded, static_cast<int32_t>(model.config().eos_token_id));
  const double c0 = CpuSeconds();
  auto grammar = epd::grammar::Compile(kSchema);
  const double compile_s = CpuSeconds() - c0;
  if (!grammar.ok()) {
    std::fprintf(stderr, "compile: %s\n", grammar.status().ToString().c_str());
    return 1;
  }
  std::printf("vocab %lld, schema compiled in %.3f ms (%zu nodes)\n", static_cast<long long>(V),
              compile_s * 1e3, (*grammar)->size());
  std::printf("%-8s %-12s %8s %12s %12s %8s\n", "dspark", "constraint", "tokens", "step ms/tok",
              "mask ms/tok", "mask %");
  for (bool dspark : {false, true}) {
    epd::decode_pool::DecodeStageOptions o;
    o.dspark = dspark;
    o.masker = masker;
    epd::decode_pool::DecodeStage stage(model, o);
    for (bool constrained : {false, true}) {
      int64_t generated = 0, mask_ns = 0, masks = 0;
      double total = 0;
      for (int s = 0; s < seqs; ++s) {
        std::vector<int32_t> prompt;
        for (int i = 0; i < 40; ++i) prompt.push_back(3 + (i * 37 + s * 101) % 1500);
        epd::model::SamplingParams params;
        params.max_tokens = tokens;
        params.temperature = temperature;
        params.seed = static_cast<uint64_t>(s + 1);
        auto seq = stage.StartFromPrompt(prompt, params, constrained ? *grammar : nullptr);
        if (!seq.ok()) {
          std::fprintf(stderr, "start: %s\n", seq.status().ToString().c_str());
          return 1;
        }
        epd::decode_pool::DecodeSequence* batch[1] = {seq->get()};
        const double t0 = CpuSeconds();
        while (!(*seq)->done) {
          if (auto st = stage.Step(batch); !st.ok()) {
            std::fprintf(stderr, "step: %s\n", st.ToString().c_str());
            return 1;
          }
        }
        total += CpuSeconds() - t0;
        generated += static_cast<int64_t>((*seq)->output.size());
        mask_ns += (*seq)->mask_ns;
        masks += (*seq)->masks;
      }
      const double per_tok = total / static_cast<double>(std::max<int64_t>(1, generated));
      const double mask_per_tok = 1e-9 * static_cast<double>(mask_ns) /
                                  static_cast<double>(std::max<int64_t>(1, generated));
      std::printf("%-8s %-12s %8lld %12.3f %12.3f %7.1f%%  (%lld masks)\n", dspark ? "on" : "off",
                  constrained ? "json_schema" : "none", static_cast<long long>(generated),
                  per_tok * 1e3, mask_per_tok * 1e3,
                  per_tok > 0 ? 100.0 * mask_per_tok / per_tok : 0.0,
                  static_cast<long long>(masks));
    }
  }
  return 0;
}
