#pragma once

// Output assembly for one request: turns the decode stage's token messages into client deltas
// (detokenize, stop strings, reasoning / content / tool-call split, logprobs, reasoning-token
// count) and, at the end, the Outcome. A request with sampling.n > 1 has n choices: the decode
// worker tags each message with its choice's index and every choice keeps its own detokenizer,
// stop matcher, splitter, finish reason, tool calls and logprobs (ChoiceAssembler).
// One OutputAssembler lives for the whole request, across attempts: when a request migrates to
// another decode worker (docs/router.md, Request migration; n == 1 only) the continuation's
// tokens go through the same detokenizer and stop matcher, so the client sees one uninterrupted
// stream. Not thread-safe: used from the request's thread.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "epd/v1/worker.pb.h"
#include "services/router/router_core.h"
#include "services/router/text_codec.h"

namespace epd::services::router {

// One choice's state. Not thread-safe.
class ChoiceAssembler {
 public:
  ChoiceAssembler(const TextCodec& codec, const PreparedRequest& request, int index);

  // Adds one message's tokens (and their logprobs, already unpacked); returns the delta to send.
  Delta Add(const epd::v1::SubmitResponse& message, std::vector<TokenLogprobs> logprobs);
  // Drains what is still held into `out` and returns the choice's last delta (may be empty).
  Delta Finish(Choice* out);

  // A stop string completed: later tokens of this choice are dropped.
  bool stopped() const { return stopped_; }
  // A finish reason arrived (or a stop string completed).
  bool done() const { return stopped_ || !finish_reason_.empty(); }
  const std::string& finish_reason() const { return finish_reason_; }
  void set_finish_reason(std::string reason) { finish_reason_ = std::move(reason); }
  const std::vector<int32_t>& token_ids() const { return token_ids_; }

 private:
  const TextCodec& codec_;
  const bool thinking_;
  const bool parse_tools_;
  const std::string request_id_;
  const int index_;
  const std::string think_end_;
  std::unique_ptr<Detokenizer> detok_;
  StopMatcher stop_;
  AssistantSplitter splitter_;
  std::string full_text_;  // after stop strings
  std::string streamed_content_;
  std::string finish_reason_;
  std::string raw_;  // detokenized text until </think> (reasoning_tokens)
  bool think_ended_ = false;
  int32_t reasoning_tokens_ = 0;
  std::vector<int32_t> token_ids_;
  std::vector<TokenLogprobs> logprobs_;
  bool stopped_ = false;
};

class OutputAssembler {
 public:
  OutputAssembler(const TextCodec& codec, const PreparedRequest& request);

  // Takes one decode message (its choice index, tokens, logprobs and finish reason) and sets
  // *delta to what the client is sent now (token_ids always carries the message's tokens; empty
  // for a choice already cut by a stop string). InternalError (without the worker's name) when
  // the message names a choice out of range or carries the wrong number of logprob entries.
  absl::Status Add(const epd::v1::SubmitResponse& message, Delta* delta);

  int n() const { return static_cast<int>(choices_.size()); }
  // Every choice ended and the last one by a stop string: the worker's stream is cut.
  bool stopped() const;
  // Every choice has a finish reason (a stop string counts).
  bool finished() const;
  // Some choice received a token.
  bool any_tokens() const;
  // Choice 0 (the only one when n == 1, the case migration supports).
  const std::string& finish_reason() const { return choices_[0]->finish_reason(); }
  void set_finish_reason(std::string reason) { choices_[0]->set_finish_reason(std::move(reason)); }
  // Every token choice 0 received so far, in order (all of them were sent to the client).
  const std::vector<int32_t>& token_ids() const { return choices_[0]->token_ids(); }

  // End of output: drains every choice into out->choices (and choice 0's fields into out's
  // mirrors), sums completion_tokens and reasoning_tokens, and returns the last delta of each
  // choice, by index (some may be empty).
  std::vector<Delta> Finish(Outcome* out);

 private:
  const int logprobs_top_;
  std::vector<std::unique_ptr<ChoiceAssembler>> choices_;
};

// Completions best_of: keeps the `keep` choices of `out` with the highest mean logprob per token
// (OpenAI's "highest log probability per token"; a choice without tokens ranks last, ties keep the
// lower index), best first, re-indexed from 0; choice 0's mirrors follow. Usage is unchanged: every
// sampled token was generated and is counted (OpenAI bills best_of samples too).
void KeepBestOf(Outcome* out, int keep);

}  // namespace epd::services::router
