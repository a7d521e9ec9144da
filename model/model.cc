// The model's construction and loading, the state sizes, and the forward (MODEL.md §3): a
// layer's block (Block), a stage of layers (RunStage), the calls built on it (Forward, Prefill,
// Decode, Extend, ExtendRowByRow), the state a call leaves (Commit, KeepMainHidden) and a
// verification step's checkpoint and rollback. The forward's parts are files of their own:
// attention.cc (RoPE, compressors, indexer, sparse attention), moe.cc, mhc.cc (the
// hyper-connection steps), engram.cc (the Engram sublayer), logits.cc (the head and what comes
// back of the logits), dspark_draft.cc (the DSpark rings and draft pass) and decode_step.cc (the
// batched decode step).
#include "model/model.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/format.h"
#include "kernels/rope.h"
#include "model/scratch.h"
#include "model/step_graph.h"

namespace epd::model {
namespace {

using std::vector;

}  // namespace

Model::Model(ModelConfig config, std::unique_ptr<ModelWeights> weights, EngramConstants engram,
             kernels::Backend& backend, ModelOptions options)
    : config_(std::move(config)),
      roles_(config_.Roles()),
      weights_(std::move(weights)),
      engram_(std::move(engram)),
      backend_(backend),
      options_(options) {
  const ModelConfig& c = config_;
  freqs_plain_ = kernels::RopeFrequencies(c.rope_head_dim, c.rope_theta, false, 1, 1, 1, 1);
  freqs_yarn_ =
      kernels::RopeFrequencies(c.rope_head_dim, c.compress_rope_theta, true, c.rope_factor,
                               static_cast<double>(c.original_seq_len), c.beta_fast, c.beta_slow);
  // The pool's content-hash seed: the shape of the KV (blocks of another layout never match).
  const uint64_t seed =
      absl::HashOf(c.dim, c.head_dim, c.index_head_dim, c.window_size, c.compress_ratios,
                   c.kv_source_layers, c.vocab_size, options_.unquantized_kv);
  kv_pool_ = std::make_shared<KvPool>(options_.kv_pool_bytes, seed, &backend_);
  scratch_pool_ = std::make_unique<ScratchPool>(backend_, options_.scratch_cache_bytes);
  vector<float> both = freqs_plain_;
  both.insert(both.end(), freqs_yarn_.begin(), freqs_yarn_.end());
  const auto bytes = static_cast<int64_t>(both.size() * sizeof(float));
  if (auto f = backend_.Allocate(bytes); f.ok() && backend_.Upload(both.data(), bytes, *f).ok()) {
    freqs_dev_ = std::move(*f);
  }
  if (options_.step_graphs && backend_.supports_graphs()) {
    step_graphs_ = std::make_unique<StepGraphCache>(backend_, options_.step_graph_max_rows,
                                                    options_.step_graph_sets);
  }
}

Model::~Model() = default;

int64_t KvBlockBytes(const ModelConfig& c, bool unquantized_kv) {
  return KvBytesFor(c, kKvBlockTokens, unquantized_kv);
}

int64_t KvBytesFor(const ModelConfig& c, int64_t tokens, bool unquantized_kv) {
  const KvRowFormat kvf = unquantized_kv ? KvRowFormat::kF32 : KvRowFormat::kPackedKv;
  const KvRowFormat kf = unquantized_kv ? KvRowFormat::kF32 : KvRowFormat::kPackedKey;
  int64_t b = 0;
  for (int l : c.kv_source_layers) {
    const int r = std::max(1, c.compress_ratios[l]);
    const int64_t rpb = std::max<int64_t>(1, kKvBlockTokens / r);
    const int64_t blocks = (std::max<int64_t>(0, tokens) / r + rpb - 1) / rpb;
    b += blocks * rpb * (KvRowBytes(kvf, c.head_dim) + KvRowBytes(kf, c.index_head_dim));
  }
  return b;
}

int64_t SwaRingBytes(const ModelConfig& c) {
  return int64_t{c.total_layers()} * c.window_size *
         kernels::format::PackedSwaSlotBytes(c.head_dim);
}

int64_t CompressorTailBytes(const ModelConfig& c) {
  int64_t b = 0;
  for (int l : c.kv_source_layers) {
    if (c.compress_ratios[l] > 1) b += int64_t{2} * c.compress_ratios[l] * c.head_dim * 4;
  }
  return b;
}

std::unique_ptr<SequenceState> NewSequenceState(const ModelConfig& c, std::shared_ptr<KvPool> pool,
                                                bool unquantized_kv) {
  auto s = std::make_unique<SequenceState>();
  const KvRowFormat kvf = unquantized_kv ? KvRowFormat::kF32 : KvRowFormat::kPackedKv;
  const KvRowFormat kf = unquantized_kv ? KvRowFormat::kF32 : KvRowFormat::kPackedKey;
  s->swa.assign(c.total_layers(), SwaRing(pool, c.window_size, c.head_dim));
  for (int l : c.kv_source_layers) {
    SequenceState::Source& src = s->sources[l];
    src.ratio = c.compress_ratios[l];
    src.kv = KvRows(pool, kvf, c.head_dim, src.ratio, static_cast<uint64_t>(l) * 2);
    src.keys = KvRows(pool, kf, c.index_head_dim, src.ratio, static_cast<uint64_t>(l) * 2 + 1);
    if (src.ratio > 1) src.tail = CompressorTail(pool, src.ratio, c.head_dim);
  }
  return s;
}

int64_t Model::KvBlockBytes() const {
  return model::KvBlockBytes(config_, options_.unquantized_kv);
}

int64_t Model::KvBytesFor(int64_t tokens) const {
  return model::KvBytesFor(config_, tokens, options_.unquantized_kv);
}

std::unique_ptr<SequenceState> Model::NewSequence(std::shared_ptr<KvPool> pool) const {
  return NewSequenceState(config_, pool != nullptr ? std::move(pool) : kv_pool_,
                          options_.unquantized_kv);
}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir,
                                                   kernels::Backend& backend,
                                                   ModelOptions options) {
  namespace fs = std::filesystem;
  auto cfg = LoadModelConfig((fs::path(dir) / "config.json").string());
  if (!cfg.ok()) return cfg.status();
  auto store = TensorStore::Open(dir);
  if (!store.ok()) return store.status();
  std::shared_ptr<const TensorStore> shared(std::move(*store));
  auto w = ModelWeights::Load(*cfg, shared, &backend);
  if (!w.ok()) return w.status();
  EngramConstants ek;
  if (!cfg->engram_layer_ids.empty()) {
    // engram_constants.json (a generated model), else the "engram" object of a golden set's
    // manifest.json (tests/data/golden: `epd serve --model` on the official checkpoints).
    const fs::path p = fs::path(dir) / "engram_constants.json";
    const fs::path manifest = fs::path(dir) / "manifest.json";
    absl::StatusOr<EngramConstants> k;
    if (fs::exists(p)) {
      k = EngramConstants::Load(p.string());
    } else if (fs::exists(manifest)) {
      std::ifstream in(manifest, std::ios::binary);
      std::stringstream text;
      text << in.rdbuf();
      k = ParseEngramConstantsJson(text.str());
      if (!k.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("model: ", manifest.string(), ": ", k.status().message()));
      }
    } else {
      return absl::NotFoundError(
          absl::StrCat("model: missing ", p.string(), " (or a golden set's manifest.json)"));
    }
    if (!k.ok()) return k.status();
    if (absl::Status s = ValidateEngramConstants(*k, *cfg); !s.ok()) return s;
    ek = std::move(*k);
  }
  return std::make_unique<Model>(std::move(*cfg), std::move(*w), std::move(ek), backend, options);
}

absl::Status Model::Block(Scratch& outer, int l, float* h, float* pre, Call& call,
                          SequenceState& state, ForwardTrace* trace) const {
  const ModelConfig& c = config_;
  const LayerWeights& L = weights_->layers[l];
  const int64_t D = c.dim, hc = c.hc_mult, S = call.rows;
  Scratch ws(backend_, scratch_pool_.get(), &outer);
  HcMix m;
  RETURN_IF_ERROR(m.Allocate(ws, S, hc));
  ASSIGN_OR_RETURN(float* x, ws.Alloc<float>(S * D));
  ASSIGN_OR_RETURN(float* y, ws.Alloc<float>(S * D));
  // Decode-semantics rows are single-token reference calls, whose sigmoids torch computes on its
  // scalar path (Backend::HcMixesSingleToken).
  const bool single = call.per_row_keys;
  RETURN_IF_ERROR(HcBeforeAttention(L, single, S, h, pre, m, x));
  RETURN_IF_ERROR(backend_.RmsNorm(x, L.attn_norm.data(), S, D, c.norm_eps, x));
  if (trace) RETURN_IF_ERROR(ws.DownloadTo(x, S * D, trace->attn_in[l]));
  RETURN_IF_ERROR(Attention(l, x, call, state, y, trace));
  if (trace) RETURN_IF_ERROR(ws.DownloadTo(y, S * D, trace->attn_out[l]));
  RETURN_IF_ERROR(HcBeforeFfn(L, single, S, y, h, pre, m, x));
  RETURN_IF_ERROR(backend_.RmsNorm(x, L.ffn_norm.data(), S, D, c.norm_eps, x));
  if (trace) RETURN_IF_ERROR(ws.DownloadTo(x, S * D, trace->ffn_in[l]));
  RETURN_IF_ERROR(Moe(ws, l, x, S, y, trace ? &trace->experts[l] : nullptr));
  if (trace) RETURN_IF_ERROR(ws.DownloadTo(y, S * D, trace->ffn_out[l]));
  RETURN_IF_ERROR(HcAfterFfn(S, y, h, m));
  if (trace) RETURN_IF_ERROR(ws.DownloadTo(h, S * hc * D, trace->block_out[l]));
  return absl::OkStatus();
}

absl::Status Model::RunStage(SequenceState& state, std::span<const int32_t> ids,
                             const StageSpec& spec, Hidden& io, ForwardTrace* trace,
                             Scratch* outer, DeviceResidual* keep) const {
  const ModelConfig& c = config_;
  const int64_t S = static_cast<int64_t>(ids.size()), D = c.dim, hc = c.hc_mult, V = c.vocab_size;
  const int last = spec.last_layer < 0 ? c.n_layers : spec.last_layer;
  if (S == 0) return absl::InvalidArgumentError("model: no tokens");
  if (spec.first_layer < 0 || spec.first_layer > last || last > c.n_layers) {
    return absl::InvalidArgumentError("model: bad layer range");
  }
  for (int32_t id : ids) {
    if (id < 0 || id >= V)
      return absl::InvalidArgumentError(absl::StrCat("model: token id ", id, " out of range"));
  }
  Call call;
  call.start_pos = spec.start_pos;
  call.rows = S;
  call.prefill = spec.start_pos == 0;
  call.per_row_keys = !call.prefill && spec.per_row_keys;
  call.published_at_start = state.published_keys;
  call.window_floor = spec.window_floor;
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  // The residual stream lives in backend memory for the stage; `io` (host) carries it between
  // stages and processes, unless the caller keeps it (`keep`, in `outer`).
  if ((keep == nullptr) != (outer == nullptr))
    return absl::InvalidArgumentError("model: a kept residual needs the caller's scratch");
  std::optional<Scratch> own;
  if (outer == nullptr) own.emplace(backend_, scratch_pool_.get());
  Scratch& ws = outer != nullptr ? *outer : *own;
  call.scratch = &ws;
  float* h = nullptr;
  float* pre = nullptr;
  float* main_hidden = nullptr;
  if (spec.first_layer == 0) {
    io.rows = S;
    RETURN_IF_ERROR(EmbedRows(ws, ids, &h, &pre));
  } else if (io.rows != S || io.h.size() != static_cast<size_t>(S * hc * D) ||
             io.pre.size() != static_cast<size_t>(S * hc)) {
    return absl::InvalidArgumentError("model: residual rows do not match the tokens");
  } else {
    ASSIGN_OR_RETURN(h, ws.Copy(io.h));
    ASSIGN_OR_RETURN(pre, ws.Copy(io.pre));
  }
  if (spec.first_layer != 0 && io.main_hidden.size() == static_cast<size_t>(S * nt * D)) {
    ASSIGN_OR_RETURN(main_hidden, ws.Copy(io.main_hidden));
  } else {
    ASSIGN_OR_RETURN(main_hidden, ws.Filled<float>(S * nt * D, 0.f));
  }
  const int nel = static_cast<int>(c.engram_layer_ids.size());
  const int per = (c.engram_max_ngram_size - 1) * c.engram_n_heads;
  bool engram_in_range = false;
  for (int l : c.engram_layer_ids) {
    engram_in_range |=
        (l >= spec.first_layer && l < last && !(spec.first_engram_done && l == spec.first_layer)) ||
        l == spec.compress_only_layer;
  }
  vector<int64_t> hashes;
  if (engram_in_range) {
    if (spec.engram_history != nullptr) {
      SequenceState tmp;
      tmp.engram_history = *spec.engram_history;
      hashes = EngramHashes(tmp, ids);
    } else {
      if (state.pos != spec.start_pos) {
        return absl::FailedPreconditionError(
            "model: Engram layers need the token history at start_pos");
      }
      hashes = EngramHashes(state, ids);
    }
  }
  if (trace) trace->engram_hash_ids = hashes;
  auto engram = [&](int l) -> absl::Status {
    const int li =
        static_cast<int>(std::find(c.engram_layer_ids.begin(), c.engram_layer_ids.end(), l) -
                         c.engram_layer_ids.begin());
    if (trace) RETURN_IF_ERROR(ws.DownloadTo(h, S * hc * D, trace->engram_in[l]));
    RETURN_IF_ERROR(
        Engram(l, hashes.data() + li * per, int64_t{nel} * per, S, h, call.per_row_keys));
    if (trace) RETURN_IF_ERROR(ws.DownloadTo(h, S * hc * D, trace->engram_out[l]));
    return absl::OkStatus();
  };
  for (int l = spec.first_layer; l < last; ++l) {
    const LayerRole& role = roles_[l];
    if (role.has_engram && !(spec.first_engram_done && l == spec.first_layer)) {
      RETURN_IF_ERROR(engram(l));
    }
    if (role.is_dspark_target) {
      const int64_t ti =
          std::find(c.dspark_target_layer_ids.begin(), c.dspark_target_layer_ids.end(), l) -
          c.dspark_target_layer_ids.begin();
      RETURN_IF_ERROR(backend_.HcMean(S, h, static_cast<int>(hc), D, main_hidden + ti * D, nt * D));
    }
    call.compress = spec.compress || l != spec.first_layer;
    call.window_floor = l >= spec.floor_first_layer ? spec.window_floor : 0;
    RETURN_IF_ERROR(Block(ws, l, h, pre, call, state, trace));
  }
  if (spec.compress_only_layer >= 0) {
    // The next layer's compressor + index keys only (its attention input needs just the residual
    // and the delayed pre-mix): the encoder's share of the first decoder layer.
    const int l = spec.compress_only_layer;
    if (l >= c.n_layers || !roles_[l].is_kv_source) {
      return absl::InvalidArgumentError("model: compress_only_layer is not a KV source");
    }
    // The layer's Engram comes before its block (and so before its compressor); the residual
    // handed on carries it (StageSpec::first_engram_done).
    if (roles_[l].has_engram) {
      RETURN_IF_ERROR(engram(l));
    }
    ASSIGN_OR_RETURN(float* x, ws.Alloc<float>(S * D));
    vector<int64_t> pos(S);
    for (int64_t i = 0; i < S; ++i) pos[i] = spec.start_pos + i;
    RETURN_IF_ERROR(backend_.HcPre(S, h, static_cast<int>(hc), D, pre, x));
    RETURN_IF_ERROR(backend_.RmsNorm(x, weights_->layers[l].attn_norm.data(), S, D, c.norm_eps, x));
    RETURN_IF_ERROR(Compress(l, x, pos.data(), S, state));
  }
  if (call.per_row_keys && options_.stale_index_keys) {
    state.published_keys = DecodeKeySource(c.n_layers, spec.start_pos + S - 1, call);
  }
  if (keep != nullptr) {
    *keep = {h, pre, main_hidden};
    io.h.clear();
    io.pre.clear();
  } else {
    RETURN_IF_ERROR(ws.DownloadTo(h, S * hc * D, io.h));
    RETURN_IF_ERROR(ws.DownloadTo(pre, S * hc, io.pre));
  }
  return ws.DownloadTo(main_hidden, S * nt * D, io.main_hidden);
}

absl::Status Model::Commit(SequenceState& state, std::span<const int32_t> ids, int64_t end_pos,
                           const Hidden& io) const {
  const ModelConfig& c = config_;
  state.pos = end_pos;
  for (int32_t id : ids) state.engram_history.push_back(EngramCompressedId(engram_, id));
  const size_t keep = static_cast<size_t>(std::max(0, c.engram_max_ngram_size - 1));
  if (state.engram_history.size() > keep) {
    state.engram_history.erase(state.engram_history.begin(), state.engram_history.end() - keep);
  }
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  if (nt > 0 && !io.main_hidden.empty()) {
    state.main_hidden.assign(io.main_hidden.end() - nt * c.dim, io.main_hidden.end());
    state.main_hidden_pos = end_pos - 1;
    state.main_hidden_row = -1;
  }
  std::vector<KvRows*> streams;
  for (auto& [l, src] : state.sources) {
    streams.push_back(&src.kv);
    streams.push_back(&src.keys);
  }
  return SealPending(streams);
}

absl::Status Model::KeepMainHidden(SequenceState& state, const float* rows_dev, int64_t n,
                                   int64_t end_pos) const {
  const ModelConfig& c = config_;
  const int64_t per = static_cast<int64_t>(c.dspark_target_layer_ids.size()) * c.dim * 4;
  if (state.main_hidden_rows == nullptr || state.main_hidden_rows.use_count() > 1 ||
      state.main_hidden_rows->bytes() < n * per || state.main_hidden_backend != &backend_) {
    // Room for a whole verification step (the token and a block of drafts), reused by the next
    // (a copy of the state keeps the old buffer).
    const int64_t rows = std::max<int64_t>(n, c.dspark_block_size + 1);
    ASSIGN_OR_RETURN(kernels::Buffer buf, backend_.Allocate(rows * per));
    state.main_hidden_rows = std::make_shared<kernels::Buffer>(std::move(buf));
  }
  RETURN_IF_ERROR(backend_.Copy(state.main_hidden_rows->data(), rows_dev, n * per));
  state.main_hidden_backend = &backend_;
  state.main_hidden_width = per / 4;
  state.main_hidden_rows_n = n;
  state.main_hidden_row = n - 1;
  state.main_hidden_pos = end_pos - 1;
  state.main_hidden.clear();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> MainHiddenOf(const SequenceState& s) {
  if (s.main_hidden_row < 0) return s.main_hidden;
  if (s.main_hidden_backend == nullptr || s.main_hidden_rows == nullptr ||
      s.main_hidden_row >= s.main_hidden_rows_n || s.main_hidden_width <= 0)
    return absl::InternalError("sequence state: its DSpark input row is missing");
  std::vector<float> out(static_cast<size_t>(s.main_hidden_width));
  const int64_t bytes = s.main_hidden_width * static_cast<int64_t>(sizeof(float));
  RETURN_IF_ERROR(s.main_hidden_backend->Download(*s.main_hidden_rows, s.main_hidden_row * bytes,
                                                  bytes, out.data()));
  return out;
}

absl::StatusOr<ForwardResult> Model::Forward(SequenceState& state, std::span<const int32_t> ids,
                                             bool all_logits, ForwardTrace* trace,
                                             bool per_row_keys, const PrefillOptions& options,
                                             const LogitsRequest& out) const {
  StageSpec spec;
  spec.start_pos = state.pos;
  spec.per_row_keys = per_row_keys;
  if (options.decoder_tail_rows > 0) {
    spec.window_floor =
        std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - options.decoder_tail_rows);
    spec.floor_first_layer = config_.candidate_source_layer;
  }
  // The residual stays in backend memory from the last layer to the head.
  Scratch ws(backend_, scratch_pool_.get());
  DeviceResidual residual;
  Hidden io;
  if (absl::Status s = RunStage(state, ids, spec, io, trace, &ws, &residual); !s.ok()) return s;
  if (config_.n_mtp_layers > 0) {  // the DSpark rings, from the inputs still in backend memory
    RETURN_IF_ERROR(DSparkSeedFrom(ws, state, residual.main_hidden, io.rows, spec.start_pos));
  }
  ForwardResult res;
  res.rows = all_logits ? io.rows : 1;
  ASSIGN_OR_RETURN(float* logits, HeadLogits(ws, residual, io.rows, all_logits, trace));
  RETURN_IF_ERROR(LogitsToHost(ws, logits, res.rows, out, res));
  RETURN_IF_ERROR(Commit(state, ids, state.pos + io.rows, io));
  res.main_hidden = std::move(io.main_hidden);
  return res;
}

absl::Status Model::EmbedRows(Scratch& ws, std::span<const int32_t> ids, float** h,
                              float** pre) const {
  const int64_t rows = static_cast<int64_t>(ids.size()), D = config_.dim, hc = config_.hc_mult;
  ASSIGN_OR_RETURN(const int32_t* ids_dev, ws.Copy(ids.data(), rows));
  ASSIGN_OR_RETURN(*h, ws.Alloc<float>(rows * hc * D));
  RETURN_IF_ERROR(
      backend_.Embed(weights_->embed.plain(), D, ids_dev, rows, static_cast<int>(hc), *h));
  ASSIGN_OR_RETURN(*pre, ws.Copy(FirstPreMix(rows)));
  return absl::OkStatus();
}

vector<float> Model::FirstPreMix(int64_t rows) const {
  // Before the first block, each row's delayed pre-mix takes its first copy: [1, 0, ..., 0].
  const int64_t hc = config_.hc_mult;
  vector<float> pre0(rows * hc, 0.f);
  for (int64_t i = 0; i < rows; ++i) pre0[i * hc] = 1.f;
  return pre0;
}

absl::StatusOr<ForwardResult> Model::Prefill(SequenceState& state, std::span<const int32_t> ids,
                                             bool all_logits, ForwardTrace* trace) const {
  return Prefill(state, ids, all_logits, PrefillOptions{}, trace);
}

absl::StatusOr<ForwardResult> Model::Prefill(SequenceState& state, std::span<const int32_t> ids,
                                             bool all_logits, const PrefillOptions& options,
                                             ForwardTrace* trace) const {
  if (state.pos != 0)
    return absl::FailedPreconditionError("model: Prefill needs a fresh sequence (start_pos 0)");
  if (ids.empty()) return absl::InvalidArgumentError("model: empty prompt");
  if (options.decoder_tail_rows < 0)
    return absl::InvalidArgumentError("model: decoder_tail_rows must be >= 0");
  return Forward(state, ids, all_logits, trace, /*per_row_keys=*/true, options);
}

absl::StatusOr<ForwardResult> Model::Decode(SequenceState& state, int32_t id,
                                            ForwardTrace* trace) const {
  if (state.pos == 0) return absl::FailedPreconditionError("model: Decode before Prefill");
  const int32_t ids[1] = {id};
  return Extend(state, ids, false, trace);
}

absl::StatusOr<ForwardResult> Model::Extend(SequenceState& state, std::span<const int32_t> ids,
                                            bool all_logits, ForwardTrace* trace,
                                            ExtendMode mode, const LogitsRequest& out) const {
  if (state.pos == 0) return absl::FailedPreconditionError("model: Extend before Prefill");
  if (ids.empty()) return absl::InvalidArgumentError("model: Extend with no tokens");
  RETURN_IF_ERROR(
      LogitsRequestProblem(out, all_logits ? static_cast<int64_t>(ids.size()) : int64_t{1}));
  if (mode == ExtendMode::kDecode && ids.size() > 1 && StaleKeysFromLaterLayer(state, ids.size())) {
    return ExtendRowByRow(state, ids, all_logits, trace, out);
  }
  return Forward(state, ids, all_logits, trace, mode == ExtendMode::kDecode, {}, out);
}

bool Model::Batchable(const SequenceState& state, std::span<const int32_t> ids) const {
  if (state.pos == 0 || ids.empty()) return false;
  for (int32_t id : ids) {
    if (id < 0 || id >= config_.vocab_size) return false;
  }
  return !(ids.size() > 1 && StaleKeysFromLaterLayer(state, ids.size()));
}

bool Model::StaleKeysFromLaterLayer(const SequenceState& state, size_t rows) const {
  // A row whose stale index keys (MODEL.md §3) are a later layer's, emitted at an earlier row of
  // this call, cannot run in one pass: when its layer runs, that later layer has not emitted yet.
  // (With the released structure, ratio-2 sources before the ratio-1 source, the rows it needs
  // are all older than the call: one pass.)
  if (!options_.stale_index_keys) return false;
  Call call;
  call.start_pos = state.pos;
  call.published_at_start = state.published_keys;
  for (size_t i = 1; i < rows; ++i) {
    const int64_t p = state.pos + static_cast<int64_t>(i);
    for (int l : config_.index_source_layers) {
      const int s = DecodeKeySource(l, p, call);
      if (s <= l || s < 0) continue;
      const int64_t visible = (p + 1) / config_.compress_ratios[l];
      if (visible > state.sources.at(s).n) return true;
    }
  }
  return false;
}

absl::StatusOr<ForwardResult> Model::ExtendRowByRow(SequenceState& state,
                                                    std::span<const int32_t> ids, bool all_logits,
                                                    ForwardTrace* trace,
                                                    const LogitsRequest& lo) const {
  // One single-token call per row (what kDecode means), with the compressors' per-row logs of the
  // whole step kept for Rollback.
  RETURN_IF_ERROR(LogitsRequestProblem(lo, all_logits ? static_cast<int64_t>(ids.size()) : 1));
  RETURN_IF_ERROR(VerificationProblem(lo));
  // A verification needs every row at once: the rows come down as values and go back up for it
  // at the end (this path is rare: a later layer's stale index keys).
  const bool verify = lo.out == LogitsOut::kVerify;
  ForwardResult out;
  std::map<int, std::shared_ptr<CompressorLog>> logs;  // the step's, filled row by row
  for (auto& [l, src] : state.sources) {
    if (src.ratio <= 1) continue;
    ASSIGN_OR_RETURN(logs[l], CompressorLog::Make(backend_, config_.head_dim,
                                                  static_cast<int64_t>(ids.size()), nullptr));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    // The row's own request: result row `returned` of the step's penalties, moved to row 0.
    const int64_t returned = all_logits ? static_cast<int64_t>(i) : 0;
    LogitPenalties row_penalties;
    SampleRequest row_sample;
    const bool kept = all_logits || i + 1 == ids.size();  // a row of the result
    // A row not returned draws nothing (its argmax, unused, keeps its logits on the backend).
    LogitsRequest row_lo(verify                                  ? LogitsOut::kValues
                         : lo.out == LogitsOut::kSample && !kept ? LogitsOut::kArgmax
                                                                 : lo.out);
    if (kept && !verify) row_lo.top_logprobs = lo.top_logprobs;
    if (lo.out == LogitsOut::kSample && kept) {
      row_sample.params = lo.sample->params;
      row_sample.uniforms = {lo.sample->uniforms[returned]};
      row_lo.sample = &row_sample;
    }
    if (lo.penalties != nullptr && kept && !verify) {
      const int64_t V = config_.vocab_size;
      row_penalties = *lo.penalties;
      row_penalties.at.clear();
      row_penalties.counts.clear();
      for (size_t e = 0; e < lo.penalties->at.size(); ++e) {
        const int64_t a = lo.penalties->at[e] - returned * V;
        if (a < 0 || a >= V) continue;
        row_penalties.at.push_back(a);
        row_penalties.counts.push_back(lo.penalties->counts[e]);
      }
      row_lo.penalties = &row_penalties;
    }
    auto r = Forward(state, ids.subspan(i, 1), true, trace, true, {}, row_lo);
    if (!r.ok()) return r.status();
    if (kept) {
      out.logits.insert(out.logits.end(), r->logits.begin(), r->logits.end());
      out.tokens.insert(out.tokens.end(), r->tokens.begin(), r->tokens.end());
      out.logprobs.insert(out.logprobs.end(), r->logprobs.begin(), r->logprobs.end());
      out.rows += 1;
    }
    out.main_hidden.insert(out.main_hidden.end(), r->main_hidden.begin(), r->main_hidden.end());
    for (auto& [l, log] : logs) {  // the row's log (its one row) joins the step's
      const CompressorLog& row = *state.sources.at(l).log;
      for (int64_t k = 0; k < row.rows(); ++k)
        RETURN_IF_ERROR(log->Append(row.positions()[k], 1, row.kv(k), row.score(k)));
    }
  }
  for (auto& [l, log] : logs) state.sources.at(l).log = std::move(log);
  if (verify) {
    Scratch ws(backend_, scratch_pool_.get());
    ASSIGN_OR_RETURN(float* rows, ws.Copy(out.logits));
    ASSIGN_OR_RETURN(const float* raw, RawRows(ws, rows, out.rows, lo));
    if (lo.penalties != nullptr) RETURN_IF_ERROR(Penalize(ws, rows, out.rows, *lo.penalties));
    ASSIGN_OR_RETURN(int32_t * verdict, ws.Alloc<int32_t>(2));
    int32_t* chosen = nullptr;
    if (lo.top_logprobs >= 0) {
      ASSIGN_OR_RETURN(chosen, ws.Alloc<int32_t>(out.rows));
    }
    RETURN_IF_ERROR(VerifyTokens(ws, rows, out.rows, lo, verdict, chosen));
    if (chosen != nullptr)
      RETURN_IF_ERROR(LogprobsToHost(ws, raw, out.rows, chosen, lo.top_logprobs, out.logprobs));
    RETURN_IF_ERROR(ws.DownloadTo(verdict, 2, out.tokens));
    out.logits.clear();
  }
  return out;
}

StepCheckpoint Model::Checkpoint(const SequenceState& state, int64_t rows) const {
  const ModelConfig& c = config_;
  StepCheckpoint k;
  k.start = state.pos;
  k.rows = rows;
  k.published_keys = state.published_keys;
  k.engram_history = state.engram_history;
  k.main_hidden_pos = state.main_hidden_pos;
  for (const auto& [l, src] : state.sources) {
    k.sources[l] = {src.n, src.tail};
  }
  const int64_t W = c.window_size, n = std::min(rows, W);
  k.ring_slots.assign(state.swa.size(), nullptr);
  int64_t bytes = 0;
  for (const SwaRing& ring : state.swa) bytes += ring.allocated() ? n * ring.slot_bytes() : 0;
  if (bytes == 0) return k;
  k.saved = std::make_shared<Scratch>(backend_, scratch_pool_.get());
  auto at = k.saved->Alloc<uint8_t>(bytes);
  if (!at.ok()) {
    k.status = at.status();
    return k;
  }
  uint8_t* p = *at;
  for (size_t l = 0; l < state.swa.size(); ++l) {
    const SwaRing& ring = state.swa[l];
    if (!ring.allocated()) continue;
    if (absl::Status s = ring.CopySlotsTo(k.start % W, n, p); !s.ok()) {
      k.status = s;
      return k;
    }
    k.ring_slots[l] = p;
    p += n * ring.slot_bytes();
  }
  return k;
}

absl::Status Model::Rollback(SequenceState& state, const StepCheckpoint& k,
                             std::span<const int32_t> accepted, const ForwardResult& step) const {
  const ModelConfig& c = config_;
  const int64_t keep = static_cast<int64_t>(accepted.size());
  if (state.pos != k.start + k.rows) {
    return absl::FailedPreconditionError(
        "rollback: state is not right after the checkpointed step");
  }
  if (keep < 1 || keep > k.rows) return absl::InvalidArgumentError("rollback: keep 1..rows tokens");
  if (!k.status.ok()) {
    return absl::Status(k.status.code(),
                        absl::StrCat("rollback: the checkpoint failed: ", k.status.message()));
  }
  if (k.ring_slots.size() != state.swa.size())
    return absl::InvalidArgumentError("rollback: the checkpoint is of another state");
  const int64_t end = k.start + keep, hd = c.head_dim, W = c.window_size;
  // Rings: slots of rejected positions get their previous content back (backend Copies from the
  // checkpoint's copy; packed zeros where the ring had no block).
  const int64_t saved_rows = std::min(k.rows, W);
  for (size_t l = 0; l < state.swa.size() && keep < saved_rows; ++l) {
    SwaRing& ring = state.swa[l];
    const int64_t sb = ring.slot_bytes();
    if (k.ring_slots[l] != nullptr) {
      RETURN_IF_ERROR(ring.WriteSlotsFrom((k.start + keep) % W, saved_rows - keep,
                                          k.ring_slots[l] + keep * sb));
      continue;
    }
    std::vector<uint8_t> zero;
    // A fresh ring's slot: packed zeros.
    RETURN_IF_ERROR(SwaRing(kv_pool_, ring.window(), ring.dim()).CopySlotPacked(0, zero));
    for (int64_t i = keep; i < saved_rows; ++i)
      RETURN_IF_ERROR(ring.WriteSlotPacked((k.start + i) % W, zero.data()));
  }
  for (auto& [l, src] : state.sources) {
    const auto& saved = k.sources.at(l);
    src.n = std::min(src.n, end / src.ratio);
    src.kv.resize(src.n * hd);
    src.keys.resize(src.n * c.index_head_dim);
    if (src.ratio > 1) {
      // Each tail slot holds the latest accepted position with that residue: a row of the step
      // (its log, in backend memory) or, for a position before it, the checkpointed slot. With
      // every row accepted the tail is the step's already.
      if (keep == k.rows) continue;
      for (int r = 0; r < src.ratio; ++r) {
        const int64_t q = end - 1 - ((end - 1 - r) % src.ratio + src.ratio) % src.ratio;
        if (q < k.start) {
          RETURN_IF_ERROR(src.tail.CopySlotFrom(r, saved.tail, r));
          continue;
        }
        const int64_t i = src.log != nullptr ? src.log->Find(q) : -1;
        if (i < 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              "rollback: the compressor log of source ", l, " does not hold position ", q));
        }
        RETURN_IF_ERROR(src.tail.WriteSlotsFrom(r, 1, src.log->kv(i), src.log->score(i)));
      }
    }
  }
  Call call;
  call.start_pos = k.start;
  call.published_at_start = k.published_keys;
  state.published_keys =
      options_.stale_index_keys ? DecodeKeySource(c.n_layers, end - 1, call) : state.published_keys;
  state.engram_history = k.engram_history;
  for (int32_t id : accepted) state.engram_history.push_back(EngramCompressedId(engram_, id));
  const size_t hist = static_cast<size_t>(std::max(0, c.engram_max_ngram_size - 1));
  if (state.engram_history.size() > hist) {
    state.engram_history.erase(state.engram_history.begin(), state.engram_history.end() - hist);
  }
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  if (nt > 0) {
    if (state.main_hidden_row >= 0) {  // the step's rows stayed in backend memory
      if (keep > state.main_hidden_rows_n)
        return absl::InvalidArgumentError("rollback: the step kept fewer DSpark inputs");
      state.main_hidden_row = keep - 1;
    } else {
      if (step.main_hidden.size() < static_cast<size_t>(keep * nt * c.dim)) {
        return absl::InvalidArgumentError("rollback: step result lacks the DSpark inputs");
      }
      state.main_hidden.assign(step.main_hidden.begin() + (keep - 1) * nt * c.dim,
                               step.main_hidden.begin() + keep * nt * c.dim);
    }
    state.main_hidden_pos = end - 1;
  }
  state.pos = end;
  return absl::OkStatus();
}

}  // namespace epd::model
