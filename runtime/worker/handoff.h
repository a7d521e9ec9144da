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
#include "transfer/kv_transport.h"
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

// Streamed hand-offs (encoder -> prefill; docs/transfer.md "Streamed hand-offs"). The hand-off is
// cut into G + 1 groups, each its own transfer (manifest, checksums, accounting) under the request
// id "<id>#g<g>/<G>". The encoder runs its pass in chunks of C positions; group g < G holds the
// global KV rows and index keys ("kv.<L>", "keys.<L>") of every KV source for positions
// [g*C, (g+1)*C), final as soon as that chunk ran, and is sent while the next chunk computes; the
// final group G holds everything else in hand-off order (meta, rings, the rows of
// [G*C, N), compressor tails, engram, main_hidden, enc.*). G = ceil(N / C) - 1. Both sides derive
// the plan from (config, N, C) alone; C = StreamChunkTokens(config) unless a test says otherwise.
int64_t StreamChunkTokens(const model::ModelConfig& config);  // 1024 (a multiple of every ratio)
int StreamGroups(int64_t tokens, int64_t chunk_tokens);       // G
std::string StreamRequestId(const std::string& request_id, int group, int groups);
// A byte range of one expected segment.
struct StreamPiece {
  size_t shape = 0;  // index into the hand-off's shapes
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
// The pieces of every group (G + 1 lists), for a hand-off of `shapes` at `tokens` positions.
// Errors when chunk_tokens is not a positive multiple of every KV source's ratio.
absl::StatusOr<std::vector<std::vector<StreamPiece>>> StreamPlan(
    const model::ModelConfig& config, int64_t tokens, int64_t chunk_tokens,
    const std::vector<SegmentShape>& shapes);

class HandoffPeer;

// The sending side of one streamed hand-off. SendReady offers (without waiting) every group whose
// positions are all below `pos`, cut from the current KV segments; Finish offers the groups left
// and the final group, cut from the whole hand-off, then waits for every group's confirmation in
// order. On any failure (and in the destructor when Finish did not run) every offered group is
// cancelled, so the receiver fails the request and frees what it posted.
class HandoffStreamSender {
 public:
  // `shapes`: the whole hand-off as the receiver derives it (state, then encoder output).
  HandoffStreamSender(HandoffPeer& peer, const model::ModelConfig& config, std::string address,
                      HandoffHeader header, std::vector<SegmentShape> shapes,
                      absl::Duration deadline, const std::atomic<bool>* cancelled,
                      int64_t chunk_tokens = 0);
  ~HandoffStreamSender();
  HandoffStreamSender(const HandoffStreamSender&) = delete;
  HandoffStreamSender& operator=(const HandoffStreamSender&) = delete;

  int groups() const { return groups_; }  // G (the final group is G)
  int sent() const { return next_group_; }
  int64_t chunk_tokens() const { return chunk_tokens_; }
  // `kv`: at least the "kv.<L>"/"keys.<L>" segments of the state at `pos` positions.
  absl::Status SendReady(const std::vector<model::StateSegment>& kv, int64_t pos);
  // `whole`: every segment of the hand-off (any order; found by name).
  absl::Status Finish(const std::vector<model::StateSegment>& whole);
  void Abort(const std::string& reason);

 private:
  absl::Status Offer(int g, const std::vector<model::StateSegment>& from);

  HandoffPeer& peer_;
  const model::ModelConfig& config_;
  std::string address_;
  HandoffHeader header_;
  std::vector<SegmentShape> shapes_;
  absl::Duration deadline_;
  const std::atomic<bool>* cancelled_;
  int64_t chunk_tokens_;
  absl::Status plan_status_;
  std::vector<std::vector<StreamPiece>> plan_;
  int groups_ = 0;
  int next_group_ = 0;
  std::vector<transfer::TransferId> offered_;
  bool finished_ = false;
};

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
  // Receives a hand-off sent either whole (Send) or layer-streamed (HandoffStreamSender): posts
  // the whole transfer and group 0 of the stream plan (header.prompt_length positions); the offer
  // that matches decides, the other receive is cancelled; streamed, groups 1..G are posted once
  // group 0 matched and awaited in order (any group's failure cancels the rest and fails the call,
  // naming the group). Returns the segments in `shapes` order either way. `streamed` (optional):
  // set once the mode is known. chunk_tokens 0: StreamChunkTokens(config).
  absl::StatusOr<std::vector<model::StateSegment>> ReceiveStreamable(
      const model::ModelConfig& config, const HandoffHeader& header,
      const std::vector<SegmentShape>& shapes, absl::Duration deadline,
      const std::atomic<bool>* cancelled, bool* streamed = nullptr, int64_t chunk_tokens = 0);

  // Streaming building blocks: Offer connects (once per address) and offers without waiting;
  // AwaitSent waits for the confirmation and forgets the transfer.
  absl::StatusOr<transfer::TransferId> Offer(const std::string& address, epd::v1::Manifest manifest,
                                             const std::vector<model::StateSegment>& segments,
                                             absl::Duration deadline);
  absl::Status AwaitSent(const std::string& address, transfer::TransferId id,
                         absl::Duration deadline, const std::atomic<bool>* cancelled);
  void CancelAndForget(transfer::TransferId id, const std::string& reason);

 private:
  absl::StatusOr<transfer::PeerId> PeerFor(const std::string& address);
  void DropPeer(const std::string& address);
  // Posts a Receive of `shapes` under `manifest`.
  absl::StatusOr<transfer::TransferId> Post(const epd::v1::Manifest& manifest,
                                            const std::vector<SegmentShape>& shapes,
                                            absl::Duration deadline);

  absl::Status WaitFor(transfer::TransferId id, absl::Duration deadline,
                       const std::atomic<bool>* cancelled);

  transfer::KvTransport& transport_;
  std::mutex mu_;
  std::map<std::string, transfer::PeerId> peers_;
};

}  // namespace epd::worker
