#pragma once

// The one request validation of the router's front ends. The OpenAI HTTP API (openai_http.cc)
// and the gRPC Inference service (grpc_api.cc) only translate their wire format into a
// GenerateSpec (rejecting what their format cannot hold: a JSON type error, a missing JSON
// field); every rule about values (sampling ranges, limits, the served model, chat roles, the
// context length) lives here, so the same bad request gets the same error on both: the same
// absl status code (HTTP status / gRPC code), the same OpenAI `param` and `code`.
//
// Reentrant: free functions over their arguments.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "services/router/router_core.h"

namespace epd::services::router {

// The sampling ranges, shared by both front ends (docs/api.md "Parameters"). A gRPC field left
// at proto's 0 means "default" where 0 is not a valid value (top_p, repetition_penalty); the
// front end turns it into the default before validation.
struct SamplingLimits {
  static constexpr double kTemperatureMax = 2.0;
  static constexpr int32_t kTopKMax = 1 << 20;
  static constexpr double kRepetitionPenaltyMin = 0.01;
  static constexpr double kRepetitionPenaltyMax = 10.0;
  static constexpr double kPenaltyAbsMax = 2.0;  // frequency / presence
  static constexpr int kMaxStopStrings = 4;
};

// Everything knowable before tokenization: model (NotFound model_not_found; empty =
// missing_required_parameter), sampling ranges, max_tokens >= 0 (0 = the server's default), stop
// strings, top_logprobs [0, 20] (only with logprobs), n [1, 128], chat messages (non-empty; roles system | developer |
// user | assistant | tool; tool_calls only on assistant turns). Errors are ApiError with the
// OpenAI param ("temperature", "messages[2].role", ...) and code.
absl::Status ValidateSpec(const GenerateSpec& spec, const CoreOptions& options);

// tool_choice as a string: none | auto | required ("" = auto, gRPC's unset). HTTP's object form
// (a named function) is checked by its parser.
absl::Status ValidateToolChoice(const std::string& choice);

// The limits after tokenization, for a prompt of `prompt_tokens` tokens and `asked` max_tokens
// (0 = default): non-empty prompt, prompt within the context, max_tokens within the server's
// limit and, with the prompt, within the context. Returns the max_tokens the request runs with.
// `input_param` names the prompt ("messages" for chat, "prompt" otherwise).
absl::StatusOr<int32_t> ValidateLength(int64_t prompt_tokens, int64_t asked,
                                       const CoreOptions& options, const char* input_param);

}  // namespace epd::services::router
