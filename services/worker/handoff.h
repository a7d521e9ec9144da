#pragma once

// Hand-offs between worker stages over the transfer engine (docs/workers.md, "Hand-offs").
//
// A hand-off is a list of named byte segments: a SequenceState as model/sequence_state.h
// serializes it ("meta", "swa.<L>", "kv.<L>", "keys.<L>", "tail.<L>", "engram", "main_hidden"),
// plus, encoder -> prefill, the encoder output tail ("enc.meta", "enc.ids", "enc.h", "enc.pre",
// "enc.hist": Engram history before the tail, "enc.mh": DSpark inputs of targets below the split),
// and, prefill -> decode, the first-token logits ("logits"). The sender describes what it actually
// computed; the receiver derives the list it expects from (config, prompt length, tail rows) alone
// and the transfer engine compares the two field by field before any byte is used.
//
// Thread-safety: the free functions are reentrant; HandoffPeer may be used from any thread.
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epd/v1/transfer.pb.h"
#include "kvstore/transfer/kv_transport.h"
#include "model/sequence_state.h"
#include "model/stages.h"

namespace epd::worker {

// One expected segment: name, size and how it is labelled in the manifest.
struct SegmentShape {
  std::string name;
  uint64_t bytes = 0;
};

// Segments of a state at `tokens` positions as SerializeState writes them. `main_hidden`: whether
// the state carries the DSpark input of its last position (after the decoder ran).
std::vector<SegmentShape> ExpectedStateShapes(const model::ModelConfig& config, int64_t tokens,
                                              bool main_hidden);
// Encoder output tail segments for a prompt of `tokens` and at most `tail_rows` rows.
std::vector<SegmentShape> ExpectedEncoderOutputShapes(const model::ModelConfig& config,
                                                      int64_t tokens, int64_t tail_rows);
// Tail rows the encoder hands over and the decoder replays: window + DSpark block (128 + 5).
int64_t HandoffTailRows(const model::ModelConfig& config);
// The first-token logits segment (fp32 [vocab]).
SegmentShape LogitsShape(const model::ModelConfig& config);

std::vector<SegmentShape> ShapesOf(const std::vector<model::StateSegment>& segments);

std::vector<model::StateSegment> PackEncoderOutput(const model::EncoderOutput& out);
// Errors name the bad segment.
absl::StatusOr<model::EncoderOutput> UnpackEncoderOutput(
    const model::ModelConfig& config, const std::vector<model::StateSegment>& segments);
model::StateSegment PackLogits(const std::vector<float>& logits);
absl::StatusOr<std::vector<float>> UnpackLogits(const std::vector<model::StateSegment>& segments);

struct HandoffHeader {
  std::string request_id;
  std::string config_fingerprint;
  int64_t prompt_length = 0;
  int64_t cached_length = 0;
  bool dspark = false;
};

// A manifest over `shapes` (raw-byte layout; kind and layer derived from the segment name).
epd::v1::Manifest BuildHandoffManifest(const model::ModelConfig& config,
                                       const HandoffHeader& header,
                                       const std::vector<SegmentShape>& shapes);

// Sends and receives named segments over one KvTransport, caching one connection per address.
class HandoffPeer {
 public:
  explicit HandoffPeer(transfer::KvTransport& transport) : transport_(transport) {}

  // Connects (once per address), offers the segments and waits until the receiver confirmed.
  absl::Status Send(const std::string& address, epd::v1::Manifest manifest,
                    const std::vector<model::StateSegment>& segments, absl::Duration deadline,
                    const std::atomic<bool>* cancelled);
  // Waits for the offer of expected.request_id(); returns the segments named as `shapes`.
  absl::StatusOr<std::vector<model::StateSegment>> Receive(const epd::v1::Manifest& expected,
                                                           const std::vector<SegmentShape>& shapes,
                                                           absl::Duration deadline,
                                                           const std::atomic<bool>* cancelled);

 private:
  absl::Status WaitFor(transfer::TransferId id, absl::Duration deadline,
                       const std::atomic<bool>* cancelled);

  transfer::KvTransport& transport_;
  std::mutex mu_;
  std::map<std::string, transfer::PeerId> peers_;
};

}  // namespace epd::worker
