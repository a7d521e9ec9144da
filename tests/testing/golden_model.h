#pragma once

// The golden tiny models (tests/data/golden/<set>/: config, safetensors checkpoint, Engram
// constants from the manifest, the prompt), loaded for model tests. Every golden test runs over
// each set found there (GoldenSets()); set-specific numbers (prompt length, generated ids, layer
// roles, envelopes) come from the set's config and manifest (GoldenSet), never from set a's
// constants. Header-only: a test using it links epd::model and epd::testing.
//
// Thread-safety: the functions are reentrant; the returned Model borrows `backend` (which must
// outlive it).

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/numerics.h"
#include "model/engram.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::testing {

inline constexpr char kGoldenRoot[] = "tests/data/golden/";
inline constexpr char kDefaultGoldenSet[] = "v41-tiny-a";

// The golden sets: subdirectories of tests/data/golden holding a manifest.json, sorted by name.
inline std::vector<std::string> GoldenSets() {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(SourcePath(kGoldenRoot), ec)) {
    if (e.is_directory() && std::filesystem::exists(e.path() / "manifest.json"))
      out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A gtest-safe name for a set ("v41-tiny-c" -> "v41_tiny_c").
inline std::string GoldenSetName(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

// Contents of a file of a set (path relative to the set's dir); empty when missing.
inline std::string ReadGoldenText(const std::string& set, const std::string& rel) {
  std::ifstream in(SourcePath(std::string(kGoldenRoot) + set + "/" + rel), std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
inline std::string ReadGoldenText(const std::string& rel) {
  return ReadGoldenText(kDefaultGoldenSet, rel);
}
inline bool GoldenFileExists(const std::string& set, const std::string& rel) {
  return std::filesystem::exists(SourcePath(std::string(kGoldenRoot) + set + "/" + rel));
}
inline std::vector<float> ReadGoldenF32(const std::string& set, const std::string& rel) {
  std::string s = ReadGoldenText(set, rel);
  std::vector<float> v(s.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), s.data(), v.size() * 4);
  return v;
}
inline std::vector<int32_t> ReadGoldenI32(const std::string& set, const std::string& rel) {
  std::string s = ReadGoldenText(set, rel);
  std::vector<int32_t> v(s.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), s.data(), v.size() * 4);
  return v;
}
// Relative RMS error of x against g: sqrt(mean((x - g)^2)) / sqrt(mean(g^2)), over their common
// length (a length mismatch is a test failure).
inline double RelRms(const float* x, const float* g, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(x[i]) - g[i]) * (double(x[i]) - g[i]);
    den += double(g[i]) * g[i];
  }
  return std::sqrt(num / n) / std::sqrt(den / n);
}
inline double RelRms(const std::vector<float>& x, const std::vector<float>& g) {
  EXPECT_EQ(x.size(), g.size());
  return RelRms(x.data(), g.data(), std::min(x.size(), g.size()));
}

// Whether a and b hold the same floats bit for bit (NaNs and signed zeros included).
inline bool BitEqual(std::span<const float> a, std::span<const float> b) {
  // memcmp of an empty span would pass a null pointer (undefined even for 0 bytes).
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

inline std::vector<float> ReadGoldenBf16(const std::string& set, const std::string& rel) {
  std::string s = ReadGoldenText(set, rel);
  std::vector<float> v(s.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, s.data() + 2 * i, 2);
    v[i] = kernels::cpu::Bf16BitsToF32(b);
  }
  return v;
}

// The golden tiny model of `set` on `backend`; errors name the file that failed.
// `weights_in_backend`: the weights are loaded into the backend's memory (as Model::Load does)
// instead of being read in place from the checkpoint's mapping.
inline absl::StatusOr<std::unique_ptr<model::Model>> LoadGoldenModel(
    kernels::Backend& backend, const std::string& set, model::ModelOptions options = {},
    bool weights_in_backend = false) {
  const std::string dir = std::string(kGoldenRoot) + set + "/";
  auto cfg = model::LoadModelConfig(SourcePath(dir + "config.json"));
  if (!cfg.ok()) return cfg.status();
  auto store = model::TensorStore::Open(SourcePath(dir + "model.safetensors"), false);
  if (!store.ok()) return store.status();
  auto w =
      model::ModelWeights::Load(*cfg, std::shared_ptr<const model::TensorStore>(std::move(*store)),
                                weights_in_backend ? &backend : nullptr);
  if (!w.ok()) return w.status();
  auto k = model::ParseEngramConstantsJson(ReadGoldenText(set, "manifest.json"));
  if (!k.ok()) return k.status();
  if (absl::Status s = model::ValidateEngramConstants(*k, *cfg); !s.ok()) return s;
  return std::make_unique<model::Model>(std::move(*cfg), std::move(*w), std::move(*k), backend,
                                        options);
}
inline absl::StatusOr<std::unique_ptr<model::Model>> LoadGoldenModel(
    kernels::Backend& backend, model::ModelOptions options = {}) {
  return LoadGoldenModel(backend, kDefaultGoldenSet, options);
}

// The prompt of `set`.
inline std::vector<int32_t> GoldenPrompt(const std::string& set = kDefaultGoldenSet) {
  return nlohmann::json::parse(ReadGoldenText(set, "prompt.json"))["prompt_ids"]
      .get<std::vector<int32_t>>();
}

// `prompt` (a set's prompt, BOS first) continued with its own tokens after the BOS, cyclically, to
// at least n tokens: for tests that compare two paths of the same model (staged vs monolithic) and
// need a longer prompt than a set has (set d: 221 tokens), not the reference's outputs.
inline std::vector<int32_t> ExtendedPrompt(std::vector<int32_t> prompt, size_t n) {
  const size_t base = prompt.size();
  for (size_t i = 0; prompt.size() < n && base > 1; ++i) prompt.push_back(prompt[1 + i % (base - 1)]);
  return prompt;
}

// What a test needs to know about a set, from its manifest.
struct GoldenSet {
  std::string name;
  nlohmann::json manifest;
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;               // greedy ids: row 0 = after the prefill
  std::vector<std::vector<int32_t>> draft_ids;  // per decode step: input + drafts
  // Envelope of a valid alternative implementation (manifest tolerance, free running).
  double steps_rel_rms = 0, prefill_rel_rms = 0, dspark_row0_rel_rms = 0;

  static GoldenSet Load(const std::string& set) {
    GoldenSet g;
    g.name = set;
    g.manifest = nlohmann::json::parse(ReadGoldenText(set, "manifest.json"));
    g.prompt = GoldenPrompt(set);
    const auto& r = g.manifest["results"];
    g.generated = r["generated_ids"].get<std::vector<int32_t>>();
    g.draft_ids = r["dspark_output_ids"].get<std::vector<std::vector<int32_t>>>();
    const auto& fr =
        g.manifest["tolerance"]["envelope_valid_alternative_accumulation"]["free_running"];
    g.steps_rel_rms = fr["logits_steps.bin"]["rel_rms"].get<double>();
    g.prefill_rel_rms = fr["logits_prefill_all.bin"]["rel_rms"].get<double>();
    if (fr.contains("dspark_logits_row0"))
      g.dspark_row0_rel_rms = fr["dspark_logits_row0"]["rel_rms"].get<double>();
    return g;
  }
  int decode_steps() const { return static_cast<int>(generated.size()) - 1; }
};

// A test fixture with the golden model of the parameter's set on the CPU backend and its prompt,
// loaded per test. Instantiate with
//   INSTANTIATE_TEST_SUITE_P(Sets, MyTest, ::testing::ValuesIn(testing::GoldenSets()),
//                            testing::GoldenSetName);
class GoldenModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    set_ = GetParam();
    backend_ = kernels::MakeCpuBackend();
    auto m = LoadGoldenModel(*backend_, set_);
    ASSERT_TRUE(m.ok()) << set_ << ": " << m.status();
    model_ = std::move(*m);
    prompt_ = GoldenPrompt(set_);
  }
  std::string set_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<model::Model> model_;
  std::vector<int32_t> prompt_;
};

}  // namespace epd::testing
