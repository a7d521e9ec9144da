#include "services/router/byte_text_codec.h"

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "services/router/utf8.h"

namespace epd::services::router {
namespace {

constexpr char kBos[] = "<\xEF\xBD\x9C" "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
constexpr char kEos[] = "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
constexpr char kSystem[] = "<\xEF\xBD\x9CSystem\xEF\xBD\x9C>";
constexpr char kUser[] = "<\xEF\xBD\x9CUser\xEF\xBD\x9C>";
constexpr char kAssistant[] = "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>";
constexpr char kThink[] = "<think>";
constexpr char kThinkEnd[] = "</think>";
constexpr char kDsml[] = "\xEF\xBD\x9C" "DSML\xEF\xBD\x9C";  // ｜DSML｜

class ByteDetokenizer final : public Detokenizer {
 public:
  std::string Push(int32_t id) override {
    if (id < 0 || id > 255) return {};  // a token past the bytes has no text (TokenBytes)
    pending_.push_back(static_cast<char>(id));
    return TakeCompleteUtf8(&pending_, /*flush=*/false);
  }
  std::string Flush() override { return TakeCompleteUtf8(&pending_, /*flush=*/true); }

 private:
  std::string pending_;
};

std::vector<int32_t> Bytes(std::string_view s) {
  std::vector<int32_t> ids;
  ids.reserve(s.size());
  for (unsigned char c : s) ids.push_back(c);
  return ids;
}

// Parses the DSML block starting at `block`; false if it is not complete and well-formed.
bool ParseDsml(std::string_view block, std::vector<ToolCall>* calls) {
  const std::string invoke_open = absl::StrCat("<", kDsml, " invoke name=\"");
  const std::string invoke_close = absl::StrCat("</", kDsml, " invoke>");
  const std::string param_open = absl::StrCat("<", kDsml, " parameter name=\"");
  const std::string param_close = absl::StrCat("</", kDsml, " parameter>");
  const std::string calls_close = absl::StrCat("</", kDsml, " calls>");
  const size_t end = block.find(calls_close);
  if (end == std::string_view::npos) return false;
  std::string_view body = block.substr(0, end);
  size_t pos = 0;
  while (true) {
    const size_t inv = body.find(invoke_open, pos);
    if (inv == std::string_view::npos) break;
    const size_t name_start = inv + invoke_open.size();
    const size_t name_end = body.find("\">", name_start);
    if (name_end == std::string_view::npos) return false;
    const size_t inv_end = body.find(invoke_close, name_end);
    if (inv_end == std::string_view::npos) return false;
    ToolCall call;
    call.name = std::string(body.substr(name_start, name_end - name_start));
    nlohmann::json args = nlohmann::json::object();
    std::string_view params = body.substr(name_end + 2, inv_end - name_end - 2);
    size_t p = 0;
    while (true) {
      const size_t po = params.find(param_open, p);
      if (po == std::string_view::npos) break;
      const size_t pn_start = po + param_open.size();
      const size_t pn_end = params.find('"', pn_start);
      if (pn_end == std::string_view::npos) return false;
      const std::string key(params.substr(pn_start, pn_end - pn_start));
      const std::string_view str_attr = " string=\"";
      if (params.substr(pn_end + 1, str_attr.size()) != str_attr) return false;
      const size_t flag_start = pn_end + 1 + str_attr.size();
      const size_t flag_end = params.find("\">", flag_start);
      if (flag_end == std::string_view::npos) return false;
      const bool is_string = params.substr(flag_start, flag_end - flag_start) == "true";
      const size_t v_start = flag_end + 2;
      const size_t v_end = params.find(param_close, v_start);
      if (v_end == std::string_view::npos) return false;
      const std::string value(params.substr(v_start, v_end - v_start));
      if (is_string) {
        args[key] = value;
      } else {
        auto parsed = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
        if (parsed.is_discarded()) return false;
        args[key] = std::move(parsed);
      }
      p = v_end + param_close.size();
    }
    // Invalid UTF-8 in generated text becomes U+FFFD instead of a throw (tests/fuzz/fuzz_dsml).
    call.arguments_json = args.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    calls->push_back(std::move(call));
    pos = inv_end + invoke_close.size();
  }
  return true;
}

}  // namespace

int ReasoningEffortValue(std::string_view effort) {
  if (effort == "low") return 50;
  if (effort == "medium" || effort == "high") return 75;
  if (effort == "xhigh") return 90;
  if (effort == "max") return 100;
  int v = 0;
  auto [ptr, ec] = std::from_chars(effort.data(), effort.data() + effort.size(), v);
  if (ec != std::errc() || ptr != effort.data() + effort.size() || v < 1 || v > 100) return -1;
  return v;
}

std::string RenderDsmlToolCalls(const std::vector<ToolCall>& calls) {
  std::string out = absl::StrCat("<", kDsml, " calls>\n");
  for (const auto& c : calls) {
    absl::StrAppend(&out, "<", kDsml, " invoke name=\"", c.name, "\">\n");
    auto args = nlohmann::json::parse(c.arguments_json, nullptr, false);
    if (args.is_object()) {
      for (const auto& [k, v] : args.items()) {
        const bool is_string = v.is_string();
        absl::StrAppend(&out, "<", kDsml, " parameter name=\"", k, "\" string=\"",
                        is_string ? "true" : "false", "\">",
                        is_string ? v.get<std::string>() : v.dump(), "</", kDsml,
                        " parameter>\n");
      }
    }
    absl::StrAppend(&out, "</", kDsml, " invoke>\n");
  }
  absl::StrAppend(&out, "</", kDsml, " calls>");
  return out;
}

absl::StatusOr<std::string> ByteTextCodec::RenderChatText(const ChatRenderInput& in) const {
  std::string out = kBos;
  int effort = -1;
  if (!in.reasoning_effort.empty()) {
    effort = ReasoningEffortValue(in.reasoning_effort);
    if (effort < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("reasoning_effort '", in.reasoning_effort,
                       "' is not one of low, medium, high, xhigh, max or 1..100"));
    }
  }
  // The leading system block: effort line (thinking mode only), system text, tools.
  size_t first = 0;
  std::string system_text;
  while (first < in.messages.size() &&
         (in.messages[first].role == "system" || in.messages[first].role == "developer")) {
    if (!system_text.empty()) system_text += "\n\n";
    system_text += in.messages[first].content;
    ++first;
  }
  if (!system_text.empty() || !in.tools_json.empty() || (in.thinking && effort > 0)) {
    out += kSystem;
    if (in.thinking && effort > 0) {
      absl::StrAppend(&out, "Reasoning Effort: ", effort,
                      " (range 1-100, the higher the value, the more thorough the reasoning)\n\n");
    }
    out += system_text;
    if (!in.tools_json.empty()) absl::StrAppend(&out, "\n\n## Tools\n", in.tools_json);
  }
  size_t last_user = 0;
  for (size_t i = first; i < in.messages.size(); ++i) {
    if (in.messages[i].role == "user" || in.messages[i].role == "tool") last_user = i;
  }
  bool open_user = false;  // inside a user turn (tool results merge into it)
  for (size_t i = first; i < in.messages.size(); ++i) {
    const ChatMessage& m = in.messages[i];
    if (m.role == "user") {
      absl::StrAppend(&out, kUser, m.content);
      open_user = true;
    } else if (m.role == "tool") {
      if (!open_user) out += kUser;
      absl::StrAppend(&out, "<tool_result>", m.content, "</tool_result>");
      open_user = true;
    } else if (m.role == "system" || m.role == "developer") {
      absl::StrAppend(&out, kSystem, m.content, kAssistant, in.thinking ? kThink : kThinkEnd);
      open_user = false;
    } else if (m.role == "assistant") {
      // Earlier turns drop their reasoning; only a turn after the last user turn keeps it.
      absl::StrAppend(&out, kAssistant, kThinkEnd);
      if (i > last_user && !m.reasoning_content.empty()) {
        out.resize(out.size() - std::string_view(kThinkEnd).size());
        absl::StrAppend(&out, kThink, m.reasoning_content, kThinkEnd);
      }
      out += m.content;
      if (!m.tool_calls.empty()) out += RenderDsmlToolCalls(m.tool_calls);
      out += kEos;
      open_user = false;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown role '", m.role, "'"));
    }
  }
  absl::StrAppend(&out, kAssistant, in.thinking ? kThink : kThinkEnd);
  return out;
}

absl::StatusOr<std::vector<int32_t>> ByteTextCodec::EncodePrompt(std::string_view text) const {
  return Bytes(text);
}

absl::StatusOr<std::vector<int32_t>> ByteTextCodec::RenderChat(const ChatRenderInput& in) const {
  auto text = RenderChatText(in);
  if (!text.ok()) return text.status();
  return Bytes(*text);
}

ByteTextCodec::ByteTextCodec(int32_t vocab_size)
    : vocab_size_(std::max<int32_t>(vocab_size, 256)) {}

std::unique_ptr<Detokenizer> ByteTextCodec::NewDetokenizer() const {
  return std::make_unique<ByteDetokenizer>();
}

ParsedAssistant ByteTextCodec::ParseAssistant(std::string_view text, bool thinking,
                                              bool parse_tools) const {
  ParsedAssistant out;
  if (thinking) {
    const size_t end = text.find(kThinkEnd);
    if (end == std::string_view::npos) {
      out.reasoning = std::string(text);
      return out;
    }
    out.reasoning = std::string(text.substr(0, end));
    text.remove_prefix(end + std::string_view(kThinkEnd).size());
  }
  const std::string begin = Markers().tool_calls_begin;
  const size_t tc = parse_tools ? text.find(begin) : std::string_view::npos;
  if (tc != std::string_view::npos) {
    std::vector<ToolCall> calls;
    if (ParseDsml(text.substr(tc + begin.size()), &calls)) {
      out.content = std::string(text.substr(0, tc));
      out.tool_calls = std::move(calls);
      return out;
    }
  }
  out.content = std::string(text);
  return out;
}

}  // namespace epd::services::router
