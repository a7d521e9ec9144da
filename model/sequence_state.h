#pragma once

// Serialization of a SequenceState into named segments in the packed storage formats of
// MODEL.md §4, with exact byte accounting. Used to move a sequence between workers (prefill ->
// decode) and to persist it.
//
// Segments (all little-endian):
//   "meta"            : int64 pos, published_keys, main_hidden_pos, n_sources, then per source
//                       (int64 layer, int64 n)
//   "swa.<L>"         : window x packed SWA slot (E4M3 + UE8M0 per 32; 528 B at head_dim 512),
//                       for every layer incl. DSpark stages
//   "kv.<L>"          : n x packed compressed entry (E2M1 + E4M3 per 16; 288 B at 512)
//   "keys.<L>"        : n x packed index key (E2M1 + UE8M0 per 32; 68 B at 128)
//   "tail.<L>"        : ratio>1 sources only: fp32 kv_state then score_state [ratio, head_dim] each
//   "engram"          : int64 compressed ids of the last max_ngram-1 tokens (oldest first)
//   "main_hidden"     : bf16 bits [n_targets*dim] (DSpark input of the last position)
// Unpacking a packed entry gives exactly the values the forward pass holds (the quantizers are
// idempotent on their own output), so a round trip is bit-exact.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/model.h"

namespace epd::model {

struct StateSegment {
  std::string name;
  std::vector<uint8_t> bytes;
};

[[nodiscard]] std::vector<StateSegment> SerializeState(const ModelConfig& config,
                                                       const SequenceState& state);
// The segments of SerializeState whose name `keep` accepts, in the same order and bytes; the
// others are not built (the layer-streamed hand-off cuts one layer group at a time).
[[nodiscard]] std::vector<StateSegment> SerializeStateSegments(
    const ModelConfig& config, const SequenceState& state,
    const std::function<bool(const std::string& name)>& keep);
// Rebuilds a state; errors name the bad or missing segment.
[[nodiscard]] absl::StatusOr<std::unique_ptr<SequenceState>> DeserializeState(
    const Model& model, const std::vector<StateSegment>& segments);

// Bytes per segment kind for a state at `tokens` positions (before any decode), computed from the
// config alone: "global_kv" (entries + keys of all sources), "swa", "compressor_tails", "engram",
// "main_hidden", "meta", "total".
std::vector<std::pair<std::string, int64_t>> StateByteAccounting(const ModelConfig& config,
                                                                 int64_t tokens);

}  // namespace epd::model
