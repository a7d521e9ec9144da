#include "services/router/output_assembly.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace epd::services::router {

ChoiceAssembler::ChoiceAssembler(const TextCodec& codec, const PreparedRequest& request, int index)
    : codec_(codec),
      thinking_(request.thinking),
      parse_tools_(request.spec.parse_tools),
      request_id_(request.spec.request_id),
      index_(index),
      think_end_(codec.Markers().think_end),
      detok_(codec.NewDetokenizer()),
      stop_(std::vector<std::string>(request.spec.sampling.stop().begin(),
                                     request.spec.sampling.stop().end())),
      splitter_(codec.Markers(), request.thinking, request.spec.parse_tools) {}

Delta ChoiceAssembler::Add(const epd::v1::SubmitResponse& m, std::vector<TokenLogprobs> lps) {
  Delta d;
  d.index = index_;
  if (stopped_) return d;  // cut by a stop string: the rest of this choice is dropped
  std::string text;
  for (int32_t id : m.token_ids()) {
    token_ids_.push_back(id);
    const std::string t = detok_->Push(id);
    text += t;
    if (thinking_ && !think_ended_) {
      ++reasoning_tokens_;
      raw_ += t;
      think_ended_ = raw_.find(think_end_) != std::string::npos;
    }
  }
  logprobs_.insert(logprobs_.end(), lps.begin(), lps.end());
  if (!m.finish_reason().empty()) finish_reason_ = m.finish_reason();
  const std::string released = stop_.Push(text, &stopped_);
  full_text_ += released;
  d = splitter_.Push(released);
  d.index = index_;
  d.token_ids.assign(m.token_ids().begin(), m.token_ids().end());
  d.logprobs = std::move(lps);
  streamed_content_ += d.content;
  if (stopped_) finish_reason_ = "stop";
  return d;
}

Delta ChoiceAssembler::Finish(Choice* out) {
  std::string tail;
  if (!stopped_) {
    tail = stop_.Push(detok_->Flush(), &stopped_);
    if (!stopped_) tail += stop_.Flush();
  }
  full_text_ += tail;
  Delta last = splitter_.Push(tail);
  last.index = index_;
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
        out->parsed.tool_calls[i].id =
            index_ == 0 ? absl::StrCat("call_", request_id_, "_", i)
                        : absl::StrCat("call_", request_id_, "_", index_, "_", i);
      }
    }
  }
  out->token_ids = token_ids_;
  out->logprobs = logprobs_;
  out->reasoning_tokens = reasoning_tokens_;
  return last;
}

OutputAssembler::OutputAssembler(const TextCodec& codec, const PreparedRequest& request)
    : logprobs_top_(request.logprobs_top) {
  const int n = std::max(1, request.spec.sampling.n());
  for (int i = 0; i < n; ++i) {
    choices_.push_back(std::make_unique<ChoiceAssembler>(codec, request, i));
  }
}

absl::Status OutputAssembler::Add(const epd::v1::SubmitResponse& m, Delta* delta) {
  if (m.index() < 0 || m.index() >= n()) {
    return absl::InternalError(absl::StrCat("sent choice ", m.index(), " of ", n()));
  }
  std::vector<TokenLogprobs> lps;
  if (logprobs_top_ >= 0) {
    // Per token: the chosen entry, then the worker's top max(1, n) (we asked for that many).
    const int per = 1 + std::max(1, logprobs_top_);
    if (m.top_logprobs_size() != per * m.token_ids_size()) {
      return absl::InternalError(absl::StrCat("sent ", m.top_logprobs_size(),
                                              " logprob entries for ", m.token_ids_size(),
                                              " tokens (expected ", per, " each)"));
    }
    for (int i = 0; i < m.token_ids_size(); ++i) {
      const auto& chosen = m.top_logprobs(i * per);
      TokenLogprobs t{chosen.token_id(), chosen.logprob(), {}};
      for (int j = 1; j <= logprobs_top_; ++j) {
        const auto& e = m.top_logprobs(i * per + j);
        t.top.emplace_back(e.token_id(), e.logprob());
      }
      lps.push_back(std::move(t));
    }
  }
  *delta = choices_[static_cast<size_t>(m.index())]->Add(m, std::move(lps));
  return absl::OkStatus();
}

bool OutputAssembler::stopped() const {
  bool any_stopped = false;
  for (const auto& c : choices_) {
    if (!c->done()) return false;
    any_stopped = any_stopped || c->stopped();
  }
  return any_stopped;
}

bool OutputAssembler::finished() const {
  for (const auto& c : choices_) {
    if (!c->done()) return false;
  }
  return true;
}

bool OutputAssembler::any_tokens() const {
  for (const auto& c : choices_) {
    if (!c->token_ids().empty()) return true;
  }
  return false;
}

std::vector<Delta> OutputAssembler::Finish(Outcome* out) {
  std::vector<Delta> last;
  out->choices.clear();
  out->completion_tokens = 0;
  out->reasoning_tokens = 0;
  for (auto& c : choices_) {
    Choice choice;
    last.push_back(c->Finish(&choice));
    out->completion_tokens += static_cast<int32_t>(choice.token_ids.size());
    out->reasoning_tokens += choice.reasoning_tokens;
    out->choices.push_back(std::move(choice));
  }
  out->finish_reason = out->choices[0].finish_reason;
  out->parsed = out->choices[0].parsed;
  out->token_ids = out->choices[0].token_ids;
  out->logprobs = out->choices[0].logprobs;
  return last;
}

void KeepBestOf(Outcome* out, int keep) {
  std::vector<double> mean(out->choices.size());
  for (size_t i = 0; i < out->choices.size(); ++i) {
    const std::vector<TokenLogprobs>& lps = out->choices[i].logprobs;
    double sum = 0;
    for (const TokenLogprobs& lp : lps) sum += lp.logprob;
    mean[i] = lps.empty() ? -std::numeric_limits<double>::infinity()
                          : sum / static_cast<double>(lps.size());
  }
  std::vector<size_t> order(out->choices.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return mean[a] > mean[b]; });
  order.resize(std::min(order.size(), static_cast<size_t>(std::max(keep, 0))));
  std::vector<Choice> kept;
  kept.reserve(order.size());
  for (size_t i : order) kept.push_back(std::move(out->choices[i]));
  out->choices = std::move(kept);
  if (!out->choices.empty()) {
    const Choice& c0 = out->choices[0];
    out->finish_reason = c0.finish_reason;
    out->parsed = c0.parsed;
    out->token_ids = c0.token_ids;
    out->logprobs = c0.logprobs;
  }
}

}  // namespace epd::services::router
