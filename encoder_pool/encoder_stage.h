#pragma once

// The encoder stage (DESIGN.md §3): layers [0, split) of the prompt plus the split layer's
// compressor and index keys. Compute only: no gRPC, no UCX (encoder_server.cc moves the result).
//
// Thread-safety: Run may be called from any thread; calls share the model's backend and are
// serialized by an internal mutex.
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstore/kvstore_client.h"
#include "model/model.h"
#include "model/prefix_state.h"
#include "model/sequence_state.h"
#include "model/stages.h"

namespace epd::encoder_pool {

struct EncoderResult {
  std::vector<model::StateSegment> state;  // the sequence state at N (SerializeState)
  model::EncoderOutput output;             // residual entering the split layer, tail rows
};

// Prefix reuse through the kvstore (docs/workers.md "Store reuse").
struct PrefixOptions {
  // One daemon or several on the hash ring (kvstore/sharded_kv_client.h). Null: no store (P = 0,
  // nothing written).
  kvstore::KvStoreApi* store = nullptr;
  std::string fingerprint;                  // the config fingerprint inside every chain hash
  int64_t hint = 0;                         // Job.cached_tokens (the router's lookup)
  int64_t block_tokens = model::kPrefixBlockTokens;
};

// Chunked passes for the streamed hand-off (docs/transfer.md "Streamed hand-offs").
struct ChunkOptions {
  // Every EncoderPass is cut at multiples of this many positions (0: no extra cuts). Chunking does
  // not change the result (EncoderPass is bit-exact under any chunking).
  int64_t chunk_tokens = 0;
  // Called after every pass with the state at its end (state.pos = positions done): the global
  // KV rows of [0, state.pos) are final from then on. Its error stops the run and is returned.
  std::function<absl::Status(const model::SequenceState& state)> after_chunk;
};

// What the store path did, for the response and the metrics.
struct PrefixReport {
  int64_t cached_tokens = 0;      // P actually used (whole blocks, <= the hint and the tail cap)
  int64_t blocks_fetched = 0;     // G3 (or G1) block values read and used
  bool snapshot_hit = false;      // the SWA rings came from G2
  bool replayed = false;          // G2 miss/expiry: the encoder replay rebuilt the rings
  int64_t replayed_tokens = 0;    // tokens of that replay
  int64_t blocks_written = 0;     // new block values put to G3
  bool snapshot_written = false;  // SWA snapshot put to G2
  // Store operations that failed ("lookup", "get", "put", "decode": a value that did not
  // assemble); each degraded the request (shorter P, nothing written), never failed it.
  std::vector<std::string> errors;
  std::string warning;  // the first error's message
};

class EncoderStage {
 public:
  // `model` must outlive the stage. tail_rows <= 0: DefaultTailRows(config).
  explicit EncoderStage(const model::Model& model, int64_t tail_rows = 0);

  // Tail rows the decoder replays: window + DSpark block (128 + 5 in the release).
  static int64_t DefaultTailRows(const model::ModelConfig& config);
  int64_t tail_rows() const { return tail_rows_; }

  // Encodes a whole prompt from position 0. Errors on an empty prompt or ids out of the vocab.
  [[nodiscard]] absl::StatusOr<EncoderResult> Run(std::span<const int32_t> prompt);

  // The same result, reusing the stored prefix: P = min(hint, PrefixCap(N)) rounded down to a
  // block; the G3 blocks [0, P) and the G2 SWA snapshot at P are read (a missing block shortens
  // P to the blocks read; a missing/expired snapshot runs the (exact) encoder replay), then
  // EncoderPass runs over [P, N) in two chunks split at the last block boundary M of the prompt,
  // and the new blocks [P, M) not yet stored go to G3 and the rings at M to G2 (before Run
  // returns). Store errors never fail the call; they are listed in `report`.
  // `chunks` (optional): the passes over [P, M) and [M, N) are further cut at multiples of
  // chunks->chunk_tokens and chunks->after_chunk runs after each (the streamed hand-off sends the
  // finished chunks' KV rows from there while the next chunk computes).
  [[nodiscard]] absl::StatusOr<EncoderResult> Run(std::span<const int32_t> prompt,
                                                  const PrefixOptions& prefix, PrefixReport* report,
                                                  const ChunkOptions* chunks = nullptr);

  // Largest block boundary P with N - P >= tail_rows (the decoder replays the last tail rows,
  // whose residuals only the encoder computes), 0 when none.
  static int64_t PrefixCap(int64_t prompt_tokens, int64_t tail_rows, int64_t block_tokens);

 private:
  const model::Model& model_;
  int64_t tail_rows_;
  std::mutex compute_mu_;
};

}  // namespace epd::encoder_pool
