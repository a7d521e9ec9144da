#include "services/router/openai_http.h"

#include "common/cluster_secret.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"
#include "runtime/http_util.h"
#include "services/router/output_assembly.h"
#include "services/router/request_validator.h"
#include "services/router/utf8.h"

namespace epd::services::router {
namespace {

using json = nlohmann::json;

absl::Status Bad(std::string message, std::string param, std::string code = "invalid_type") {
  return ApiError(absl::StatusCode::kInvalidArgument, std::move(message), std::move(param),
                  std::move(code));
}

int HttpStatus(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

// Responses carry model output (tool-call names, arguments) that may hold invalid UTF-8: replaced
// by U+FFFD instead of throwing out of a handler.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json ErrorJson(const absl::Status& s) {
  const int status = HttpStatus(s);
  const char* type = status == 401   ? "authentication_error"
                     : status == 429 ? "rate_limit_error"
                     : status == 404 ? "invalid_request_error"
                     : status < 500  ? "invalid_request_error"
                                     : "server_error";
  const std::string param = ErrorParam(s), code = ErrorCode(s);
  return json{{"error",
               {{"message", std::string(s.message())},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

void SendError(httplib::Response& res, const absl::Status& s) {
  res.status = HttpStatus(s);
  res.set_content(Dump(ErrorJson(s)), "application/json");
}

// The router owns request identity (docs/security.md): 128 bits from the CSPRNG, unique and
// unguessable (a worker's Cancel and hand-offs are keyed by it).
std::string NewRequestId(const char* prefix) {
  return absl::StrCat(prefix, common::ToHex(common::RandomBytes(16)));
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Optional field helpers: absent and null are "not given".
const json* Field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status GetNumber(const json& obj, const char* key, double lo, double hi, double* out) {
  const json* v = Field(obj, key);
  if (!v) return absl::OkStatus();
  if (!v->is_number()) return Bad(absl::StrCat("'", key, "' must be a number"), key);
  const double x = v->get<double>();
  if (x < lo || x > hi) {
    return Bad(absl::StrCat("'", key, "' is ", x, "; it must be in [", lo, ", ", hi, "]"), key,
               "invalid_value");
  }
  *out = x;
  return absl::OkStatus();
}

absl::Status GetInt(const json& obj, const char* key, int64_t lo, int64_t hi, int64_t* out) {
  const json* v = Field(obj, key);
  if (!v) return absl::OkStatus();
  if (!v->is_number_integer() && !v->is_number_unsigned()) {
    return Bad(absl::StrCat("'", key, "' must be an integer"), key);
  }
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return Bad(absl::StrCat("'", key, "' is too large"), key, "invalid_value");
  }
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) {
    return Bad(absl::StrCat("'", key, "' is ", x, "; it must be in [", lo, ", ", hi, "]"), key,
               "invalid_value");
  }
  *out = x;
  return absl::OkStatus();
}

absl::Status GetBool(const json& obj, const char* key, bool* out) {
  const json* v = Field(obj, key);
  if (!v) return absl::OkStatus();
  if (!v->is_boolean()) return Bad(absl::StrCat("'", key, "' must be a boolean"), key);
  *out = v->get<bool>();
  return absl::OkStatus();
}

// The string at obj[key], or "" when obj is not an object or the field is missing or not a string.
// json::value() throws on a present field of another type; request parsing must never throw.
std::string StringField(const json& obj, const char* key) {
  const json* v = obj.is_object() ? Field(obj, key) : nullptr;
  return v && v->is_string() ? v->get<std::string>() : std::string();
}

// content: string, or an array of {"type":"text","text":...} parts.
absl::Status MessageContent(const json& m, const std::string& param, std::string* out) {
  const json* c = Field(m, "content");
  if (!c) return absl::OkStatus();
  if (c->is_string()) {
    *out = c->get<std::string>();
    return absl::OkStatus();
  }
  if (!c->is_array()) return Bad(param + " must be a string or an array of parts", param);
  for (size_t i = 0; i < c->size(); ++i) {
    const json& part = (*c)[i];
    const std::string pp = absl::StrCat(param, "[", i, "]");
    if (!part.is_object() || StringField(part, "type") != "text" || !part.contains("text") ||
        !part["text"].is_string()) {
      return Bad(pp + " must be a text part {\"type\":\"text\",\"text\":...}; other part types "
                      "are not supported",
                 pp, "invalid_value");
    }
    *out += part["text"].get<std::string>();
  }
  return absl::OkStatus();
}

absl::Status ParseMessages(const json& body, ChatRenderInput* chat) {
  const json* msgs = Field(body, "messages");
  if (!msgs) return Bad("'messages' is required", "messages", "missing_required_parameter");
  if (!msgs->is_array()) return Bad("'messages' must be an array", "messages");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string param = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return Bad(param + " must be an object", param);
    const json* role = Field(m, "role");
    if (!role || !role->is_string()) return Bad(param + ".role must be a string", param + ".role");
    ChatMessage msg;
    msg.role = role->get<std::string>();
    if (auto s = MessageContent(m, param + ".content", &msg.content); !s.ok()) return s;
    if (msg.role != "assistant" && !Field(m, "content")) {
      return Bad(param + ".content is required", param + ".content", "missing_required_parameter");
    }
    if (const json* r = Field(m, "reasoning_content")) {
      if (!r->is_string()) return Bad(param + ".reasoning_content must be a string", param);
      msg.reasoning_content = r->get<std::string>();
    }
    if (const json* n = Field(m, "name")) {
      if (!n->is_string()) return Bad(param + ".name must be a string", param + ".name");
      msg.name = n->get<std::string>();
    }
    if (msg.role == "tool") {
      const json* id = Field(m, "tool_call_id");
      if (id && !id->is_string()) {
        return Bad(param + ".tool_call_id must be a string", param + ".tool_call_id");
      }
      if (id) msg.tool_call_id = id->get<std::string>();
    }
    if (const json* tcs = Field(m, "tool_calls")) {
      const std::string tp = param + ".tool_calls";
      if (msg.role != "assistant" || !tcs->is_array()) {
        return Bad(tp + " must be an array on an assistant message", tp);
      }
      for (size_t k = 0; k < tcs->size(); ++k) {
        const json& tc = (*tcs)[k];
        const std::string kp = absl::StrCat(tp, "[", k, "]");
        if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object() ||
            !tc["function"].contains("name") || !tc["function"]["name"].is_string()) {
          return Bad(kp + " must be {\"type\":\"function\",\"function\":{\"name\":...,"
                          "\"arguments\":...}}",
                     kp);
        }
        ToolCall call;
        if (const json* id = Field(tc, "id"); id && !id->is_string()) {
          return Bad(kp + ".id must be a string", kp + ".id");
        }
        call.id = StringField(tc, "id");
        call.name = tc["function"]["name"].get<std::string>();
        const json* args = Field(tc["function"], "arguments");
        if (args && args->is_string()) {
          call.arguments_json = args->get<std::string>();
        } else if (args && args->is_object()) {
          call.arguments_json = args->dump();
        } else {
          call.arguments_json = "{}";
        }
        msg.tool_calls.push_back(std::move(call));
      }
    }
    if (msg.role == "assistant" && !Field(m, "content") && msg.tool_calls.empty()) {
      return Bad(param + ".content is required unless tool_calls is given", param + ".content",
                 "missing_required_parameter");
    }
    chat->messages.push_back(std::move(msg));
  }
  return absl::OkStatus();
}

absl::Status ParseTools(const json& body, GenerateSpec* spec) {
  const json* tools = Field(body, "tools");
  std::string choice = "auto";
  if (const json* tc = Field(body, "tool_choice")) {
    if (tc->is_string()) {
      choice = tc->get<std::string>();
      if (auto s = ValidateToolChoice(choice); !s.ok()) return s;
    } else if (tc->is_object()) {
      choice = "function";
    } else {
      return Bad("'tool_choice' must be a string or an object", "tool_choice");
    }
  }
  bool parallel = true;
  if (auto s = GetBool(body, "parallel_tool_calls", &parallel); !s.ok()) return s;
  if (choice == "required" || choice == "function") {
    if (!tools || !tools->is_array() || tools->empty()) {
      return Bad("'tool_choice' " + choice + " needs a non-empty 'tools'", "tool_choice",
                 "invalid_value");
    }
    std::string only;
    if (choice == "function") {
      const json& tc = body["tool_choice"];
      if (!tc.contains("function") || !tc["function"].is_object() ||
          !tc["function"].contains("name") || !tc["function"]["name"].is_string()) {
        return Bad("'tool_choice' must be {\"type\":\"function\",\"function\":{\"name\":...}}",
                   "tool_choice");
      }
      only = tc["function"]["name"].get<std::string>();
    }
    auto c = ToolCallConstraint(*tools, only, parallel && only.empty(), "tool_choice");
    if (!c.ok()) return c.status();
    spec->sampling.set_constraint(*c);
    spec->constraint_param = "tools";
  }
  if (!tools) return absl::OkStatus();
  if (!tools->is_array()) return Bad("'tools' must be an array", "tools");
  for (size_t i = 0; i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    const std::string param = absl::StrCat("tools[", i, "]");
    if (!t.is_object() || StringField(t, "type") != "function" || !t.contains("function") ||
        !t["function"].is_object() || !t["function"].contains("name") ||
        !t["function"]["name"].is_string()) {
      return Bad(param + " must be {\"type\":\"function\",\"function\":{\"name\":...}}", param);
    }
  }
  if (!tools->empty() && choice != "none") {
    spec->chat->tools_json = tools->dump();
    spec->parse_tools = true;
  }
  return absl::OkStatus();
}

// response_format: text | json_object | json_schema (enforced by the decode worker's grammar
// mask). A forced tool call (tool_choice) takes precedence.
absl::Status ParseResponseFormat(const json& body, GenerateSpec* spec) {
  const json* rf = Field(body, "response_format");
  if (!rf) return absl::OkStatus();
  if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string()) {
    return Bad("'response_format' must be {\"type\":\"text\"|\"json_object\"|\"json_schema\"}",
               "response_format");
  }
  const std::string type = (*rf)["type"].get<std::string>();
  json c;
  if (type == "text") return absl::OkStatus();
  if (type == "json_object") {
    c = {{"type", "json_object"}};
  } else if (type == "json_schema") {
    const json* js = Field(*rf, "json_schema");
    if (!js || !js->is_object() || !Field(*js, "schema")) {
      return Bad("'response_format.json_schema' must be {\"name\":...,\"schema\":{...}}",
                 "response_format.json_schema", "missing_required_parameter");
    }
    c = {{"type", "json_schema"}, {"schema", (*js)["schema"]}};
    // strict false (OpenAI: the schema is guidance, not enforced): the grammar still enforces
    // what it supports and ignores the keywords it does not, instead of refusing them.
    if (const json* strict = Field(*js, "strict"); strict && *strict == false) c["strict"] = false;
  } else {
    return Bad("'response_format.type' must be text, json_object or json_schema",
               "response_format", "unsupported_value");
  }
  if (!spec->sampling.constraint().empty()) return absl::OkStatus();
  spec->sampling.set_constraint(c.dump());
  spec->constraint_param = "response_format";
  return absl::OkStatus();
}

absl::Status ParseThinking(const json& body, ChatRenderInput* chat) {
  std::optional<bool> thinking;
  if (const json* t = Field(body, "thinking")) {
    if (t->is_boolean()) {
      thinking = t->get<bool>();
    } else if (t->is_object() && t->contains("type") && (*t)["type"].is_string()) {
      const std::string type = (*t)["type"].get<std::string>();
      if (type != "enabled" && type != "disabled") {
        return Bad("'thinking.type' must be enabled or disabled", "thinking", "invalid_value");
      }
      thinking = type == "enabled";
    } else {
      return Bad("'thinking' must be a boolean or {\"type\":\"enabled\"|\"disabled\"}",
                 "thinking");
    }
  }
  if (const json* k = Field(body, "chat_template_kwargs")) {
    if (!k->is_object()) return Bad("'chat_template_kwargs' must be an object",
                                    "chat_template_kwargs");
    for (const char* key : {"thinking", "enable_thinking"}) {
      if (const json* t = Field(*k, key)) {
        if (!t->is_boolean()) {
          return Bad(absl::StrCat("'chat_template_kwargs.", key, "' must be a boolean"),
                     "chat_template_kwargs");
        }
        thinking = t->get<bool>();
      }
    }
  }
  if (const json* e = Field(body, "reasoning_effort")) {
    if (!e->is_string()) return Bad("'reasoning_effort' must be a string", "reasoning_effort");
    chat->reasoning_effort = e->get<std::string>();
    if (!thinking) thinking = true;  // asking for an effort asks for thinking
  }
  chat->thinking = thinking.value_or(false);
  return absl::OkStatus();
}

absl::Status ParseSampling(const json& body, bool chat, GenerateSpec* spec) {
  auto& s = spec->sampling;
  double x = 1.0;
  // JSON types here; value ranges, limits, model and roles in ValidateSpec (request_validator.h),
  // which the gRPC front end shares.
  constexpr double kAny = std::numeric_limits<double>::infinity();
  if (auto st = GetNumber(body, "temperature", -kAny, kAny, &x); !st.ok()) return st;
  s.set_temperature(Field(body, "temperature") ? static_cast<float>(x) : 1.0f);
  x = 1.0;
  if (auto st = GetNumber(body, "top_p", -kAny, kAny, &x); !st.ok()) return st;
  s.set_top_p(static_cast<float>(x));
  int64_t k = 0;
  if (auto st = GetInt(body, "top_k", INT32_MIN, INT32_MAX, &k); !st.ok()) return st;
  s.set_top_k(static_cast<int32_t>(k == -1 ? 0 : k));  // -1 = off, as 0
  x = 0;
  if (auto st = GetNumber(body, "min_p", -kAny, kAny, &x); !st.ok()) return st;
  s.set_min_p(static_cast<float>(x));
  x = 1.0;
  if (auto st = GetNumber(body, "repetition_penalty", -kAny, kAny, &x); !st.ok()) return st;
  s.set_repetition_penalty(static_cast<float>(x));
  x = 0;
  if (auto st = GetNumber(body, "frequency_penalty", -kAny, kAny, &x); !st.ok()) return st;
  s.set_frequency_penalty(static_cast<float>(x));
  x = 0;
  if (auto st = GetNumber(body, "presence_penalty", -kAny, kAny, &x); !st.ok()) return st;
  s.set_presence_penalty(static_cast<float>(x));
  if (const json* seed = Field(body, "seed")) {
    if (!seed->is_number_integer() && !seed->is_number_unsigned()) {
      return Bad("'seed' must be an integer", "seed");
    }
    s.set_seed(seed->is_number_unsigned() ? seed->get<uint64_t>()
                                          : static_cast<uint64_t>(seed->get<int64_t>()));
  }
  int64_t n = 1;
  if (auto st = GetInt(body, "n", 1, INT32_MAX, &n); !st.ok()) return st;  // <= 128: ValidateSpec
  s.set_n(static_cast<int32_t>(n));
  if (!chat && Field(body, "best_of")) {
    // best_of samples, the n with the highest mean token logprob returned (KeepBestOf).
    int64_t best_of = n;
    if (auto st = GetInt(body, "best_of", 1, 128, &best_of); !st.ok()) return st;
    if (best_of < n) {
      return Bad(absl::StrCat("'best_of' is ", best_of, "; it must be at least 'n' (", n, ")"),
                 "best_of", "invalid_value");
    }
    if (best_of > n) {
      spec->best_of_keep = static_cast<int32_t>(n);
      s.set_n(static_cast<int32_t>(best_of));
    }
  }
  // Chat: logprobs (bool) + top_logprobs [0, 20]; completions: logprobs = the top count.
  bool logprobs = false;
  int64_t top = 0;
  if (chat) {
    if (auto st = GetBool(body, "logprobs", &logprobs); !st.ok()) return st;
    // [0, 20] and "only with logprobs": ValidateSpec.
    if (auto st = GetInt(body, "top_logprobs", INT32_MIN, INT32_MAX, &top); !st.ok()) return st;
  } else if (Field(body, "logprobs")) {  // the range here: the param is named logprobs
    if (auto st = GetInt(body, "logprobs", 0, 20, &top); !st.ok()) return st;
    logprobs = true;
  }
  if (spec->best_of_keep > 0 && !logprobs) {
    spec->hide_logprobs = true;  // the ranking needs each chosen token's logprob
    logprobs = true;
  }
  s.set_logprobs(logprobs);
  s.set_top_logprobs(static_cast<int32_t>(top));
  int64_t max_tokens = 0;
  const char* max_key = "max_tokens";
  if (chat && Field(body, "max_completion_tokens")) max_key = "max_completion_tokens";
  if (auto st = GetInt(body, max_key, INT32_MIN, INT32_MAX, &max_tokens); !st.ok()) return st;
  if (max_tokens == 0 && Field(body, max_key)) {  // gRPC cannot say 0: there it is the default
    return Bad(absl::StrCat("'", max_key, "' is 0; it must be at least 1"), max_key,
               "invalid_value");
  }
  if (!chat && max_tokens == 0 && !Field(body, "max_tokens")) max_tokens = 16;  // OpenAI default
  s.set_max_tokens(static_cast<int32_t>(max_tokens));
  if (const json* stop = Field(body, "stop")) {
    if (stop->is_string()) {
      s.add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const auto& e : *stop) {
        if (!e.is_string()) return Bad("'stop' must be a string or an array of strings", "stop");
        s.add_stop(e.get<std::string>());
      }
    } else {
      return Bad("'stop' must be a string or an array of strings", "stop");
    }
  }
  return absl::OkStatus();
}

json UsageJson(const Outcome& o) {
  return json{{"prompt_tokens", o.prompt_tokens},
              {"completion_tokens", o.completion_tokens},
              {"total_tokens", o.prompt_tokens + o.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", o.cached_tokens}}},
              {"completion_tokens_details", {{"reasoning_tokens", o.reasoning_tokens}}}};
}

// One token as the OpenAI logprob entries show it: its text (lossy UTF-8) and its raw bytes.
std::pair<std::string, json> TokenText(const TextCodec& codec, int32_t id) {
  std::string raw = codec.TokenBytes(id);
  json bytes = json::array();
  for (unsigned char c : raw) bytes.push_back(static_cast<int>(c));
  std::string text = TakeCompleteUtf8(&raw, /*flush=*/true);
  return {std::move(text), std::move(bytes)};
}

// Chat: {"content":[{"token","logprob","bytes","top_logprobs":[{"token","logprob","bytes"}]}]}.
json ChatLogprobsJson(const TextCodec& codec, const std::vector<TokenLogprobs>& lps) {
  json content = json::array();
  for (const TokenLogprobs& t : lps) {
    auto [text, bytes] = TokenText(codec, t.token);
    json top = json::array();
    for (const auto& [id, lp] : t.top) {
      auto [ttext, tbytes] = TokenText(codec, id);
      top.push_back({{"token", std::move(ttext)}, {"logprob", lp}, {"bytes", std::move(tbytes)}});
    }
    content.push_back({{"token", std::move(text)},
                       {"logprob", t.logprob},
                       {"bytes", std::move(bytes)},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}, {"refusal", nullptr}};
}

// Completions: {"tokens","token_logprobs","top_logprobs":[{token: logprob}],"text_offset"};
// *offset is the byte offset of the next token's text in the completion and advances.
json CompletionLogprobsJson(const TextCodec& codec, const std::vector<TokenLogprobs>& lps,
                            int64_t* offset) {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(),
       offsets = json::array();
  for (const TokenLogprobs& t : lps) {
    std::string text = TokenText(codec, t.token).first;
    offsets.push_back(*offset);
    *offset += static_cast<int64_t>(codec.TokenBytes(t.token).size());
    tokens.push_back(std::move(text));
    token_lps.push_back(t.logprob);
    json top = json::object();
    for (const auto& [id, lp] : t.top) top[TokenText(codec, id).first] = lp;
    tops.push_back(std::move(top));
  }
  return json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(token_lps)},
              {"top_logprobs", std::move(tops)},
              {"text_offset", std::move(offsets)}};
}

json ToolCallsJson(const std::vector<ToolCall>& calls, bool with_index) {
  json arr = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json c = {{"id", calls[i].id},
              {"type", "function"},
              {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments_json}}}};
    if (with_index) c["index"] = i;
    arr.push_back(std::move(c));
  }
  return arr;
}

// Collects deltas for a non-streaming response.
class Collector final : public StreamObserver {
 public:
  bool OnDelta(const Delta&) override { return true; }
};

// Writes deltas as SSE chunks; false once the client is gone.
class SseWriter final : public StreamObserver {
 public:
  // `codec` non-null: the request asked for logprobs and every chunk with tokens carries them.
  SseWriter(httplib::DataSink& sink, json base, bool chat, const TextCodec* codec)
      : sink_(sink), base_(std::move(base)), chat_(chat), codec_(codec) {}

  bool Send(const json& j) { return Write(absl::StrCat("data: ", Dump(j), "\n\n")); }
  bool Write(const std::string& s) {
    if (broken_) return false;
    if (!sink_.write(s.data(), s.size())) broken_ = true;
    return !broken_;
  }

  json Chunk(json delta_or_text, json finish, json logprobs = nullptr, int index = 0) const {
    json j = base_;
    json choice = {{"index", index}, {"finish_reason", std::move(finish)},
                   {"logprobs", std::move(logprobs)}};
    if (chat_) {
      choice["delta"] = std::move(delta_or_text);
    } else {
      choice["text"] = std::move(delta_or_text);
    }
    j["choices"] = json::array({std::move(choice)});
    return j;
  }

  bool OnDelta(const Delta& d) override {
    // With logprobs, a chunk goes out for every token even when its text is held back.
    const bool lp = codec_ != nullptr && !d.logprobs.empty();
    if (chat_) {
      json delta = json::object();
      if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
      if (!d.content.empty()) delta["content"] = d.content;
      if (delta.empty() && !lp) return !broken_;  // tokens held back (marker / tool block)
      return Send(Chunk(std::move(delta), nullptr,
                        lp ? ChatLogprobsJson(*codec_, d.logprobs) : json(nullptr), d.index));
    }
    const std::string text = d.reasoning + d.content;
    if (text.empty() && !lp) return !broken_;
    if (offsets_.size() <= static_cast<size_t>(d.index)) offsets_.resize(d.index + 1, 0);
    return Send(Chunk(text, nullptr,
                      lp ? CompletionLogprobsJson(*codec_, d.logprobs, &offsets_[d.index])
                         : json(nullptr),
                      d.index));
  }

 private:
  httplib::DataSink& sink_;
  json base_;
  bool chat_;
  const TextCodec* codec_;
  std::vector<int64_t> offsets_;  // completions' text_offset, per choice
  bool broken_ = false;
};

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

}  // namespace

absl::StatusOr<GenerateSpec> ParseOpenAiRequest(const json& body, bool chat, bool* stream,
                                                bool* include_usage) {
  if (!body.is_object()) return Bad("the request body must be a JSON object", "");
  GenerateSpec spec;
  const json* model = Field(body, "model");
  if (!model) return Bad("'model' is required", "model", "missing_required_parameter");
  if (!model->is_string()) return Bad("'model' must be a string", "model");
  spec.model = model->get<std::string>();
  *stream = false;
  *include_usage = false;
  if (auto s = GetBool(body, "stream", stream); !s.ok()) return s;
  if (const json* so = Field(body, "stream_options")) {
    if (!so->is_object()) return Bad("'stream_options' must be an object", "stream_options");
    if (auto s = GetBool(*so, "include_usage", include_usage); !s.ok()) return s;
  }
  if (chat) {
    spec.chat.emplace();
    if (auto s = ParseMessages(body, &*spec.chat); !s.ok()) return s;
    if (auto s = ParseTools(body, &spec); !s.ok()) return s;
    if (auto s = ParseThinking(body, &*spec.chat); !s.ok()) return s;
  } else {
    const json* prompt = Field(body, "prompt");
    if (!prompt) return Bad("'prompt' is required", "prompt", "missing_required_parameter");
    const json* p = prompt;
    if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) {
      p = &(*p)[0];
    }
    if (p->is_string()) {
      spec.prompt_text = p->get<std::string>();
    } else if (p->is_array() && !p->empty() && (*p)[0].is_number_integer()) {
      std::vector<int32_t> ids;
      for (const auto& e : *p) {
        if (!e.is_number_integer()) return Bad("'prompt' token arrays must hold integers", "prompt");
        const int64_t v = e.get<int64_t>();
        if (v < 0 || v > INT32_MAX) return Bad("'prompt' holds an invalid token id", "prompt",
                                                "invalid_value");
        ids.push_back(static_cast<int32_t>(v));
      }
      spec.prompt_ids = std::move(ids);
    } else {
      return Bad("'prompt' must be a string, an array with one string, or an array of token ids",
                 "prompt");
    }
    bool echo = false;
    if (auto s = GetBool(body, "echo", &echo); !s.ok()) return s;
    if (echo) return Bad("'echo' is not supported", "echo", "unsupported_parameter");
    if (Field(body, "suffix")) return Bad("'suffix' is not supported", "suffix",
                                          "unsupported_parameter");
  }
  if (auto s = ParseSampling(body, chat, &spec); !s.ok()) return s;
  if (spec.best_of_keep > 0 && *stream) {
    return Bad("'best_of' greater than 'n' cannot be streamed (the best samples are known only at "
               "the end)",
               "best_of", "unsupported_value");
  }
  if (auto s = ParseResponseFormat(body, &spec); !s.ok()) return s;
  return spec;
}

absl::StatusOr<std::string> ToolCallConstraint(const json& tools, const std::string& only,
                                               bool parallel, const std::string& param) {
  json list = json::array();
  for (const auto& t : tools) {
    if (!t.is_object() || !t.contains("function") || !t["function"].is_object() ||
        !t["function"].contains("name") || !t["function"]["name"].is_string()) {
      continue;  // ParseTools names a malformed tool
    }
    const std::string name = t["function"]["name"].get<std::string>();
    if (!only.empty() && name != only) continue;
    json entry = {{"name", name},
                  {"parameters", t["function"].value("parameters", json::object())}};
    // function.strict false: best effort, as for response_format (docs/api.md).
    if (t["function"].contains("strict") && t["function"]["strict"] == false) {
      entry["strict"] = false;
    }
    list.push_back(std::move(entry));
  }
  if (list.empty()) {
    return Bad(only.empty() ? "no tool to call"
                            : absl::StrCat("tool_choice names '", only, "', which is not in tools"),
               param, "invalid_value");
  }
  return json{{"type", "tool_calls"}, {"tools", std::move(list)}, {"parallel", parallel}}.dump();
}

std::string RouterHealthJson(RouterCore& core, bool* serving) {
  Registry& reg = core.registry();
  json pools = json::object();
  for (int p = 0; p < kNumPools; ++p) {
    const auto pool = static_cast<PoolKind>(p);
    json workers = json::array();
    for (const auto& w : reg.Workers(pool)) {
      workers.push_back({{"id", w.id},
                         {"address", w.control_address},
                         {"queue_depth", w.load.queue_depth},
                         {"running", w.load.running_requests},
                         {"inflight", w.router_inflight},
                         {"draining", w.draining}});
    }
    pools[PoolName(pool)] = {{"count", workers.size()}, {"workers", std::move(workers)}};
  }
  int decode = 0;
  for (const auto& w : reg.Workers(PoolKind::kDecode)) decode += !w.draining;
  *serving = decode > 0;
  json j = {{"serving", *serving},
            {"model", core.options().model},
            {"config_fingerprint", reg.Fingerprint()},
            {"pools", std::move(pools)},
            {"inflight_requests", core.inflight()},
            {"registration_refusals", reg.RecentRefusals()}};
  return j.dump();
}

OpenAiHttpServer::OpenAiHttpServer(RouterCore& core, std::shared_ptr<prometheus::Registry> metrics,
                                   HttpOptions options)
    : core_(core), metrics_(std::move(metrics)), options_(std::move(options)) {}

OpenAiHttpServer::~OpenAiHttpServer() { Stop(); }

absl::StatusOr<int> OpenAiHttpServer::Start(const std::string& host, int port) {
  if (server_) return absl::FailedPreconditionError("HTTP server already started");
  if (options_.tls_cert_file.empty() != options_.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and a key file");
  }
  if (!options_.tls_cert_file.empty()) {
    auto tls = std::make_unique<httplib::SSLServer>(options_.tls_cert_file.c_str(),
                                                    options_.tls_key_file.c_str());
    if (!tls->is_valid()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot load the TLS certificate ", options_.tls_cert_file, " / key ",
                       options_.tls_key_file, " (missing, not PEM, or not a pair)"));
    }
    server_ = std::move(tls);
  } else {
    server_ = std::make_unique<httplib::Server>();
  }
  const int threads = std::max(4, options_.threads);
  server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server_->set_payload_max_length(64u << 20);
  runtime::ConfigureListener(*server_);
  Routes();
  int bound = port;
  if (port == 0) {
    bound = server_->bind_to_any_port(host);
    if (bound < 0) {
      server_.reset();
      return absl::UnavailableError("cannot bind HTTP server on " + host);
    }
  } else if (!server_->bind_to_port(host, port)) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot bind HTTP server on ", host, ":", port,
                                               " (port in use?)"));
  }
  listener_.Start(server_.get());
  return bound;
}

void OpenAiHttpServer::Stop() {
  if (!server_) return;
  listener_.Stop();
  server_.reset();
}

namespace {

// With --api-key, /v1/* needs "Authorization: Bearer <key>": else a 401 (counted as a rejection)
// and false.
bool Authorized(RouterCore& core, const std::string& api_key, const httplib::Request& req,
                httplib::Response& res) {
  if (api_key.empty()) return true;
  const std::string header = req.get_header_value("Authorization");
  const std::string_view prefix = "Bearer ";
  if (header.size() > prefix.size() && header.compare(0, prefix.size(), prefix) == 0 &&
      ConstantTimeEquals(std::string_view(header).substr(prefix.size()), api_key)) {
    return true;
  }
  absl::Status s = ApiError(absl::StatusCode::kUnauthenticated,
                            header.empty() ? "Missing API key: send 'Authorization: Bearer <key>'"
                                           : "Incorrect API key provided",
                            "", "invalid_api_key");
  core.CountRejected(s);
  SendError(res, s);
  return false;
}

// GET /v1/models: the one model served.
void ListModels(RouterCore& core, httplib::Response& res) {
  json data = json::array();
  data.push_back({{"id", core.options().model},
                  {"object", "model"},
                  {"created", 0},
                  {"owned_by", "epd"},
                  {"max_model_len", core.options().context_length}});
  res.set_content(json{{"object", "list"}, {"data", std::move(data)}}.dump(), "application/json");
}

// GET /v1/models/{id}: the model served, else a 404 (counted as a rejection).
void GetModel(RouterCore& core, const std::string& id, httplib::Response& res) {
  if (id != core.options().model) {
    absl::Status s =
        ApiError(absl::StatusCode::kNotFound, absl::StrCat("The model '", id, "' does not exist"),
                 "model", "model_not_found");
    core.CountRejected(s);
    return SendError(res, s);
  }
  res.set_content(json{{"id", id},
                       {"object", "model"},
                       {"created", 0},
                       {"owned_by", "epd"},
                       {"max_model_len", core.options().context_length}}
                      .dump(),
                  "application/json");
}

// A generate request that passed every check: prepared, and admitted when admission is on.
struct Accepted {
  PreparedRequest prepared;
  std::shared_ptr<AdmissionQueue::Ticket> ticket;  // null without admission
  bool stream = false;
  bool include_usage = false;
};

// The checks of a generate request, in order: UTF-8, JSON, the OpenAI fields, the router's
// preparation, a live decode worker, and admission last, so a refused request costs nothing
// (429 + Retry-After at once). A refusal is counted and sent, and nullopt returned.
std::optional<Accepted> Accept(RouterCore& core, const HttpOptions& options, bool chat,
                               const httplib::Request& req, httplib::Response& res) {
  auto fail = [&](const absl::Status& s) -> std::optional<Accepted> {
    core.CountRejected(s);
    SendError(res, s);
    return std::nullopt;
  };
  if (!IsValidUtf8(req.body)) {
    return fail(Bad("the request body is not valid UTF-8", "", "invalid_utf8"));
  }
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return fail(Bad("the request body is not valid JSON", "", "invalid_json"));
  }
  Accepted a;
  auto spec = ParseOpenAiRequest(body, chat, &a.stream, &a.include_usage);
  if (!spec.ok()) return fail(spec.status());
  spec->request_id = NewRequestId(chat ? "chatcmpl-" : "cmpl-");
  auto prepared = core.Prepare(std::move(*spec));
  if (!prepared.ok()) {
    absl::Status s = prepared.status();
    if (ErrorParam(s) == "max_tokens" && chat && Field(body, "max_completion_tokens")) {
      s = ApiError(s.code(), std::string(s.message()), "max_completion_tokens", ErrorCode(s));
    }
    return fail(s);
  }
  bool serving = false;
  for (const auto& w : core.registry().Workers(PoolKind::kDecode)) serving |= !w.draining;
  if (!serving) {
    return fail(ApiError(absl::StatusCode::kUnavailable, "no live decode worker; try again later",
                         "", "no_workers"));
  }
  if (options.admission) {
    auto admitted = options.admission->Admit("http");
    if (!admitted.ok()) {
      res.set_header("Retry-After", std::to_string(options.admission->options().retry_after_s));
      return fail(admitted.status());
    }
    a.ticket = std::make_shared<AdmissionQueue::Ticket>(std::move(*admitted));
  }
  a.prepared = std::move(*prepared);
  return a;
}

// One choice of a whole (not streamed) response.
json WholeChoiceJson(RouterCore& core, const PreparedRequest& prepared, bool chat, size_t idx,
                     const Choice& ch) {
  json choice = {{"index", idx}, {"finish_reason", ch.finish_reason}, {"logprobs", nullptr}};
  if (prepared.logprobs_top >= 0 && !prepared.spec.hide_logprobs) {
    int64_t offset = 0;
    choice["logprobs"] = chat ? ChatLogprobsJson(core.codec(), ch.logprobs)
                              : CompletionLogprobsJson(core.codec(), ch.logprobs, &offset);
  }
  if (chat) {
    json msg = {{"role", "assistant"},
                {"content", ch.parsed.content.empty() && !ch.parsed.tool_calls.empty()
                                ? json(nullptr)
                                : json(ch.parsed.content)}};
    if (prepared.thinking) msg["reasoning_content"] = ch.parsed.reasoning;
    if (!ch.parsed.tool_calls.empty()) {
      msg["tool_calls"] = ToolCallsJson(ch.parsed.tool_calls, false);
    }
    choice["message"] = std::move(msg);
  } else {
    choice["text"] = ch.parsed.reasoning + ch.parsed.content;
  }
  return choice;
}

// Not streamed: runs the request to its end and sends one JSON response.
void ReplyWhole(RouterCore& core, const PreparedRequest& prepared, const json& base, bool chat,
                httplib::Response& res) {
  Collector collector;
  auto out = core.Run(prepared, &collector);
  if (!out.ok()) return SendError(res, out.status());
  if (prepared.spec.best_of_keep > 0) KeepBestOf(&*out, prepared.spec.best_of_keep);
  json j = base;
  json list = json::array();
  for (size_t idx = 0; idx < out->choices.size(); ++idx) {
    list.push_back(WholeChoiceJson(core, prepared, chat, idx, out->choices[idx]));
  }
  j["choices"] = std::move(list);
  j["usage"] = UsageJson(*out);
  res.set_content(Dump(j), "application/json");
}

// The server-sent events of a streamed request, written to `sink` as it runs: (chat) each
// choice's role first, the deltas, each choice's tool calls and finish, the usage when asked, an
// error unless the client cancelled, then [DONE].
bool StreamEvents(RouterCore& core, const PreparedRequest& request, const json& base, bool chat,
                  bool include_usage, httplib::DataSink& sink) {
  SseWriter writer(sink, base, chat, request.logprobs_top >= 0 ? &core.codec() : nullptr);
  const int n = std::max(1, request.spec.sampling.n());
  if (chat) {
    for (int i = 0; i < n; ++i) {
      writer.Send(writer.Chunk({{"role", "assistant"}, {"content", ""}}, nullptr, nullptr, i));
    }
  }
  auto out = core.Run(request, &writer);
  if (out.ok()) {
    for (size_t i = 0; i < out->choices.size(); ++i) {
      const Choice& ch = out->choices[i];
      const int idx = static_cast<int>(i);
      if (chat && !ch.parsed.tool_calls.empty()) {
        writer.Send(writer.Chunk({{"tool_calls", ToolCallsJson(ch.parsed.tool_calls, true)}},
                                 nullptr, nullptr, idx));
      }
      writer.Send(writer.Chunk(chat ? json::object() : json(""), ch.finish_reason, nullptr, idx));
    }
    if (include_usage) {
      json u = base;
      u["choices"] = json::array();
      u["usage"] = UsageJson(*out);
      writer.Send(u);
    }
  } else if (out.status().code() != absl::StatusCode::kCancelled) {
    spdlog::warn("request {} failed: {}", request.spec.request_id,
                 std::string(out.status().message()));
    writer.Send(ErrorJson(out.status()));
  }
  writer.Write("data: [DONE]\n\n");
  sink.done();
  return true;
}

// POST /v1/chat/completions (`chat`) and /v1/completions: checked and admitted (Accept), then
// answered whole or streamed as server-sent events (the admission ticket held until the stream
// ends).
void HandleGenerate(RouterCore& core, const HttpOptions& options, bool chat,
                    const httplib::Request& req, httplib::Response& res) {
  if (!Authorized(core, options.api_key, req, res)) return;
  std::optional<Accepted> a = Accept(core, options, chat, req, res);
  if (!a) return;
  const std::string id = a->prepared.spec.request_id;
  json base = {{"id", id},
               {"object", chat ? (a->stream ? "chat.completion.chunk" : "chat.completion")
                               : "text_completion"},
               {"created", UnixSeconds()},
               {"model", a->prepared.spec.model},
               {"system_fingerprint", core.registry().Fingerprint()}};
  res.set_header("X-Request-Id", id);
  if (!a->stream) return ReplyWhole(core, a->prepared, base, chat, res);
  auto request = std::make_shared<PreparedRequest>(std::move(a->prepared));
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream", [core = &core, request, base, chat, include_usage = a->include_usage,
                            ticket = a->ticket](size_t, httplib::DataSink& sink) {
        return StreamEvents(*core, *request, base, chat, include_usage, sink);
      });
}

// A known path asked with a method it does not serve: 405 with Allow (RFC 9110 15.5.6), not
// httplib's 404, counted in epd_request_rejections_total{reason="method_not_allowed"}.
httplib::Server::Handler MethodNotAllowed(RouterCore& core, std::string allow) {
  return [core = &core, allow](const httplib::Request& req, httplib::Response& res) {
    absl::Status s = ApiError(
        absl::StatusCode::kInvalidArgument,
        absl::StrCat("Method ", req.method, " is not allowed on ", req.path, "; allowed: ", allow),
        "", "method_not_allowed");
    core->CountRejected(s);
    json body = ErrorJson(s);
    res.status = 405;
    res.set_header("Allow", allow);
    res.set_content(body.dump(), "application/json");
  };
}

}  // namespace

void OpenAiHttpServer::Routes() {
  // The API key before the body (docs/security.md): httplib runs the pre-routing handler once a
  // request's headers are in and before it reads the body, so a caller without the key gets its
  // 401 without making the router read (and hold) up to the 64 MiB payload limit. The connection
  // is closed after the 401: the unread body must not be parsed as the next request.
  server_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty() || req.path.rfind("/v1/", 0) != 0 ||
        Authorized(core_, options_.api_key, req, res))
      return httplib::Server::HandlerResponse::Unhandled;
    res.set_header("Connection", "close");
    return httplib::Server::HandlerResponse::Handled;
  });
  server_->Get("/health", [this](const httplib::Request& req, httplib::Response& res) {
    bool serving = false;
    std::string body = RouterHealthJson(core_, &serving);
    // Without the API key (when there is one) only live/ready: the workers' addresses, the
    // fingerprint and the load are for the operator (docs/security.md).
    if (!options_.api_key.empty()) {
      const std::string header = req.get_header_value("Authorization");
      const std::string_view prefix = "Bearer ";
      const bool has_key =
          header.size() > prefix.size() && header.compare(0, prefix.size(), prefix) == 0 &&
          ConstantTimeEquals(std::string_view(header).substr(prefix.size()), options_.api_key);
      if (!has_key) body = json{{"live", true}, {"serving", serving}}.dump();
    }
    res.status = serving ? 200 : 503;
    res.set_content(body, "application/json");
  });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    prometheus::TextSerializer serializer;
    res.set_content(serializer.Serialize(metrics_->Collect()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  server_->Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    if (Authorized(core_, options_.api_key, req, res)) ListModels(core_, res);
  });
  server_->Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    if (Authorized(core_, options_.api_key, req, res)) GetModel(core_, req.matches[1], res);
  });
  server_->Post("/v1/chat/completions",
                [this](const httplib::Request& req, httplib::Response& res) {
                  HandleGenerate(core_, options_, /*chat=*/true, req, res);
                });
  server_->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleGenerate(core_, options_, /*chat=*/false, req, res);
  });
  for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
    server_->Get(path, MethodNotAllowed(core_, "POST"));
    server_->Put(path, MethodNotAllowed(core_, "POST"));
    server_->Patch(path, MethodNotAllowed(core_, "POST"));
    server_->Delete(path, MethodNotAllowed(core_, "POST"));
  }
  for (const char* path : {"/v1/models", "/health", "/metrics"}) {
    server_->Post(path, MethodNotAllowed(core_, "GET, HEAD"));
    server_->Put(path, MethodNotAllowed(core_, "GET, HEAD"));
    server_->Patch(path, MethodNotAllowed(core_, "GET, HEAD"));
    server_->Delete(path, MethodNotAllowed(core_, "GET, HEAD"));
  }
}

}  // namespace epd::services::router
