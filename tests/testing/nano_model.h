#pragma once

// The generated nano model (model::GenerateNanoModel) as GoogleTest suite fixtures. Header-only:
// a test using it links epd::model and epd::testing (and GTest).
//
// - NanoModelDirTest: the nano model written into a TempDir once per test suite (dir_); for tests
//   that hand the directory to real processes.
// - NanoModelTest: the same plus a CPU backend (backend_) and the Model loaded on it (model_).
// - BoundedReferenceGreedy: the in-process reference of an E/P/D run on a model directory.
//
// Ownership: the fixture owns dir_, backend_ and model_ from SetUpTestSuite to TearDownTestSuite;
// model_ borrows backend_. Thread-safety: set up and torn down on the test thread; the pointers
// are stable for the whole suite. A fixture that needs more suite state defines its own
// SetUpTestSuite/TearDownTestSuite and calls these first/last.

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "model/sampling.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/subprocess.h"

namespace epd::testing {

class NanoModelDirTest : public ::testing::Test {
 public:
  // The directory holding the nano model's config + checkpoint (valid while the suite runs; public
  // for helpers outside the fixture that start processes on it).
  static std::string model_dir() { return dir_->path(); }

 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    ASSERT_TRUE(model::GenerateNanoModel(dir_->path()).ok());
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static inline TempDir* dir_ = nullptr;
};

// The model of `set` with its weights loaded into `backend`'s memory: "nano" (the suite's
// NanoModelDirTest directory) or a golden set (tests/data/golden).
inline absl::StatusOr<std::unique_ptr<model::Model>> LoadModelInto(
    kernels::Backend& backend, const std::string& set, model::ModelOptions options = {}) {
  if (set == "nano") return model::Model::Load(NanoModelDirTest::model_dir(), backend, options);
  return LoadGoldenModel(backend, set, options, /*weights_in_backend=*/true);
}

class NanoModelTest : public NanoModelDirTest {
 protected:
  static void SetUpTestSuite() {
    NanoModelDirTest::SetUpTestSuite();
    if (::testing::Test::HasFatalFailure()) return;
    backend_ = kernels::MakeCpuBackend().release();
    auto m = model::Model::Load(dir_->path(), *backend_);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
    delete backend_;
    backend_ = nullptr;
    NanoModelDirTest::TearDownTestSuite();
  }

  static inline kernels::Backend* backend_ = nullptr;
  static inline model::Model* model_ = nullptr;
};

// The monolithic reference forward in this process: Model::Prefill over all layers with the
// semantics E/P/D computes (bounded decoder replay of window + DSpark block tail rows; the exact
// forward for prompts up to that length), then greedy Decode until `max_tokens` tokens or EOS
// (not emitted). `finish`, when given, is set to "stop" (EOS) or "length".
inline std::vector<int32_t> BoundedReferenceGreedy(const std::string& model_dir,
                                                   const std::vector<int32_t>& prompt,
                                                   int max_tokens, std::string* finish = nullptr) {
  auto backend = kernels::MakeCpuBackend();
  auto model = model::Model::Load(model_dir, *backend);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  auto st = (*model)->NewSequence();
  model::PrefillOptions bounded;
  bounded.decoder_tail_rows = model::DecoderTailRows((*model)->config());
  auto r = (*model)->Prefill(*st, prompt, false, bounded);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  std::vector<int32_t> out;
  int32_t tok = model::ArgMax(r->logits);
  const int32_t eos = static_cast<int32_t>((*model)->config().eos_token_id);
  if (finish != nullptr) *finish = "length";
  while (static_cast<int>(out.size()) < max_tokens) {
    if (tok == eos) {
      if (finish != nullptr) *finish = "stop";
      break;
    }
    out.push_back(tok);
    if (static_cast<int>(out.size()) == max_tokens) break;
    auto d = (*model)->Decode(*st, tok);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) break;
    tok = model::ArgMax(d->logits);
  }
  return out;
}

}  // namespace epd::testing
