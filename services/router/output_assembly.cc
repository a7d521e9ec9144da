#include "services/router/output_assembly.h"

#include "absl/strings/str_cat.h"

namespace epd::services::router {

OutputAssembler::OutputAssembler(const TextCodec& codec, const PreparedRequest& request)
    : codec_(codec),
      thinking_(request.thinking),
      parse_tools_(request.spec.parse_tools),
      request_id_(request.spec.request_id),
      detok_(codec.NewDetokenizer()),
      stop_(std::vector<std::string>(request.spec.sampling.stop().begin(),
                                     request.spec.sampling.stop().end())),
      splitter_(codec.Markers(), request.thinking, request.spec.parse_tools) {}

Delta OutputAssembler::Add(const epd::v1::SubmitResponse& m) {
  std::string text;
  for (int32_t id : m.token_ids()) {
    token_ids_.push_back(id);
    text += detok_->Push(id);
  }
  if (!m.finish_reason().empty()) finish_reason_ = m.finish_reason();
  const std::string released = stop_.Push(text, &stopped_);
  full_text_ += released;
  Delta d = splitter_.Push(released);
  d.token_ids.assign(m.token_ids().begin(), m.token_ids().end());
  streamed_content_ += d.content;
  if (stopped_) finish_reason_ = "stop";
  return d;
}

Delta OutputAssembler::Finish(Outcome* out) {
  std::string tail;
  if (!stopped_) {
    tail = stop_.Push(detok_->Flush(), &stopped_);
    if (!stopped_) tail += stop_.Flush();
  }
  full_text_ += tail;
  Delta last = splitter_.Push(tail);
  Delta fin = splitter_.Finish();
  last.reasoning += fin.reasoning;
  last.content += fin.content;
  out->parsed = codec_.ParseAssistant(full_text_, thinking_, parse_tools_);
  // Whatever the final parse put in content beyond what was streamed (e.g. a tool-call block
  // that did not parse) goes out now.
  streamed_content_ += last.content;
  if (out->parsed.content.size() > streamed_content_.size() &&
      out->parsed.content.compare(0, streamed_content_.size(), streamed_content_) == 0) {
    last.content += out->parsed.content.substr(streamed_content_.size());
  }
  out->finish_reason = finish_reason_;
  if (!out->parsed.tool_calls.empty()) {
    out->finish_reason = "tool_calls";
    for (size_t i = 0; i < out->parsed.tool_calls.size(); ++i) {
      if (out->parsed.tool_calls[i].id.empty()) {
        out->parsed.tool_calls[i].id = absl::StrCat("call_", request_id_, "_", i);
      }
    }
  }
  out->token_ids = token_ids_;
  out->completion_tokens = static_cast<int32_t>(token_ids_.size());
  return last;
}

}  // namespace epd::services::router
