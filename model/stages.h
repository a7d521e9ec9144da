#pragma once

// Stage runners for Encoder-Prefill-Decode disaggregation (DESIGN.md §3, MODEL.md §6) on top of
// the reference forward pass. A stage knows nothing of sockets: it reads and writes a
// SequenceState (serialisable with model/sequence_state.h) and an EncoderOutput.
//
// The split layer is the candidate source (layer 20 in the release, 4 in the golden tiny model):
// the encoder runs layers [0, split) plus the split layer's compressor and index keys; the decoder
// runs layers [split, n_layers) on the tail rows only (bounded replay, approximate when the
// prompt is longer than the tail: windows are truncated at the tail start; the global KV path
// stays exact). Its reference is Model::Prefill with PrefillOptions::decoder_tail_rows = the
// tail: EncoderPass (any chunking, incl. a SerializeState round trip between chunks) +
// DecoderReplay + DecodeStep equal it bit for bit (tests/model/bounded_reference_test.cc).
//
// Thread-safety: as Model (one thread per SequenceState).

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model.h"

namespace epd::model {

struct EncoderOutput {
  int64_t tail_start = 0;         // position of tail row 0
  std::vector<int32_t> tail_ids;  // tokens of the tail rows
  Model::Hidden tail;             // residual entering the split layer's block (after its
                                  // Engram, if any), tail rows only; main_hidden holds the
                                  // DSpark inputs of target layers below the split (others 0),
                                  // empty when there are none (DSparkTargetsBelowSplit)
  // Engram compressed ids of the (up to max_ngram-1) tokens before tail_start, oldest first: the
  // decoder's Engram layers hash the tail rows with them.
  std::vector<int64_t> engram_history;
};

// First decoder layer: the candidate source layer.
int DecoderSplitLayer(const ModelConfig& config);

// Whether a DSpark target layer lies below the split (the encoder output then carries the DSpark
// inputs of the tail rows; else they are all the decoder's).
bool DSparkTargetsBelowSplit(const ModelConfig& config);

// Rows the decoder replays from the encoder's residuals (DESIGN.md §3): the window plus the DSpark
// block (128 + 5 in the release). The bounded-replay semantics of the whole system
// (PrefillOptions::decoder_tail_rows), the encoder -> prefill hand-off's tail and the router's
// prefix cap all use this one number.
int64_t DecoderTailRows(const ModelConfig& config);

// Runs layers [0, split) on `ids` at positions state.pos.. (start 0: the reference prefill; later
// chunks: one reference call each), the split layer's compressor + index keys, and advances
// state.pos and the Engram history. `prev` (optional) is the previous chunk's output, so the tail
// may span chunks. Keeps the residual of the last `tail_rows` positions.
[[nodiscard]] absl::StatusOr<EncoderOutput> EncoderPass(const Model& model, SequenceState& state,
                                                        std::span<const int32_t> ids,
                                                        int64_t tail_rows,
                                                        const EncoderOutput* prev = nullptr);

// Encoder replay after a prefix hit without SWA rings: `ids` are the tokens at
// [state.pos - ids.size(), state.pos) (at most split x window), `history` the max_ngram-1 tokens
// before them. Rebuilds the rings of layers [0, split) with windows truncated at the replay start;
// the global KV is not recomputed. The rings are exact (bit-identical to a pass from 0) when the
// replay starts at 0 or covers split x window tokens (PrefixReplayTokens).
[[nodiscard]] absl::Status EncoderReplay(const Model& model, SequenceState& state,
                                         std::span<const int32_t> ids,
                                         std::span<const int32_t> history);

// Decoder bounded replay: layers [split, n_layers) on the encoder's tail rows, windows truncated
// at the tail start; fills the decoder rings, seeds the DSpark rings and state.main_hidden.
// Returns the last row's logits.
[[nodiscard]] absl::StatusOr<ForwardResult> DecoderReplay(const Model& model, SequenceState& state,
                                                          const EncoderOutput& enc);

// One decode step for a batch: sequence b gets tokens[b] (1..k+1 positions: the last token and
// k drafts) at its own position; logits of every position. Each row behaves exactly like a
// single-token Decode (so greedy verification equals plain decoding).
// `failed` null: the first sequence that fails fails the call (the states of the batch are then
// unspecified). `failed` given: it receives one status per sequence; a sequence that fails gets
// its status there and an empty result (its state must not be used further) and the others run
// as if it were not in the batch — one bad request does not fail its neighbours.
// `out[b]` (default: every sequence kValues) says whether sequence b's result carries its logits
// rows, only their argmax, or only their draws (LogitsOut), after which penalties and with which
// uniforms (LogitsRequest).
[[nodiscard]] absl::StatusOr<std::vector<ForwardResult>> DecodeStep(
    const Model& model, std::span<SequenceState* const> states,
    std::span<const std::vector<int32_t>> tokens, std::vector<absl::Status>* failed = nullptr,
    std::span<const LogitsRequest> out = {});

}  // namespace epd::model
