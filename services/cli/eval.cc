#include "services/cli/eval.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/stages.h"
#include "tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace epd::services {
namespace {

// log-softmax of `row` at `target` (fp64 accumulation).
double LogProb(const float* row, int64_t n, int32_t target) {
  const float mx = *std::max_element(row, row + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
  return static_cast<double>(row[target]) - mx - std::log(sum);
}

}  // namespace

void AddEvalFlags(CLI::App& app, EvalOptions* o) {
  app.add_option("--model", o->model_dir, "Model directory (config.json, safetensors, tokenizer)")
      ->required();
  app.add_option("--data", o->data, "UTF-8 text file (held-out data)")->required();
  app.add_option("--context", o->context, "Prompt tokens per window (default 1024)");
  app.add_option("--score", o->score, "Scored tokens after each prompt (default 64)");
  app.add_option("--windows", o->windows, "At most this many windows (default 4)");
  app.add_option("--replay", o->replay, "Decoder replay: exact (whole prompt) or bounded")
      ->check(CLI::IsMember({"exact", "bounded"}));
  app.add_option("--kv", o->kv, "Compressed KV: fp4 (checkpoint format) or full (unquantized)")
      ->check(CLI::IsMember({"fp4", "full"}));
}

absl::StatusOr<EvalResult> RunEval(const EvalOptions& o) {
  if (o.context < 1 || o.score < 1 || o.windows < 1) {
    return absl::InvalidArgumentError("--context, --score and --windows must be >= 1");
  }
  auto tok = model::Tokenizer::FromFile(o.model_dir + "/tokenizer.json");
  if (!tok.ok()) return tok.status();
  std::ifstream in(o.data, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --data ", o.data));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::vector<int32_t> ids = (*tok)->EncodeOrdinary(ss.str());
  const int64_t span = o.context + o.score;
  const int64_t n_windows = std::min<int64_t>(o.windows, static_cast<int64_t>(ids.size()) / span);
  if (n_windows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data has ", ids.size(), " tokens, fewer than one window of ", span));
  }
  auto backend = kernels::MakeCpuBackend();
  model::ModelOptions mo;
  mo.unquantized_kv = o.kv == "full";
  auto loaded = model::Model::Load(o.model_dir, *backend, mo);
  if (!loaded.ok()) return loaded.status();
  const model::Model& m = **loaded;
  const int64_t vocab = m.config().vocab_size;
  // The decoder's bounded replay covers the window plus the DSpark draft block (docs/model.md).
  const int64_t bounded = m.config().window_size + m.config().dspark_block_size;
  EvalResult res;
  res.tail_rows = o.replay == "bounded" ? std::min(bounded, o.context) : o.context;
  double nll = 0;
  for (int64_t w = 0; w < n_windows; ++w) {
    const int32_t* base = ids.data() + w * span;
    std::span<const int32_t> prompt(base, static_cast<size_t>(o.context));
    auto state = m.NewSequence();
    auto enc = model::EncoderPass(m, *state, prompt, res.tail_rows);
    if (!enc.ok()) return enc.status();
    auto first = model::DecoderReplay(m, *state, *enc);
    if (!first.ok()) return first.status();
    std::vector<float> row(first->logits.end() - vocab, first->logits.end());
    for (int64_t s = 0; s < o.score; ++s) {
      const int32_t target = base[o.context + s];
      nll -= LogProb(row.data(), vocab, target);
      ++res.scored_tokens;
      if (s + 1 == o.score) break;
      model::SequenceState* states[] = {state.get()};
      std::vector<std::vector<int32_t>> tokens = {{target}};
      auto step = model::DecodeStep(m, states, tokens);
      if (!step.ok()) return step.status();
      row.assign((*step)[0].logits.end() - vocab, (*step)[0].logits.end());
    }
  }
  res.windows = n_windows;
  res.mean_nll = nll / static_cast<double>(res.scored_tokens);
  res.perplexity = std::exp(res.mean_nll);
  return res;
}

int RunEvalCommand(const EvalOptions& o) {
  auto r = RunEval(o);
  if (!r.ok()) {
    std::cerr << "epd eval: " << r.status().message() << "\n";
    return 1;
  }
  nlohmann::json j = {{"model", o.model_dir},
                      {"data", o.data},
                      {"context", o.context},
                      {"score", o.score},
                      {"replay", o.replay},
                      {"kv", o.kv},
                      {"tail_rows", r->tail_rows},
                      {"windows", r->windows},
                      {"scored_tokens", r->scored_tokens},
                      {"mean_nll", r->mean_nll},
                      {"perplexity", r->perplexity}};
  std::cout << j.dump() << "\n";
  return 0;
}

}  // namespace epd::services
