// The attention path of the forward (MODEL.md §3 steps 4-8; docs/model.md): RoPE; the KV
// sources' compressors (projections, pooling of a ratio > 1 source's groups, the entries' norm,
// RoPE and FP4 qdq, their index keys, appended to the pool's streams); the indexer (queries, key
// scores, candidate masks and top-k, reading the reference's stale index keys: DecodeKeySource,
// IndexRowKeys); the window KV rows (StageKv, of every layer, the DSpark stages' too); and
// Attention itself: each row's list (window part, then top-k part), the sparse attention over it,
// the inverse RoPE and the grouped output projection. The batched decode step runs the same
// pieces for many sequences at once (model/decode_step.cc: StepAttention, StepCompress,
// StepIndexer).
#include <algorithm>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/model.h"
#include "model/scratch.h"

namespace epd::model {
namespace {

using std::vector;

}  // namespace

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

// What Attention's steps share: the call's rows and their queries, where the window part of the
// lists reads its KV, and the layer's compressed entries with how the top-k and lists are kept.
struct Model::AttentionPass {
  struct Rows {
    int64_t n = 0;
    std::span<const int64_t> pos;      // [n] the rows' positions (host)
    const int64_t* pos_dev = nullptr;  // the same in backend memory (the call's)
    const float* qr = nullptr;         // [n, q_lora_rank] after q_norm
    const float* q = nullptr;          // [n, heads, head_dim] after RoPE
  } rows;
  struct Window {
    StepKv* step = nullptr;               // a batched step's shared attention (AttentionRows::step)
    const float* kv_all = nullptr;        // the window KV
    int64_t win_rows = 0;                 // its rows: list entries from here on are compressed ones
    int64_t ring_base = 0, new_base = 0;  // where kv_all holds the ring's slots and the call's rows
  } window;
  struct Entries {
    bool device_lists = false;  // the lists are made on the backend (few rows)
    bool whole_source = false;  // a larger call's top-k is kept on the backend too
    bool device_topk = false;   // the top-k stays on the backend (either of the two)
    int64_t nk = 0;             // the layer's compressed entries (LayerKeyCount)
    const SequenceState::Source* src = nullptr;  // their KV source (compressed layers)
  } entries;
};

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
  }
  const AttentionPass p{.rows = {S, pos, pos_dev, qr, q},
                        .window = {step, kv_all, win_rows, ring_base, new_base},
                        .entries = {device_lists, whole_source, device_topk, nk, src}};
  if (ratio > 0 && role.is_index_source && !(given != nullptr && given->indexed))
    RETURN_IF_ERROR(IndexerTopK(ws, l, x, call, state, given, p, trace));
  return AttentionOverLists(ws, l, call, given, p, out);
}

absl::Status Model::IndexerTopK(Scratch& ws, int l, const float* x, Call& call,
                                const SequenceState& state, const AttentionRows* given,
                                const AttentionPass& p, ForwardTrace* trace) const {
  const ModelConfig& c = config_;
  const LayerRole& role = roles_[l];
  const int ratio = role.compress_ratio;
  const int64_t S = p.rows.n, nk = p.entries.nk, win_rows = p.window.win_rows;
  const std::span<const int64_t> pos = p.rows.pos;
  const int64_t* pos_dev = p.rows.pos_dev;
  const float* qr = p.rows.qr;
  const bool device_topk = p.entries.device_topk;

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
          RETURN_IF_ERROR(backend_.CandidateMaskRows(score, n, nk, c.candidate_block_size,
                                                     visible_dev + r0, nullptr,
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
                                  static_cast<int>(nI), scored[i], most_scored[keysrc[i]], score,
                                  unpacked_keys));
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
  return absl::OkStatus();
}

absl::Status Model::AttentionOverLists(Scratch& ws, int l, Call& call, const AttentionRows* given,
                                       const AttentionPass& p, float* out) const {
  const ModelConfig& c = config_;
  const int64_t S = p.rows.n, hd = c.head_dim, H = c.n_heads, W = c.window_size;
  const int ratio = roles_[l].compress_ratio;
  const int64_t* pos_dev = p.rows.pos_dev;
  const float* q = p.rows.q;
  StepKv* step = p.window.step;
  const float* kv_all = p.window.kv_all;
  const int64_t win_rows = p.window.win_rows;
  const int64_t ring_base = p.window.ring_base, new_base = p.window.new_base;
  const bool device_lists = p.entries.device_lists, whole_source = p.entries.whole_source;
  const bool device_topk = p.entries.device_topk;
  const int64_t nk = p.entries.nk;
  const SequenceState::Source* src = p.entries.src;

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
  const float wscale = c.index_weight_scale();  // bf16(c), as the reference
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

}  // namespace epd::model
