// The `epd` binary as a user runs it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/device/device.h"
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

// `epd serve --dspark-k` (passed to every decode worker) takes -1 (the k policy) or 0..5; a value
// outside, by flag or by --config, fails at once naming it, before anything starts.
TEST(CliTest, ServeDSparkKOutsideItsRangeIsRejected) {
  TempDir d;
  std::string out;
  EXPECT_NE(RunCommand(BinaryPath("epd") + " serve --dspark-k 6 --data-dir " + d.File("a") +
                           " 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("--dspark-k"), std::string::npos) << out;
  {
    std::ofstream cfg(d.File("serve.json"));
    cfg << R"({"dspark_k": 9})";
  }
  EXPECT_NE(RunCommand(BinaryPath("epd") + " serve --config " + d.File("serve.json") +
                           " --data-dir " + d.File("b") + " 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("dspark_k must be -1 (the k policy) or 0..5"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(d.File("a"))) << "epd serve started something";
  EXPECT_FALSE(std::filesystem::exists(d.File("b"))) << "epd serve started something";
}

// `--step-graphs` (the decode step graphs, docs/cuda.md) takes on or off, on `epd serve` (by flag
// or --config) and on the workers; anything else fails at once naming it, before anything starts.
TEST(CliTest, StepGraphsTakesOnOrOff) {
  TempDir d;
  std::string out;
  EXPECT_NE(RunCommand(BinaryPath("epd") + " serve --step-graphs maybe --data-dir " + d.File("a") +
                           " 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("--step-graphs"), std::string::npos) << out;
  {
    std::ofstream cfg(d.File("serve.json"));
    cfg << R"({"step_graphs": "fast"})";
  }
  EXPECT_NE(RunCommand(BinaryPath("epd") + " serve --config " + d.File("serve.json") +
                           " --data-dir " + d.File("b") + " 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("step_graphs must be \"on\" or \"off\""), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(d.File("a"))) << "epd serve started something";
  EXPECT_FALSE(std::filesystem::exists(d.File("b"))) << "epd serve started something";
  EXPECT_NE(RunCommand(BinaryPath("epd-decode") +
                           " --step-graphs maybe --router 127.0.0.1:1 --kvstore 127.0.0.1:1 "
                           "--model " +
                           SourcePath("models/epd-nano") + " 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("--step-graphs"), std::string::npos) << out;
}

// --device cuda on a machine without a GPU (CI): every entry point fails at once (exit != 0, no
// model read, nothing started) with a message naming the missing device and the cause. (On a GPU
// machine cuda:0 runs: tests/gpu/device_check.sh's epd_generate step.)
void ExpectCudaRefused(const std::string& cmd, const std::string& device) {
  std::string out;
  EXPECT_NE(RunCommand(cmd + " 2>&1", &out), 0) << cmd;
  EXPECT_NE(out.find(device), std::string::npos) << cmd << ":\n" << out;
  EXPECT_NE(out.find(device + " is not available"), std::string::npos) << cmd << ":\n" << out;
  EXPECT_TRUE(out.find("no CUDA device") != std::string::npos ||
              out.find("no CUDA backend") != std::string::npos)
      << cmd << ":\n"
      << out;
}

TEST(CliTest, DeviceCudaWithoutAGpuFailsAtOnceNamingTheDevice) {
  if (kernels::MakeBackend({kernels::DeviceSpec::Kind::kCuda, 0}).ok()) {
    GTEST_SKIP() << "a GPU is present: cuda:0 runs here";
  }
  TempDir d;
  {
    std::ofstream ids(d.File("ids.json"));
    ids << "[1, 2, 3]";
  }
  const std::string model = SourcePath("models/epd-nano");
  ExpectCudaRefused(BinaryPath("epd") + " generate --device cuda --model " + model +
                        " --prompt-ids " + d.File("ids.json"),
                    "cuda:0");
  ExpectCudaRefused(BinaryPath("epd") + " generate --device cuda:1 --model " + model +
                        " --prompt-ids " + d.File("ids.json"),
                    "cuda:1");
  ExpectCudaRefused(BinaryPath("epd") + " serve --device cuda --data-dir " + d.File("serve"),
                    "cuda:0");
  EXPECT_FALSE(std::filesystem::exists(d.File("serve"))) << "epd serve started something";
  for (const char* worker : {"epd-encoder", "epd-prefill", "epd-decode"}) {
    ExpectCudaRefused(BinaryPath(worker) +
                          " --device cuda --router 127.0.0.1:1 --kvstore 127.0.0.1:1 --model " +
                          model,
                      "cuda:0");
  }
  std::string out;
  EXPECT_NE(RunCommand(BinaryPath("epd") + " generate --device tpu:0 --model " + model +
                           " --prompt-ids " + d.File("ids.json") + " 2>&1",
                       &out),
            0);
  EXPECT_NE(out.find("--device tpu:0: expected cpu, cuda or cuda:N"), std::string::npos) << out;
}

}  // namespace
}  // namespace epd
