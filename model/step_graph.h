#pragma once

// A batched decode step's arrays and its graphs (docs/cuda.md, "Decode step graphs").
//
// A decode step (Model::ExtendBatch) of R rows runs, for each layer, the parts that treat every
// row alike (mHC, norms, the attention's projections, the MoE) once for the batch, and the
// attention that reads and writes each sequence's own KV once per sequence. The first kind are
// cut into n_layers + 1 segments (Model::StepSegment), each running on StepArrays only: the
// step's inputs (ids, positions, Engram hash ids) are written into the arrays before segment 0,
// and nothing in a segment depends on the step but the contents of those arrays. A segment of a
// fixed R is thus the same ops on the same pointers and scalars every step, which a backend that
// records graphs (Backend::BeginCapture) launches as one unit: a CUDA graph instead of dozens of
// kernel launches per layer, so a small batch is not launch-bound.
//
// StepGraphCache keeps, per row count R (up to ModelOptions::step_graph_max_rows), a Set: the
// arrays and an arena (a ScratchPool of its own, never freeing) that every array a segment takes
// comes from, so the pointers a graph holds stay valid for the Set's life and no other call
// reuses them. A Set's first step runs op by op on the arena (sizing it and the backend's own
// scratch, so a capture allocates nothing), the second records each segment and launches it, the
// later ones launch. A capture that fails marks the Set failed: that R runs op by op from then on.
// So does a launch that fails (that step fails: how much of the graph ran is unknown).
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/scratch.h"

namespace epd::model {

// A batched decode step's arrays in backend memory ([R, ...] each; R = rows).
struct StepArrays {
  int64_t rows = 0;
  // Inputs, written before segment 0.
  int32_t* ids = nullptr;         // [R] tokens
  int64_t* pos = nullptr;         // [R] positions
  int64_t* engram_ids = nullptr;  // [n_engram_layers, R, (max_ngram-1)*n_heads] hash ids
  // Constants of R, written when the arrays are made.
  float* pre0 = nullptr;       // [R, hc] the first block's delayed pre-mix: [1, 0, ..., 0]
  int64_t* o_order = nullptr;  // [R * o_groups] the output projection's regrouping
  // Carried from segment to segment (and to the attention between them).
  float* h = nullptr;            // [R, hc, dim] residual stream
  float* pre = nullptr;          // [R, hc] delayed pre-mix
  float* main_hidden = nullptr;  // [R, n_targets * dim] DSpark inputs
  float* x = nullptr;            // [R, dim] a sublayer's normed input
  float* y = nullptr;            // [R, dim] a sublayer's output
  float* qr = nullptr;           // [R, q_lora_rank]
  float* q = nullptr;            // [R, heads, head_dim]
  float* kv = nullptr;           // [R, head_dim]
  float* qi = nullptr;           // [R, index_heads, index_head_dim]
  float* w = nullptr;            // [R, index_heads]
  float* cmp_kv = nullptr;       // [R, head_dim] a KV source's compressor projection (ratio 1:
                                 // normed, the entries before RoPE)
  float* cmp_score = nullptr;    // [R, head_dim] its gate projection (ratio > 1)
  float* mtp_kv = nullptr;       // [n_mtp_layers, R, head_dim] the DSpark layers' window rows
                                 // (Model::DSparkSeedFrom's), made in the last segment
  float* o = nullptr;            // [R, heads, head_dim] the attention's output
  float* logits = nullptr;       // [R, vocab]
  Model::HcMix mix;              // the layer's mHC mixes
};

class StepGraphCache {
 public:
  struct Set {
    explicit Set(kernels::Backend& backend, int64_t rows);
    ~Set();
    int64_t rows;
    // Declared in this order so that the graphs go first, then the arrays, then the arena.
    std::unique_ptr<ScratchPool> arena;
    std::unique_ptr<Scratch> held;  // holds the arrays (from the arena)
    StepArrays arrays;
    std::vector<std::unique_ptr<kernels::Graph>> segments;  // n_layers + 1 once recorded
    int64_t uses = 0;
    bool failed = false;  // a capture or a launch failed: R runs op by op, its graphs dropped
    uint64_t last_used = 0;
  };

  StepGraphCache(kernels::Backend& backend, int64_t max_rows, int max_sets)
      : backend_(backend), max_rows_(max_rows), max_sets_(max_sets) {}

  // Held for a whole step: one step at a time uses the sets.
  std::mutex& mu() { return mu_; }
  // The set for `rows` rows (made on first use, without its arrays; the least recently used set
  // goes when there are max_sets), or null when rows is over max_rows. Under mu().
  Set* Get(int64_t rows);
  StepGraphStats& stats() { return stats_; }  // under mu()

 private:
  kernels::Backend& backend_;
  const int64_t max_rows_;
  const int max_sets_;
  std::mutex mu_;
  std::map<int64_t, std::unique_ptr<Set>> sets_;
  uint64_t clock_ = 0;
  StepGraphStats stats_;
};

}  // namespace epd::model
