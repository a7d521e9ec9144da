// The `epd` binary as a user runs it.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::BinaryPath;
using epd::testing::RunCommand;
using epd::testing::SourcePath;
using epd::testing::TempDir;

TEST(CliTest, HelpListsEverySubcommand) {
  std::string out;
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " --help", &out), 0);
  for (const char* sub :
       {"serve", "generate", "gen-model", "kv-layout", "bench", "version", "eval", "tokenize"}) {
    EXPECT_NE(out.find(sub), std::string::npos) << sub << " missing from:\n" << out;
  }
  for (const char* sub :
       {"serve", "generate", "gen-model", "kv-layout", "bench", "version", "eval", "tokenize"}) {
    std::string sub_out;
    EXPECT_EQ(RunCommand(BinaryPath("epd") + " " + sub + " --help", &sub_out), 0) << sub;
    EXPECT_NE(sub_out.find("Usage"), std::string::npos) << sub;
  }
}

TEST(CliTest, VersionPrintsTheVersion) {
  std::string out;
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " version", &out), 0);
  EXPECT_EQ(out.rfind("epd 0.", 0), 0u) << out;
}

TEST(CliTest, KvLayoutOfTheOfficialConfigIs890BytesPerToken) {
  std::string out;
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " kv-layout --config " +
                           SourcePath("tests/data/configs/deepseek-v4.1-flash/config.json"),
                       &out),
            0);
  EXPECT_NE(out.find("\nglobal_bytes_per_token: 890\n"), std::string::npos) << out;
  EXPECT_NE(out.find("swa_bytes_per_layer_slot: 528\n"), std::string::npos) << out;
}

TEST(CliTest, KvLayoutOfAMissingFileNamesIt) {
  std::string out;
  EXPECT_NE(RunCommand(BinaryPath("epd") + " kv-layout --config /nonexistent/config.json 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("/nonexistent/config.json"), std::string::npos) << out;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(CliTest, GenModelIsDeterministic) {
  TempDir a, b;
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " gen-model --preset nano --out " + a.path()), 0);
  ASSERT_EQ(RunCommand(BinaryPath("epd") + " gen-model --preset nano --out " + b.path()), 0);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json",
                        "engram_constants.json", "model.safetensors.index.json"}) {
    std::string x = ReadAll(a.File(f)), y = ReadAll(b.File(f));
    EXPECT_FALSE(x.empty()) << f;
    EXPECT_TRUE(x == y) << f << " differs between two runs";
  }
  std::string out;
  EXPECT_EQ(RunCommand(BinaryPath("epd") + " kv-layout --config " + a.File("config.json"), &out),
            0);
}

TEST(CliTest, UnknownPresetIsRejected) {
  std::string out;
  TempDir d;
  EXPECT_NE(RunCommand(BinaryPath("epd") + " gen-model --preset huge --out " + d.path() + " 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("huge"), std::string::npos) << out;
}

}  // namespace
}  // namespace epd
