// libFuzzer target: OpenAI chat `messages` (+ `tools`) JSON as the model-side chat format reads
// them: MessagesFromOpenAi, then RenderChat in thinking and chat mode with a reasoning effort.
// Input: a JSON document {"messages": [...], "tools": [...], "reasoning_effort": "..."} or a
// bare messages array.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  const nlohmann::json* messages = &j;
  std::vector<nlohmann::json> tools;
  epd::model::ChatRenderOptions options;
  if (j.is_object()) {
    auto it = j.find("messages");
    if (it == j.end()) return 0;
    messages = &*it;
    if (auto t = j.find("tools"); t != j.end() && t->is_array()) {
      for (const auto& tool : *t) tools.push_back(tool);
    }
    if (auto e = j.find("reasoning_effort"); e != j.end() && e->is_string()) {
      auto effort = epd::model::ParseReasoningEffort(e->get<std::string>());
      if (effort.ok()) options.reasoning_effort = *effort;
    }
  }
  auto parsed = epd::model::MessagesFromOpenAi(*messages);
  if (!parsed.ok()) return 0;
  for (bool thinking : {false, true}) {
    options.thinking = thinking;
    (void)epd::model::RenderChat(*parsed, tools, options);
  }
  return 0;
}
