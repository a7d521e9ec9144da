#pragma once

// Output assembly for one request: turns the decode stage's token messages into client deltas
// (detokenize, stop strings, reasoning / content / tool-call split) and, at the end, the Outcome.
// One OutputAssembler lives for the whole request, across attempts: when a request migrates to
// another decode worker (docs/router.md, Request migration) the continuation's tokens go through
// the same detokenizer and stop matcher, so the client sees one uninterrupted stream.
// Not thread-safe: used from the request's thread.
#include <memory>
#include <string>
#include <vector>

#include "epd/v1/worker.pb.h"
#include "services/router/router_core.h"
#include "services/router/text_codec.h"

namespace epd::services::router {

class OutputAssembler {
 public:
  OutputAssembler(const TextCodec& codec, const PreparedRequest& request);

  // Takes one decode message (its tokens and finish reason); returns what the client is sent
  // now (token_ids always carries the message's tokens). After a stop string completes,
  // stopped() is true and later messages must not be added.
  Delta Add(const epd::v1::SubmitResponse& message);

  bool stopped() const { return stopped_; }
  // The finish reason the decode stage reported (empty until it did).
  const std::string& finish_reason() const { return finish_reason_; }
  void set_finish_reason(std::string reason) { finish_reason_ = std::move(reason); }
  // Every token received so far, in order (all of them were sent to the client).
  const std::vector<int32_t>& token_ids() const { return token_ids_; }

  // End of output: drains what the detokenizer, stop matcher and splitter still hold, parses the
  // whole text into `out` (parsed, finish_reason, token_ids, completion_tokens) and returns the
  // last delta to send (may be empty).
  Delta Finish(Outcome* out);

 private:
  const TextCodec& codec_;
  const bool thinking_;
  const bool parse_tools_;
  const std::string request_id_;
  std::unique_ptr<Detokenizer> detok_;
  StopMatcher stop_;
  AssistantSplitter splitter_;
  std::string full_text_;  // after stop strings
  std::string streamed_content_;
  std::string finish_reason_;
  std::vector<int32_t> token_ids_;
  bool stopped_ = false;
};

}  // namespace epd::services::router
