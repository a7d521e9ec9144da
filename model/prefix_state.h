#pragma once

// Prefix reuse (DESIGN.md §3 steps 1-2, §5): an encoder SequenceState cut at a block boundary into
// the values the kvstore holds, and the inverse.
//
//  - G3 block value, one per block b (tokens [bB, (b+1)B), B = kPrefixBlockTokens, a multiple of
//    every compression ratio): the entries of every KV source covering those tokens (`kv.<L>`,
//    `keys.<L>` slices, entries [bB/r, (b+1)B/r)), plus the state at the block end that is not
//    per-token: the compressor tails (`tail.<L>`), `published_keys` and the Engram history.
//  - G2 SWA snapshot at P: the SWA rings of layers [0, split) (the encoder's) and the Engram
//    history at P.
//
// Every value starts with a 40-byte header (LE): magic "EPDP" u32, version u16 (=1), kind u16
// (1 block, 2 snapshot), block_tokens i64, end position i64 (block: (b+1)B; snapshot: P),
// block index i64 (snapshot: P/B - 1), segment count i64; then per segment: name length u32,
// name, byte length u64, bytes (the packed formats of model/sequence_state.h). A value of another
// version, kind, position or block index is an error naming the field, never used.
//
// Only encoder states are cut: main_hidden (a decoder product) is not part of a prefix, and the
// rings of layers >= split are never touched by the encoder (an assembled state has them zero,
// as NewSequence).
//
// Thread-safety: pure functions.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model.h"

namespace epd::model {

inline constexpr int64_t kPrefixBlockTokens = 64;
inline constexpr uint16_t kPrefixValueVersion = 1;

// Block values for blocks [first_block, end_block) of `state` (an encoder state at
// pos == end_block * B); `prompt` holds the tokens of at least positions [0, pos) (the Engram
// history at each block end). `published_keys` is the state's (for an encoder state it is the
// split layer at every block end: the last source to emit). The compressor tail of block b <
// end_block - 1 is rebuilt from the compressor log of the last call (SequenceState::Source::log,
// model/compressor_state.h), which must hold its last `ratio` rows: true when the last
// EncoderPass chunk started at or before the first of these blocks and block_tokens is a multiple
// of the state's cut_block_tokens (or the block ends in the chunk's last 64 rows).
// FailedPrecondition otherwise.
[[nodiscard]] absl::StatusOr<std::vector<std::string>> CutPrefixBlocks(
    const Model& model, const SequenceState& state, std::span<const int32_t> prompt,
    int64_t first_block, int64_t end_block, int64_t block_tokens = kPrefixBlockTokens);

// The SWA snapshot of `state` at its position (must be a multiple of block_tokens, > 0).
[[nodiscard]] absl::StatusOr<std::string> CutSwaSnapshot(const Model& model,
                                                         const SequenceState& state,
                                                         int64_t block_tokens = kPrefixBlockTokens);

// The state at P = blocks.size() * B from the block values of blocks 0..P/B-1 (in order) and, if
// given, the SWA snapshot at P. Without a snapshot the encoder rings are zero: run
// PrefixReplay before using the state. Errors name the value and the field that is wrong.
[[nodiscard]] absl::StatusOr<std::unique_ptr<SequenceState>> AssemblePrefixState(
    const Model& model, std::span<const std::string> blocks, const std::string* snapshot,
    int64_t block_tokens = kPrefixBlockTokens);

// Tokens the encoder replay runs at P: min(P, split x window), the depth at which the rebuilt
// rings are exact (a replay of one window is not: see prefix_state.cc).
int64_t PrefixReplayTokens(const ModelConfig& config, int64_t prefix);

// Encoder replay of a state assembled without a snapshot: EncoderReplay over
// [P - PrefixReplayTokens, P) of `prompt` (which must hold at least P tokens). Afterwards the
// state equals, bit for bit, the state of an EncoderPass over [0, P).
[[nodiscard]] absl::Status PrefixReplay(const Model& model, SequenceState& state,
                                        std::span<const int32_t> prompt);

}  // namespace epd::model
