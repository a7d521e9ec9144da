#pragma once

// Test reference (not in any worker): the shipping decode path (decode_pool/decode_stage.cc) rolls
// rejected drafts back with Model::Checkpoint/Rollback inside one batched DecodeStep. This journal
// is the independent second implementation the DSpark tests compare it against.

// Rollback of rejected draft positions: a journal of exactly what a decode position can touch in a
// SequenceState (model/model.h), so the positions after the last accepted one can be undone.
//
// What one decode position p touches (Model::Decode): in every layer, main and DSpark stages, the
// window ring slot p % window; per KV source the compressed entries and index keys it appends
// (n grows), the ratio > 1 compressor tail slot p % ratio; published_keys; the Engram history;
// the DSpark input main_hidden / main_hidden_pos; pos. The journal saves each overwritten ring
// slot before the position runs and the small per-position state after it; appended entries are
// undone by truncation. Cost per position: total_layers x head_dim floats of ring slots plus the
// tails, Engram history and main_hidden (docs/dspark.md has the measured figures).
//
// Thread-safety: one journal per sequence, used by one thread at a time.

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "model/config.h"
#include "model/model.h"

namespace epd::testing {

class StepJournal {
 public:
  explicit StepJournal(const model::ModelConfig& config);

  // Starts a step at state.pos (drops any previous journal).
  void Begin(const model::SequenceState& state);
  // Call right before the target processes position state.pos: saves the ring slot it overwrites
  // in every layer.
  void BeforePosition(const model::SequenceState& state);
  // Call right after that position: records the small state (tails, counts, Engram, DSpark input).
  void AfterPosition(const model::SequenceState& state);
  // Keeps the first `keep` positions journaled since Begin (0 <= keep <= positions()) and restores
  // everything the others touched. The journal is empty afterwards.
  [[nodiscard]] absl::Status Rollback(model::SequenceState& state, int64_t keep);

  int64_t positions() const { return static_cast<int64_t>(after_.size()); }
  // Bytes the journal holds now (ring slots + small state).
  int64_t bytes() const;

 private:
  struct SourceTail {
    int64_t n = 0;
    std::vector<float> tail;  // the compressor tail's values: kv then score (CompressorTail)
  };
  struct Small {
    int64_t pos = 0;
    int published_keys = -1;
    std::vector<int64_t> engram_history;
    std::vector<float> main_hidden;
    int64_t main_hidden_pos = -1;
    std::map<int, SourceTail> sources;
  };
  static Small Capture(const model::SequenceState& state);

  int64_t window_, head_dim_, index_head_dim_;
  bool active_ = false;
  Small base_;
  std::vector<Small> after_;               // per journaled position
  std::vector<std::vector<float>> slots_;  // per journaled position: [layers, head_dim]
};

// Exact equality of two states (every float compared by bit pattern; sizes included). Returns
// an empty string when equal, else the first differing field.
std::string DiffStates(const model::SequenceState& a, const model::SequenceState& b);

// Bytes of a full SequenceState copy (the alternative to the journal).
int64_t StateBytes(const model::SequenceState& state);

}  // namespace epd::testing
