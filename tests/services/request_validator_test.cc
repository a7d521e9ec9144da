// services/router/request_validator.h: the rules both front ends share, on specs as the gRPC
// front end builds them (proto values, NaN included) and on the limits after tokenization.
#include "services/router/request_validator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace epd::services::router {
namespace {

GenerateSpec Good() {
  GenerateSpec spec;
  spec.model = "m";
  spec.chat.emplace();
  spec.chat->messages = {{.role = "user", .content = "q"}};
  return spec;  // sampling as proto leaves it: 0 = default where 0 is not a value
}

CoreOptions Options() {
  CoreOptions o;
  o.model = "m";
  o.context_length = 100;
  o.max_tokens_limit = 40;
  o.default_max_tokens = 30;
  return o;
}

struct Refusal {
  absl::StatusCode code;
  std::string param;
  std::string error_code;
};

Refusal Check(const GenerateSpec& spec) {
  absl::Status s = ValidateSpec(spec, Options());
  return {s.code(), ErrorParam(s), ErrorCode(s)};
}

void ExpectRefused(const GenerateSpec& spec, absl::StatusCode code, const std::string& param,
                   const std::string& error_code) {
  const Refusal r = Check(spec);
  EXPECT_EQ(r.code, code);
  EXPECT_EQ(r.param, param);
  EXPECT_EQ(r.error_code, error_code);
}

TEST(RequestValidatorTest, AcceptsAGoodRequestAndTheRangeEnds) {
  EXPECT_TRUE(ValidateSpec(Good(), Options()).ok());
  GenerateSpec s = Good();
  s.sampling.set_temperature(2);
  s.sampling.set_top_p(0);
  s.sampling.set_top_k(1 << 20);
  s.sampling.set_min_p(1);
  s.sampling.set_repetition_penalty(10);
  s.sampling.set_frequency_penalty(-2);
  s.sampling.set_presence_penalty(2);
  for (const char* stop : {"a", "b", "c", "d"}) s.sampling.add_stop(stop);
  EXPECT_TRUE(ValidateSpec(s, Options()).ok());
}

TEST(RequestValidatorTest, NamesTheParamAndCode) {
  using C = absl::StatusCode;
  auto with = [](auto edit) {
    GenerateSpec s = Good();
    edit(s);
    return s;
  };
  ExpectRefused(with([](auto& s) { s.model = "x"; }), C::kNotFound, "model", "model_not_found");
  ExpectRefused(with([](auto& s) { s.model = ""; }), C::kInvalidArgument, "model",
                "missing_required_parameter");
  ExpectRefused(with([](auto& s) { s.sampling.set_temperature(2.5f); }), C::kInvalidArgument,
                "temperature", "invalid_value");
  ExpectRefused(
      with([](auto& s) { s.sampling.set_temperature(std::numeric_limits<float>::quiet_NaN()); }),
      C::kInvalidArgument, "temperature", "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_top_p(-0.1f); }), C::kInvalidArgument, "top_p",
                "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_top_k(-1); }), C::kInvalidArgument, "top_k",
                "invalid_value");  // the front ends turn -1 into 0 before
  ExpectRefused(with([](auto& s) { s.sampling.set_min_p(1.5f); }), C::kInvalidArgument, "min_p",
                "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_repetition_penalty(0.001f); }),
                C::kInvalidArgument, "repetition_penalty", "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_repetition_penalty(-1); }), C::kInvalidArgument,
                "repetition_penalty", "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_frequency_penalty(-2.5f); }), C::kInvalidArgument,
                "frequency_penalty", "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_max_tokens(-1); }), C::kInvalidArgument,
                "max_tokens", "invalid_value");
  ExpectRefused(with([](auto& s) {
                  for (const char* stop : {"a", "b", "c", "d", "e"}) s.sampling.add_stop(stop);
                }),
                C::kInvalidArgument, "stop", "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.add_stop(""); }), C::kInvalidArgument, "stop",
                "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_top_logprobs(2); }), C::kInvalidArgument,
                "top_logprobs", "invalid_value");  // without logprobs
  ExpectRefused(with([](auto& s) {
                  s.sampling.set_logprobs(true);
                  s.sampling.set_top_logprobs(21);
                }),
                C::kInvalidArgument, "top_logprobs", "invalid_value");
  ExpectRefused(with([](auto& s) { s.sampling.set_n(129); }), C::kInvalidArgument, "n",
                "invalid_value");
  ExpectRefused(with([](auto& s) { s.chat->messages.clear(); }), C::kInvalidArgument, "messages",
                "invalid_value");
  ExpectRefused(
      with([](auto& s) { s.chat->messages.push_back({.role = "wizard", .content = "x"}); }),
      C::kInvalidArgument, "messages[1].role", "invalid_value");
  ExpectRefused(with([](auto& s) {
                  s.chat->messages[0].tool_calls.push_back({"id", "f", "{}"});
                }),
                C::kInvalidArgument, "messages[0].tool_calls", "invalid_value");
}

TEST(RequestValidatorTest, LengthLimits) {
  const CoreOptions o = Options();  // context 100, limit 40, default 30
  auto refused = [&](int64_t n, int64_t asked) {
    auto r = ValidateLength(n, asked, o, "messages");
    EXPECT_FALSE(r.ok());
    return std::make_pair(ErrorParam(r.status()), ErrorCode(r.status()));
  };
  EXPECT_EQ(*ValidateLength(10, 0, o, "messages"), 30);  // the default
  EXPECT_EQ(*ValidateLength(80, 0, o, "messages"), 20);  // capped by the context left
  EXPECT_EQ(*ValidateLength(60, 40, o, "messages"), 40);
  EXPECT_EQ(refused(0, 0), std::make_pair(std::string("messages"), std::string("invalid_value")));
  EXPECT_EQ(refused(100, 0),
            std::make_pair(std::string("messages"), std::string("context_length_exceeded")));
  EXPECT_EQ(refused(10, 41),
            std::make_pair(std::string("max_tokens"), std::string("max_tokens_exceeded")));
  EXPECT_EQ(refused(61, 40),
            std::make_pair(std::string("max_tokens"), std::string("context_length_exceeded")));
}

}  // namespace
}  // namespace epd::services::router
