#pragma once

// The generated nano model (model::GenerateNanoModel) as GoogleTest suite fixtures. Header-only:
// a test using it links epd::model and epd::testing (and GTest).
//
// - NanoModelDirTest: the nano model written into a TempDir once per test suite (dir_); for tests
//   that hand the directory to real processes.
// - NanoModelTest: the same plus a CPU backend (backend_) and the Model loaded on it (model_).
//
// Ownership: the fixture owns dir_, backend_ and model_ from SetUpTestSuite to TearDownTestSuite;
// model_ borrows backend_. Thread-safety: set up and torn down on the test thread; the pointers
// are stable for the whole suite. A fixture that needs more suite state defines its own
// SetUpTestSuite/TearDownTestSuite and calls these first/last.

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/nano_generator.h"
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

}  // namespace epd::testing
