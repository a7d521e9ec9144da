#include "tokenizer/chat_format.h"

#include <charconv>
#include <type_traits>

#include "common/status_macros.h"

namespace epd::model {
namespace {

// absl::StrCat in this absl build does not take std::string_view; a small local equivalent.
template <typename T>
void AppendOne(std::string& s, const T& v) {
  if constexpr (std::is_arithmetic_v<T>) {
    s += std::to_string(v);
  } else {
    s += std::string_view(v);
  }
}
template <typename... A>
std::string Cat(const A&... a) {
  std::string s;
  (AppendOne(s, a), ...);
  return s;
}
template <typename... A>
void Append(std::string* s, const A&... a) {
  (AppendOne(*s, a), ...);
}

using ojson = nlohmann::ordered_json;

const std::string kCallsOpen = Cat("<", kDsml, " calls>");
const std::string kCallsClose = Cat("</", kDsml, " calls>");
const std::string kInvokeOpen = Cat("<", kDsml, " invoke name=\"");
const std::string kInvokeClose = Cat("</", kDsml, " invoke>");
const std::string kParamOpen = Cat("<", kDsml, " parameter name=\"");
const std::string kParamClose = Cat("</", kDsml, " parameter>");

constexpr std::string_view kToolResultOpen = "<tool_result>";
constexpr std::string_view kToolResultClose = "</tool_result>";

std::string EffortLine(int effort) {
  return Cat("Reasoning Effort: ", effort,
             " (range 1-100, the higher the value, the more thorough the reasoning)\n\n");
}

std::string ToolsBlock(const std::vector<nlohmann::json>& tools) {
  std::string s =
      Cat("## Tools\n\nYou have access to the tools below. To call tools, write one block in this "
          "format "
          "after your reply:\n\n",
          kCallsOpen, "\n", kInvokeOpen, "$FUNCTION_NAME\">\n", kParamOpen,
          "$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE", kParamClose, "\n",
          kInvokeClose, "\n", kCallsClose,
          "\n\nSet string=\"true\" for string parameters (value written as is) and "
          "string=\"false\" for all "
          "others (value written as JSON). Tool results come back as ",
          kToolResultOpen, "...", kToolResultClose, ".\n\n### Available Tool Schemas\n\n");
  for (const nlohmann::json& t : tools) {
    const nlohmann::json& f = t.contains("function") ? t["function"] : t;
    s += f.dump();
    s += "\n";
  }
  return s;
}

bool IsUserSide(const std::string& role) { return role == "user" || role == "tool"; }

}  // namespace

absl::StatusOr<int> ParseReasoningEffort(std::string_view text) {
  if (text == "low") return 25;
  if (text == "medium") return 50;
  if (text == "high") return 75;
  if (text == "max") return 100;
  int v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || v < 1 || v > 100) {
    return absl::InvalidArgumentError(
        Cat("reasoning effort \"", text, "\" is not low/medium/high/max or 1..100"));
  }
  return v;
}

absl::StatusOr<std::string> RenderToolCalls(const std::vector<ToolCall>& calls) {
  std::string s = kCallsOpen + "\n";
  for (const ToolCall& c : calls) {
    if (c.name.empty()) return absl::InvalidArgumentError("tool call without a function name");
    ojson args = c.arguments.empty() ? ojson::object() : ojson::parse(c.arguments, nullptr, false);
    if (args.is_discarded() || !args.is_object()) {
      return absl::InvalidArgumentError(
          Cat("tool call ", c.name, ": arguments are not a JSON object: ", c.arguments));
    }
    Append(&s, kInvokeOpen, c.name, "\">\n");
    for (auto it = args.begin(); it != args.end(); ++it) {
      const bool is_string = it.value().is_string();
      Append(&s, kParamOpen, it.key(), "\" string=\"", is_string ? "true" : "false", "\">",
             is_string ? it.value().get<std::string>() : it.value().dump(), kParamClose, "\n");
    }
    Append(&s, kInvokeClose, "\n");
  }
  s += kCallsClose;
  return s;
}

absl::StatusOr<std::string> RenderChat(const std::vector<ChatMessage>& messages,
                                       const std::vector<nlohmann::json>& tools,
                                       const ChatRenderOptions& o) {
  if (o.reasoning_effort && (*o.reasoning_effort < 1 || *o.reasoning_effort > 100)) {
    return absl::InvalidArgumentError(
        Cat("reasoning effort ", *o.reasoning_effort, " is not in 1..100"));
  }
  std::string out;
  if (o.add_bos) out += kBosText;
  size_t i = 0;
  const bool effort = o.thinking && o.reasoning_effort.has_value();
  const bool first_system = !messages.empty() && messages[0].role == "system";
  if (first_system || !tools.empty() || effort) {
    out += kSystemText;
    if (effort) out += EffortLine(*o.reasoning_effort);
    if (first_system) {
      out += messages[0].content;
      i = 1;
    }
    if (!tools.empty()) {
      if (first_system && !messages[0].content.empty()) out += "\n\n";
      out += ToolsBlock(tools);
    }
  }
  // Reasoning is kept only for assistant turns after the last user message.
  size_t last_user = 0;
  bool have_user = false;
  for (size_t k = 0; k < messages.size(); ++k) {
    if (messages[k].role == "user") {
      last_user = k;
      have_user = true;
    }
  }
  auto header = [&](size_t assistant_index) {
    const bool keep = o.thinking && (!have_user || assistant_index > last_user);
    return Cat(kAssistantText, keep ? kThinkStart : kThinkEnd);
  };
  bool header_written = false;  // the previous message already wrote this assistant's header
  bool in_user_turn = false;
  bool last_was_tool = false;
  bool saw_tool_call = false;
  for (; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (IsUserSide(m.role)) {
      // Consecutive user/tool messages share one user turn: tool results are concatenated,
      // anything else is separated by a blank line.
      if (!in_user_turn) {
        out += kUserText;
        in_user_turn = true;
      } else if (!(m.role == "tool" && last_was_tool)) {
        out += "\n\n";
      }
      if (m.role == "tool") {
        if (!saw_tool_call) {
          return absl::InvalidArgumentError(
              Cat("message ", i, ": tool result without a preceding assistant tool call"));
        }
        Append(&out, kToolResultOpen, m.content, kToolResultClose);
      } else {
        out += m.content;
      }
      last_was_tool = m.role == "tool";
    } else if (m.role == "system") {
      Append(&out, kSystemText, m.content);
      in_user_turn = false;
      last_was_tool = false;
    } else if (m.role == "assistant") {
      if (!header_written) out += header(i);
      const bool keep = o.thinking && (!have_user || i > last_user);
      if (keep) Append(&out, m.reasoning_content, kThinkEnd);
      out += m.content;
      if (!m.tool_calls.empty()) {
        ASSIGN_OR_RETURN(std::string calls, RenderToolCalls(m.tool_calls));
        if (!m.content.empty()) out += "\n\n";
        out += calls;
        saw_tool_call = true;
      }
      out += kEosText;
      in_user_turn = false;
      last_was_tool = false;
    } else {
      return absl::InvalidArgumentError(Cat("message ", i, ": unknown role \"", m.role, "\""));
    }
    // A user/tool/system turn followed by an assistant message gets the assistant header.
    header_written =
        m.role != "assistant" && i + 1 < messages.size() && messages[i + 1].role == "assistant";
    if (header_written) {
      out += header(i + 1);
      in_user_turn = false;
    }
  }
  if (o.add_generation_prompt) out += header(messages.size());
  return out;
}

absl::StatusOr<std::vector<ChatMessage>> MessagesFromOpenAi(const nlohmann::json& messages) {
  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be an array");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& j = messages[i];
    if (!j.is_object() || !j.contains("role") || !j["role"].is_string()) {
      return absl::InvalidArgumentError(Cat("messages[", i, "] has no string \"role\""));
    }
    ChatMessage m;
    m.role = j["role"].get<std::string>();
    if (m.role == "developer") m.role = "system";
    if (j.contains("content") && !j["content"].is_null()) {
      const nlohmann::json& c = j["content"];
      if (c.is_string()) {
        m.content = c.get<std::string>();
      } else if (c.is_array()) {
        for (const nlohmann::json& part : c) {
          if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
              !part.contains("text") || !part["text"].is_string()) {
            return absl::InvalidArgumentError(
                Cat("messages[", i, "].content: only text parts are supported"));
          }
          m.content += part["text"].get<std::string>();
        }
      } else {
        return absl::InvalidArgumentError(
            Cat("messages[", i, "].content must be a string or parts"));
      }
    }
    if (j.contains("reasoning_content") && j["reasoning_content"].is_string()) {
      m.reasoning_content = j["reasoning_content"].get<std::string>();
    }
    if (j.contains("tool_calls") && j["tool_calls"].is_array()) {
      for (const nlohmann::json& tc : j["tool_calls"]) {
        if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object() ||
            !tc["function"].contains("name") || !tc["function"]["name"].is_string()) {
          return absl::InvalidArgumentError(
              Cat("messages[", i, "].tool_calls entry lacks a string function.name"));
        }
        const nlohmann::json& f = tc["function"];
        ToolCall call{f["name"].get<std::string>(), "{}"};
        if (f.contains("arguments")) {
          call.arguments = f["arguments"].is_string() ? f["arguments"].get<std::string>()
                                                      : f["arguments"].dump();
        }
        m.tool_calls.push_back(std::move(call));
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

static absl::Status ParseCallsBody(std::string_view body, std::vector<ToolCall>& out);

absl::StatusOr<ParsedCompletion> ParseCompletion(std::string_view text, bool thinking) {
  ParsedCompletion r;
  if (size_t eos = text.find(kEosText); eos != std::string_view::npos) {
    text = text.substr(0, eos);
    r.finished = true;
  }
  if (thinking) {
    if (text.starts_with(kThinkStart)) text.remove_prefix(kThinkStart.size());
    const size_t end = text.find(kThinkEnd);
    if (end == std::string_view::npos) {
      r.reasoning = std::string(text);
      return r;
    }
    r.reasoning = std::string(text.substr(0, end));
    text.remove_prefix(end + kThinkEnd.size());
  } else if (text.starts_with(kThinkEnd)) {
    text.remove_prefix(kThinkEnd.size());
  }
  // Content is the text outside tool-call blocks; newlines right before a block are separators.
  while (true) {
    const size_t calls = text.find(kCallsOpen);
    if (calls == std::string_view::npos) {
      r.content.append(text);
      return r;
    }
    std::string_view before = text.substr(0, calls);
    while (!before.empty() && before.back() == '\n') before.remove_suffix(1);
    r.content.append(before);
    std::string_view rest = text.substr(calls + kCallsOpen.size());
    const size_t close = rest.find(kCallsClose);
    if (close == std::string_view::npos) {
      return absl::InvalidArgumentError(
          "DSML tool-call block is not terminated (no </｜DSML｜ calls>)");
    }
    RETURN_IF_ERROR(ParseCallsBody(rest.substr(0, close), r.tool_calls));
    text = rest.substr(close + kCallsClose.size());
  }
}

static absl::Status ParseCallsBody(std::string_view body, std::vector<ToolCall>& out) {
  while (true) {
    const size_t inv = body.find(kInvokeOpen);
    if (inv == std::string_view::npos) break;
    body.remove_prefix(inv + kInvokeOpen.size());
    const size_t q = body.find("\">");
    if (q == std::string_view::npos || q == 0) {
      return absl::InvalidArgumentError("DSML invoke without a name=\"...\"");
    }
    ToolCall call;
    call.name = std::string(body.substr(0, q));
    body.remove_prefix(q + 2);
    const size_t inv_end = body.find(kInvokeClose);
    if (inv_end == std::string_view::npos) {
      return absl::InvalidArgumentError(Cat("DSML invoke of ", call.name, " is not terminated"));
    }
    std::string_view params = body.substr(0, inv_end);
    body.remove_prefix(inv_end + kInvokeClose.size());
    ojson args = ojson::object();
    while (true) {
      const size_t p = params.find(kParamOpen);
      if (p == std::string_view::npos) break;
      params.remove_prefix(p + kParamOpen.size());
      const size_t nq = params.find('"');
      if (nq == std::string_view::npos)
        return absl::InvalidArgumentError("DSML parameter without a name");
      const std::string name(params.substr(0, nq));
      params.remove_prefix(nq + 1);
      bool is_string = true;
      constexpr std::string_view kStrTrue = " string=\"true\">", kStrFalse = " string=\"false\">";
      if (params.starts_with(kStrTrue)) {
        params.remove_prefix(kStrTrue.size());
      } else if (params.starts_with(kStrFalse)) {
        is_string = false;
        params.remove_prefix(kStrFalse.size());
      } else if (params.starts_with(">")) {
        params.remove_prefix(1);
      } else {
        return absl::InvalidArgumentError(
            Cat("DSML parameter ", name, " of ", call.name, " is malformed"));
      }
      const size_t pe = params.find(kParamClose);
      if (pe == std::string_view::npos) {
        return absl::InvalidArgumentError(
            Cat("DSML parameter ", name, " of ", call.name, " is not terminated"));
      }
      const std::string value(params.substr(0, pe));
      params.remove_prefix(pe + kParamClose.size());
      if (is_string) {
        args[name] = value;
      } else {
        ojson v = ojson::parse(value, nullptr, false);
        if (v.is_discarded()) {
          return absl::InvalidArgumentError(Cat("DSML parameter ", name, " of ", call.name,
                                                " has string=\"false\" but is not JSON: ", value));
        }
        args[name] = v;
      }
    }
    // Generated text may hold invalid UTF-8 (a model can emit any byte): replace it (U+FFFD)
    // rather than throw (found by tests/fuzz/fuzz_dsml).
    call.arguments = args.dump(-1, ' ', false, ojson::error_handler_t::replace);
    out.push_back(std::move(call));
  }
  return absl::OkStatus();
}

namespace {

// Length of the longest suffix of `s` that is a proper prefix of `marker`.
size_t PartialMarkerSuffix(std::string_view s, std::string_view marker) {
  for (size_t n = std::min(s.size(), marker.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

absl::StatusOr<StreamingCompletionParser::Delta> StreamingCompletionParser::Add(
    std::string_view text) {
  Delta d;
  if (finished_) return d;
  pending_.append(text);
  if (!started_) {
    // A leading <think> (thinking) or </think> (chat mode) may be echoed: wait until it can be
    // told.
    const std::string_view lead = in_reasoning_ ? kThinkStart : kThinkEnd;
    if (pending_.size() < lead.size() && std::string_view(lead).starts_with(pending_)) return d;
    if (std::string_view(pending_).starts_with(lead)) pending_.erase(0, lead.size());
    started_ = true;
  }
  while (true) {
    if (in_calls_) {
      const size_t eos = pending_.find(kEosText);
      const size_t close = pending_.find(kCallsClose);
      if (close == std::string::npos && eos == std::string::npos) return d;
      if (close == std::string::npos || (eos != std::string::npos && eos < close)) {
        return absl::InvalidArgumentError(
            "DSML tool-call block is not terminated (no </｜DSML｜ calls>)");
      }
      const std::string block = kCallsOpen + pending_.substr(0, close + kCallsClose.size());
      ASSIGN_OR_RETURN(ParsedCompletion p, ParseCompletion(block, false));
      for (ToolCall& c : p.tool_calls) d.tool_calls.push_back(std::move(c));
      pending_.erase(0, close + kCallsClose.size());
      in_calls_ = false;
      continue;
    }
    std::string& out = in_reasoning_ ? d.reasoning : d.content;
    // Markers that end the current section.
    const size_t eos = pending_.find(kEosText);
    const size_t end = in_reasoning_ ? pending_.find(kThinkEnd) : pending_.find(kCallsOpen);
    if (end != std::string::npos && (eos == std::string::npos || end < eos)) {
      std::string_view before = std::string_view(pending_).substr(0, end);
      if (!in_reasoning_) {
        while (!before.empty() && before.back() == '\n') before.remove_suffix(1);
      }
      out.append(before);
      pending_.erase(0, end + (in_reasoning_ ? kThinkEnd.size() : kCallsOpen.size()));
      if (in_reasoning_) {
        in_reasoning_ = false;
      } else {
        in_calls_ = true;
      }
      continue;
    }
    if (eos != std::string::npos) {
      out.append(pending_.substr(0, eos));
      pending_.clear();
      finished_ = true;
      return d;
    }
    // Hold back a possible partial marker and, in content, trailing newlines.
    size_t hold = PartialMarkerSuffix(pending_, kEosText);
    hold = std::max(hold, PartialMarkerSuffix(
                              pending_, in_reasoning_ ? kThinkEnd : std::string_view(kCallsOpen)));
    if (!in_reasoning_) {
      size_t nl = 0;
      while (nl < pending_.size() - hold && pending_[pending_.size() - hold - 1 - nl] == '\n') ++nl;
      hold += nl;
    }
    out.append(pending_.substr(0, pending_.size() - hold));
    pending_.erase(0, pending_.size() - hold);
    return d;
  }
}

absl::StatusOr<StreamingCompletionParser::Delta> StreamingCompletionParser::Finish() {
  Delta d;
  if (in_calls_) {
    return absl::InvalidArgumentError(
        "DSML tool-call block is not terminated (no </｜DSML｜ calls>)");
  }
  if (!finished_) {
    (in_reasoning_ ? d.reasoning : d.content) = std::move(pending_);
  }
  pending_.clear();
  finished_ = true;
  return d;
}

}  // namespace epd::model
