// One request validation for both front ends (services/router/request_validator.h): the same bad
// request sent to the real epd-router over the OpenAI HTTP API and over gRPC (epd.v1.Inference)
// gets the corresponding error on both: HTTP status <-> gRPC code, and the same OpenAI `param` and
// `code` (in the JSON error object; in the gRPC trailing metadata epd-error-param and
// epd-error-code). Each refusal is counted in epd_request_rejections_total{reason}, the router
// stays up and the next good request succeeds. Also: a wrong HTTP method answers 405 with Allow.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "epd/v1/inference.grpc.pb.h"
#include "tests/e2e/router_cluster.h"

namespace epd {
namespace {

using epd::testing::RouterCluster;
using epd::testing::ScrapeMetric;
using nlohmann::json;

struct BadRequest {
  std::string name;
  std::function<void(json&)> http;                      // edits a good chat request body
  std::function<void(epd::v1::GenerateRequest&)> grpc;  // edits a good GenerateRequest
  int http_status;
  grpc::StatusCode grpc_code;
  std::string param;
  std::string code;
};

json GoodHttp() {
  return {{"model", "epd-nano"},
          {"messages", {{{"role", "user"}, {"content", "hi"}}}},
          {"max_tokens", 4}};
}

epd::v1::GenerateRequest GoodGrpc() {
  epd::v1::GenerateRequest r;
  r.set_model("epd-nano");
  auto* m = r.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("hi");
  r.mutable_sampling()->set_max_tokens(4);
  return r;
}

// The router runs with --context-length 128 and --max-tokens-limit 32.
std::vector<BadRequest> Cases() {
  using SC = grpc::StatusCode;
  const std::string long_prompt(200, 'x');
  return {
      {"temperature out of range", [](json& j) { j["temperature"] = 9; },
       [](auto& r) { r.mutable_sampling()->set_temperature(9); }, 400, SC::INVALID_ARGUMENT,
       "temperature", "invalid_value"},
      {"negative max_tokens", [](json& j) { j["max_tokens"] = -5; },
       [](auto& r) { r.mutable_sampling()->set_max_tokens(-5); }, 400, SC::INVALID_ARGUMENT,
       "max_tokens", "invalid_value"},
      {"max_tokens above the limit", [](json& j) { j["max_tokens"] = 100; },
       [](auto& r) { r.mutable_sampling()->set_max_tokens(100); }, 400, SC::INVALID_ARGUMENT,
       "max_tokens", "max_tokens_exceeded"},
      {"unknown model", [](json& j) { j["model"] = "no-such-model"; },
       [](auto& r) { r.set_model("no-such-model"); }, 404, SC::NOT_FOUND, "model",
       "model_not_found"},
      {"empty model", [](json& j) { j["model"] = ""; }, [](auto& r) { r.set_model(""); }, 400,
       SC::INVALID_ARGUMENT, "model", "missing_required_parameter"},
      {"prompt over the context",
       [long_prompt](json& j) { j["messages"][0]["content"] = long_prompt; },
       [long_prompt](auto& r) { r.mutable_chat()->mutable_messages(0)->set_content(long_prompt); },
       400, SC::INVALID_ARGUMENT, "messages", "context_length_exceeded"},
      {"empty messages", [](json& j) { j["messages"] = json::array(); },
       [](auto& r) { r.mutable_chat()->clear_messages(); }, 400, SC::INVALID_ARGUMENT, "messages",
       "invalid_value"},
      {"bad role", [](json& j) { j["messages"][0]["role"] = "robot"; },
       [](auto& r) { r.mutable_chat()->mutable_messages(0)->set_role("robot"); }, 400,
       SC::INVALID_ARGUMENT, "messages[0].role", "invalid_value"},
      {"top_p out of range", [](json& j) { j["top_p"] = 1.5; },
       [](auto& r) { r.mutable_sampling()->set_top_p(1.5); }, 400, SC::INVALID_ARGUMENT, "top_p",
       "invalid_value"},
      {"top_k below -1", [](json& j) { j["top_k"] = -2; },
       [](auto& r) { r.mutable_sampling()->set_top_k(-2); }, 400, SC::INVALID_ARGUMENT, "top_k",
       "invalid_value"},
      {"presence_penalty out of range", [](json& j) { j["presence_penalty"] = 3; },
       [](auto& r) { r.mutable_sampling()->set_presence_penalty(3); }, 400, SC::INVALID_ARGUMENT,
       "presence_penalty", "invalid_value"},
      {"five stop strings",
       [](json& j) {
         j["stop"] = {"a", "b", "c", "d", "e"};
       },
       [](auto& r) {
         for (const char* s : {"a", "b", "c", "d", "e"}) r.mutable_sampling()->add_stop(s);
       },
       400, SC::INVALID_ARGUMENT, "stop", "invalid_value"},
  };
}

std::map<std::string, std::string> Trailers(const grpc::ClientContext& ctx) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
    out[std::string(k.data(), k.size())] = std::string(v.data(), v.size());
  }
  return out;
}

TEST(ValidationE2ETest, SameBadRequestSameErrorOverHttpAndGrpc) {
  RouterCluster c({"--context-length", "128", "--max-tokens-limit", "32"});
  ASSERT_NE(c.AddWorker("decode", "d0"), nullptr);
  auto stub = epd::v1::Inference::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(c.grpc_port()), grpc::InsecureChannelCredentials()));

  auto good_http = [&] {
    auto r = c.Post("/v1/chat/completions", GoodHttp().dump());
    EXPECT_EQ(r.status, 200) << r.body;
  };
  auto good_grpc = [&] {
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, GoodGrpc());
    epd::v1::GenerateResponse m;
    int messages = 0;
    while (reader->Read(&m)) ++messages;
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_GT(messages, 0);
  };
  good_http();
  good_grpc();

  std::map<std::string, int> expected_rejections;  // by code
  for (const BadRequest& bad : Cases()) {
    SCOPED_TRACE(bad.name);
    json body = GoodHttp();
    bad.http(body);
    auto h = c.Post("/v1/chat/completions", body.dump());
    EXPECT_EQ(h.status, bad.http_status) << h.body;
    ASSERT_TRUE(h.json.is_object() && h.json.contains("error")) << h.body;
    EXPECT_EQ(h.json["error"]["param"], bad.param) << h.body;
    EXPECT_EQ(h.json["error"]["code"], bad.code) << h.body;

    epd::v1::GenerateRequest req = GoodGrpc();
    bad.grpc(req);
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, req);
    epd::v1::GenerateResponse m;
    EXPECT_FALSE(reader->Read(&m)) << "a refused request streams nothing";
    const grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), bad.grpc_code) << st.error_message();
    const auto trailers = Trailers(ctx);
    EXPECT_EQ(trailers.count("epd-error-param") ? trailers.at("epd-error-param") : "", bad.param)
        << st.error_message();
    EXPECT_EQ(trailers.count("epd-error-code") ? trailers.at("epd-error-code") : "", bad.code)
        << st.error_message();
    EXPECT_NE(st.error_message().find("(param: " + bad.param + ")"), std::string::npos)
        << st.error_message();
    expected_rejections[bad.code] += 2;
  }
  good_http();
  good_grpc();

  // A wrong method: 405 with Allow, counted as a rejection too.
  {
    httplib::Client cli("127.0.0.1", c.http_port());
    auto get = cli.Get("/v1/chat/completions");
    ASSERT_TRUE(get);
    EXPECT_EQ(get->status, 405) << get->body;
    EXPECT_EQ(get->get_header_value("Allow"), "POST");
    json e = json::parse(get->body, nullptr, false);
    ASSERT_TRUE(e.is_object()) << get->body;
    EXPECT_EQ(e["error"]["code"], "method_not_allowed") << get->body;
    auto post = cli.Post("/v1/models", "{}", "application/json");
    ASSERT_TRUE(post);
    EXPECT_EQ(post->status, 405) << post->body;
    EXPECT_EQ(post->get_header_value("Allow"), "GET, HEAD");
    auto del = cli.Delete("/v1/completions");
    ASSERT_TRUE(del);
    EXPECT_EQ(del->status, 405);
    EXPECT_EQ(del->get_header_value("Allow"), "POST");
    expected_rejections["method_not_allowed"] += 3;
    // An unknown path is still 404.
    auto unknown = cli.Get("/v1/nothing");
    ASSERT_TRUE(unknown);
    EXPECT_EQ(unknown->status, 404);
  }

  for (const auto& [code, n] : expected_rejections) {
    EXPECT_EQ(
        ScrapeMetric(c.router().metrics, "epd_request_rejections_total{reason=\"" + code + "\"}"),
        static_cast<double>(n))
        << code;
  }
}

}  // namespace
}  // namespace epd
