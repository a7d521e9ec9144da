#pragma once

// The golden tiny model (tests/data/golden/v41-tiny-a: config, safetensors checkpoint, Engram
// constants from the manifest, the 301-token prompt), loaded for model tests. Header-only: a test
// using it links epd::model and epd::testing.
//
// Thread-safety: the functions are reentrant; the returned Model borrows `backend` (which must
// outlive it).

#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "model/engram.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::testing {

inline constexpr char kGoldenDir[] = "tests/data/golden/v41-tiny-a/";

// Contents of a golden file (path relative to the golden dir); empty when missing.
inline std::string ReadGoldenText(const std::string& rel) {
  std::ifstream in(SourcePath(std::string(kGoldenDir) + rel), std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The golden tiny model on `backend`; errors name the file that failed.
inline absl::StatusOr<std::unique_ptr<model::Model>> LoadGoldenModel(
    kernels::Backend& backend, model::ModelOptions options = {}) {
  auto cfg = model::LoadModelConfig(SourcePath(std::string(kGoldenDir) + "config.json"));
  if (!cfg.ok()) return cfg.status();
  auto store =
      model::TensorStore::Open(SourcePath(std::string(kGoldenDir) + "model.safetensors"), false);
  if (!store.ok()) return store.status();
  auto w =
      model::ModelWeights::Load(*cfg, std::shared_ptr<const model::TensorStore>(std::move(*store)));
  if (!w.ok()) return w.status();
  auto k = model::ParseEngramConstantsJson(ReadGoldenText("manifest.json"));
  if (!k.ok()) return k.status();
  return std::make_unique<model::Model>(std::move(*cfg), std::move(*w), std::move(*k), backend,
                                        options);
}

// The golden prompt (301 token ids).
inline std::vector<int32_t> GoldenPrompt() {
  return nlohmann::json::parse(ReadGoldenText("prompt.json"))["prompt_ids"]
      .get<std::vector<int32_t>>();
}

// A test fixture with the golden model on the CPU backend and the golden prompt, loaded per test.
class GoldenModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = kernels::MakeCpuBackend();
    auto m = LoadGoldenModel(*backend_);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    prompt_ = GoldenPrompt();
  }
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<model::Model> model_;
  std::vector<int32_t> prompt_;
};

}  // namespace epd::testing
