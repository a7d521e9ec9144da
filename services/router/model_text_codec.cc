#include "services/router/model_text_codec.h"

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tokenizer/chat_format.h"
#include "services/router/byte_text_codec.h"

namespace epd::services::router {
namespace {

constexpr std::string_view kPhOpen = "\xEE\x80\x80";   // U+E000
constexpr std::string_view kPhClose = "\xEE\x80\x81";  // U+E001

class ModelDetokenizer final : public Detokenizer {
 public:
  ModelDetokenizer(const model::Tokenizer& tokenizer, const std::vector<int32_t>& skipped)
      : detok_(tokenizer, /*skip_special=*/false), skipped_(skipped) {}
  std::string Push(int32_t id) override {
    if (std::find(skipped_.begin(), skipped_.end(), id) != skipped_.end()) return "";
    auto text = detok_.Add(id);
    // An id the tokenizer does not know (cannot come from a model of this vocabulary).
    if (!text.ok()) return "\xEF\xBF\xBD";
    return *std::move(text);
  }
  std::string Flush() override { return detok_.Flush(); }

 private:
  model::IncrementalDetokenizer detok_;
  const std::vector<int32_t>& skipped_;
};

// Applies `protect` to every string (keys and values) of `j`.
template <typename Json, typename F>
Json ProtectJson(const Json& j, const F& protect) {
  if (j.is_string()) return Json(protect(j.template get<std::string>()));
  if (j.is_array()) {
    Json out = Json::array();
    for (const auto& e : j) out.push_back(ProtectJson(e, protect));
    return out;
  }
  if (j.is_object()) {
    Json out = Json::object();
    for (auto it = j.begin(); it != j.end(); ++it) {
      out[protect(it.key())] = ProtectJson(it.value(), protect);
    }
    return out;
  }
  return j;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelTextCodec>> ModelTextCodec::Load(const std::string& model_dir) {
  auto tok = model::Tokenizer::FromFile(model_dir + "/tokenizer.json");
  if (!tok.ok()) return tok.status();
  return std::make_unique<ModelTextCodec>(*std::move(tok));
}

ModelTextCodec::ModelTextCodec(std::unique_ptr<model::Tokenizer> tokenizer)
    : tokenizer_(std::move(tokenizer)) {
  for (const model::AddedToken& t : tokenizer_->added_tokens()) {
    if (t.content.empty()) continue;
    added_by_first_byte_[static_cast<unsigned char>(t.content[0])].push_back({t.content, t.id});
  }
  for (auto& [b, v] : added_by_first_byte_) {
    std::stable_sort(v.begin(), v.end(),
                     [](const Token& a, const Token& c) { return a.text.size() > c.text.size(); });
  }
  for (std::string_view s :
       {model::kBosText, model::kEosText,
        std::string_view("<\xEF\xBD\x9C\xE2\x96\x81pad\xE2\x96\x81\xEF\xBD\x9C>")}) {
    if (auto id = tokenizer_->TokenId(s); id.has_value()) skipped_ids_.push_back(*id);
  }
}

size_t ModelTextCodec::MatchAdded(std::string_view text, size_t pos, int32_t* id) const {
  auto it = added_by_first_byte_.find(static_cast<unsigned char>(text[pos]));
  if (it == added_by_first_byte_.end()) return 0;
  for (const Token& t : it->second) {
    if (text.compare(pos, t.text.size(), t.text) == 0) {
      *id = t.id;
      return t.text.size();
    }
  }
  return 0;
}

std::string ModelTextCodec::Protect(std::string_view s, std::vector<std::string>* originals) const {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    int32_t id = 0;
    size_t n = MatchAdded(s, i, &id);
    if (n == 0 && s.compare(i, kPhOpen.size(), kPhOpen) == 0) n = kPhOpen.size();
    if (n == 0) {
      out.push_back(s[i++]);
      continue;
    }
    out.append(kPhOpen).append(std::to_string(originals->size())).append(kPhClose);
    originals->emplace_back(s.substr(i, n));
    i += n;
  }
  return out;
}

absl::StatusOr<std::vector<int32_t>> ModelTextCodec::EncodePrompt(std::string_view text) const {
  return tokenizer_->EncodeOrdinary(text);
}

absl::StatusOr<std::vector<int32_t>> ModelTextCodec::RenderChat(const ChatRenderInput& in) const {
  std::vector<std::string> originals;
  auto protect = [&](const std::string& s) { return Protect(s, &originals); };

  model::ChatRenderOptions options;
  options.thinking = in.thinking;
  if (!in.reasoning_effort.empty()) {
    const int effort = ReasoningEffortValue(in.reasoning_effort);
    if (effort < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("reasoning_effort '", in.reasoning_effort,
                       "' is not one of low, medium, high, xhigh, max or 1..100"));
    }
    options.reasoning_effort = effort;
  }
  std::vector<nlohmann::json> tools;
  if (!in.tools_json.empty()) {
    auto parsed = nlohmann::json::parse(in.tools_json, nullptr, false);
    if (parsed.is_discarded() || !parsed.is_array()) {
      return absl::InvalidArgumentError("tools must be a JSON array");
    }
    for (const auto& t : parsed) tools.push_back(ProtectJson(t, protect));
  }
  std::vector<model::ChatMessage> messages;
  messages.reserve(in.messages.size());
  for (size_t i = 0; i < in.messages.size(); ++i) {
    const ChatMessage& m = in.messages[i];
    model::ChatMessage out;
    out.role = m.role == "developer" ? "system" : m.role;
    out.content = protect(m.content);
    out.reasoning_content = protect(m.reasoning_content);
    for (const ToolCall& c : m.tool_calls) {
      model::ToolCall call;
      call.name = protect(c.name);
      if (!c.arguments_json.empty()) {
        auto args = nlohmann::ordered_json::parse(c.arguments_json, nullptr, false);
        if (args.is_discarded() || !args.is_object()) {
          return absl::InvalidArgumentError(absl::StrCat("messages[", i, "]: tool call ", c.name,
                                                         ": arguments are not a JSON object"));
        }
        call.arguments = ProtectJson(args, protect).dump();
      }
      out.tool_calls.push_back(std::move(call));
    }
    messages.push_back(std::move(out));
  }
  auto text = model::RenderChat(messages, tools, options);
  if (!text.ok()) return text.status();

  // Encode: added tokens are recognised in the template text only; placeholders become their
  // original text, encoded as plain text together with the surrounding plain text.
  std::vector<int32_t> ids;
  std::string plain;
  auto flush = [&] {
    if (plain.empty()) return;
    std::vector<int32_t> part = tokenizer_->EncodeOrdinary(plain);
    ids.insert(ids.end(), part.begin(), part.end());
    plain.clear();
  };
  const std::string_view s = *text;
  for (size_t i = 0; i < s.size();) {
    if (s.compare(i, kPhOpen.size(), kPhOpen) == 0) {
      const size_t close = s.find(kPhClose, i);
      const size_t index = std::strtoull(
          std::string(s.substr(i + kPhOpen.size(), close - i - kPhOpen.size())).c_str(), nullptr,
          10);
      if (close == std::string_view::npos || index >= originals.size()) {
        return absl::InternalError("chat rendering lost a placeholder");
      }
      plain += originals[index];
      i = close + kPhClose.size();
      continue;
    }
    int32_t id = 0;
    if (const size_t n = MatchAdded(s, i, &id); n > 0) {
      flush();
      ids.push_back(id);
      i += n;
      continue;
    }
    plain.push_back(s[i++]);
  }
  flush();
  return ids;
}

std::unique_ptr<Detokenizer> ModelTextCodec::NewDetokenizer() const {
  return std::make_unique<ModelDetokenizer>(*tokenizer_, skipped_ids_);
}

ParsedAssistant ModelTextCodec::ParseAssistant(std::string_view text, bool thinking,
                                               bool parse_tools) const {
  ParsedAssistant out;
  if (parse_tools) {
    auto parsed = model::ParseCompletion(text, thinking);
    if (parsed.ok()) {
      out.reasoning = std::move(parsed->reasoning);
      out.content = std::move(parsed->content);
      for (auto& c : parsed->tool_calls) {
        out.tool_calls.push_back(ToolCall{"", std::move(c.name), std::move(c.arguments)});
      }
      return out;
    }
  }
  // No tool parsing (or an unparseable block, which stays in content).
  if (const size_t eos = text.find(model::kEosText); eos != std::string_view::npos) {
    text = text.substr(0, eos);
  }
  if (thinking) {
    const size_t end = text.find(model::kThinkEnd);
    if (end == std::string_view::npos) {
      out.reasoning = std::string(text);
      return out;
    }
    out.reasoning = std::string(text.substr(0, end));
    text.remove_prefix(end + model::kThinkEnd.size());
  }
  out.content = std::string(text);
  return out;
}

std::string ModelTextCodec::TokenBytes(int32_t id) const {
  if (id < 0 || id >= tokenizer_->vocab_size()) return "";
  const int32_t ids[1] = {id};
  auto bytes = tokenizer_->Decode(ids, /*skip_special=*/false);
  return bytes.ok() ? *std::move(bytes) : "";
}

}  // namespace epd::services::router
