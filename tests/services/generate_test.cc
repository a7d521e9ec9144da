// `epd generate` as a real process on the golden tiny checkpoint (tests/data/golden/v41-tiny-a).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::testing {
namespace {

const std::string kGolden = "tests/data/golden/v41-tiny-a";
constexpr int kVocab = 512;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

double RelRms(const float* x, const float* g, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(x[i]) - g[i]) * (double(x[i]) - g[i]);
    den += double(g[i]) * g[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Runs `epd generate ARGS`; returns the exit status, stdout in *out, stderr in *err.
int Generate(const TempDir& dir, const std::string& args, std::string* out, std::string* err) {
  const std::string err_file = dir.File("stderr.txt");
  int rc = RunCommand(BinaryPath("epd") + " generate " + args + " 2>" + err_file, out);
  *err = ReadBytes(err_file);
  return rc;
}

TEST(GenerateTest, StagedGreedyMatchesGoldenAndMonolithicBitForBit) {
  TempDir dir;
  const std::string model = SourcePath(kGolden);
  const std::string ids_file = SourcePath(kGolden + "/prompt.json");
  std::string out, err;
  ASSERT_EQ(Generate(dir,
                     "--model " + model + " --prompt-ids " + ids_file +
                         " --max-tokens 9 --dump-logits " + dir.File("staged.bin"),
                     &out, &err),
            0)
      << err;
  // The result is the last stdout line.
  while (!out.empty() && out.back() == '\n') out.pop_back();
  auto j = nlohmann::json::parse(
      out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1));
  EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(),
            (std::vector<int32_t>{99, 143, 448, 258, 103, 211, 174, 229, 92}));
  EXPECT_EQ(j["prompt_tokens"], 301);
  EXPECT_FALSE(j.contains("text"));  // the golden dir has no tokenizer

  const std::string staged = ReadBytes(dir.File("staged.bin"));
  ASSERT_EQ(staged.size(), 9u * kVocab * sizeof(float));  // [1 + 8 steps, vocab]
  const std::vector<float> got = Floats(staged);
  const std::vector<float> golden =
      Floats(ReadBytes(SourcePath(kGolden + "/logits_prefill_last.bin")));
  ASSERT_EQ(golden.size(), static_cast<size_t>(kVocab));
  EXPECT_LT(RelRms(got.data(), golden.data(), kVocab), 0.06);
  const std::vector<float> steps = Floats(ReadBytes(SourcePath(kGolden + "/logits_steps.bin")));
  ASSERT_EQ(steps.size(), 9u * kVocab);
  for (int s = 1; s < 9; ++s) {
    EXPECT_LT(RelRms(got.data() + s * kVocab, steps.data() + s * kVocab, kVocab), 0.06)
        << "step " << s;
  }

  // The monolithic reference path gives the same bytes.
  ASSERT_EQ(Generate(dir,
                     "--model " + model + " --prompt-ids " + ids_file +
                         " --max-tokens 9 --monolithic --dump-logits " + dir.File("mono.bin"),
                     &out, &err),
            0)
      << err;
  EXPECT_TRUE(ReadBytes(dir.File("mono.bin")) == staged) << "staged != monolithic";
}

TEST(GenerateTest, ErrorsNameTheCause) {
  TempDir dir;
  std::string out, err;
  const std::string ids_file = SourcePath(kGolden + "/prompt.json");
  EXPECT_NE(Generate(dir, "--model " + dir.File("nope") + " --prompt-ids " + ids_file, &out, &err),
            0);
  EXPECT_NE(err.find(dir.File("nope")), std::string::npos) << err;

  std::ofstream(dir.File("bad.json")) << "[1, 2, \"three\"]";
  EXPECT_NE(
      Generate(dir, "--model " + SourcePath(kGolden) + " --prompt-ids " + dir.File("bad.json"),
               &out, &err),
      0);
  EXPECT_NE(err.find(dir.File("bad.json")), std::string::npos) << err;

  EXPECT_NE(
      Generate(dir, "--model " + SourcePath(kGolden) + " --prompt-ids " + dir.File("none.json"),
               &out, &err),
      0);
  EXPECT_NE(err.find(dir.File("none.json")), std::string::npos) << err;

  std::ofstream(dir.File("big.json")) << "[0, 99999]";
  EXPECT_NE(
      Generate(dir, "--model " + SourcePath(kGolden) + " --prompt-ids " + dir.File("big.json"),
               &out, &err),
      0);
  EXPECT_NE(err.find("99999"), std::string::npos) << err;

  // --prompt needs a tokenizer.
  EXPECT_NE(Generate(dir, "--model " + SourcePath(kGolden) + " --prompt hello", &out, &err), 0);
  EXPECT_NE(err.find("tokenizer.json"), std::string::npos) << err;
}

}  // namespace
}  // namespace epd::testing
