#pragma once

// The V4.1 reference forward pass (MODEL.md §3) on a kernels::Backend.
//
// Model is immutable after construction and may be shared by threads; each call takes the
// per-sequence SequenceState it mutates (one thread per state at a time). The Backend is used
// from the calling thread (one call at a time per backend instance).
//
// Calls mirror the reference: Prefill (start_pos 0, the whole prompt in one shot; logits of every
// position on request), Decode (one token at position state.pos), and the DSpark draft pass.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "model/compressor_state.h"
#include "model/config.h"
#include "model/engram.h"
#include "model/kv_pool.h"
#include "model/sampling.h"
#include "model/weights.h"

namespace epd::model {

class Scratch;         // model/scratch.h: a call's arrays in backend memory
class ScratchPool;     // model/scratch.h: backend buffers kept for the next calls' Scratch
class StepGraphCache;  // model/step_graph.h: a batched decode step's graphs, by rows
struct StepArrays;     // model/step_graph.h: a batched decode step's arrays

struct ModelOptions {
  // Reproduce the reference's stale index keys at even decode positions (MODEL.md §3). Default:
  // true.
  bool stale_index_keys = true;
  // Benchmarks only (tests/bench/ced_bench.cc): keep the compressed KV latents and index keys in
  // full precision, skipping their FP4 quantize-dequantize (MODEL.md §3). Default false = the
  // reference numerics; false changes nothing. (The KV pool then holds fp32 rows.)
  bool unquantized_kv = false;
  // Capacity of the model's KV pool in bytes (0 = unbounded); see Model::kv_pool().
  int64_t kv_pool_bytes = 0;
  // Backend memory kept between calls for their arrays (model/scratch.h), in bytes.
  int64_t scratch_cache_bytes = int64_t{256} << 20;
  // A call of at most this many rows (decode steps, verification blocks) keeps its top-k in
  // backend memory: TopKSlots writes the top-k part of its attention lists and the selected
  // entries are gathered per list slot (rows x top-k entries), with no host round trip. Larger
  // calls (prefill) download the top-k and gather each selected entry once (a compact,
  // deduplicated buffer). Both give the same bits (OpCountTest); 0 = always the compact path.
  int64_t device_list_rows = 16;
  // On a device backend, a larger call (prefill) keeps its top-k in backend memory too when every
  // KV source's compressed entries at the call's end fit this many bytes unpacked (fp32): each
  // attention layer unpacks its source whole and TopKSlots writes the top-k part of its lists (no
  // download of the top-k, no host-built gather). Beyond it, and on the host, the compact path.
  // Same bits either way (OpCountTest); 0 = never.
  int64_t whole_source_bytes = int64_t{64} << 20;
  // Decode step graphs (docs/cuda.md, "Decode step graphs"; model/step_graph.h): on a backend
  // that records graphs (Backend::supports_graphs: CUDA), a batched decode step of at most
  // step_graph_max_rows rows runs the row-independent parts of each layer (everything but the
  // attention that reads and writes each sequence's own KV) as one graph launch per layer,
  // recorded the second time a step of that many rows runs. At most step_graph_sets row counts
  // keep their graphs (the least recently used goes). The same bits as op by op.
  bool step_graphs = true;
  int64_t step_graph_max_rows = 128;
  int step_graph_sets = 8;
};

// What the decode step graphs have done so far (Model::step_graph_stats).
struct StepGraphStats {
  int64_t sets = 0;         // row counts with graphs now
  int64_t captured = 0;     // segments recorded
  int64_t launched = 0;     // segment graphs launched
  int64_t eager_steps = 0;  // batched steps run op by op (first use of a row count, or none)
  int64_t graph_steps = 0;  // batched steps whose segments ran as graphs
  int64_t failures = 0;     // captures or launches that failed (those row counts then run op by op)
  int64_t evicted = 0;      // sets dropped for a newer row count
};

// Per-sequence state kept between calls. The global KV (compressed entries and index keys of
// every KV source) lives in the model's KvPool in its packed formats, read and written through
// each stream's block table (KvRows, model/kv_pool.h); copying a state shares those blocks
// (copy-on-write). So do the SWA rings, one pool block each in the packed SWA slot format
// (SwaRing). So does each compressor's tail state (CompressorTail, one fp32 block); its log of
// the last call's rows is a backend buffer (CompressorLog): model/compressor_state.h.
struct SequenceState {
  int64_t pos = 0;  // tokens processed so far (next position)
  // Per layer (main + DSpark stages): window ring [window, head_dim], slot = position % window,
  // packed, in the pool.
  std::vector<SwaRing> swa;
  struct Source {
    int ratio = 0;
    KvRows kv;    // [n, head_dim] FP4-qdq compressed latents (RoPE applied), packed, paged
    KvRows keys;  // [n, index_head_dim] FP4-qdq index keys, packed, paged
    int64_t n = 0;
    // ratio > 1: kv and score inputs [ratio, head_dim] of the unfinished group.
    CompressorTail tail;
    // ratio > 1: the rows of the last call Rollback and CutPrefixBlocks may need. Transient.
    std::shared_ptr<CompressorLog> log;  // never written while shared
  };
  std::map<int, Source> sources;  // by KV source layer
  // The block of the prefix cut (CutPrefixBlocks): the compressor logs keep the rows of the tail
  // at each multiple of it (the encoder sets its store's block).
  int64_t cut_block_tokens = kKvBlockTokens;
  int published_keys = -1;        // layer whose index keys were published last (reference quirk)
  std::vector<int64_t>
      engram_history;              // compressed ids of the last max_ngram-1 tokens, newest last
  // [n_targets*dim] DSpark input of the last position (read it with MainHiddenOf: a batched
  // decode step on a device backend leaves it in backend memory, main_hidden_rows, and this host
  // copy stale).
  std::vector<float> main_hidden;
  int64_t main_hidden_pos = -1;
  // Set by Model::ExtendBatch on a device backend: the step's DSpark inputs [rows, n_targets*dim]
  // (main_hidden_rows_n rows; the buffer is kept and reused by the next step unless a copy of
  // the state shares it), row main_hidden_row being the last position's (-1: main_hidden holds
  // it). Rollback picks the kept row; nothing comes down until a hand-off serializes the state.
  std::shared_ptr<kernels::Buffer> main_hidden_rows;
  int64_t main_hidden_rows_n = 0;
  int64_t main_hidden_width = 0;  // floats per row (n_targets*dim)
  int64_t main_hidden_row = -1;
  kernels::Backend* main_hidden_backend = nullptr;
};

// The DSpark input of `s`'s last position ([n_targets*dim]; empty before any forward):
// s.main_hidden, or one read of the row a decode step left in backend memory.
[[nodiscard]] absl::StatusOr<std::vector<float>> MainHiddenOf(const SequenceState& s);

// A fresh state for `config` whose global KV and rings live in `pool` (Model::NewSequence; tools
// and tests that need a state without weights, e.g. a synthesized long state of the release
// config).
std::unique_ptr<SequenceState> NewSequenceState(const ModelConfig& config,
                                                std::shared_ptr<KvPool> pool,
                                                bool unquantized_kv = false);
// Pool bytes of one kKvBlockTokens-token block of global KV over all sources, and of a state at
// `tokens` positions (whole blocks of every stream, unshared).
int64_t KvBlockBytes(const ModelConfig& config, bool unquantized_kv = false);
int64_t KvBytesFor(const ModelConfig& config, int64_t tokens, bool unquantized_kv = false);
// Pool bytes of a state's SWA rings once written (every layer incl. the DSpark stages: `epd
// kv-layout`'s swa_bytes_per_sequence).
int64_t SwaRingBytes(const ModelConfig& config);
// Pool bytes of a state's compressor tails once written (ratio > 1 sources: fp32 kv and score
// [ratio, head_dim] each; StateByteAccounting's compressor_tails).
int64_t CompressorTailBytes(const ModelConfig& config);

// What a step of `rows` tokens may overwrite, saved before it (Model::Checkpoint) so that
// rejected draft positions can be rolled back (Model::Rollback).
struct StepCheckpoint {
  int64_t start = 0;
  int64_t rows = 0;
  int published_keys = -1;
  std::vector<int64_t> engram_history;
  int64_t main_hidden_pos = -1;
  struct Tail {
    int64_t n = 0;
    CompressorTail tail;  // shares the state's block (copy-on-write)
  };
  std::map<int, Tail> sources;
  // [layer] the min(rows, window) packed SWA slots of the step's positions as they were, in
  // backend memory (copied there with backend Copies: no host round trip), or nullptr where the
  // ring had no block yet (its slots were packed zeros).
  std::vector<const uint8_t*> ring_slots;
  std::shared_ptr<Scratch> saved;  // owns ring_slots' memory (the model's scratch pool)
  // Not ok: the checkpoint could not be taken (Rollback refuses it; the caller fails the step).
  absl::Status status;
};

// Optional capture of intermediates (for parity tests and debugging); all bf16 values as float.
struct ForwardTrace {
  std::map<int, std::vector<float>> attn_in, attn_out, ffn_in, ffn_out;  // [S, dim]
  std::map<int, std::vector<float>> engram_in, engram_out;               // [S, hc, dim]
  std::map<int, std::vector<float>> block_out;  // [S, hc, dim] residual after the block
  std::map<int, std::vector<int32_t>> topk;     // [S, k] compressed positions, -1 = none
  std::map<int, std::vector<int32_t>> experts;  // [S, top_k]
  std::vector<int64_t> engram_hash_ids;         // [S, n_engram_layers, (max_ngram-1)*n_heads]
  std::vector<float> final_norm;                // [S, dim]
};

// Which semantics a monolithic prefill computes (the reference of a staged run).
struct PrefillOptions {
  // 0 (default): the exact reference forward (model.py). > 0: bounded replay, the semantics of
  // Encoder-Prefill-Decode (DESIGN.md §3): in the decoder layers [candidate_source_layer,
  // n_layers), a row at a position >= floor = N - decoder_tail_rows does not see window positions
  // below the floor (rows below the floor keep their full windows; they do not influence the rows
  // above it). EncoderPass over the prompt (any chunking) + DecoderReplay of the last
  // decoder_tail_rows rows gives the same logits and state bit for bit; the decode steps after it
  // too when decoder_tail_rows >= window_size (the decoder rings then hold tail rows only).
  int64_t decoder_tail_rows = 0;
};

// What a forward brings back of its logits rows (Extend, ExtendBatch, DecodeStep, Draft).
enum class LogitsOut {
  kValues,  // the fp32 rows (ForwardResult::logits, DraftResult::logits)
  kArgmax,  // each row's greedy token only (ForwardResult::tokens; a draft's ids): the rows stay
            // in backend memory, and a step downloads rows x 4 bytes instead of rows x vocab x 4
  kSample,  // each row's seeded T > 0 draw only (ForwardResult::tokens; LogitsRequest::sample):
            // Backend::SampleLogits on the rows in backend memory, the host Sampler's arithmetic
  kVerify,  // DSpark T > 0 verification of rows [last, drafts...] (LogitsRequest::sample and
            // ::verify): ForwardResult::tokens = {drafts accepted, the token after them}, by
            // Backend::SampleLogits' distributions and Backend::VerifyDrafts on the rows in
            // backend memory (Drafter::Verify's arithmetic)
};

// Sampling penalties applied to a sequence's logits rows on the backend before their argmax or
// draw (Backend::PenalizeLogits; the entries a Sampler lists with Sampler::PenaltyEntries), so a
// request with penalties also gets its tokens without its rows coming down.
struct LogitPenalties {
  float repetition = 1.f;
  float frequency = 0.f;
  float presence = 0.f;
  std::vector<int64_t> at;      // row * vocab + token, rows of the sequence's result; distinct
  std::vector<int32_t> counts;  // per entry: times generated (the row's pending drafts included)
};

// A T > 0 draw of each of a sequence's result rows on the backend (LogitsOut::kSample).
struct SampleRequest {
  kernels::SampleParams params;  // Sampler::DrawParams()
  std::vector<double> uniforms;  // per result row, in [0, 1): the Sampler's Rng draws
};

// What a LogitsOut::kVerify result verifies: a draft pass's drafts and the distributions they
// were drawn from, still in backend memory (DraftResult::q).
struct DraftVerification {
  std::shared_ptr<kernels::Buffer> q;  // [>= drafts, vocab] fp32, of this model's backend
  std::vector<int32_t> drafts;         // [rows - 1]
};

// What a forward brings back of one sequence's logits rows.
struct LogitsRequest {
  LogitsRequest(LogitsOut out = LogitsOut::kValues, const LogitPenalties* penalties = nullptr,
                const SampleRequest* sample = nullptr, const DraftVerification* verify = nullptr)
      : out(out), penalties(penalties), sample(sample), verify(verify) {}
  LogitsOut out;
  // kArgmax, kSample and kVerify (else ignored): borrowed for the call.
  const LogitPenalties* penalties;
  // kSample and kVerify (required; one uniform per row): borrowed for the call.
  const SampleRequest* sample;
  const DraftVerification* verify;  // kVerify only (required): borrowed for the call
  // >= 0 with kArgmax, kSample or kVerify: each row's logprobs too (ForwardResult::logprobs) with
  // the top `top_logprobs` entries, computed on the backend from the raw rows
  // (Backend::TopLogprobs, the arithmetic of model::ComputeLogprobs; before the penalties) and the
  // row's token (kVerify: the verdict's token at its row and at the last, the row's draft
  // elsewhere).
  int top_logprobs = -1;
};

// Why `out` cannot be a request for `rows` result rows (OK when it can): penalties with one count
// per entry; a kSample or kVerify request with valid filters and one uniform in [0, 1) per row;
// a kVerify request with rows - 1 >= 1 drafts and their distributions.
[[nodiscard]] absl::Status LogitsRequestProblem(const LogitsRequest& out, int64_t rows);

struct ForwardResult {
  int64_t rows = 0;                // rows of logits (S with all_logits, else 1)
  std::vector<float> logits;       // [rows, vocab] fp32 (LogitsOut::kValues)
  // [rows] (LogitsOut::kArgmax, kSample); logits is then empty. kArgmax: the first index of each
  // row's largest logit (Backend::Argmax, the rule of model::ArgMax and of a greedy Sampler
  // without penalties). kSample: each row's draw with its uniform (Backend::SampleLogits).
  std::vector<int32_t> tokens;
  std::vector<Logprobs> logprobs;  // [rows] when LogitsRequest::top_logprobs >= 0 (with tokens)
  // [S, n_targets*dim] DSpark inputs of every position; empty from a batched decode step on a
  // device backend (ExtendBatch, DecodeStep: the state keeps them there, MainHiddenOf).
  std::vector<float> main_hidden;
};

struct DraftResult {
  std::vector<int32_t> ids;       // [block+1]: the input token then the drafts
  std::vector<float> logits;      // [block, vocab] fp32, markov bias included (kValues only)
  std::vector<float> confidence;  // [block] raw projection
  // kSample: [block, vocab] fp32 in backend memory, the distribution each draft was drawn from
  // (Backend::SampleLogits' probs; what a kVerify result takes, DraftVerification::q). A buffer
  // of the model's scratch pool, given back when the last copy goes: it must not outlive the
  // model.
  std::shared_ptr<kernels::Buffer> q;
};

// Model's definitions are in files by concern: model.cc (construction, loading, sizes, the
// forward: Prefill, Decode, Extend, RunStage, Block, Commit, Checkpoint / Rollback),
// attention.cc (RoPE, compressors, indexer, window KV, Attention), moe.cc, mhc.cc (the mHC
// steps), engram.cc (the Engram sublayer), logits.cc (the head and what a forward brings back of
// its logits: Head, LogitsToHost and their steps), dspark_draft.cc (Draft, DSparkSeed*) and
// decode_step.cc (ExtendBatch, the batched decode step and its graphs).
class Model {
 public:
  Model(ModelConfig config, std::unique_ptr<ModelWeights> weights, EngramConstants engram,
        kernels::Backend& backend, ModelOptions options = {});
  ~Model();

  // Loads config.json, the safetensors checkpoint and engram_constants.json from `dir`.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& dir,
                                                                   kernels::Backend& backend,
                                                                   ModelOptions options = {});

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  kernels::Backend& backend() const { return backend_; }
  const std::vector<LayerRole>& roles() const { return roles_; }
  const ModelWeights& weights() const { return *weights_; }
  const EngramConstants& engram() const { return engram_; }

  // A fresh sequence whose global KV and rings live in `pool` (default: the model's kv_pool()).
  std::unique_ptr<SequenceState> NewSequence(std::shared_ptr<KvPool> pool = nullptr) const;
  // The pool the model's sequences hold their global KV in (thread-safe; SetCapacity sizes it).
  KvPool& kv_pool() const { return *kv_pool_; }
  const std::shared_ptr<KvPool>& kv_pool_ptr() const { return kv_pool_; }
  // The backend buffers the model's calls take their arrays from and give back (thread-safe).
  ScratchPool& scratch_pool() const { return *scratch_pool_; }
  // The decode step graphs' counters (all zero when the backend records no graphs or
  // ModelOptions::step_graphs is off).
  StepGraphStats step_graph_stats() const;
  // Bytes of one kKvBlockTokens-token block of global KV over all sources (the store's block).
  int64_t KvBlockBytes() const;
  // Pool bytes of a sequence's global KV at `tokens` positions (whole blocks of every stream,
  // unshared); its SWA rings and compressor tails hold FixedStateBytes() more once written.
  int64_t KvBytesFor(int64_t tokens) const;
  int64_t SwaRingBytes() const { return model::SwaRingBytes(config_); }
  int64_t FixedStateBytes() const {
    return model::SwaRingBytes(config_) + model::CompressorTailBytes(config_);
  }

  // Prefill at start_pos 0 (state must be fresh). Logits of every position if all_logits, else
  // of the last. Also seeds the DSpark rings when the model has DSpark stages.
  [[nodiscard]] absl::StatusOr<ForwardResult> Prefill(SequenceState& state,
                                                      std::span<const int32_t> ids, bool all_logits,
                                                      ForwardTrace* trace = nullptr) const;
  // The same with explicit semantics (exact, or bounded decoder replay; see PrefillOptions). Runs
  // every layer over all rows, layer by layer, like Prefill (not via the stage runners).
  [[nodiscard]] absl::StatusOr<ForwardResult> Prefill(SequenceState& state,
                                                      std::span<const int32_t> ids, bool all_logits,
                                                      const PrefillOptions& options,
                                                      ForwardTrace* trace = nullptr) const;
  // One decode step: token `id` at position state.pos. Returns its logits [vocab].
  [[nodiscard]] absl::StatusOr<ForwardResult> Decode(SequenceState& state, int32_t id,
                                                     ForwardTrace* trace = nullptr) const;
  // Several tokens at positions state.pos.. in one call (chunked prefill after a prefix, or
  // the k+1 positions of a DSpark verification step). Bit-identical to calling Decode once per
  // token. Logits of every row if all_logits, else of the last.
  // kDecode: every row behaves exactly like a single-token Decode call (incl. the reference's
  // stale index keys), so a verification step equals sequential decoding. kPrefillChunk: one
  // reference call (sources publish their keys when they emit), so prompt chunks equal the
  // monolithic prefill.
  enum class ExtendMode { kDecode, kPrefillChunk };
  [[nodiscard]] absl::StatusOr<ForwardResult> Extend(SequenceState& state,
                                                     std::span<const int32_t> ids, bool all_logits,
                                                     ForwardTrace* trace = nullptr,
                                                     ExtendMode mode = ExtendMode::kDecode,
                                                     const LogitsRequest& out = {}) const;
  // Extend (kDecode, logits of every row) of several sequences in one forward (a decode step's
  // batch): the row-independent steps (embedding, Engram, mHC, norms, MoE) take every row of the
  // batch at once, so the weights are read once per step; attention runs per sequence on its
  // rows; the head over every row. Each result is bit-identical to that sequence's own Extend.
  // status[b] receives sequence b's own failure (its result is then empty and its state must not
  // be used further) without failing the others; the call fails only when a step shared by the
  // batch does (every state is then unspecified). Every sequence must be Batchable. `out[b]`
  // (default: every sequence kValues) says what sequence b's result carries.
  [[nodiscard]] absl::StatusOr<std::vector<ForwardResult>> ExtendBatch(
      std::span<SequenceState* const> states, std::span<const std::vector<int32_t>> tokens,
      std::vector<absl::Status>& status, std::span<const LogitsRequest> out = {}) const;
  // Whether Extend(state, ids) can go in an ExtendBatch: after a prefill, tokens in range, and
  // not a multi-token step that must run row by row (a later layer's stale index keys).
  bool Batchable(const SequenceState& state, std::span<const int32_t> ids) const;
  // Verification support: Checkpoint before an Extend of `rows` tokens; Rollback after it keeps
  // the first accepted.size() tokens (the Extend's `step` result supplies their DSpark inputs, or
  // the state's rows in backend memory after a batched step on a device backend), leaving the
  // state exactly as if only they had been decoded.
  StepCheckpoint Checkpoint(const SequenceState& state, int64_t rows) const;
  [[nodiscard]] absl::Status Rollback(SequenceState& state, const StepCheckpoint& checkpoint,
                                      std::span<const int32_t> accepted,
                                      const ForwardResult& step) const;
  // DSpark draft pass after a decode step (uses state.main_hidden of position state.pos-1).
  // `forced_ids` (optional, block-1 entries) replaces the greedy chaining of draft ids. With
  // `out` kArgmax the logits stay in backend memory (DraftResult::logits empty): what a greedy
  // request needs of a draft is its ids and confidences. `penalties` (kArgmax only; one row's
  // entries, at in [0, vocab)) are applied to every draft position's logits before its argmax:
  // a greedy request's penalties as of the step's start (the chain's own drafts are not counted
  // in them; drafts only decide what verification tests, never the output).
  // With `out` kSample the chain is drawn instead (a T > 0 request's drafts): position i's draft
  // is Backend::SampleLogits of its logits (the Markov bias of the chain drawn so far, then
  // `penalties` as above) with sample->uniforms[i] (one per block position), and DraftResult::q
  // keeps each position's distribution in backend memory.
  [[nodiscard]] absl::StatusOr<DraftResult> Draft(SequenceState& state, int32_t last_token,
                                                  std::span<const int32_t> forced_ids = {},
                                                  LogitsOut out = LogitsOut::kValues,
                                                  const LogitPenalties* penalties = nullptr,
                                                  const SampleRequest* sample = nullptr) const;

  // ---- Module entry points (tests, staged runners) ----
  // Per-call scratch shared by the layers of one call (the reference's shared_attn singleton).
  struct Call {
    int64_t start_pos = 0;
    int64_t rows = 0;
    bool prefill = true;
    std::vector<int32_t> topk;  // [rows, k] last published top-k (window offset applied);
                                // host copy: calls of more than device_list_rows rows, traces
    int64_t topk_k = 0;
    // The same in `scratch`, for calls of at most device_list_rows rows: their lists are
    // completed and gathered on the backend.
    int32_t* topk_dev = nullptr;
    // topk_dev holds the keys themselves (a batched step's selection, Model::StepIndexer), not
    // key + the window rows (SelectTopK's offset, as `topk`).
    bool topk_batched = false;
    // Uploaded once per call into `scratch` and shared by its layers: the rows' positions, and
    // for calls of at most device_list_rows rows the window part of the attention lists (top-k
    // part -1) by (list length, window floor).
    const int64_t* pos_dev = nullptr;
    std::map<std::pair<int64_t, int64_t>, const int32_t*> window_lists;
    uint8_t* cand = nullptr;  // [rows, cand_cols] candidate mask of the candidate source
                              // (backend memory, in `scratch`)
    // The call's scratch: arrays that span its layers (RunStage's; for a call a module entry
    // point's caller made without one, Attention makes own_scratch on first use).
    Scratch* scratch = nullptr;
    std::shared_ptr<Scratch> own_scratch;
    int64_t cand_cols = 0;
    bool per_row_keys = false;    // emulate single-token calls for the stale index keys
    int published_at_start = -1;  // state.published_keys when the call started
    bool compress = true;         // run KV sources' compressors (false: KV already present)
    int64_t window_floor = 0;     // rows at or above this position do not see window positions
                                  // below it (bounded replay)
  };
  // Residual stream between stages: h [rows, hc, dim], the delayed pre-mix [rows, hc] and the
  // DSpark inputs [rows, n_targets*dim] collected so far.
  struct Hidden {
    int64_t rows = 0;
    std::vector<float> h, pre, main_hidden;
  };
  struct StageSpec {
    int64_t start_pos = 0;         // position of ids[0]
    int first_layer = 0;           // 0: embed the ids; else `io` holds the residual entering it
    int last_layer = -1;           // exclusive; -1 = n_layers
    int64_t window_floor = 0;      // bounded replay: rows at or above this position do not see
                                   // window positions below it
    int floor_first_layer = 0;     // window_floor applies to layers >= this one
    bool compress = true;          // false: first_layer's compressor already ran (KV exists)
    bool per_row_keys = true;      // decode semantics for the stale index keys (start_pos > 0)
    int compress_only_layer = -1;  // after the range: this KV source's Engram (if any, applied
                                   // to io.h), then its compressor + keys only
    // first_layer's Engram already ran (the encoder applies the split layer's Engram: its
    // compressor needs it).
    bool first_engram_done = false;
    const std::vector<int64_t>* engram_history = nullptr;  // ids before start_pos (default: state)
  };
  // The residual stream a stage leaves in backend memory (in the caller's Scratch).
  struct DeviceResidual {
    float* h = nullptr;            // [rows, hc, dim]
    float* pre = nullptr;          // [rows, hc]
    float* main_hidden = nullptr;  // [rows, n_targets * dim] (RunStage; also in io.main_hidden)
  };
  // Runs layers [first_layer, last_layer) on `ids` (one reference call). Does not advance
  // state.pos; the stage runners (model/stages.h) and Forward do. The residual at the end goes
  // to io.h / io.pre (host), or, given `keep`, stays in backend memory: its arrays are taken
  // from `outer` (a scratch of the caller that outlives the call) and io.h / io.pre are left
  // empty. io.main_hidden is always downloaded (the DSpark inputs are host state).
  [[nodiscard]] absl::Status RunStage(SequenceState& state, std::span<const int32_t> ids,
                                      const StageSpec& spec, Hidden& io,
                                      ForwardTrace* trace = nullptr, Scratch* outer = nullptr,
                                      DeviceResidual* keep = nullptr) const;
  // Final norm + LM head on the residual: fp32 logits [rows or 1, vocab].
  [[nodiscard]] absl::StatusOr<std::vector<float>> Head(const Hidden& io, bool all_logits,
                                                        ForwardTrace* trace = nullptr) const;
  // The same on a residual of `rows` rows in backend memory (arrays in `ws` or its parents),
  // leaving the logits there: [rows or 1, vocab] in `ws`.
  [[nodiscard]] absl::StatusOr<float*> HeadLogits(Scratch& ws, const DeviceResidual& r,
                                                  int64_t rows, bool all_logits,
                                                  ForwardTrace* trace,
                                                  float* logits_out = nullptr) const;
  // Brings `rows` logits rows in backend memory into res as `out` says (res.logits, or
  // res.tokens through Backend::Argmax, Backend::SampleLogits or VerifyTokens after its
  // penalties).
  [[nodiscard]] absl::Status LogitsToHost(Scratch& ws, float* logits, int64_t rows,
                                          const LogitsRequest& out, ForwardResult& res) const;
  // tokens [rows] (backend memory) = the draws of `rows` logits rows in backend memory
  // (Backend::SampleLogits with the request's uniforms).
  [[nodiscard]] absl::Status DrawTokens(Scratch& ws, const float* logits, int64_t rows,
                                        const SampleRequest& sample, int32_t* tokens) const;
  // Why a kVerify request cannot verify (its drafts outside the vocabulary, its distributions
  // short of them); OK for any other request.
  [[nodiscard]] absl::Status VerificationProblem(const LogitsRequest& out) const;
  // verdict [2] (backend memory) = {drafts accepted, the token after them} of `rows` penalized
  // logits rows in backend memory verifying out.verify's drafts (LogitsOut::kVerify); `chosen`
  // (null, or [rows] in backend memory) = each row's token for its logprobs.
  [[nodiscard]] absl::Status VerifyTokens(Scratch& ws, const float* logits, int64_t rows,
                                          const LogitsRequest& out, int32_t* verdict,
                                          int32_t* chosen = nullptr) const;
  // Applies `p` to `rows` logits rows in backend memory (Backend::PenalizeLogits).
  [[nodiscard]] absl::Status Penalize(Scratch& ws, float* logits, int64_t rows,
                                      const LogitPenalties& p) const;
  // The rows whose logprobs `out` asks for, as they are before its penalties: `logits` itself, or
  // a copy in `ws` when penalties will change them.
  [[nodiscard]] absl::StatusOr<const float*> RawRows(Scratch& ws, const float* logits, int64_t rows,
                                                     const LogitsRequest& out) const;
  // `out` = the logprobs of `rows` raw logits rows and their tokens (backend memory) with the top
  // `top` entries (Backend::TopLogprobs), in one download.
  [[nodiscard]] absl::Status LogprobsToHost(Scratch& ws, const float* raw, int64_t rows,
                                            const int32_t* tokens, int top,
                                            std::vector<Logprobs>& out) const;
  // Keeps a batched decode step's DSpark inputs `rows_dev` [n, n_targets*dim] (backend memory) in
  // the state's backend buffer, the last row the state's (SequenceState::main_hidden_rows).
  [[nodiscard]] absl::Status KeepMainHidden(SequenceState& state, const float* rows_dev, int64_t n,
                                            int64_t end_pos) const;
  // Advances pos to end_pos, appends ids to the Engram history, keeps the last DSpark input, and
  // seals the global-KV blocks the call filled (SealPending: one Download on a device pool).
  [[nodiscard]] absl::Status Commit(SequenceState& state, std::span<const int32_t> ids,
                                    int64_t end_pos,
              const Hidden& io) const;
  // Seeds the DSpark rings with DSpark inputs [rows, n_targets*dim] at positions start_pos...
  // (host memory; uploaded).
  [[nodiscard]] absl::Status DSparkSeed(SequenceState& state, const float* main_hidden,
                                        int64_t rows, int64_t start_pos) const;
  // The same from inputs in backend memory (in `ws` or its parents): nothing crosses.
  [[nodiscard]] absl::Status DSparkSeedFrom(Scratch& ws, SequenceState& state,
                                            const float* main_hidden, int64_t rows,
                                            int64_t start_pos) const;
  // What DSparkSeedFrom writes into the DSpark layers' rings: their window rows kv
  // [n_mtp_layers, rows, head_dim] of main_hidden's rows at `positions` (backend memory). Rows
  // are independent (a batched step makes every row's in its last segment).
  [[nodiscard]] absl::Status DSparkSeedRows(Scratch& ws, const float* main_hidden, int64_t rows,
                                            const int64_t* positions, float* kv) const;

  // The module entry points return the first backend error (the backend's ops return
  // absl::Status). Their activation pointers (x, out, h) are the backend's memory (host memory
  // on the CPU backend); hash ids are host memory.
  // Attention of layer l: x [rows, dim] (attn_norm output) -> out [rows, dim].
  absl::Status Attention(int l, const float* x, Call& call, SequenceState& state, float* out,
                         ForwardTrace* trace = nullptr) const;
  // The attention buffers a batched step's sequences share, so that sequences whose lists have
  // the same length run in one SparseAttention call: every list indexes
  //   kv  [B * W + R, head_dim]: sequence b's window ring (as it was before the step) in rows
  //       b * W .. b * W + W - 1, then the step's R new window rows;
  //   ext [R * index_topk, head_dim]: each sequence's gathered top-k entries, one after another,
  //       read from list entry kv_ext_start = B * W + R on;
  // and the lists themselves are one after another in idx. A list entry reads the same values
  // as in a call of its own, the lists have the same lengths, so the rows' bits are the same.
  struct StepKv {
    int64_t seqs = 0;  // B
    int64_t rows = 0;  // R
    float* kv = nullptr;
    float* ext = nullptr;
    int32_t* idx = nullptr;
    int64_t kv_ext_start = 0;
    // The rings are read and written for every sequence at once (one UnpackRows, one PackRows
    // per layer) when every sequence's rows fit its ring: the new rows' ring rows (sequence b's
    // rows go to b * W + position % W; uploaded once per step) and the layers' ring pages (layer
    // l's at pages + l * B; the page of a sequence failed by then is `spare`, a ring's bytes
    // that nothing reads). PrepareStepRings uploads, in one Upload at the step's start, the pages
    // of every main layer whose rings each sequence holds alone (`prepared[l]`: the steady
    // state); a sequence that fails later in the step keeps its pages, so its rings of the later
    // layers take rows (its failed step's state is not used again). Another layer's pages (a
    // ring to allocate or copy first, a DSpark layer) are uploaded by its own StepRings.
    bool batched_rings = false;
    int32_t* ring_rows = nullptr;  // [R]
    uint8_t** pages = nullptr;     // [(n_layers + n_mtp_layers) * B]
    uint8_t* spare = nullptr;
    std::vector<char> prepared;  // [n_layers]
    // Filled per layer, sequence by sequence.
    int64_t ext_used = 0;  // rows of ext
    int64_t idx_used = 0;  // entries of idx
    struct Lists {
      int64_t list_len = 0;
      int64_t idx_offset = 0;
      int64_t ring_base = 0, new_base = 0;  // where kv holds its ring and its new rows
      struct Slots {                        // the TopKSlots of its top-k part (topk null: none)
        const int32_t* topk = nullptr;
        int64_t rows = 0, k = 0, base = 0;
        int32_t* list = nullptr;
      } slots;
    } lists;  // the last sequence's, left for the caller to write
    // The window parts of a layer's lists as uploaded (by content): layers with the same
    // layout copy them in one call.
    std::vector<std::pair<std::vector<int32_t>, const int32_t*>> window_parts;
  };
  // The row-independent parts of a layer's attention for every row of a batched step at once
  // (Block over several sequences): the queries, the window KV rows and the indexer's queries and
  // weights before, the inverse RoPE and the output projection after. Attention then runs, per
  // sequence, only what reads or writes its own KV; its rows of `o` are the attention's output
  // before the inverse RoPE. Per row, the same ops on the same values as a call of its own.
  struct AttentionRows {
    const float* qr = nullptr;  // [rows, q_lora_rank] after q_norm
    const float* q = nullptr;   // [rows, heads, head_dim] after RoPE
    const float* kv = nullptr;  // [rows, head_dim] the window KV rows
    const float* qi = nullptr;  // [rows, index_heads, index_head_dim] (index-source layers)
    const float* w = nullptr;   // [rows, index_heads] the indexer's head weights
    float* o = nullptr;         // [rows, heads, head_dim] out: before the inverse RoPE
    // A batched step's shared attention (StepAttention; null: the call's own). Then the ring was
    // read and written by the caller, this sequence's lists go into `step`, and the caller runs
    // the SparseAttention (StepKv::lists says where the lists are).
    StepKv* step = nullptr;
    int64_t seq = 0;   // the sequence's index in the step (its ring's rows in step->kv)
    int64_t row0 = 0;  // its first row in the step
    bool compressed = false;  // the caller ran the layer's compressor (StepCompress)
    bool indexed = false;     // the caller ran the layer's indexer (StepIndexer)
    int64_t ext_row = -1;     // >= 0: the caller gathered the top-k entries into step->ext
                              // from this row on (StepGather)
  };
  absl::Status Attention(int l, const float* x, Call& call, SequenceState& state,
                         const AttentionRows& rows) const;
  // The window part of `call`'s lists [rows, list_len] (the top-k part untouched): slot j of row
  // i (position p) is position max(0, p-W+1) + j, -1 when after p or below the window floor, as
  // an entry of the call's KV: its own rows from `new_base`, the ring's slots from `ring_base`
  // (a decode-mode call), the position itself (a prefill).
  void WindowLists(const Call& call, int64_t list_len, int64_t ring_base, int64_t new_base,
                   int32_t* out) const;
  // Layer l's SparseAttention arguments for `rows` lists of `list_len` entries: its sink, the
  // heads, the scale (the caller sets q, kv, idx and out).
  kernels::SparseAttentionArgs LayerAttentionArgs(int l, int64_t rows, int64_t list_len) const;
  // MoE of layer l: x [rows, dim] -> out [rows, dim]. Rows go through in chunks of
  // kMoeRowsPerCall (the grouped buffers hold each row once per expert slot).
  static constexpr int64_t kMoeRowsPerCall = 2048;
  absl::Status Moe(int l, const float* x, int64_t rows, float* out,
                   std::vector<int32_t>* experts = nullptr) const;
  // The same with its arrays from `outer`'s pool.
  absl::Status Moe(Scratch& outer, int l, const float* x, int64_t rows, float* out,
                   std::vector<int32_t>* experts) const;
  // Engram of layer l on the residual h [rows, hc, dim] in place, with hash ids [rows,
  // ids_per_row]. `single_token_calls`: each row is a decode-time reference call
  // (Backend::EngramGateSingleToken).
  absl::Status Engram(int l, const int64_t* hash_ids, int64_t ids_stride, int64_t rows, float* h,
                      bool single_token_calls = false) const;
  // The same with the hash ids [rows, ids_per_row] already in backend memory (in `outer` or its
  // parents, whose pool gives the arrays).
  absl::Status EngramFromIds(Scratch& outer, int l, const int64_t* ids_dev, int64_t rows, float* h,
                             bool single_token_calls) const;
  // Hash ids [rows, n_engram_layers, per_layer] for `ids` at positions state.pos.. (uses history).
  std::vector<int64_t> EngramHashes(const SequenceState& state, std::span<const int32_t> ids) const;

 private:
  // ---- The forward (model/model.cc) ----
  absl::StatusOr<ForwardResult> Forward(SequenceState& state, std::span<const int32_t> ids,
                                        bool all_logits, ForwardTrace* trace,
                                        bool per_row_keys = true,
                                        const PrefillOptions& options = {},
                                        const LogitsRequest& out = {}) const;
  bool StaleKeysFromLaterLayer(const SequenceState& state, size_t rows) const;
  absl::StatusOr<ForwardResult> ExtendRowByRow(SequenceState& state, std::span<const int32_t> ids,
                                               bool all_logits, ForwardTrace* trace,
                                               const LogitsRequest& out) const;
  absl::Status Block(Scratch& outer, int l, float* h, float* pre, Call& call, SequenceState& state,
                     ForwardTrace* trace) const;
  // The first block's input for `ids`: the embedded residual stream [rows, hc, dim] in `*h` and
  // the delayed pre-mix [rows, hc] in `*pre`, both from `ws`.
  absl::Status EmbedRows(Scratch& ws, std::span<const int32_t> ids, float** h, float** pre) const;
  // The host values of that first pre-mix for `rows` rows: each row's [1, 0, ..., 0] (hc_mult).
  std::vector<float> FirstPreMix(int64_t rows) const;

  // ---- The attention path (model/attention.cc) ----
  int DecodeKeySource(int l, int64_t p, const Call& call) const;
  // The compressed entries compressed layer l reads in `call` from its KV source `src`: those up
  // to the call's end, min((start_pos + rows) / ratio, src.n).
  int64_t LayerKeyCount(int l, const Call& call, const SequenceState::Source& src) const;
  // What the row at position `pos` of `call` scores at index layer l, of the layer's nk keys: its
  // key source (decode semantics, the reference's stale keys: what a single-token call at pos
  // would read), the keys it sees ((pos + 1) / ratio) and of those the ones it scores
  // (0 when its source holds none).
  struct RowKeys {
    int source = -1;
    int64_t visible = 0, scored = 0;
  };
  RowKeys IndexRowKeys(int l, const Call& call, const SequenceState& state, int64_t nk,
                       int64_t pos) const;
  absl::Status Compress(int l, const float* x, const int64_t* pos, int64_t rows,
                        SequenceState& state) const;
  // Compress's steps. CompressorProjections: a KV source's projections of x [rows, dim]: kv
  // [rows, head_dim] (ratio 1: normed, the entries before RoPE; score unused), and for ratio > 1
  // the gate's score [rows, head_dim]. Rows are independent. PoolGroups: a ratio > 1 source's
  // pooling of a call's projected rows kvf / scf [pos.size(), head_dim]: logs the rows, writes the
  // tail state and pools each group the rows complete into `latents` (one row per group, in order;
  // before the norm), appending each group's first position to `gpos`.
  absl::Status CompressorProjections(int l, const float* x, int64_t rows, float* kv,
                                     float* score) const;
  absl::Status PoolGroups(Scratch& ws, SequenceState::Source& s, int64_t cut_block,
                          const float* kvf, const float* scf, const std::vector<int64_t>& pos,
                          float* latents, std::vector<int64_t>& gpos) const;
  // The normed latents [ne, head_dim] of entries at first positions `gpos` (backend memory) made
  // the entries (RoPE, FP4 qdq; in place) and their index keys [ne, index_head_dim]. Rows are
  // independent: entries of several sequences go in one call.
  absl::Status FinishLatents(Scratch& ws, int l, float* latents, int64_t ne, const int64_t* gpos,
                             float* keys) const;
  // The entries and keys appended to layer l's source of `state` (published).
  absl::Status AppendLatents(int l, SequenceState& state, const float* latents, const float* keys,
                             int64_t ne) const;
  // Whether `call` takes the whole-source path (ModelOptions::whole_source_bytes).
  bool WholeSourceOnBackend(const Call& call) const;
  // A ratio > 1 source's log of this call: the rows of kv / score [pos.size(), head_dim] (backend
  // memory) at the positions CompressorLog::LogsPosition keeps (`cut_block`: the state's
  // cut_block_tokens).
  absl::Status LogCompressorRows(Scratch& ws, SequenceState::Source& s, int64_t cut_block,
                                 const float* kv, const float* score,
                                 const std::vector<int64_t>& pos) const;
  // Indexer scores of one query row against keys [0, n) of a source, read through the pool:
  // single-row calls score straight from the pool's blocks (IndexerScoresPaged: no unpacked
  // copy, one call); multi-row calls unpack once per call, into `unpacked[layer]`, the
  // `available` keys (the most any row of the call scores). The scores do not depend on how the
  // keys are read (each key's score is computed on its own).
  using UnpackedKeys = std::map<int, std::pair<const float*, int64_t>>;
  absl::Status ScoreKeys(Scratch& ws, const KvRows& keys, int layer, int64_t rows, const float* q,
                         const float* w, int heads, int64_t n, int64_t available, float* score,
                         UnpackedKeys& unpacked) const;
  // Keys [0, max(n, available)) of a source unpacked into backend memory, once per call.
  absl::StatusOr<const float*> UnpackKeys(Scratch& ws, const KvRows& keys, int layer, int64_t n,
                                          int64_t available, UnpackedKeys& unpacked) const;
  // The indexer's scores, candidate masks and top-k of a multi-row call whose rows all read one
  // key source go through the *Rows ops in chunks of at most kIndexerRowsPerCall rows and
  // kIndexerScoresPerCall scores (rows x keys), a fixed number of calls per chunk.
  static constexpr int64_t kIndexerRowsPerCall = 4096;
  static constexpr int64_t kIndexerScoresPerCall = int64_t{1} << 22;
  absl::Status RopeRows(Scratch& ws, int l, float* x, int64_t rows, int heads, int stride,
                        int offset, const int64_t* positions, bool inverse) const;
  // Attention's query: x [rows, dim] -> qr [rows, q_lora_rank] (normed; the indexer's input too)
  // and q [rows, heads, head_dim] with RoPE at `positions` (backend memory).
  absl::Status QueryProjection(Scratch& ws, int l, const float* x, int64_t rows,
                               const int64_t* positions, float* qr, float* q) const;
  // The indexer's queries qi [rows, index_heads, index_head_dim] (from qr, RoPE'd, FP4
  // quantize-dequantized) and head weights w [rows, index_heads] of layer l.
  absl::Status IndexQueries(Scratch& ws, int l, const float* x, const float* qr, int64_t rows,
                            const int64_t* positions, float* qi, float* w) const;
  // The window KV rows of `rows` positions (`positions`: their absolute positions, in backend
  // memory, as the query's RoPE takes them).
  absl::Status StageKv(Scratch& ws, int stage_layer, const float* main_x, int64_t rows,
                       const int64_t* positions, float* kv) const;
  // Attention with `given` rows (nullptr: computed here, and `out` written). Its steps: the
  // queries and window KV rows (unless given), the window part of the KV (the ring and the call's
  // rows), the layer's compressor, then IndexerTopK and AttentionOverLists on what they share
  // (AttentionPass, model/attention.cc).
  absl::Status Attention(int l, const float* x, Call& call, SequenceState& state, float* out,
                         ForwardTrace* trace, const AttentionRows* given) const;
  struct AttentionPass;
  // An index layer's top-k of the call's rows (unless `given` says the caller made it): the
  // indexer's queries (unless given), each row's key scores, candidate mask and top-k, in a fixed
  // number of calls per chunk of rows when every row reads one key source, else row by row; left
  // in `call` (topk on the host, or topk_dev in its scratch).
  absl::Status IndexerTopK(Scratch& ws, int l, const float* x, Call& call,
                           const SequenceState& state, const AttentionRows* given,
                           const AttentionPass& p, ForwardTrace* trace) const;
  // The rest of Attention: each row's list (window part, then the top-k part), the compressed
  // entries it reads (gathered per slot, the whole source, or a compact gather), the sparse
  // attention into `given`'s o (a shared step's lists are left in its StepKv for the caller), or
  // into o and on through FinishAttention to `out`.
  absl::Status AttentionOverLists(Scratch& ws, int l, Call& call, const AttentionRows* given,
                                  const AttentionPass& p, float* out) const;
  // The attention's output rows o (before the inverse RoPE, overwritten) -> out [rows, dim].
  absl::Status FinishAttention(Scratch& ws, int l, float* o, int64_t rows, const int64_t* positions,
                               float* out, const int64_t* order = nullptr) const;
  // Attention's grouped output projection: o [rows, heads, head_dim] -> out [rows, dim].
  // `order` (optional, backend memory): the regrouping list of `rows` rows (StepArrays'
  // o_order); uploaded here when not given.
  absl::Status OutputProjection(Scratch& ws, const AttentionWeights& A, const float* o,
                                int64_t rows, float* out, const int64_t* order = nullptr) const;
  // OutputProjection's regrouping list of `rows` rows: entry g * rows + i is row i's group g.
  std::vector<int64_t> OutputGroupOrder(int64_t rows) const;

  // ---- The mHC steps (model/mhc.cc) ----
  // The mHC steps of a block around its two sublayers, row by row (the reference's order), and
  // the mixes they carry from one step to the next ([rows, hc] and [rows, hc, hc], backend
  // memory). `single_token`: decode-semantics rows (Backend::HcMixesSingleToken). The attention
  // input's pre-mix is the delayed one in `pre`; the FFN mixes write the next block's into `pre`.
  struct HcMix {
    float* attn_pre = nullptr;
    float* attn_post = nullptr;
    float* attn_comb = nullptr;
    float* ffn_post = nullptr;
    float* ffn_comb = nullptr;
    absl::Status Allocate(Scratch& ws, int64_t rows, int64_t hc);
  };
  // One sublayer's mixes of `rows` rows of h (single-token semantics for decode rows).
  absl::Status HcMixRows(bool single_token, int64_t rows, const float* h, const WeightArray& fn,
                         const WeightArray& scale, const WeightArray& base, float* pre, float* post,
                         float* comb) const;
  // h, pre -> the attention's input x (before its norm).
  absl::Status HcBeforeAttention(const LayerWeights& L, bool single_token, int64_t rows,
                                 const float* h, const float* pre, HcMix& m, float* x) const;
  // The attention's output y into h; the FFN's mixes; the FFN's input x (before its norm).
  absl::Status HcBeforeFfn(const LayerWeights& L, bool single_token, int64_t rows, const float* y,
                           float* h, float* pre, HcMix& m, float* x) const;
  // The FFN's output y into h.
  absl::Status HcAfterFfn(int64_t rows, const float* y, float* h, const HcMix& m) const;

  // ---- DSpark drafting (model/dspark_draft.cc) ----
  // Why Draft cannot draft `last_token`'s block for `state` as asked (the request's out,
  // penalties and sample; the model's DSpark stages; a forward before it): OK when it can.
  absl::Status DraftProblem(const SequenceState& state, int32_t last_token, LogitsOut out,
                            const LogitPenalties* penalties, const SampleRequest* sample) const;

  // ---- The batched decode step (model/decode_step.cc) ----
  // One sequence of a batched step: its call, its state, its first row in the batch and where its
  // own failure goes (it then does not fail the step).
  struct StepSequence {
    Call* call = nullptr;
    SequenceState* state = nullptr;
    int64_t row0 = 0;
    absl::Status* status = nullptr;
  };
  // ExtendBatch's steps, on what they share (StepBatch, model/decode_step.cc). ExtendBatch checks
  // the requests, takes the step's graph set (or its own arrays), uploads the inputs and makes
  // each sequence's call; StepInputs: the rows' ids, positions and Engram hash ids, each sequence
  // Batchable; StepLayers: the segments (graphs launched, recorded, or op by op) and each layer's
  // StepAttention between them; StepResults: the head's rows brought back as each sequence asks
  // (StepTokens when not every sequence wants values), each sequence committed, the DSpark
  // layers' rings written.
  struct StepBatch;
  absl::Status StepInputs(StepBatch& sb) const;
  absl::Status StepLayers(Scratch& ws, StepBatch& sb, const StepArrays& a) const;
  absl::Status StepResults(Scratch& ws, Scratch& arrays_scratch, StepBatch& sb, const StepArrays& a,
                           std::vector<ForwardResult>& out) const;
  // Every row's token in every.tokens (argmax, a sampled sequence's draws, a verification's
  // verdict in its first two rows), each sequence's penalties first, and the logprobs asked for.
  absl::Status StepTokens(Scratch& head_ws, const StepBatch& sb, float* head, ForwardResult& every,
                          std::vector<std::vector<Logprobs>>& logprobs) const;
  // The step's arrays for `rows` rows, from `ws` (StepArrays; constants written).
  absl::Status AllocateStepArrays(Scratch& ws, int64_t rows, StepArrays& a) const;
  // Segment s (0 <= s <= n_layers) of a step: what runs between two layers' attention, on the
  // step's arrays only (no host data, no per-step scalar), so that it can be a graph. s > 0
  // finishes layer s-1 after its attention (inverse RoPE, output projection, mHC, MoE); s <
  // n_layers begins layer s up to its attention (Engram, DSpark input, mHC, norm, the attention's
  // projections); segment 0 embeds; segment n_layers ends with every row's logits.
  absl::Status StepSegment(Scratch& outer, int s, const StepArrays& a) const;
  // Layer l's attention of each sequence on its rows of the step's arrays (what reads and writes
  // its own KV): q, kv, qr, qi, w -> o. A sequence that fails gets zero rows. With `shared`
  // (every sequence has at most device_list_rows rows), the sequences' lists index shared
  // buffers and consecutive sequences whose lists have the same length share a SparseAttention
  // call; else each sequence's attention is a call of its own.
  absl::Status StepAttention(Scratch& ws, int l, const StepArrays& a, std::span<StepSequence> seqs,
                             StepKv* shared) const;
  // Layer l's compressor (a KV source) for every sequence of a shared step: each sequence's
  // pooling (ratio > 1) into one array, then the entries' norm, RoPE, qdq and index keys in one
  // call each (rows are independent), then each sequence's append. From the step's projections
  // (StepArrays::cmp_kv, cmp_score). A sequence that fails takes the error.
  absl::Status StepCompress(Scratch& ws, int l, const StepArrays& a,
                            std::span<StepSequence> seqs) const;
  // StepCompress's appends: sequence b's entries latents / keys rows [first[b], first[b] +
  // count[b]) into its source's streams (AppendLatents), every sequence's in one PackRows per
  // stream kind over page tables of the sequences' streams. A sequence whose pool is full fails
  // alone; a PackRows failure fails every sequence of the step, nothing appended.
  absl::Status StepAppend(int l, const float* latents, const float* keys,
                          const std::vector<int64_t>& first, const std::vector<int64_t>& count,
                          std::span<StepSequence> seqs) const;
  // StepCompress's pooling (ratio > 1) when every sequence has one row: each row into its log
  // and its tail in one PackRows per array, the groups that end pooled in one CompressPool into
  // `latents` (first / count: each sequence's entries; gpos: each entry's first position, on the
  // host and, uploaded with the page tables, at *gpos_dev).
  absl::Status PoolSingleRows(Scratch& ws, int l, const StepArrays& a, std::span<StepSequence> seqs,
                              float* latents, std::vector<int64_t>& gpos, const int64_t** gpos_dev,
                              std::vector<int64_t>& first, std::vector<int64_t>& count) const;
  // Layer l's indexer (an index source) for the sequences of a shared step whose index keys
  // have one codec: runs of consecutive sequences with the same k (and the same candidate mask
  // layout) score, mask and select in a fixed number of calls per kIndexerScoresPerCall scores
  // (IndexerScoresPaged straight from each row's own key source, CandidateMaskRows,
  // SelectTopKRows), each row over its own keys and as wide as the run's widest (the extra keys
  // score -inf and are never picked, the candidate mask keeps each row's width: the same top-k
  // and mask as a call of its own). The top-k stays in the calls' scratch (Call::topk_batched:
  // it holds the keys); indexed[b] says which sequences it did (Attention does the others).
  absl::Status StepIndexer(int l, const StepArrays& a, std::span<StepSequence> seqs,
                           std::vector<char>& indexed) const;
  // Layer l's top-k entries (a compressed layer) of the sequences whose top-k StepIndexer made
  // (at an index source: those indexed now), gathered from their KV sources into kv->ext in one
  // GatherRows per run of consecutive sequences with the same k and codec (a page table per
  // row: each sequence's own, as KvRows keeps it); ext_rows[b] is sequence b's first row there
  // (-1: Attention gathers its own).
  absl::Status StepGather(int l, std::span<StepSequence> seqs, const std::vector<char>& indexed,
                          StepKv* kv, std::vector<int64_t>& ext_rows) const;
  // The StepKv buffers of a step of `seqs` (their rows from seqs[b].row0 on), from `ws`.
  absl::Status AllocateStepKv(Scratch& ws, std::span<const StepSequence> seqs, int64_t rows,
                              StepKv& kv) const;
  // The ring pages for StepRings (StepKv::pages) of every main layer whose rings the step's
  // sequences hold alone, uploaded in one Upload (no pool allocation: a ring that needs one
  // gets it when its layer runs).
  absl::Status PrepareStepRings(Scratch& ws, std::span<StepSequence> seqs, StepKv& kv) const;
  // Whether layer l's rings of `seqs` can be read and written in one call each (StepKv).
  bool RingsBatched(int l, std::span<const StepSequence> seqs, const StepKv* kv) const;
  // Layer l's window rings of the step's sequences (those whose status is OK) read into kv->kv
  // (with `read`) and written with the new rows `kv_rows` [R, head_dim]: in one UnpackRows and
  // one PackRows when kv->batched_rings, else ring by ring (kv may be null without `read`). A
  // sequence whose ring fails takes the error.
  absl::Status StepRings(Scratch& ws, int l, bool read, const float* kv_rows,
                         std::span<StepSequence> seqs, StepKv* kv) const;

  ModelConfig config_;
  std::vector<LayerRole> roles_;
  std::unique_ptr<ModelWeights> weights_;
  EngramConstants engram_;
  kernels::Backend& backend_;
  ModelOptions options_;
  std::vector<float> freqs_plain_, freqs_yarn_;
  // The same two tables in backend memory ([plain; yarn]; empty if the upload failed: RopeRows
  // then uploads them per call).
  kernels::Buffer freqs_dev_;
  std::shared_ptr<KvPool> kv_pool_;
  std::unique_ptr<ScratchPool> scratch_pool_;  // internally synchronized
  // The decode step graphs (null when the backend records none or step_graphs is off); internally
  // synchronized, held for a whole step.
  std::unique_ptr<StepGraphCache> step_graphs_;

  friend struct StepArrays;  // holds an HcMix
};

}  // namespace epd::model
