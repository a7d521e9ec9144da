#pragma once

// The nano demo model (DESIGN.md §8): a deterministic random checkpoint with the real
// DeepSeek-V4.1-Flash architecture and exact checkpoint format (MODEL.md §2), small enough
// for unit tests, plus its byte-level BPE tokenizer and Engram constants.
//
// `GenerateNanoModel(dir, seed)` writes into `dir`:
//   config.json                    HF layout (top level + nested text_config), = configs/nano.json
//   model.safetensors              one shard, native tensor names, official dtypes
//   model.safetensors.index.json   {"metadata": {"total_size": N}, "weight_map": {name: file}}
//   tokenizer.json                 the nano tokenizer (HF format)
//   tokenizer_config.json          add_bos/add_eos false, bos/eos/pad token strings
//   engram_constants.json          see model/engram_constants.h
// Same seed -> byte-identical files.
//
// Thread-safety: all functions are reentrant.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace epd::model {

inline constexpr uint64_t kNanoDefaultSeed = 20261130;

// Training text of the nano tokenizer (model/nano/nano_corpus.cc).
std::string_view NanoCorpus();

// The nano tokenizer.json text (trained deterministically on NanoCorpus()).
// Ids: 0 BOS, 1 EOS, 2 PAD, 3..258 bytes, merged tokens, then the protocol tokens
// <｜User｜> <｜Assistant｜> <think> </think> ｜DSML｜ <｜System｜> <｜latest_reminder｜>
// <｜deepseek_image｜> at the end (vocab 2048).
absl::StatusOr<std::string> NanoTokenizerJson();

// The same trainer and special tokens (vocab 2048) on another corpus (the trained demo model's
// tokenizer, tools/train/).
absl::StatusOr<std::string> NanoTokenizerJsonFor(std::string_view corpus);

// The nano config.json (embedded copy of model/configs/nano.json).
std::string_view NanoConfigJson();

// Writes a random checkpoint for `config` (HF config.json layout with text_config) as
// `out_dir/model.safetensors` + `out_dir/model.safetensors.index.json`. Weight scales follow
// the golden generator (shared/golden/tools/v41_tiny_gen.py): small residual-branch gains so
// the network stays well-conditioned. Errors name a missing/invalid config field.
// `threads` > 1 draws and quantizes on that many threads (a release-config layer's gigabytes:
// tests/bench/cuda_model_bench.cc); its bytes depend on the seed alone but are not the
// one-thread checkpoint's (the nano model is made with one).
absl::Status GenerateCheckpoint(const nlohmann::json& config, uint64_t seed,
                                const std::string& out_dir, int threads = 1);

// Writes the whole nano model directory (see above). Creates `out_dir` if needed.
absl::Status GenerateNanoModel(const std::string& out_dir, uint64_t seed = kNanoDefaultSeed);

// As GenerateNanoModel, with the tokenizer trained on `tokenizer_corpus` when given (config
// engram_compressed_vocab_size then follows that tokenizer's Engram class count). The random
// checkpoint is the starting point of tools/train/.
absl::Status GenerateNanoModelFor(const std::string& out_dir, uint64_t seed,
                                  std::optional<std::string_view> tokenizer_corpus);

// Structural fuzz (tests/model/structure_fuzz_test.cc): the nano config with a random legal layer
// structure drawn from `seed` (same seed -> same config): 4..8 layers, groups of a KV source
// (ratio 1 or 2, the reference's two compressors; Full) followed by Reuse / Reindex layers of its
// ratio, SWA layers anywhere, the last KV source as the candidate source (the decoder split; the
// decoder layers own no global KV), 0..2 Engram layers (layer 0
// and the split layer drawn often), 1..3 DSpark stages with 1..3 target layers, a 16-token
// window (so short prompts exercise the ring and the bounded replay) and a 512-token vocabulary.
nlohmann::json RandomStructureConfig(uint64_t seed);

// Writes config.json, the checkpoint and engram_constants.json (identity token map: compressed
// id = token id) for RandomStructureConfig(seed) into `out_dir` (no tokenizer). Creates `out_dir`.
absl::Status GenerateStructureModel(const std::string& out_dir, uint64_t seed);

}  // namespace epd::model
