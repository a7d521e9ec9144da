#include "services/cli/generate.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/device/device.h"
#include "model/config.h"
#include "model/engram.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/stages.h"
#include "tokenizer/tokenizer.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"

namespace epd::services {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The model of `dir`: engram constants from engram_constants.json (generated models) or the golden
// manifest.json.
absl::StatusOr<std::unique_ptr<model::Model>> LoadModel(const std::string& dir,
                                                        kernels::Backend& backend,
                                                        bool weights_in_backend) {
  if (!fs::is_directory(dir)) {
    return absl::NotFoundError(absl::StrCat("model directory ", dir, " does not exist"));
  }
  auto cfg = model::LoadModelConfig((fs::path(dir) / "config.json").string());
  if (!cfg.ok()) return cfg.status();
  auto store = model::TensorStore::Open(dir, /*log_progress=*/false);
  if (!store.ok()) return store.status();
  auto w =
      model::ModelWeights::Load(*cfg, std::shared_ptr<const model::TensorStore>(std::move(*store)),
                                weights_in_backend ? &backend : nullptr);
  if (!w.ok()) return w.status();
  model::EngramConstants k;
  if (!cfg->engram_layer_ids.empty()) {
    std::string path = (fs::path(dir) / "engram_constants.json").string();
    if (!fs::exists(path)) path = (fs::path(dir) / "manifest.json").string();
    auto text = ReadFile(path);
    if (!text.ok()) {
      return absl::NotFoundError(
          absl::StrCat("model directory ", dir, " has no engram_constants.json or manifest.json"));
    }
    auto parsed = model::ParseEngramConstantsJson(*text);
    if (!parsed.ok())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", parsed.status().message()));
    if (auto s = model::ValidateEngramConstants(*parsed, *cfg); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
    }
    k = std::move(*parsed);
  }
  return std::make_unique<model::Model>(std::move(*cfg), std::move(*w), std::move(k), backend);
}

// A JSON list of ids, or an object holding it under `key` (prompt_ids / generated_ids, also
// inside "results" as in a golden manifest). `what` names the file in errors.
absl::StatusOr<std::vector<int32_t>> ReadIds(const std::string& path,
                                             const std::string& key = "prompt_ids",
                                             const std::string& what = "prompt ids file") {
  auto text = ReadFile(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(what, " ", path, " cannot be read"));
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (!j.is_discarded() && j.is_object() && !j.contains(key) && j.contains("results") &&
      j["results"].is_object()) {
    j = j["results"];
  }
  if (!j.is_discarded() && j.is_object() && j.contains(key)) j = j[key];
  if (j.is_discarded() || !j.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " is not a JSON list of token ids"));
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", path, ": element ", i, " is not an integer"));
    }
    const int64_t v = j[i].get<int64_t>();
    if (v < 0 || v > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", path, ": element ", i, " (", v, ") is not a token id"));
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

int32_t Argmax(const float* row, int64_t n) {
  // Ties go to the lower id.
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

}  // namespace

void AddGenerateFlags(CLI::App& app, GenerateOptions* o) {
  app.add_option("--model", o->model_dir, "Model directory (config.json + safetensors)")
      ->required();
  auto* prompt = app.add_option("--prompt", o->prompt, "Prompt text (needs tokenizer.json)");
  auto* ids =
      app.add_option("--prompt-ids", o->prompt_ids_file,
                     "JSON file with the prompt's token ids (a list, or {\"prompt_ids\": [...]})");
  prompt->excludes(ids);
  app.add_option("--max-tokens", o->max_tokens, "Tokens to generate")->capture_default_str();
  app.add_flag("--ignore-eos", o->ignore_eos, "Keep generating after EOS");
  app.add_option("--dump-logits", o->dump_logits,
                 "Write logits as raw little-endian float32 [1 + steps, vocab]");
  app.add_option("--tail-rows", o->tail_rows,
                 "Encoder tail rows handed to the decoder (0 = whole prompt, exact)")
      ->capture_default_str();
  app.add_flag("--monolithic", o->monolithic,
               "Use Model::Prefill/Decode instead of the stage runners (reference)");
  app.add_option("--force-ids", o->force_ids_file,
                 "Teacher forcing: JSON list of ids (or {\"generated_ids\": [...]}) fed as the "
                 "generated tokens; logits of every step are still dumped");
  app.add_option("--device", o->device,
                 "Backend the model runs on: cpu, cuda or cuda:N (docs/cuda.md)")
      ->capture_default_str();
}

absl::StatusOr<GenerateResult> RunGenerate(const GenerateOptions& o) {
  if (o.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  // The device first: a missing GPU fails at once, before the model is read. The backend made
  // here is the one the model runs on.
  auto device = kernels::ParseDeviceSpec(o.device);
  if (!device.ok()) return device.status();
  auto backend = kernels::MakeBackend(*device);
  if (!backend.ok()) return backend.status();
  if (o.max_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  if (o.prompt.empty() == o.prompt_ids_file.empty()) {
    return absl::InvalidArgumentError("give exactly one of --prompt and --prompt-ids");
  }
  if (!fs::is_directory(o.model_dir)) {
    return absl::NotFoundError(absl::StrCat("model directory ", o.model_dir, " does not exist"));
  }
  std::unique_ptr<model::Tokenizer> tokenizer;
  const std::string tok_path = (fs::path(o.model_dir) / "tokenizer.json").string();
  if (fs::exists(tok_path)) {
    auto t = model::Tokenizer::FromFile(tok_path);
    if (!t.ok()) return t.status();
    tokenizer = std::move(*t);
  } else if (!o.prompt.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--prompt needs ", tok_path, " (use --prompt-ids without a tokenizer)"));
  }
  std::vector<int32_t> prompt;
  if (!o.prompt.empty()) {
    prompt = tokenizer->EncodeOrdinary(o.prompt);
  } else {
    auto ids = ReadIds(o.prompt_ids_file);
    if (!ids.ok()) return ids.status();
    prompt = std::move(*ids);
  }
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  std::vector<int32_t> forced;
  const bool forcing = !o.force_ids_file.empty();
  if (forcing) {
    auto f = ReadIds(o.force_ids_file, "generated_ids", "forced ids file");
    if (!f.ok()) return f.status();
    forced = std::move(*f);
    if (forced.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("forced ids file ", o.force_ids_file, " has no ids"));
  }

  auto model = LoadModel(o.model_dir, **backend, kernels::WeightsInBackend(*device));
  if (!model.ok()) return model.status();
  const model::Model& m = **model;
  const int64_t vocab = m.config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt id ", prompt[i], " at index ", i,
                                                     " is outside the vocabulary (", vocab, ")"));
    }
  }
  for (size_t i = 0; i < forced.size(); ++i) {
    if (forced[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("forced id ", forced[i], " at index ", i,
                                                     " is outside the vocabulary (", vocab, ")"));
    }
  }
  const int max_tokens =
      forcing ? std::min<int>(o.max_tokens, static_cast<int>(forced.size())) : o.max_tokens;
  if (static_cast<int64_t>(prompt.size()) + max_tokens > m.config().max_position_embeddings &&
      m.config().max_position_embeddings > 0) {
    return absl::InvalidArgumentError("prompt + max tokens exceed max_position_embeddings");
  }

  std::ofstream dump;
  if (!o.dump_logits.empty()) {
    dump.open(o.dump_logits, std::ios::binary | std::ios::trunc);
    if (!dump) return absl::InvalidArgumentError(absl::StrCat("cannot write ", o.dump_logits));
  }
  // Raw float32 rows; the host is little-endian (x86-64 / aarch64).
  auto write_row = [&](const std::vector<float>& logits) {
    if (dump.is_open()) {
      dump.write(reinterpret_cast<const char*>(logits.data()),
                 static_cast<std::streamsize>(vocab * sizeof(float)));
    }
  };

  auto state = m.NewSequence();
  absl::StatusOr<model::ForwardResult> first;
  if (o.monolithic) {
    // --tail-rows with --monolithic: the bounded monolithic reference (PrefillOptions), which a
    // staged run with the same tail equals bit for bit (REVIEW: the flag was ignored here).
    model::PrefillOptions po;
    po.decoder_tail_rows = o.tail_rows;
    first = m.Prefill(*state, prompt, /*all_logits=*/false, po);
  } else {
    const int64_t tail = o.tail_rows > 0 ? o.tail_rows : static_cast<int64_t>(prompt.size());
    auto enc = model::EncoderPass(m, *state, prompt, tail);
    if (!enc.ok()) return enc.status();
    first = model::DecoderReplay(m, *state, *enc);
  }
  if (!first.ok()) return first.status();
  // DecoderReplay/Prefill return the last row's logits.
  const float* last = first->logits.data() + (first->rows - 1) * vocab;
  std::vector<float> row(last, last + vocab);
  write_row(row);

  GenerateResult result;
  result.prompt_tokens = static_cast<int64_t>(prompt.size());
  result.finish_reason = "length";
  int32_t next = Argmax(row.data(), vocab);
  for (int step = 0; step < max_tokens; ++step) {
    if (forcing) {
      result.argmax_ids.push_back(next);
      next = forced[step];
    }
    result.ids.push_back(next);
    if (!forcing && !o.ignore_eos && next == m.config().eos_token_id) {
      result.finish_reason = "stop";
      break;
    }
    if (step + 1 == max_tokens) break;  // the last token needs no forward pass
    absl::StatusOr<model::ForwardResult> r;
    if (o.monolithic) {
      r = m.Decode(*state, next);
    } else {
      model::SequenceState* states[] = {state.get()};
      std::vector<std::vector<int32_t>> tokens = {{next}};
      auto batch = model::DecodeStep(m, states, tokens);
      if (!batch.ok()) return batch.status();
      r = std::move((*batch)[0]);
    }
    if (!r.ok()) return r.status();
    row.assign(r->logits.end() - vocab, r->logits.end());
    write_row(row);
    next = Argmax(row.data(), vocab);
  }
  if (dump.is_open()) {
    dump.close();
    if (!dump) return absl::InternalError(absl::StrCat("writing ", o.dump_logits, " failed"));
  }
  if (tokenizer) {
    result.has_text = true;
    auto text = tokenizer->DecodeLossy(result.ids);
    if (text.ok()) result.text = *text;
  }
  return result;
}

int RunGenerateCommand(const GenerateOptions& options) {
  // stdout carries only the result line; logs go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("epd-generate"));
  auto r = RunGenerate(options);
  if (!r.ok()) {
    std::cerr << "epd generate: " << r.status().message() << "\n";
    return 1;
  }
  nlohmann::json j;
  j["prompt_tokens"] = r->prompt_tokens;
  j["ids"] = r->ids;
  if (r->has_text) j["text"] = r->text;
  j["finish_reason"] = r->finish_reason;
  if (!options.force_ids_file.empty()) j["argmax_ids"] = r->argmax_ids;
  std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  return 0;
}

}  // namespace epd::services
