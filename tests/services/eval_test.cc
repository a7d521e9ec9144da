// `epd eval` (services/cli/eval.h) on the trained demo model (models/epd-nano) and its held-out
// text: perplexity through the serving path, far below the random model's and below the unigram
// baseline's; the bounded decoder replay equals the exact one while the prompt fits in the
// replayed tail and differs from it beyond; unquantized KV changes the figure; `epd tokenize`
// and `epd gen-model --tokenizer-corpus` (the training tool's entry points) work; bad input is a
// clear error.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using testing::BinaryPath;
using testing::RunCommand;
using testing::SourcePath;
using testing::TempDir;

nlohmann::json Eval(const std::string& model, const std::string& args) {
  std::string out;
  const int rc = RunCommand(BinaryPath("epd") + " eval --model " + model + " --data " +
                                SourcePath("tests/data/trained_nano_parity/heldout.txt") + " " +
                                args + " 2>/dev/null",
                            &out);
  EXPECT_EQ(rc, 0) << out;
  // The JSON result is the last line (the model loader logs before it).
  const size_t end = out.find_last_not_of('\n');
  const size_t start = end == std::string::npos ? 0 : out.rfind('\n', end);
  auto j =
      nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1), nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << out;
  return j;
}

TEST(EvalTest, PerplexityThroughTheServingPath) {
  const std::string trained = SourcePath("models/epd-nano");
  const auto exact = Eval(trained, "--context 100 --score 32 --windows 2");
  const auto bounded = Eval(trained, "--context 100 --score 32 --windows 2 --replay bounded");
  ASSERT_EQ(exact["scored_tokens"], 64);
  // 100 prompt tokens fit in the 133 replayed rows: the bounded replay is exact.
  EXPECT_EQ(exact["perplexity"], bounded["perplexity"]);
  EXPECT_EQ(bounded["tail_rows"], 100);

  const auto exact_long = Eval(trained, "--context 400 --score 32 --windows 2");
  const auto bounded_long = Eval(trained, "--context 400 --score 32 --windows 2 --replay bounded");
  const auto full_kv = Eval(trained, "--context 400 --score 32 --windows 2 --kv full");
  EXPECT_EQ(bounded_long["tail_rows"], 133);
  EXPECT_NE(exact_long["perplexity"], bounded_long["perplexity"]);
  EXPECT_NE(exact_long["perplexity"], full_kv["perplexity"]);
  // Both approximations cost little on this model (docs/demo.md has the figures).
  const double p = exact_long["perplexity"].get<double>();
  EXPECT_LT(std::abs(bounded_long["perplexity"].get<double>() - p), 0.25 * p);
  EXPECT_LT(std::abs(full_kv["perplexity"].get<double>() - p), 0.25 * p);

  // The trained model predicts held-out text far better than random weights do.
  TempDir dir;
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " gen-model --out " + dir.File("random")), 0);
  const auto random = Eval(dir.File("random"), "--context 400 --score 32 --windows 2");
  EXPECT_LT(p * 20, random["perplexity"].get<double>());
  // The unigram baseline of the training text on these 64 positions is 888
  // (tools/train/unigram.py --context 400 --score 32 --windows 2): less than half of it.
  EXPECT_LT(p, 444.0);
}

TEST(EvalTest, BadInputIsAClearError) {
  std::string out;
  EXPECT_NE(RunCommand(BinaryPath("epd") + " eval --model " + SourcePath("models/epd-nano") +
                           " --data /nonexistent/file 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("cannot read --data /nonexistent/file"), std::string::npos) << out;
  EXPECT_NE(RunCommand(BinaryPath("epd") + " eval --model " + SourcePath("models/epd-nano") +
                           " --data " + SourcePath("tests/data/trained_nano_parity/heldout.txt") +
                           " --context 100000000 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("fewer than one window"), std::string::npos) << out;
}

TEST(EvalTest, TokenizerCorpusAndTokenize) {
  TempDir dir;
  const std::string corpus = SourcePath("tests/data/trained_nano_parity/heldout.txt");
  std::string out;
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " gen-model --out " + dir.File("m") +
                           " --tokenizer-corpus " + corpus + " 2>&1",
                       &out),
            0)
      << out;
  // Another corpus, another tokenizer: the Engram class count follows it.
  std::ifstream cfg(dir.File("m") + "/config.json");
  const auto config = nlohmann::json::parse(cfg);
  EXPECT_NE(config["text_config"]["engram_compressed_vocab_size"], 1796);
  {
    std::ofstream text(dir.File("t.txt"));
    text << "<｜begin▁of▁sentence｜>The function returns the value of the object.";
  }
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " tokenize --model " + dir.File("m") + " --in " +
                           dir.File("t.txt") + " --out " + dir.File("t.ids") + " 2>&1",
                       &out),
            0)
      << out;
  const auto bytes = std::filesystem::file_size(dir.File("t.ids"));
  ASSERT_GT(bytes, 4u);
  ASSERT_EQ(bytes % 4, 0u);
  std::ifstream ids(dir.File("t.ids"), std::ios::binary);
  int32_t first = -1;
  ids.read(reinterpret_cast<char*>(&first), 4);
  EXPECT_EQ(first, 0);        // the BOS string encodes as the BOS token
  EXPECT_LT(bytes / 4, 20u);  // merged tokens: far fewer ids than the 46 characters
}

}  // namespace
}  // namespace epd
