#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

absl::Status Model::RopeRows(Scratch& ws, int l, float* x, int64_t rows, int heads, int stride,
                             int offset, const int64_t* positions, bool inverse) const {
  const bool yarn = roles_[l].compress_ratio > 0;
  const vector<float>& f = yarn ? freqs_yarn_ : freqs_plain_;
  const int np = static_cast<int>(f.size());
  const float* freqs = nullptr;
  if (!freqs_dev_.empty()) {
    freqs = freqs_dev_.as<float>() + (yarn ? freqs_plain_.size() : 0);
  } else {
    ASSIGN_OR_RETURN(freqs, ws.Copy(f));
  }
  ASSIGN_OR_RETURN(float* cs, ws.Alloc<float>(rows * np));
  ASSIGN_OR_RETURN(float* sn, ws.Alloc<float>(rows * np));
  RETURN_IF_ERROR(backend_.RopeTables(freqs, np, positions, rows, cs, sn));
  return backend_.Rope(x, rows, heads, stride, offset, np, cs, sn, inverse);
}

absl::Status Model::Compress(int l, const float* x, const int64_t* pos_ptr, int64_t S,
                             SequenceState& state) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = weights_->layers[l].attn;
  const int64_t hd = c.head_dim;
  const int ratio = roles_[l].compress_ratio;
  const vector<int64_t> pos(pos_ptr, pos_ptr + S);
  SequenceState::Source& s = state.sources[l];
  Scratch ws(backend_, scratch_pool_.get());
  float* latents = nullptr;  // [emitted entries, hd], in emission order
  vector<int64_t> gpos;      // their first positions
  if (ratio == 1) {
    ASSIGN_OR_RETURN(latents, ws.Alloc<float>(S * hd));
    RETURN_IF_ERROR(CompressorProjections(l, x, S, latents, nullptr));
    gpos = pos;
  } else {
    ASSIGN_OR_RETURN(float* kvf, ws.Alloc<float>(S * hd));
    ASSIGN_OR_RETURN(float* scf, ws.Alloc<float>(S * hd));
    RETURN_IF_ERROR(CompressorProjections(l, x, S, kvf, scf));
    int64_t emits = 0;
    for (int64_t i = 0; i < S; ++i) emits += (pos[i] + 1) % ratio == 0 ? 1 : 0;
    ASSIGN_OR_RETURN(latents, ws.Alloc<float>(emits * hd));
    RETURN_IF_ERROR(PoolGroups(ws, s, state.cut_block_tokens, kvf, scf, pos, latents, gpos));
    // Every entry's norm in one call (rows are independent).
    if (!gpos.empty()) {
      RETURN_IF_ERROR(backend_.RmsNorm(latents, A.cmp_norm.data(),
                                       static_cast<int64_t>(gpos.size()), hd, c.norm_eps, latents));
    }
  }
  const int64_t ne = static_cast<int64_t>(gpos.size());
  if (ne == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(float* keys, ws.Alloc<float>(ne * c.index_head_dim));
  ASSIGN_OR_RETURN(const int64_t* gpos_dev, ws.Copy(gpos));
  RETURN_IF_ERROR(FinishLatents(ws, l, latents, ne, gpos_dev, keys));
  return AppendLatents(l, state, latents, keys, ne);
}

absl::Status Model::CompressorProjections(int l, const float* x, int64_t rows, float* kv,
                                          float* score) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = weights_->layers[l].attn;
  const int64_t D = c.dim, hd = c.head_dim;
  if (roles_[l].compress_ratio == 1) {
    RETURN_IF_ERROR(backend_.LinearBf16(x, rows, A.cmp_wkv.plain(), hd, D, kv));
    return backend_.RmsNorm(kv, A.cmp_norm.data(), rows, hd, c.norm_eps, kv);
  }
  RETURN_IF_ERROR(backend_.LinearF32(x, rows, A.cmp_wkv.plain(), hd, D, kv));
  return backend_.LinearF32(x, rows, A.cmp_wgate.plain(), hd, D, score);
}

absl::Status Model::PoolGroups(Scratch& ws, SequenceState::Source& s, int64_t cut_block,
                               const float* kvf, const float* scf, const vector<int64_t>& pos,
                               float* latents, vector<int64_t>& gpos) const {
  const int64_t hd = config_.head_dim, S = static_cast<int64_t>(pos.size());
  const int ratio = s.ratio;
  const int64_t g0 = static_cast<int64_t>(gpos.size());  // latents[0]'s entry
  RETURN_IF_ERROR(LogCompressorRows(ws, s, cut_block, kvf, scf, pos));
  // The tail state (backend memory) takes the call's rows lazily: rows [written, i] just before
  // a group begun in an earlier call pools it, and at the end the last row of each slot.
  // write_rows writes the rows of [from, to) that `keep`, a run of consecutive positions in
  // consecutive slots at a time.
  int64_t written = 0;
  auto write_rows = [&](int64_t from, int64_t to, auto keep) -> absl::Status {
    for (int64_t i = from; i < to;) {
      if (!keep(i)) {
        ++i;
        continue;
      }
      int64_t n = 1;
      while (i + n < to && keep(i + n) && pos[i + n] == pos[i] + n && pos[i] % ratio + n < ratio)
        ++n;
      RETURN_IF_ERROR(s.tail.WriteSlotsFrom(pos[i] % ratio, n, kvf + i * hd, scf + i * hd));
      i += n;
    }
    return absl::OkStatus();
  };
  // Groups whose rows are all in this call pool straight from kvf/scf; consecutive ones go in
  // one CompressPool call (a run: `run` groups from row run_row, into latents from run_lat).
  int64_t run = 0, run_row = 0, run_lat = 0;
  auto flush_run = [&]() -> absl::Status {
    if (run == 0) return absl::OkStatus();
    const int64_t n = run;
    run = 0;
    return backend_.CompressPool(kvf + run_row * hd, scf + run_row * hd, n, ratio, hd,
                                 latents + run_lat * hd);
  };
  for (int64_t i = 0; i < S; ++i) {
    if ((pos[i] + 1) % ratio != 0) continue;
    const int64_t e = static_cast<int64_t>(gpos.size()) - g0;  // this group's latent
    // The group is positions pos[i]-ratio+1..pos[i], slot j = the group's j-th position. When
    // the whole group is this call's rows, its tail slots are exactly those rows of kvf/scf;
    // a group begun in an earlier call pools the tail state.
    const bool in_call = i + 1 >= ratio && pos[i + 1 - ratio] == pos[i] + 1 - ratio;
    if (!in_call) {
      RETURN_IF_ERROR(write_rows(written, i + 1, [](int64_t) { return true; }));
      written = i + 1;
      RETURN_IF_ERROR(
          backend_.CompressPool(s.tail.kv(), s.tail.score(), 1, ratio, hd, latents + e * hd));
    } else if (run > 0 && run_row + run * ratio == i + 1 - ratio && run_lat + run == e) {
      ++run;  // the next group of the run: its rows follow the previous group's
    } else {
      RETURN_IF_ERROR(flush_run());
      run_row = i + 1 - ratio;
      run_lat = e;
      run = 1;
    }
    gpos.push_back(pos[i] + 1 - ratio);
  }
  // The rows still to write: of each slot, its last row (later rows overwrite earlier ones).
  std::vector<int64_t> last(static_cast<size_t>(ratio), -1);
  for (int64_t i = written; i < S; ++i) last[pos[i] % ratio] = i;
  RETURN_IF_ERROR(write_rows(written, S, [&](int64_t i) { return last[pos[i] % ratio] == i; }));
  return flush_run();
}

absl::Status Model::FinishLatents(Scratch& ws, int l, float* latents, int64_t ne,
                                  const int64_t* gpos, float* keys) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = weights_->layers[l].attn;
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  const int rd = c.rope_head_dim, nope = c.nope_head_dim();
  RETURN_IF_ERROR(backend_.LinearBf16(latents, ne, A.idx_wk.plain(), ihd, hd, keys));
  RETURN_IF_ERROR(backend_.RmsNorm(keys, A.idx_k_norm.data(), ne, ihd, c.norm_eps, keys));
  RETURN_IF_ERROR(
      RopeRows(ws, l, keys, ne, 1, static_cast<int>(ihd), static_cast<int>(ihd - rd), gpos, false));
  if (!options_.unquantized_kv)  // benchmark switch, see ModelOptions
    RETURN_IF_ERROR(backend_.QuantDequant(kernels::Backend::Qdq::kFp4Index, keys, ne, ihd));
  RETURN_IF_ERROR(RopeRows(ws, l, latents, ne, 1, static_cast<int>(hd), nope, gpos, false));
  if (!options_.unquantized_kv)
    RETURN_IF_ERROR(backend_.QuantDequant(kernels::Backend::Qdq::kFp4Kv, latents, ne, hd));
  return absl::OkStatus();
}

absl::Status Model::AppendLatents(int l, SequenceState& state, const float* latents,
                                  const float* keys, int64_t ne) const {
  SequenceState::Source& s = state.sources[l];
  // The pool packs the rows into its blocks (the backend's PackRows, in its memory).
  RETURN_IF_ERROR(s.kv.AppendFrom(latents, ne));
  if (absl::Status st = s.keys.AppendFrom(keys, ne); !st.ok()) {
    s.kv.Truncate(s.n);
    return st;
  }
  s.n += ne;
  state.published_keys = l;
  return absl::OkStatus();
}

bool Model::WholeSourceOnBackend(const Call& call) const {
  if (options_.whole_source_bytes <= 0 || backend_.memory_kind() == kernels::MemoryKind::kHost)
    return false;
  const int64_t T = call.start_pos + call.rows;
  for (int l : config_.kv_source_layers) {
    const int r = config_.compress_ratios[l];
    if (r > 0 && T / r * config_.head_dim * 4 > options_.whole_source_bytes) return false;
  }
  return true;
}

absl::Status Model::LogCompressorRows(Scratch& ws, SequenceState::Source& s, int64_t cut_block,
                                       const float* kv, const float* score,
                                       const vector<int64_t>& pos) const {
  const int64_t S = static_cast<int64_t>(pos.size()), hd = config_.head_dim;
  const int64_t last = S > 0 ? pos.back() : 0;
  vector<int64_t> rows, positions;
  for (int64_t i = 0; i < S; ++i) {
    if (!CompressorLog::LogsPosition(pos[i], last, s.ratio, cut_block)) continue;
    rows.push_back(i);
    positions.push_back(pos[i]);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  ASSIGN_OR_RETURN(s.log, CompressorLog::Make(backend_, hd, n, std::move(s.log)));
  if (n == 0) return absl::OkStatus();
  // A call of at most kLogRecentRows rows at consecutive positions (a decode step, a
  // verification block) logs every row: two Copies. A larger one (a prefill: the last rows and
  // the tails at block boundaries) gathers, one CopyRows per array.
  if (S <= CompressorLog::kLogRecentRows && n == S && pos.back() - pos.front() == S - 1)
    return s.log->Append(positions.front(), n, kv + rows.front() * hd, score + rows.front() * hd);
  ASSIGN_OR_RETURN(const int64_t* rows_dev, ws.Copy(rows));
  return s.log->AppendGathered(positions, rows_dev, kv, score);
}

absl::Status Model::ScoreKeys(Scratch& ws, const KvRows& keys, int layer, int64_t rows,
                              const float* q, const float* w, int heads, int64_t n,
                              int64_t available, float* score, UnpackedKeys& unpacked) const {
  const int64_t ihd = keys.dim();
  if (n <= 0) return absl::OkStatus();
  if (rows > 1) {
    ASSIGN_OR_RETURN(const float* u, UnpackKeys(ws, keys, layer, n, available, unpacked));
    return backend_.IndexerScores(q, w, heads, u, n, ihd, score);
  }
  // Straight from the pool's blocks: no unpacked copy of the keys, one call.
  const auto held = static_cast<int64_t>(keys.blocks().size()) * keys.rows_per_block();
  if (n > held) {
    return absl::OutOfRangeError(absl::StrCat("indexer: ", n, " keys of ", held, " in the blocks"));
  }
  ASSIGN_OR_RETURN(uint8_t* const* pages, keys.Pages());
  const uint8_t* const* table = pages;
  ASSIGN_OR_RETURN(const uint8_t* const* const* tables, ws.Copy(&table, 1));
  ASSIGN_OR_RETURN(const int64_t* rpp_valid,
                   ws.Copy(std::vector<int64_t>{keys.rows_per_block(), n}));
  return backend_.IndexerScoresPaged(q, w, heads, KvRowCodec(keys.format()), tables, rpp_valid,
                                     rpp_valid + 1, n, ihd, 1, score);
}

absl::StatusOr<const float*> Model::UnpackKeys(Scratch& ws, const KvRows& keys, int layer,
                                               int64_t n, int64_t available,
                                               UnpackedKeys& unpacked) const {
  auto it = unpacked.find(layer);
  if (it == unpacked.end() || it->second.second < n) {
    // Every key the source has (the rows of this call score prefixes of them): unpacked once.
    const int64_t all = std::max(n, available), ihd = keys.dim();
    ASSIGN_OR_RETURN(float* u, ws.Alloc<float>(all * ihd));
    RETURN_IF_ERROR(keys.UnpackTo(0, all, u));
    it = unpacked.insert_or_assign(layer, std::make_pair(static_cast<const float*>(u), all)).first;
  }
  return it->second.first;
}

int64_t Model::LayerKeyCount(int l, const Call& call, const SequenceState::Source& src) const {
  return std::min<int64_t>((call.start_pos + call.rows) / roles_[l].compress_ratio, src.n);
}

Model::RowKeys Model::IndexRowKeys(int l, const Call& call, const SequenceState& state, int64_t nk,
                                   int64_t pos) const {
  RowKeys rk;
  rk.source = !options_.stale_index_keys ? roles_[l].index_key_source
              : call.per_row_keys        ? DecodeKeySource(l, pos, call)
                                         : state.published_keys;
  rk.visible = (pos + 1) / roles_[l].compress_ratio;
  auto it = state.sources.find(rk.source);
  if (it != state.sources.end())
    rk.scored = std::max<int64_t>(0, std::min({nk, it->second.n, rk.visible}));
  return rk;
}

int Model::DecodeKeySource(int l, int64_t p, const Call& call) const {
  // The reference publishes a source's index keys only in a call where its compressor emitted.
  // In a single-token call at q, source s emits iff (q + 1) % ratio_s == 0; at the call for p only
  // sources up to layer l have run when l's indexer reads the keys.
  for (int64_t q = p; q >= call.start_pos; --q) {
    int best = -1;
    for (int s : config_.kv_source_layers) {
      if (q == p && s > l) break;
      if ((q + 1) % config_.compress_ratios[s] == 0) best = s;
    }
    if (best >= 0) return best;
  }
  return call.published_at_start;
}

absl::Status Model::Attention(int l, const float* x, Call& call, SequenceState& state, float* out,
                              ForwardTrace* trace) const {
  return Attention(l, x, call, state, out, trace, nullptr);
}

absl::Status Model::Attention(int l, const float* x, Call& call, SequenceState& state,
                              const AttentionRows& rows) const {
  return Attention(l, x, call, state, nullptr, nullptr, &rows);
}

absl::Status Model::Attention(int l, const float* x, Call& call, SequenceState& state, float* out,
                              ForwardTrace* trace, const AttentionRows* given) const {
  const ModelConfig& c = config_;
  const LayerRole& role = roles_[l];
  const int64_t S = call.rows, hd = c.head_dim, H = c.n_heads, W = c.window_size;
  Scratch ws(backend_, scratch_pool_.get());
  vector<int64_t> pos(S);
  for (int64_t i = 0; i < S; ++i) pos[i] = call.start_pos + i;
  if (call.scratch == nullptr) {  // a module entry point's call: arrays that span its layers
    call.own_scratch = std::make_shared<Scratch>(backend_, scratch_pool_.get());
    call.scratch = call.own_scratch.get();
  }
  if (call.pos_dev == nullptr) {  // uploaded once per call
    ASSIGN_OR_RETURN(call.pos_dev, call.scratch->Copy(pos));
  }
  const int64_t* pos_dev = call.pos_dev;

  const float* qr = nullptr;
  const float* q = nullptr;
  const float* kv = nullptr;
  if (given != nullptr) {
    qr = given->qr;
    q = given->q;
    kv = given->kv;
  } else {
    ASSIGN_OR_RETURN(float* qr_own, ws.Alloc<float>(S * c.q_lora_rank));
    ASSIGN_OR_RETURN(float* q_own, ws.Alloc<float>(S * H * hd));
    ASSIGN_OR_RETURN(float* kv_own, ws.Alloc<float>(S * hd));
    RETURN_IF_ERROR(QueryProjection(ws, l, x, S, pos_dev, qr_own, q_own));
    RETURN_IF_ERROR(StageKv(ws, l, x, S, pos_dev, kv_own));
    qr = qr_own;
    q = q_own;
    kv = kv_own;
  }

  // Window part of the KV and of each row's list.
  StepKv* step = given != nullptr ? given->step : nullptr;
  if (step != nullptr && (call.prefill || S > options_.device_list_rows))
    return absl::InternalError("attention: a shared step takes decode calls of few rows");
  SwaRing& ring = state.swa[l];
  const float* kv_all = kv;  // start_pos 0: the chunk's own rows are the window (reference prefill)
  const int64_t win_rows = call.prefill ? S : W + S;
  // Where kv_all holds the ring's slots and this call's rows (a decode-mode call).
  int64_t ring_base = 0, new_base = W;
  if (step != nullptr) {  // the caller read the ring into step->kv and wrote this call's rows
    kv_all = step->kv;
    ring_base = given->seq * W;
    new_base = step->seqs * W + given->row0;
  } else if (!call.prefill) {
    // start_pos > 0 (decode, multi-token decode, chunked prefill): [ring as before this call;
    // this call's rows]. Each row lists positions p-W+1..p oldest first, as the reference decode.
    ASSIGN_OR_RETURN(float* joined, ws.Alloc<float>((W + S) * hd));
    RETURN_IF_ERROR(ring.ReadWindowTo(joined));
    RETURN_IF_ERROR(
        backend_.Copy(joined + W * hd, kv, S * hd * static_cast<int64_t>(sizeof(float))));
    kv_all = joined;
  }
  if (step == nullptr) RETURN_IF_ERROR(ring.WritePositionsFrom(call.start_pos, S, kv));

  // Compressed part: compressor (KV sources), indexer (index sources), shared top-k (Reuse).
  const int ratio = role.compress_ratio;
  const bool device_lists = S <= options_.device_list_rows;
  // A larger call on a device keeps its top-k there too when the sources fit unpacked whole
  // (ModelOptions::whole_source_bytes): its lists index the whole unpacked source.
  const bool whole_source = !device_lists && WholeSourceOnBackend(call);
  const bool device_topk = device_lists || whole_source;
  int64_t nk = 0;
  const SequenceState::Source* src = nullptr;
  if (ratio > 0) {
    const int64_t T = call.start_pos + S;
    nk = T / ratio;
    if (role.is_kv_source && call.compress) {
      if (given == nullptr || !given->compressed)
        RETURN_IF_ERROR(Compress(l, x, pos.data(), S, state));
    } else if (role.is_kv_source && state.sources.at(l).n >= nk) {
      state.published_keys = l;  // KV already present (replay): the layer's own keys are current
    }
    src = &state.sources.at(role.kv_source);
    nk = LayerKeyCount(l, call, *src);

    if (role.is_index_source && !(given != nullptr && given->indexed)) {
      const int64_t k = std::min<int64_t>(c.index_topk, nk);
      call.topk_k = k;
      call.topk.assign(S * k, -1);
      call.topk_dev = nullptr;
      call.topk_batched = false;
      if (nk > 0) {
        const int64_t nI = c.index_n_heads, ihd = c.index_head_dim;
        const float* qi = given != nullptr ? given->qi : nullptr;
        const float* w = given != nullptr ? given->w : nullptr;
        if (qi == nullptr || w == nullptr) {
          ASSIGN_OR_RETURN(float* qi_own, ws.Alloc<float>(S * nI * ihd));
          ASSIGN_OR_RETURN(float* w_own, ws.Alloc<float>(S * nI));
          RETURN_IF_ERROR(IndexQueries(ws, l, x, qr, S, pos_dev, qi_own, w_own));
          qi = qi_own;
          w = w_own;
        }
        // A top-k kept on the backend is read by the call's later layers too: in its scratch.
        ASSIGN_OR_RETURN(int32_t * topk, (device_topk ? *call.scratch : ws).Alloc<int32_t>(S * k));
        UnpackedKeys unpacked_keys;  // multi-row calls: keys unpacked once
        if (role.is_candidate_source) {
          ASSIGN_OR_RETURN(call.cand, call.scratch->Alloc<uint8_t>(S * nk));
          call.cand_cols = nk;
        }
        const uint8_t* cand = call.cand_cols > 0 ? call.cand : nullptr;
        // Each row's key source (decode semantics: the keys a single-token call at its position
        // would see) and how many of its keys it scores; multi-row calls unpack, per source, the
        // most any row scores.
        vector<int> keysrc(S);
        vector<int64_t> scored(S);
        std::map<int, int64_t> most_scored;
        for (int64_t i = 0; i < S; ++i) {
          const RowKeys rk = IndexRowKeys(l, call, state, nk, pos[i]);
          keysrc[i] = rk.source;
          scored[i] = rk.scored;
          most_scored[keysrc[i]] = std::max(most_scored[keysrc[i]], scored[i]);
        }
        const bool one_source =
            std::all_of(keysrc.begin(), keysrc.end(), [&](int s) { return s == keysrc[0]; });
        if (S > 1 && one_source) {
          // Every row at once (prefill): the same ops per row as below, in a fixed number of
          // calls per chunk of rows.
          const int ks = keysrc[0];
          vector<int64_t> visible(S);
          for (int64_t i = 0; i < S; ++i) visible[i] = (pos[i] + 1) / ratio;
          ASSIGN_OR_RETURN(const int64_t* valid_dev, ws.Copy(scored));
          ASSIGN_OR_RETURN(const int64_t* visible_dev, ws.Copy(visible));
          const float* u = nullptr;
          if (most_scored[ks] > 0) {
            ASSIGN_OR_RETURN(u, UnpackKeys(ws, state.sources.at(ks).keys, ks, most_scored[ks],
                                           most_scored[ks], unpacked_keys));
          }
          const int64_t cr =
              std::clamp<int64_t>(kIndexerScoresPerCall / nk, 1, std::min(S, kIndexerRowsPerCall));
          ASSIGN_OR_RETURN(float* score, ws.Alloc<float>(cr * nk));
          for (int64_t r0 = 0; r0 < S; r0 += cr) {
            const int64_t n = std::min(cr, S - r0);
            RETURN_IF_ERROR(backend_.IndexerScoresRows(qi + r0 * nI * ihd, w + r0 * nI,
                                                       static_cast<int>(nI), u, nk, ihd, n,
                                                       valid_dev + r0, score));
            if (role.is_candidate_source) {
              RETURN_IF_ERROR(backend_.CandidateMaskRows(
                  score, n, nk, c.candidate_block_size, visible_dev + r0, nullptr,
                  c.candidate_topk_blocks, call.cand + r0 * nk));
            }
            const bool masked = role.uses_candidates && call.cand_cols > 0;
            RETURN_IF_ERROR(backend_.SelectTopKRows(score, n, nk, k, visible_dev + r0, win_rows,
                                                    masked ? cand + r0 * call.cand_cols : nullptr,
                                                    masked ? call.cand_cols : 0, topk + r0 * k));
          }
        } else {
          // One row at a time (single-row calls; decode-semantics rows reading several sources).
          ASSIGN_OR_RETURN(float* score, ws.Alloc<float>(nk));
          for (int64_t i = 0; i < S; ++i) {
            const int64_t visible = (pos[i] + 1) / ratio;
            const SequenceState::Source& ks = state.sources.at(keysrc[i]);
            RETURN_IF_ERROR(ScoreKeys(ws, ks.keys, keysrc[i], S, qi + i * nI * ihd, w + i * nI,
                                      static_cast<int>(nI), scored[i], most_scored[keysrc[i]],
                                      score, unpacked_keys));
            RETURN_IF_ERROR(backend_.MaskScores(score, nk, scored[i], nullptr, 0));
            if (role.is_candidate_source) {
              RETURN_IF_ERROR(backend_.CandidateMask(score, nk, c.candidate_block_size, visible,
                                                     c.candidate_topk_blocks, call.cand + i * nk));
            }
            if (role.uses_candidates && call.cand_cols > 0) {
              RETURN_IF_ERROR(
                  backend_.MaskScores(score, nk, nk, cand + i * call.cand_cols, call.cand_cols));
            }
            RETURN_IF_ERROR(backend_.SelectTopK(score, nk, k, visible, win_rows, topk + i * k));
          }
        }
        if (!device_topk) {
          RETURN_IF_ERROR(ws.Download(topk, S * k, call.topk.data()));
        } else {
          call.topk_dev = topk;
          if (trace != nullptr) {  // the host copy only for the trace
            RETURN_IF_ERROR(call.scratch->Download(topk, S * k, call.topk.data()));
          }
        }
      }
      if (trace) {
        std::vector<int32_t>& t = trace->topk[l];  // compressed positions, -1 = none
        t = call.topk;
        for (int32_t& v : t) v = v < 0 ? -1 : static_cast<int32_t>(v - win_rows);
      }
    }
  }

  // Index lists and sparse attention.
  const int64_t k = ratio > 0 ? call.topk_k : 0;
  const int64_t list_len = W + k;
  // One layout for every kind of call, so that a row's list (and thus its attention, which works
  // in 64-entry chunks of the list) depends only on its position, the window floor and its top-k:
  // slot j holds position max(0, p-W+1) + j (oldest first), -1 when that is after p or below the
  // floor; the top-k entries start at slot W. A small call's window part is the same for each of
  // its layers with this list length and floor: built and uploaded once (call.window_lists).
  // A shared step's window parts are written by the caller, for all its sequences at once.
  const int32_t* window_list = nullptr;
  if (device_lists && step == nullptr) {
    auto it = call.window_lists.find({list_len, call.window_floor});
    if (it != call.window_lists.end()) window_list = it->second;
  }
  const bool host_lists = window_list == nullptr && step == nullptr;
  vector<int32_t> idx(host_lists ? S * list_len : 0, -1);
  if (host_lists) {
    WindowLists(call, list_len, ring_base, new_base, idx.data());
    for (int64_t i = 0; i < S && !device_topk; ++i) {
      for (int64_t j = 0; j < k; ++j) idx[i * list_len + W + j] = call.topk[i * k + j];
    }
  }
  int32_t* idx_dev = nullptr;
  if (step != nullptr) {
    idx_dev = step->idx + step->idx_used;
    step->lists = {list_len, step->idx_used, ring_base, new_base, {}};
    step->idx_used += S * list_len;
  } else {
    ASSIGN_OR_RETURN(idx_dev, ws.Alloc<int32_t>(S * list_len));
  }

  float* o = given != nullptr ? given->o : nullptr;
  if (o == nullptr) {
    ASSIGN_OR_RETURN(o, ws.Alloc<float>(S * H * hd));
  }
  kernels::SparseAttentionArgs args = LayerAttentionArgs(l, S, list_len);
  args.q = q;
  args.kv = kv_all;
  const bool device_slots = ratio > 0 && nk > 0 && k > 0 && device_lists;
  int64_t slots_base = win_rows;  // the list entry of the gather's first row
  if (device_slots) {
    // Top-k slot (i, j) reads row i * k + j of a per-slot gather of the selected compressed
    // entries (a -1 slot gathers nothing and its list entry stays -1): the values and their
    // order in each list are those of the compact path below, so is the attention.
    if (call.topk_dev == nullptr) return absl::InternalError("attention: no top-k on the backend");
    float* kv_sel = nullptr;
    if (step != nullptr && given->ext_row >= 0) {  // gathered by the caller (StepGather)
      slots_base = step->kv_ext_start + given->ext_row;
    } else if (step != nullptr) {  // after the step's earlier sequences' gathers
      kv_sel = step->ext + step->ext_used * hd;
      slots_base = step->kv_ext_start + step->ext_used;
      step->ext_used += S * k;
    } else {
      ASSIGN_OR_RETURN(kv_sel, ws.Alloc<float>(S * k * hd));
    }
    if (kv_sel != nullptr) {
      RETURN_IF_ERROR(
          src->kv.GatherTo(call.topk_dev, S * k, kv_sel, call.topk_batched ? 0 : -win_rows));
    }
    args.kv_ext = step != nullptr ? step->ext : kv_sel;
    args.kv_ext_start = step != nullptr ? step->kv_ext_start : win_rows;
  } else if (ratio > 0 && nk > 0 && whole_source) {
    // The whole source unpacked once; TopKSlots (below) writes each slot's entry as it is.
    if (k > 0 && call.topk_dev == nullptr)
      return absl::InternalError("attention: no top-k on the backend");
    ASSIGN_OR_RETURN(float* kv_src, ws.Alloc<float>(nk * hd));
    RETURN_IF_ERROR(src->kv.UnpackTo(0, nk, kv_src));
    args.kv_ext = kv_src;
    args.kv_ext_start = win_rows;
  } else if (ratio > 0 && nk > 0 && !device_topk) {
    // Top-k entries (list values >= win_rows): the selected compressed entries, unpacked from the
    // pool's blocks into a compact buffer in first-use order; the list is renumbered to it (the
    // values and their order in each list are unchanged, so is the attention).
    vector<int32_t> remap(nk, -1), sel;
    for (int32_t& v : idx) {
      if (v < win_rows) continue;
      int32_t& m = remap[v - win_rows];
      if (m < 0) {
        m = static_cast<int32_t>(sel.size());
        sel.push_back(static_cast<int32_t>(v - win_rows));
      }
      v = static_cast<int32_t>(win_rows + m);
    }
    const int64_t ns = static_cast<int64_t>(sel.size());
    ASSIGN_OR_RETURN(float* kv_sel, ws.Alloc<float>(ns * hd));
    ASSIGN_OR_RETURN(const int32_t* sel_dev, ws.Copy(sel));
    RETURN_IF_ERROR(src->kv.GatherTo(sel_dev, ns, kv_sel));
    args.kv_ext = kv_sel;
    args.kv_ext_start = win_rows;
  }
  if (step != nullptr) {
    // The caller writes the window part, then the top-k part over it (StepKv::Lists::slots).
    if (device_slots) step->lists.slots = {call.topk_dev, S, k, slots_base, idx_dev};
    return absl::OkStatus();
  }
  if (device_lists) {
    if (window_list == nullptr) {
      ASSIGN_OR_RETURN(window_list, call.scratch->Copy(idx));
      call.window_lists[{list_len, call.window_floor}] = window_list;
    }
    RETURN_IF_ERROR(
        backend_.Copy(idx_dev, window_list, S * list_len * static_cast<int64_t>(sizeof(int32_t))));
  } else {
    RETURN_IF_ERROR(ws.Upload(idx_dev, idx.data(), S * list_len));
  }
  if (device_slots) {  // the top-k part of the lists, over the uploaded window part
    RETURN_IF_ERROR(backend_.TopKSlots(call.topk_dev, S, k, slots_base, /*per_slot=*/true, idx_dev,
                                       list_len, W));
  } else if (whole_source && ratio > 0 && nk > 0 && k > 0) {  // each slot's entry, as it is
    RETURN_IF_ERROR(
        backend_.TopKSlots(call.topk_dev, S, k, 0, /*per_slot=*/false, idx_dev, list_len, W));
  }
  args.idx = idx_dev;
  args.out = o;
  RETURN_IF_ERROR(backend_.SparseAttention(args));
  if (given != nullptr) return absl::OkStatus();  // the caller finishes every row at once
  return FinishAttention(ws, l, o, S, pos_dev, out);
}

kernels::SparseAttentionArgs Model::LayerAttentionArgs(int l, int64_t rows,
                                                       int64_t list_len) const {
  kernels::SparseAttentionArgs args;
  args.sink = weights_->layers[l].attn.attn_sink.data();
  args.rows = rows;
  args.heads = static_cast<int>(config_.n_heads);
  args.head_dim = static_cast<int>(config_.head_dim);
  args.list_len = list_len;
  args.scale = static_cast<float>(std::pow(static_cast<double>(config_.head_dim), -0.5));
  return args;
}

void Model::WindowLists(const Call& call, int64_t list_len, int64_t ring_base, int64_t new_base,
                        int32_t* out) const {
  const int64_t W = config_.window_size;
  for (int64_t i = 0; i < call.rows; ++i) {
    int32_t* li = out + i * list_len;
    const int64_t p = call.start_pos + i;
    const int64_t base = std::max<int64_t>(0, p - W + 1);
    const int64_t lo = p >= call.window_floor ? std::max(base, call.window_floor) : base;
    for (int64_t j = 0; j < W; ++j) {
      const int64_t qp = base + j;
      if (qp > p || qp < lo) continue;
      li[j] = static_cast<int32_t>(call.prefill           ? qp
                                   : qp >= call.start_pos ? new_base + (qp - call.start_pos)
                                                          : ring_base + qp % W);
    }
  }
}

absl::Status Model::FinishAttention(Scratch& ws, int l, float* o, int64_t rows,
                                    const int64_t* positions, float* out,
                                    const int64_t* order) const {
  const ModelConfig& c = config_;
  RETURN_IF_ERROR(RopeRows(ws, l, o, rows, static_cast<int>(c.n_heads),
                           static_cast<int>(c.head_dim), c.nope_head_dim(), positions, true));
  return OutputProjection(ws, weights_->layers[l].attn, o, rows, out, order);
}

absl::Status Model::IndexQueries(Scratch& ws, int l, const float* x, const float* qr, int64_t rows,
                                 const int64_t* positions, float* qi, float* w) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = weights_->layers[l].attn;
  const int64_t nI = c.index_n_heads, ihd = c.index_head_dim;
  RETURN_IF_ERROR(backend_.LinearQuant(qr, rows, A.idx_wq_b, qi));
  RETURN_IF_ERROR(RopeRows(ws, l, qi, rows, static_cast<int>(nI), static_cast<int>(ihd),
                           static_cast<int>(ihd - c.rope_head_dim), positions, false));
  RETURN_IF_ERROR(backend_.QuantDequant(kernels::Backend::Qdq::kFp4Index, qi, rows * nI, ihd));
  RETURN_IF_ERROR(backend_.LinearBf16(x, rows, A.idx_weights_proj.plain(), nI, c.dim, w));
  const float wscale = static_cast<float>(std::pow(static_cast<double>(ihd), -0.5) *
                                          std::pow(static_cast<double>(nI), -0.5));
  return backend_.ScaleRoundBf16(w, rows * nI, wscale);
}

absl::Status Model::QueryProjection(Scratch& ws, int l, const float* x, int64_t rows,
                                    const int64_t* positions, float* qr, float* q) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = weights_->layers[l].attn;
  RETURN_IF_ERROR(backend_.LinearQuant(x, rows, A.wq_a, qr));
  RETURN_IF_ERROR(backend_.RmsNorm(qr, A.q_norm.data(), rows, c.q_lora_rank, c.norm_eps, qr));
  RETURN_IF_ERROR(backend_.LinearQuant(qr, rows, A.wq_b, q));
  return RopeRows(ws, l, q, rows, static_cast<int>(c.n_heads), static_cast<int>(c.head_dim),
                  c.nope_head_dim(), positions, false);
}

absl::Status Model::OutputProjection(Scratch& ws, const AttentionWeights& A, const float* o,
                                     int64_t rows, float* out, const int64_t* order) const {
  // Grouped wo_a (bf16: the reference's per-group einsum) then wo_b (FP8). o [rows, G, gin] is
  // regrouped to [G, rows, gin] (CopyRows), each group's rows go through its weight in one
  // LinearBf16, and the outputs go back to [rows, G, R]: LinearBf16 is row-independent, so this
  // equals one call per row and group, in G + 2 calls instead of rows x G.
  const ModelConfig& c = config_;
  const int64_t H = c.n_heads, hd = c.head_dim;
  const int64_t G = c.o_groups, gin = H / G * hd, R = c.o_lora_rank;
  ASSIGN_OR_RETURN(float* oa, ws.Alloc<float>(rows * G * R));
  if (rows == 1) {  // one row's groups are already contiguous
    for (int64_t g = 0; g < G; ++g) {
      RETURN_IF_ERROR(backend_.LinearBf16(o + g * gin, 1, A.wo_a.plain().From(g * R * gin), R, gin,
                                          oa + g * R));
    }
    return backend_.LinearQuant(oa, rows, A.wo_b, out);
  }
  const int64_t* order_dev = order;
  if (order_dev == nullptr) {
    ASSIGN_OR_RETURN(order_dev, ws.Copy(OutputGroupOrder(rows)));
  }
  ASSIGN_OR_RETURN(float* og, ws.Alloc<float>(rows * G * gin));
  ASSIGN_OR_RETURN(float* oag, ws.Alloc<float>(rows * G * R));
  RETURN_IF_ERROR(backend_.CopyRows(o, order_dev, og, nullptr, rows * G, gin));
  for (int64_t g = 0; g < G; ++g) {
    RETURN_IF_ERROR(backend_.LinearBf16(og + g * rows * gin, rows, A.wo_a.plain().From(g * R * gin),
                                        R, gin, oag + g * rows * R));
  }
  RETURN_IF_ERROR(backend_.CopyRows(oag, nullptr, oa, order_dev, rows * G, R));
  return backend_.LinearQuant(oa, rows, A.wo_b, out);
}

absl::Status Model::Moe(int l, const float* x, int64_t rows, float* out,
                        vector<int32_t>* experts) const {
  Scratch ws(backend_, scratch_pool_.get());
  return Moe(ws, l, x, rows, out, experts);
}

absl::Status Model::Moe(Scratch& outer, int l, const float* x, int64_t rows, float* out,
                        vector<int32_t>* experts) const {
  const ModelConfig& c = config_;
  const MoeWeights& M = weights_->layers[l].ffn;
  const int64_t D = c.dim, E = M.n_experts, I = c.moe_inter_dim;
  const float lim = c.swiglu_limit;
  // Routing, then the backend groups the rows by expert (MoeGroup: no host round trip) and every
  // expert runs over its rows in one grouped call per projection (GroupedLinearQuant; rows are
  // independent, so this equals one call per row and expert); each row then sums its experts'
  // outputs in ascending expert id order, then the shared experts (the reference order). Rows go
  // through in chunks of kMoeRowsPerCall (rows are independent), which bounds the grouped
  // buffers: each holds a chunk's rows once per expert slot.
  const int64_t K = M.top_k, NS = static_cast<int64_t>(M.shared.size()), slots = K + NS;
  const int64_t lists = E + NS;
  vector<const kernels::QuantWeight*> w1(lists), w3(lists), w2(lists);
  for (int64_t i = 0; i < lists; ++i) {
    const ExpertWeights& ew = i < E ? M.experts[i] : M.shared[i - E];
    w1[i] = &ew.w1;
    w3[i] = &ew.w3;
    w2[i] = &ew.w2;
  }
  // One grouped call per run of lists whose weights share shape and format (routed FP4 experts,
  // then the FP8 shared expert in the released checkpoints).
  vector<std::pair<int, int>> runs;
  for (int i = 0; i < static_cast<int>(lists); ++i) {
    auto like = [&](const vector<const kernels::QuantWeight*>& w, int a, int b) {
      const kernels::QuantWeight* two[] = {w[a], w[b]};
      return kernels::WeightGroupProblem(two, 2).empty();
    };
    if (!runs.empty() && like(w1, runs.back().first, i) && like(w3, runs.back().first, i) &&
        like(w2, runs.back().first, i)) {
      runs.back().second = i + 1;
    } else {
      runs.emplace_back(i, i + 1);
    }
  }
  if (experts) experts->assign(static_cast<size_t>(rows * K), -1);
  Scratch ws(backend_, outer.pool(), &outer);
  const int64_t chunk = std::min<int64_t>(rows, kMoeRowsPerCall);
  const int64_t entries = chunk * slots;
  ASSIGN_OR_RETURN(float* z, ws.Alloc<float>(chunk * E));
  ASSIGN_OR_RETURN(int32_t * sel, ws.Alloc<int32_t>(chunk * K));
  ASSIGN_OR_RETURN(float* wts, ws.Alloc<float>(chunk * K));
  int32_t* ranked = nullptr;
  if (experts) {
    ASSIGN_OR_RETURN(ranked, ws.Filled<int32_t>(chunk * K, -1));
  }
  ASSIGN_OR_RETURN(int64_t * starts, ws.Alloc<int64_t>(lists + 1));
  ASSIGN_OR_RETURN(int64_t * from, ws.Alloc<int64_t>(entries));
  ASSIGN_OR_RETURN(int64_t * to, ws.Alloc<int64_t>(entries));
  ASSIGN_OR_RETURN(float* entry_weights, ws.Alloc<float>(chunk * K));
  // Every entry's gathered input, gate/up/hidden and output; ys [chunk, slots, D] for SumSlots
  // (every slot is written: each row has K distinct experts).
  ASSIGN_OR_RETURN(float* xg, ws.Alloc<float>(entries * D));
  ASSIGN_OR_RETURN(float* g, ws.Alloc<float>(entries * I));
  ASSIGN_OR_RETURN(float* u, ws.Alloc<float>(entries * I));
  ASSIGN_OR_RETURN(float* hbuf, ws.Alloc<float>(entries * I));
  ASSIGN_OR_RETURN(float* yg, ws.Alloc<float>(entries * D));
  ASSIGN_OR_RETURN(float* ys, ws.Alloc<float>(entries * D));
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0), routed = n * K, all = n * slots;
    const float* xc = x + r0 * D;
    RETURN_IF_ERROR(backend_.LinearF32(xc, n, M.gate.plain(), E, D, z));
    RETURN_IF_ERROR(backend_.MoeRoute(z, n, static_cast<int>(E), M.gate_bias.data(), M.top_k,
                                      c.route_scale, sel, wts, ranked));
    if (experts) RETURN_IF_ERROR(ws.Download(ranked, routed, experts->data() + r0 * K));
    RETURN_IF_ERROR(backend_.MoeGroup(sel, wts, n, static_cast<int>(E), static_cast<int>(K),
                                      static_cast<int>(NS), starts, from, to, entry_weights));
    RETURN_IF_ERROR(backend_.CopyRows(xc, from, xg, nullptr, all, D));
    for (const auto& [b, e] : runs) {
      RETURN_IF_ERROR(backend_.GroupedLinearQuant(xg, all, starts + b, w1.data() + b, e - b, g));
      RETURN_IF_ERROR(backend_.GroupedLinearQuant(xg, all, starts + b, w3.data() + b, e - b, u));
    }
    // The routed entries (the first n * K) carry their routing weight; the shared ones none.
    RETURN_IF_ERROR(backend_.SwiGlu(g, u, routed, I, lim, entry_weights, hbuf));
    RETURN_IF_ERROR(backend_.SwiGlu(g + routed * I, u + routed * I, all - routed, I, lim, nullptr,
                                    hbuf + routed * I));
    for (const auto& [b, e] : runs) {
      RETURN_IF_ERROR(backend_.GroupedLinearQuant(hbuf, all, starts + b, w2.data() + b, e - b, yg));
    }
    RETURN_IF_ERROR(backend_.CopyRows(yg, nullptr, ys, to, all, D));
    RETURN_IF_ERROR(backend_.SumSlots(ys, n, slots, D, out + r0 * D));
  }
  return absl::OkStatus();
}

absl::Status Model::Engram(int l, const int64_t* hash_ids, int64_t stride, int64_t rows, float* h,
                           bool single_token_calls) const {
  const ModelConfig& c = config_;
  const int64_t nid = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  vector<int64_t> ids(rows * nid);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < nid; ++j) ids[r * nid + j] = hash_ids[r * stride + j];
  }
  Scratch ws(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(const int64_t* ids_dev, ws.Copy(ids));
  return EngramFromIds(ws, l, ids_dev, rows, h, single_token_calls);
}

absl::Status Model::EngramFromIds(Scratch& outer, int l, const int64_t* ids_dev, int64_t rows,
                                  float* h, bool single_token_calls) const {
  const ModelConfig& c = config_;
  const EngramWeights& E = *weights_->layers[l].engram;
  const int64_t D = c.dim, hc = c.hc_mult, ehd = c.engram_head_dim;
  const int64_t nid = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  if (E.table.shape.size() != 2 || E.table.shape[1] != ehd)
    return absl::InternalError("model: Engram table shape does not match engram_head_dim");
  Scratch ws(backend_, outer.pool(), &outer);
  ASSIGN_OR_RETURN(float* in, ws.Alloc<float>(rows * nid * ehd));
  ASSIGN_OR_RETURN(float* e, ws.Alloc<float>(rows * (hc + 1) * D));
  RETURN_IF_ERROR(
      backend_.Fp8RowLookup(E.table.data, E.table_scale.data, ehd, ids_dev, rows * nid, in));
  RETURN_IF_ERROR(backend_.LinearQuant(in, rows, E.wkv, e));
  return single_token_calls
             ? backend_.EngramGateSingleToken(h, e, rows, static_cast<int>(hc), D,
                                              E.q_weight.data(), E.k_weight.data(), c.norm_eps)
             : backend_.EngramGate(h, e, rows, static_cast<int>(hc), D, E.q_weight.data(),
                                   E.k_weight.data(), c.norm_eps);
}

vector<int64_t> Model::EngramHashes(const SequenceState& state,
                                    std::span<const int32_t> ids) const {
  const ModelConfig& c = config_;
  const int nl = static_cast<int>(c.engram_layer_ids.size());
  const int per = (c.engram_max_ngram_size - 1) * c.engram_n_heads;
  const int64_t S = static_cast<int64_t>(ids.size());
  vector<int64_t> out(S * nl * per);
  vector<int64_t> hist(state.engram_history);
  const int nh = c.engram_max_ngram_size;
  for (int64_t i = 0; i < S; ++i) {
    hist.push_back(EngramCompressedId(engram_, ids[i]));
    int64_t recent[16];
    const int n = std::min<int>(nh, static_cast<int>(hist.size()));
    for (int s = 0; s < n; ++s) recent[s] = hist[hist.size() - 1 - s];
    for (int li = 0; li < nl; ++li) {
      EngramHashRow(engram_, li, recent, n, nh, c.engram_n_heads, out.data() + (i * nl + li) * per);
    }
  }
  return out;
}

absl::Status Model::HcMix::Allocate(Scratch& ws, int64_t rows, int64_t hc) {
  ASSIGN_OR_RETURN(attn_pre, ws.Alloc<float>(rows * hc));
  ASSIGN_OR_RETURN(attn_post, ws.Alloc<float>(rows * hc));
  ASSIGN_OR_RETURN(attn_comb, ws.Alloc<float>(rows * hc * hc));
  ASSIGN_OR_RETURN(ffn_post, ws.Alloc<float>(rows * hc));
  ASSIGN_OR_RETURN(ffn_comb, ws.Alloc<float>(rows * hc * hc));
  return absl::OkStatus();
}

absl::Status Model::HcMixRows(bool single_token, int64_t rows, const float* h,
                              const WeightArray& fn, const WeightArray& scale,
                              const WeightArray& base, float* pre, float* post, float* comb) const {
  const ModelConfig& c = config_;
  const int hc = static_cast<int>(c.hc_mult);
  return single_token
             ? backend_.HcMixesSingleToken(rows, h, hc, c.dim, fn.data(), scale.data(), base.data(),
                                           c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, pre, post,
                                           comb)
             : backend_.HcMixes(rows, h, hc, c.dim, fn.data(), scale.data(), base.data(),
                                c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, pre, post, comb);
}

// The mHC steps take every row in one call: each op is row-independent (Backend contract), so
// this equals one call per row, with a fixed number of launches per layer on a device.
absl::Status Model::HcBeforeAttention(const LayerWeights& L, bool single_token, int64_t rows,
                                      const float* h, const float* pre, HcMix& m, float* x) const {
  const int64_t D = config_.dim;
  const int hc = static_cast<int>(config_.hc_mult);
  RETURN_IF_ERROR(HcMixRows(single_token, rows, h, L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base,
                            m.attn_pre, m.attn_post, m.attn_comb));
  return backend_.HcPre(rows, h, hc, D, pre, x);
}

absl::Status Model::HcBeforeFfn(const LayerWeights& L, bool single_token, int64_t rows,
                                const float* y, float* h, float* pre, HcMix& m, float* x) const {
  const int64_t D = config_.dim;
  const int hc = static_cast<int>(config_.hc_mult);
  RETURN_IF_ERROR(backend_.HcPost(rows, y, h, hc, D, m.attn_post, m.attn_comb, h));
  RETURN_IF_ERROR(HcMixRows(single_token, rows, h, L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, pre,
                            m.ffn_post, m.ffn_comb));
  return backend_.HcPre(rows, h, hc, D, m.attn_pre, x);
}

absl::Status Model::HcAfterFfn(int64_t rows, const float* y, float* h, const HcMix& m) const {
  return backend_.HcPost(rows, y, h, static_cast<int>(config_.hc_mult), config_.dim, m.ffn_post,
                         m.ffn_comb, h);
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

absl::StatusOr<vector<float>> Model::Head(const Hidden& io, bool all_logits,
                                          ForwardTrace* trace) const {
  const ModelConfig& c = config_;
  const int64_t S = io.rows, D = c.dim, hc = c.hc_mult;
  if (S <= 0 || io.h.size() != static_cast<size_t>(S * hc * D) ||
      io.pre.size() != static_cast<size_t>(S * hc)) {
    return absl::InvalidArgumentError("model: Head needs the residual of its rows");
  }
  // Rows are normed independently: only the rows whose logits (or trace) are wanted go up.
  const int64_t first = all_logits || trace ? 0 : S - 1, n = S - first;
  Scratch ws(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(float* h, ws.Copy(io.h.data() + first * hc * D, n * hc * D));
  ASSIGN_OR_RETURN(float* pre, ws.Copy(io.pre.data() + first * hc, n * hc));
  ASSIGN_OR_RETURN(float* logits, HeadLogits(ws, DeviceResidual{h, pre}, n, all_logits, trace));
  return ws.ToHost(logits, (all_logits ? n : 1) * c.vocab_size);
}

absl::StatusOr<float*> Model::HeadLogits(Scratch& ws, const DeviceResidual& r, int64_t S,
                                         bool all_logits, ForwardTrace* trace,
                                         float* logits_out) const {
  const ModelConfig& c = config_;
  const int64_t D = c.dim, hc = c.hc_mult, V = c.vocab_size;
  if (S <= 0 || r.h == nullptr || r.pre == nullptr)
    return absl::InvalidArgumentError("model: Head needs the residual of its rows");
  // Rows are normed independently: only the rows whose logits (or trace) are wanted.
  const int64_t first = all_logits || trace ? 0 : S - 1, n = S - first;
  const float* h = r.h + first * hc * D;
  const float* pre = r.pre + first * hc;
  ASSIGN_OR_RETURN(float* x, ws.Alloc<float>(n * D));
  RETURN_IF_ERROR(backend_.HcPre(n, h, static_cast<int>(hc), D, pre, x));
  RETURN_IF_ERROR(backend_.RmsNorm(x, weights_->norm.data(), n, D, c.norm_eps, x));
  if (trace) RETURN_IF_ERROR(ws.DownloadTo(x, n * D, trace->final_norm));
  const int64_t out_rows = all_logits ? S : 1;
  float* logits = logits_out;
  if (logits == nullptr) {
    ASSIGN_OR_RETURN(logits, ws.Alloc<float>(out_rows * V));
  }
  RETURN_IF_ERROR(
      backend_.LinearF32(x + (n - out_rows) * D, out_rows, weights_->head.plain(), V, D, logits));
  return logits;
}

absl::Status Model::Penalize(Scratch& ws, float* logits, int64_t rows,
                             const LogitPenalties& p) const {
  if (p.at.size() != p.counts.size())
    return absl::InvalidArgumentError("model: penalties need one count per entry");
  if (p.at.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const int64_t* at, ws.Copy(p.at));
  ASSIGN_OR_RETURN(const int32_t* counts, ws.Copy(p.counts));
  return backend_.PenalizeLogits(logits, rows * config_.vocab_size, at, counts,
                                 static_cast<int64_t>(p.at.size()), p.repetition, p.frequency,
                                 p.presence);
}

absl::Status LogitsRequestProblem(const LogitsRequest& out, int64_t rows) {
  if (out.penalties != nullptr && out.penalties->at.size() != out.penalties->counts.size())
    return absl::InvalidArgumentError("model: penalties need one count per entry");
  if (out.out == LogitsOut::kVerify) {
    if (out.verify == nullptr || out.verify->q == nullptr)
      return absl::InvalidArgumentError(
          "model: a verified result needs its drafts and their distributions");
    if (rows < 2 || static_cast<int64_t>(out.verify->drafts.size()) != rows - 1)
      return absl::InvalidArgumentError(absl::StrCat("model: a verified result of ", rows,
                                                     " rows has ", out.verify->drafts.size(),
                                                     " drafts (needs rows - 1 >= 1)"));
  }
  if (out.out != LogitsOut::kSample && out.out != LogitsOut::kVerify) return absl::OkStatus();
  if (out.sample == nullptr)
    return absl::InvalidArgumentError("model: a sampled result needs its sample request");
  if (const char* why = kernels::sampling::ParamsProblem(out.sample->params); why != nullptr)
    return absl::InvalidArgumentError(absl::StrCat("model: sample request: ", why));
  if (static_cast<int64_t>(out.sample->uniforms.size()) != rows) {
    return absl::InvalidArgumentError(absl::StrCat("model: sample request has ",
                                                   out.sample->uniforms.size(),
                                                   " uniforms for ", rows, " rows"));
  }
  for (double u : out.sample->uniforms) {
    if (!(u >= 0.0 && u < 1.0))
      return absl::InvalidArgumentError(absl::StrCat("model: uniform ", u, " is outside [0, 1)"));
  }
  return absl::OkStatus();
}

absl::Status Model::DrawTokens(Scratch& ws, const float* logits, int64_t rows,
                               const SampleRequest& sample, int32_t* tokens) const {
  ASSIGN_OR_RETURN(const double* u, ws.Copy(sample.uniforms));
  return backend_.SampleLogits(logits, rows, config_.vocab_size, sample.params, u, tokens, nullptr);
}

absl::Status Model::VerificationProblem(const LogitsRequest& out) const {
  if (out.out != LogitsOut::kVerify) return absl::OkStatus();
  const int64_t V = config_.vocab_size;
  const DraftVerification& dv = *out.verify;  // LogitsRequestProblem checked it is there
  const auto k = static_cast<int64_t>(dv.drafts.size());
  if (dv.q->bytes() < k * V * static_cast<int64_t>(sizeof(float)))
    return absl::InvalidArgumentError(
        absl::StrCat("model: the distributions of ", k, " drafts do not fit their buffer"));
  for (int32_t d : dv.drafts) {
    if (d < 0 || d >= V)
      return absl::InvalidArgumentError(
          absl::StrCat("model: draft ", d, " is outside the vocabulary"));
  }
  return absl::OkStatus();
}

absl::Status Model::VerifyTokens(Scratch& ws, const float* logits, int64_t rows,
                                 const LogitsRequest& out, int32_t* verdict,
                                 int32_t* chosen) const {
  const int64_t V = config_.vocab_size, k = rows - 1;
  const DraftVerification& dv = *out.verify;
  RETURN_IF_ERROR(VerificationProblem(out));
  // The target rows' distributions (SampleLogits' probs; its draws are not used), then the
  // verdict: two ids are all that comes down.
  ASSIGN_OR_RETURN(float* p, ws.Alloc<float>(rows * V));
  ASSIGN_OR_RETURN(int32_t * draws, ws.Alloc<int32_t>(rows));
  ASSIGN_OR_RETURN(const double* u, ws.Copy(out.sample->uniforms));
  RETURN_IF_ERROR(backend_.SampleLogits(logits, rows, V, out.sample->params, u, draws, p));
  ASSIGN_OR_RETURN(const int32_t* drafts, ws.Copy(dv.drafts));
  return backend_.VerifyDrafts(p, static_cast<const float*>(dv.q->data()), drafts, k, V, u, verdict,
                               chosen);
}

absl::StatusOr<const float*> Model::RawRows(Scratch& ws, const float* logits, int64_t rows,
                                            const LogitsRequest& out) const {
  if (out.top_logprobs < 0 || out.penalties == nullptr || out.penalties->at.empty()) return logits;
  const int64_t n = rows * config_.vocab_size;
  ASSIGN_OR_RETURN(float* raw, ws.Alloc<float>(n));
  RETURN_IF_ERROR(backend_.Copy(raw, logits, n * static_cast<int64_t>(sizeof(float))));
  return static_cast<const float*>(raw);
}

absl::Status Model::LogprobsToHost(Scratch& ws, const float* raw, int64_t rows,
                                   const int32_t* tokens, int top,
                                   std::vector<Logprobs>& out) const {
  const int64_t V = config_.vocab_size, t = top;
  // One buffer of 4-byte words: [rows] tokens, [rows] chosen logprobs, [rows, top] top ids, then
  // [rows, top] their logprobs.
  ASSIGN_OR_RETURN(int32_t * words, ws.Alloc<int32_t>(rows * (2 + 2 * t)));
  RETURN_IF_ERROR(backend_.Copy(words, tokens, rows * static_cast<int64_t>(sizeof(int32_t))));
  float* chosen_lp = reinterpret_cast<float*>(words + rows);
  int32_t* top_ids = words + 2 * rows;
  float* top_lp = reinterpret_cast<float*>(words + 2 * rows + rows * t);
  RETURN_IF_ERROR(backend_.TopLogprobs(raw, rows, V, tokens, t, chosen_lp, top_ids, top_lp));
  std::vector<int32_t> host;
  RETURN_IF_ERROR(ws.DownloadTo(words, rows * (2 + 2 * t), host));
  auto as_float = [&](int64_t i) {
    float f;
    std::memcpy(&f, &host[static_cast<size_t>(i)], sizeof f);
    return f;
  };
  out.assign(static_cast<size_t>(rows), Logprobs{});
  for (int64_t r = 0; r < rows; ++r) {
    Logprobs& lp = out[static_cast<size_t>(r)];
    lp.chosen = {host[static_cast<size_t>(r)], as_float(rows + r)};
    for (int64_t j = 0; j < t; ++j) {
      lp.top.push_back({host[static_cast<size_t>(2 * rows + r * t + j)],
                        as_float(2 * rows + rows * t + r * t + j)});
    }
  }
  return absl::OkStatus();
}

absl::Status Model::LogitsToHost(Scratch& ws, float* logits, int64_t rows,
                                 const LogitsRequest& out, ForwardResult& res) const {
  const int64_t V = config_.vocab_size;
  if (out.out == LogitsOut::kValues) return ws.DownloadTo(logits, rows * V, res.logits);
  RETURN_IF_ERROR(LogitsRequestProblem(out, rows));
  ASSIGN_OR_RETURN(const float* raw, RawRows(ws, logits, rows, out));
  if (out.penalties != nullptr) RETURN_IF_ERROR(Penalize(ws, logits, rows, *out.penalties));
  ASSIGN_OR_RETURN(int32_t * tokens, ws.Alloc<int32_t>(rows));
  if (out.out == LogitsOut::kVerify) {
    // The verdict in tokens' first 2 slots; with logprobs, each row's token in `chosen`.
    int32_t* chosen = nullptr;
    if (out.top_logprobs >= 0) {
      ASSIGN_OR_RETURN(chosen, ws.Alloc<int32_t>(rows));
    }
    RETURN_IF_ERROR(VerifyTokens(ws, logits, rows, out, tokens, chosen));
    if (chosen != nullptr)
      RETURN_IF_ERROR(LogprobsToHost(ws, raw, rows, chosen, out.top_logprobs, res.logprobs));
    return ws.DownloadTo(tokens, 2, res.tokens);
  }
  if (out.out == LogitsOut::kSample) {
    RETURN_IF_ERROR(DrawTokens(ws, logits, rows, *out.sample, tokens));
  } else {
    RETURN_IF_ERROR(backend_.Argmax(logits, rows, V, tokens));
  }
  if (out.top_logprobs >= 0) {
    // The tokens come down with the logprobs.
    RETURN_IF_ERROR(LogprobsToHost(ws, raw, rows, tokens, out.top_logprobs, res.logprobs));
    res.tokens.clear();
    for (const Logprobs& lp : res.logprobs) res.tokens.push_back(lp.chosen.token);
    return absl::OkStatus();
  }
  return ws.DownloadTo(tokens, rows, res.tokens);
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

vector<int64_t> Model::OutputGroupOrder(int64_t rows) const {
  const int64_t G = config_.o_groups;
  vector<int64_t> order(rows * G);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < rows; ++i) order[g * rows + i] = i * G + g;
  }
  return order;
}

absl::Status Model::StageKv(Scratch& ws, int L, const float* main_x, int64_t rows,
                            const int64_t* pos_dev, float* kv) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = weights_->layers[L].attn;
  const int64_t hd = c.head_dim;
  RETURN_IF_ERROR(backend_.LinearQuant(main_x, rows, A.wkv, kv));
  RETURN_IF_ERROR(backend_.RmsNorm(kv, A.kv_norm.data(), rows, hd, c.norm_eps, kv));
  RETURN_IF_ERROR(
      RopeRows(ws, L, kv, rows, 1, static_cast<int>(hd), c.nope_head_dim(), pos_dev, false));
  return backend_.QuantDequant(kernels::Backend::Qdq::kFp8Window, kv, rows, hd);
}

absl::Status Model::DSparkSeed(SequenceState& state, const float* main_hidden, int64_t rows,
                               int64_t start_pos) const {
  const DSparkWeights& Dw = *weights_->dspark;
  Scratch ws(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(const float* mh, ws.Copy(main_hidden, rows * Dw.main_proj.in));
  return DSparkSeedFrom(ws, state, mh, rows, start_pos);
}

absl::Status Model::DSparkSeedFrom(Scratch& outer, SequenceState& state, const float* mh,
                                   int64_t rows, int64_t start_pos) const {
  const ModelConfig& c = config_;
  const int64_t hd = c.head_dim;
  Scratch ws(backend_, scratch_pool_.get(), &outer);
  ASSIGN_OR_RETURN(float* kv, ws.Alloc<float>(c.n_mtp_layers * rows * hd));
  vector<int64_t> pos(rows);
  for (int64_t i = 0; i < rows; ++i) pos[i] = start_pos + i;
  ASSIGN_OR_RETURN(const int64_t* pos_dev, ws.Copy(pos));
  RETURN_IF_ERROR(DSparkSeedRows(ws, mh, rows, pos_dev, kv));
  for (int s = 0; s < c.n_mtp_layers; ++s) {
    RETURN_IF_ERROR(
        state.swa[c.n_layers + s].WritePositionsFrom(start_pos, rows, kv + s * rows * hd));
  }
  return absl::OkStatus();
}

absl::Status Model::DSparkSeedRows(Scratch& outer, const float* mh, int64_t rows,
                                   const int64_t* positions, float* kv) const {
  const ModelConfig& c = config_;
  const DSparkWeights& Dw = *weights_->dspark;
  const int64_t D = c.dim;
  Scratch ws(backend_, outer.pool(), &outer);
  ASSIGN_OR_RETURN(float* mx, ws.Alloc<float>(rows * D));
  RETURN_IF_ERROR(backend_.LinearQuant(mh, rows, Dw.main_proj, mx));
  RETURN_IF_ERROR(backend_.RmsNorm(mx, Dw.main_norm.data(), rows, D, c.norm_eps, mx));
  for (int s = 0; s < c.n_mtp_layers; ++s) {
    RETURN_IF_ERROR(StageKv(ws, c.n_layers + s, mx, rows, positions, kv + s * rows * c.head_dim));
  }
  return absl::OkStatus();
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

absl::StatusOr<DraftResult> Model::Draft(SequenceState& state, int32_t last_token,
                                         std::span<const int32_t> forced_ids, LogitsOut lo,
                                         const LogitPenalties* penalties,
                                         const SampleRequest* sample) const {
  const ModelConfig& c = config_;
  if (lo == LogitsOut::kVerify)
    return absl::InvalidArgumentError("model: a draft pass returns its ids or its logits");
  if (penalties != nullptr && lo == LogitsOut::kValues)
    return absl::InvalidArgumentError(
        "model: a draft pass applies penalties to its argmax or draws only");
  if (lo == LogitsOut::kSample) {
    RETURN_IF_ERROR(
        LogitsRequestProblem(LogitsRequest(lo, penalties, sample), c.dspark_block_size));
  }
  if (penalties != nullptr) {
    RETURN_IF_ERROR(LogitsRequestProblem(LogitsRequest(LogitsOut::kArgmax, penalties), 1));
    for (int64_t a : penalties->at) {
      if (a < 0 || a >= c.vocab_size)
        return absl::InvalidArgumentError(
            absl::StrCat("model: draft penalty entry ", a, " is outside one vocabulary row"));
    }
  }
  if (c.n_mtp_layers == 0 || !weights_->dspark)
    return absl::FailedPreconditionError("model: no DSpark stages");
  if (state.main_hidden_pos < 0)
    return absl::FailedPreconditionError("model: Draft before any forward");
  if (last_token < 0 || last_token >= c.vocab_size)
    return absl::InvalidArgumentError("model: bad draft token");
  const DSparkWeights& Dw = *weights_->dspark;
  const int64_t B = c.dspark_block_size, D = c.dim, hc = c.hc_mult, V = c.vocab_size,
                hd = c.head_dim;
  const int64_t H = c.n_heads, W = c.window_size, nope = c.nope_head_dim();
  const int64_t pos = state.main_hidden_pos;
  Scratch ws(backend_, scratch_pool_.get());
  vector<int32_t> block(B, static_cast<int32_t>(c.dspark_noise_token_id));
  block[0] = last_token;
  float* h = nullptr;
  float* pre = nullptr;
  RETURN_IF_ERROR(EmbedRows(ws, block, &h, &pre));
  vector<int64_t> qpos(B);
  for (int64_t i = 0; i < B; ++i) qpos[i] = pos + 1 + i;
  ASSIGN_OR_RETURN(const int64_t* qpos_dev, ws.Copy(qpos));
  HcMix m;
  RETURN_IF_ERROR(m.Allocate(ws, B, hc));
  ASSIGN_OR_RETURN(float* x, ws.Alloc<float>(B * D));
  ASSIGN_OR_RETURN(float* y, ws.Alloc<float>(B * D));
  ASSIGN_OR_RETURN(float* qr, ws.Alloc<float>(B * c.q_lora_rank));
  ASSIGN_OR_RETURN(float* q, ws.Alloc<float>(B * H * hd));
  ASSIGN_OR_RETURN(float* kv_all, ws.Alloc<float>((W + B) * hd));
  ASSIGN_OR_RETURN(float* o, ws.Alloc<float>(B * H * hd));
  for (int s = 0; s < c.n_mtp_layers; ++s) {
    const int L = c.n_layers + s;
    const LayerWeights& LW = weights_->layers[L];
    const AttentionWeights& A = LW.attn;
    RETURN_IF_ERROR(HcBeforeAttention(LW, /*single_token=*/false, B, h, pre, m, x));
    RETURN_IF_ERROR(backend_.RmsNorm(x, LW.attn_norm.data(), B, D, c.norm_eps, x));
    // DSpark attention: ring slots (slot order) + all draft rows, no causal mask.
    RETURN_IF_ERROR(QueryProjection(ws, L, x, B, qpos_dev, qr, q));
    RETURN_IF_ERROR(state.swa[L].ReadWindowTo(kv_all));
    RETURN_IF_ERROR(StageKv(ws, L, x, B, qpos_dev, kv_all + W * hd));
    const int64_t nring = std::min(W - 1, pos) + 1;
    const int64_t list_len = nring + B;
    vector<int32_t> idx(B * list_len);
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t j = 0; j < nring; ++j) idx[i * list_len + j] = static_cast<int32_t>(j);
      for (int64_t j = 0; j < B; ++j) idx[i * list_len + nring + j] = static_cast<int32_t>(W + j);
    }
    ASSIGN_OR_RETURN(const int32_t* idx_dev, ws.Copy(idx));
    kernels::SparseAttentionArgs args = LayerAttentionArgs(L, B, list_len);
    args.q = q;
    args.kv = kv_all;
    args.idx = idx_dev;
    args.out = o;
    RETURN_IF_ERROR(backend_.SparseAttention(args));
    RETURN_IF_ERROR(RopeRows(ws, L, o, B, static_cast<int>(H), static_cast<int>(hd),
                             static_cast<int>(nope), qpos_dev, true));
    RETURN_IF_ERROR(OutputProjection(ws, A, o, B, y));
    RETURN_IF_ERROR(HcBeforeFfn(LW, /*single_token=*/false, B, y, h, pre, m, x));
    RETURN_IF_ERROR(backend_.RmsNorm(x, LW.ffn_norm.data(), B, D, c.norm_eps, x));
    RETURN_IF_ERROR(Moe(L, x, B, y));
    RETURN_IF_ERROR(HcAfterFfn(B, y, h, m));
  }
  ASSIGN_OR_RETURN(float* xn, ws.Alloc<float>(B * D));
  for (int64_t i = 0; i < B; ++i) {
    RETURN_IF_ERROR(
        backend_.HcPre(1, h + i * hc * D, static_cast<int>(hc), D, pre + i * hc, x + i * D));
  }
  RETURN_IF_ERROR(backend_.RmsNorm(x, Dw.norm.data(), B, D, c.norm_eps, xn));
  ASSIGN_OR_RETURN(float* logits, ws.Alloc<float>(B * V));
  RETURN_IF_ERROR(backend_.LinearF32(xn, B, weights_->head.plain(), V, D, logits));
  // The Markov chain runs on the backend: chain[i] is the token before draft position i (the
  // input token, then each position's argmax or draw, or the forced id), and position i's Markov
  // embedding row is gathered by it (Embed with hc 1: a row copy), so no draft id comes down
  // until the end (one Download for the ids, one for the confidences).
  const int64_t R = c.dspark_markov_rank;
  const int64_t forced = std::min<int64_t>(static_cast<int64_t>(forced_ids.size()), B);
  vector<int32_t> chain_host(B + 1, 0);
  chain_host[0] = last_token;
  for (int64_t i = 0; i < forced; ++i) {
    if (forced_ids[i] < 0 || forced_ids[i] >= c.vocab_size)
      return absl::InvalidArgumentError(
          absl::StrCat("model: forced draft id ", forced_ids[i], " is outside the vocabulary"));
    chain_host[i + 1] = forced_ids[i];
  }
  ASSIGN_OR_RETURN(int32_t * chain, ws.Copy(chain_host));
  ASSIGN_OR_RETURN(int32_t * best, ws.Alloc<int32_t>(1));  // a forced position's own argmax
  ASSIGN_OR_RETURN(float* bias, ws.Alloc<float>(V));
  ASSIGN_OR_RETURN(float* cat, ws.Alloc<float>(D + R));  // [x_i, markov_embed[chain[i]]]
  ASSIGN_OR_RETURN(float* confidence, ws.Alloc<float>(B));
  // A drawn chain: each position's uniform, and its distribution kept for the verification.
  DraftResult out;
  const double* u = nullptr;
  float* dist = nullptr;
  if (lo == LogitsOut::kSample) {
    ASSIGN_OR_RETURN(u, ws.Copy(sample->uniforms));
    // From the scratch pool (a device allocation synchronizes the device), given back when the
    // last holder lets go of it.
    ASSIGN_OR_RETURN(kernels::Buffer qb,
                     scratch_pool_->Take(B * V * static_cast<int64_t>(sizeof(float))));
    ScratchPool* pool = scratch_pool_.get();
    out.q = std::shared_ptr<kernels::Buffer>(new kernels::Buffer(std::move(qb)),
                                             [pool](kernels::Buffer* b) {
                                               pool->Give(std::move(*b));
                                               delete b;
                                             });
    dist = static_cast<float*>(out.q->data());
  }
  const int64_t* pen_at = nullptr;  // the penalties' entries, uploaded once for every position
  const int32_t* pen_counts = nullptr;
  const bool penalize = penalties != nullptr && !penalties->at.empty();
  if (penalize) {
    ASSIGN_OR_RETURN(pen_at, ws.Copy(penalties->at));
    ASSIGN_OR_RETURN(pen_counts, ws.Copy(penalties->counts));
  }
  for (int64_t i = 0; i < B; ++i) {
    RETURN_IF_ERROR(backend_.Embed(Dw.markov_embed.plain(), R, chain + i, 1, 1, cat + D));
    RETURN_IF_ERROR(backend_.LinearF32(cat + D, 1, Dw.markov_head.plain(), V, R, bias));
    float* li = logits + i * V;
    RETURN_IF_ERROR(backend_.Add(li, bias, V));
    if (penalize) {
      RETURN_IF_ERROR(backend_.PenalizeLogits(
          li, V, pen_at, pen_counts, static_cast<int64_t>(penalties->at.size()),
          penalties->repetition, penalties->frequency, penalties->presence));
    }
    int32_t* next = i < forced ? best : chain + i + 1;
    if (lo == LogitsOut::kSample) {
      RETURN_IF_ERROR(backend_.SampleLogits(li, 1, V, sample->params, u + i, next, dist + i * V));
    } else {
      RETURN_IF_ERROR(backend_.Argmax(li, 1, V, next));
    }
    RETURN_IF_ERROR(backend_.Copy(cat, x + i * D, D * static_cast<int64_t>(sizeof(float))));
    RETURN_IF_ERROR(backend_.LinearF32(cat, 1, Dw.confidence.plain(), 1, D + R, confidence + i));
  }
  ASSIGN_OR_RETURN(out.ids, ws.ToHost(chain, B + 1));
  if (lo == LogitsOut::kValues) {
    ASSIGN_OR_RETURN(out.logits, ws.ToHost(logits, B * V));
  }
  ASSIGN_OR_RETURN(out.confidence, ws.ToHost(confidence, B));
  return out;
}

}  // namespace epd::model
