// The OpenAI API as agent frameworks use it (docs/api.md; issue 15): the official OpenAI Node SDK
// (tests/clients/openai_features_test.mjs) against two clusters of REAL processes (epd-router +
// epd-encoder + epd-prefill + epd-decode over UCX on the generated nano model), one with DSpark
// on and one with it off: models.retrieve, logprobs / top_logprobs on chat and completions,
// streaming and not, equal in both clusters; response_format json_schema / json_object and
// tool_choice required / named function enforced by the decode worker's grammar mask (outputs
// validated with ajv). Plus the gRPC Generate API's logprob entries.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "epd/v1/inference.grpc.pb.h"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

class OpenAiApiTest : public testing::NanoModelDirTest {
 protected:
  static testing::RealClusterOptions Options(bool dspark) {
    return {.model_dir = model_dir(), .dspark = dspark};
  }
};

// Runs tests/clients/`script` against the two clusters; returns its output, *rc its exit code.
std::string RunNode(const std::string& script, testing::RealCluster& on, testing::RealCluster& off,
                    int* rc) {
  std::string out;
  *rc = epd::testing::RunCommand(
      "cd " + epd::testing::SourcePath("tests/clients") +
          " && EPD_BASE_URL=http://127.0.0.1:" + std::to_string(on.http_port()) +
          "/v1 EPD_BASE_URL_OFF=http://127.0.0.1:" + std::to_string(off.http_port()) +
          "/v1 EPD_DECODE_METRICS=http://127.0.0.1:" + std::to_string(on.metrics("decode")) +
          "/metrics timeout 240 node " + script + " 2>&1",
      &out);
  return out;
}

bool NodeReady() {
  return epd::testing::RunCommand("command -v node >/dev/null 2>&1") == 0 &&
         std::filesystem::exists(epd::testing::SourcePath("tests/clients") +
                                 "/node_modules/openai/package.json");
}

TEST_F(OpenAiApiTest, OfficialSdkModelsLogprobsStructuredOutputAndToolChoice) {
  testing::RealCluster on(Options(true));
  testing::RealCluster off(Options(false));

  // gRPC: with sampling.logprobs and top_logprobs 3, every token carries 1 + 3 entries: the
  // chosen token (greedy: the most likely) then the top 3, sorted.
  {
    auto stub = epd::v1::Inference::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(on.grpc_port()), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    epd::v1::GenerateRequest req;
    req.set_model("epd-nano");
    for (int32_t id : testing::Prompt(20, 1)) req.mutable_prompt_ids()->add_ids(id);
    req.mutable_sampling()->set_max_tokens(6);
    req.mutable_sampling()->set_logprobs(true);
    req.mutable_sampling()->set_top_logprobs(3);
    auto reader = stub->Generate(&ctx, req);
    epd::v1::GenerateResponse m;
    int tokens = 0;
    while (reader->Read(&m)) {
      ASSERT_EQ(m.top_logprobs_size(), 4 * m.token_ids_size());
      for (int i = 0; i < m.token_ids_size(); ++i, ++tokens) {
        const auto& chosen = m.top_logprobs(4 * i);
        EXPECT_EQ(chosen.token_id(), m.token_ids(i));
        EXPECT_EQ(chosen.token_id(), m.top_logprobs(4 * i + 1).token_id());
        EXPECT_EQ(chosen.logprob(), m.top_logprobs(4 * i + 1).logprob());
        EXPECT_GE(m.top_logprobs(4 * i + 1).logprob(), m.top_logprobs(4 * i + 2).logprob());
        EXPECT_GE(m.top_logprobs(4 * i + 2).logprob(), m.top_logprobs(4 * i + 3).logprob());
      }
    }
    ASSERT_TRUE(reader->Finish().ok()) << on.Logs();
    EXPECT_GT(tokens, 0);
  }

  if (!NodeReady()) GTEST_SKIP() << "node or tests/clients/node_modules missing";
  // models.retrieve + logprobs (openai_features_test.mjs), then structured output and forced
  // tool calls validated with ajv (openai_structured_test.mjs).
  // agents_structured_test.mjs: the Vercel AI SDK and LangChain with zod schemas (issue 54).
  for (const char* script :
       {"openai_features_test.mjs", "openai_structured_test.mjs", "agents_structured_test.mjs"}) {
    int rc = 0;
    const std::string out = RunNode(script, on, off, &rc);
    std::printf("--- %s\n%s", script, out.c_str());
    EXPECT_EQ(rc, 0) << script << "\n"
                     << out << "\n--- DSpark on ---\n"
                     << on.Logs() << "\n--- off ---\n"
                     << off.Logs();
    EXPECT_NE(out.find("ALL OK"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace epd
