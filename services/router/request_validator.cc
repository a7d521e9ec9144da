#include "services/router/request_validator.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace epd::services::router {
namespace {

absl::Status Invalid(std::string message, std::string param, std::string code = "invalid_value") {
  return ApiError(absl::StatusCode::kInvalidArgument, std::move(message), std::move(param),
                  std::move(code));
}

// NaN fails every comparison, so `!(lo <= x && x <= hi)` also refuses it (gRPC floats can be NaN).
absl::Status InRange(const char* param, double x, double lo, double hi) {
  if (lo <= x && x <= hi) return absl::OkStatus();
  return Invalid(absl::StrCat("'", param, "' is ", x, "; it must be in [", lo, ", ", hi, "]"),
                 param);
}

bool KnownRole(const std::string& r) {
  return r == "system" || r == "developer" || r == "user" || r == "assistant" || r == "tool";
}

absl::Status ValidateSampling(const epd::v1::SamplingParams& s) {
  using L = SamplingLimits;
  if (auto st = InRange("temperature", s.temperature(), 0, L::kTemperatureMax); !st.ok()) return st;
  if (auto st = InRange("top_p", s.top_p(), 0, 1); !st.ok()) return st;
  if (s.top_k() < 0 || s.top_k() > L::kTopKMax) {
    return Invalid(absl::StrCat("'top_k' is ", s.top_k(), "; it must be -1 or 0 (off) or in [1, ",
                                L::kTopKMax, "]"),
                   "top_k");
  }
  if (auto st = InRange("min_p", s.min_p(), 0, 1); !st.ok()) return st;
  // 0 is proto's "not set" (the workers read it as 1), over HTTP as over gRPC.
  if (s.repetition_penalty() != 0) {
    if (auto st = InRange("repetition_penalty", s.repetition_penalty(), L::kRepetitionPenaltyMin,
                          L::kRepetitionPenaltyMax);
        !st.ok()) {
      return st;
    }
  }
  if (auto st = InRange("frequency_penalty", s.frequency_penalty(), -L::kPenaltyAbsMax,
                        L::kPenaltyAbsMax);
      !st.ok()) {
    return st;
  }
  if (auto st =
          InRange("presence_penalty", s.presence_penalty(), -L::kPenaltyAbsMax, L::kPenaltyAbsMax);
      !st.ok()) {
    return st;
  }
  if (s.max_tokens() < 0) {
    return Invalid(absl::StrCat("'max_tokens' is ", s.max_tokens(),
                                "; it must be at least 1 (or absent for the server's default)"),
                   "max_tokens");
  }
  if (s.stop_size() > L::kMaxStopStrings) {
    return Invalid(absl::StrCat("'stop' may hold at most ", L::kMaxStopStrings, " strings"),
                   "stop");
  }
  for (const auto& stop : s.stop()) {
    if (stop.empty()) return Invalid("'stop' strings must not be empty", "stop");
  }
  if (s.top_logprobs() < 0 || s.top_logprobs() > 20) {
    return Invalid(absl::StrCat("'top_logprobs' is ", s.top_logprobs(), "; it must be in [0, 20]"),
                   "top_logprobs");
  }
  if (s.top_logprobs() > 0 && !s.logprobs()) {
    return Invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs");
  }
  if (s.n() < 0 || s.n() > 128) {
    return Invalid(absl::StrCat("'n' is ", s.n(), "; it must be in [1, 128]"), "n");
  }
  return absl::OkStatus();
}

absl::Status ValidateChat(const ChatRenderInput& chat) {
  if (chat.messages.empty()) return Invalid("'messages' must not be empty", "messages");
  for (size_t i = 0; i < chat.messages.size(); ++i) {
    const ChatMessage& m = chat.messages[i];
    const std::string param = absl::StrCat("messages[", i, "]");
    if (!KnownRole(m.role)) {
      return Invalid(absl::StrCat(param, ".role '", m.role,
                                  "' is not one of system, developer, user, assistant, tool"),
                     param + ".role");
    }
    if (!m.tool_calls.empty() && m.role != "assistant") {
      return Invalid(param + ".tool_calls is only allowed on an assistant message",
                     param + ".tool_calls");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateToolChoice(const std::string& choice) {
  if (choice.empty() || choice == "none" || choice == "auto" || choice == "required") {
    return absl::OkStatus();
  }
  return Invalid("'tool_choice' must be none, auto, required or a function object", "tool_choice");
}

absl::Status ValidateSpec(const GenerateSpec& spec, const CoreOptions& options) {
  if (spec.model.empty()) {
    return Invalid("'model' is required", "model", "missing_required_parameter");
  }
  if (spec.model != options.model) {
    return ApiError(absl::StatusCode::kNotFound,
                    absl::StrCat("The model '", spec.model, "' does not exist"), "model",
                    "model_not_found");
  }
  if (spec.chat) {
    if (auto st = ValidateChat(*spec.chat); !st.ok()) return st;
  }
  return ValidateSampling(spec.sampling);
}

absl::StatusOr<int32_t> ValidateLength(int64_t n, int64_t asked, const CoreOptions& options,
                                       const char* input_param) {
  if (n == 0) return Invalid("the prompt is empty", input_param);
  if (n >= options.context_length) {
    return Invalid(
        absl::StrCat("This model's maximum context length is ", options.context_length,
                     " tokens. However, your ", input_param, " resulted in ", n, " tokens."),
        input_param, "context_length_exceeded");
  }
  if (asked <= 0) {
    return static_cast<int32_t>(std::min<int64_t>(
        {options.default_max_tokens, options.max_tokens_limit, options.context_length - n}));
  }
  if (asked > options.max_tokens_limit) {
    return Invalid(absl::StrCat("max_tokens is ", asked, ", above this server's limit of ",
                                options.max_tokens_limit),
                   "max_tokens", "max_tokens_exceeded");
  }
  if (n + asked > options.context_length) {
    return Invalid(absl::StrCat("This model's maximum context length is ", options.context_length,
                                " tokens. However, you requested ", n + asked, " tokens (", n,
                                " in the ", input_param, ", ", asked, " in the completion)."),
                   "max_tokens", "context_length_exceeded");
  }
  return static_cast<int32_t>(asked);
}

}  // namespace epd::services::router
