// The batched decode step (Model::ExtendBatch) and its graphs (model/step_graph.h; docs/cuda.md,
// "Decode step graphs").
#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/model.h"
#include "model/scratch.h"
#include "model/step_graph.h"

namespace epd::model {
namespace {

using std::vector;

// Several streams' blocks in one page table, so that one PackRows writes rows of many
// sequences (Model::StepAppend): each block as rows_per_block / page_rows pages of page_rows rows,
// page_rows the greatest common divisor of the streams' rows per block (the pages are addresses:
// any such split writes the same bytes).
struct JoinedPages {
  kernels::RowCodec codec = kernels::RowCodec::kF32;
  int64_t dim = 0, row_bytes = 0, page_rows = 0;
  vector<uint8_t*> pages;

  // The layout of `streams`; false when their codecs or dims differ.
  bool Layout(std::span<const KvRows* const> streams) {
    for (const KvRows* s : streams) {
      const kernels::RowCodec sc = KvRowCodec(s->format());
      if (page_rows == 0) {
        codec = sc;
        dim = s->dim();
        row_bytes = s->row_bytes();
        page_rows = s->rows_per_block();
      } else if (sc != codec || s->dim() != dim) {
        return false;
      } else {
        page_rows = std::gcd(page_rows, s->rows_per_block());
      }
    }
    return page_rows > 0;
  }
  // Appends s's blocks from its block holding row `row` on; returns where `row` is in the table.
  int64_t Append(const KvRows& s, int64_t row) {
    const auto first = static_cast<int64_t>(pages.size()) * page_rows;
    const int64_t rpb = s.rows_per_block();
    for (size_t b = static_cast<size_t>(row / rpb); b < s.blocks().size(); ++b) {
      for (int64_t p = 0; p < rpb; p += page_rows)
        pages.push_back(s.blocks()[b].data + p * row_bytes);
    }
    return first + row % rpb;
  }
};

}  // namespace

// ---- StepGraphCache ----

StepGraphCache::Set::Set(kernels::Backend& backend, int64_t r)
    : rows(r), arena(std::make_unique<ScratchPool>(backend, std::numeric_limits<int64_t>::max())) {}

StepGraphCache::Set::~Set() {
  segments.clear();  // the graphs first: they hold the arrays' and the arena's pointers
  held.reset();
}

StepGraphCache::Set* StepGraphCache::Get(int64_t rows) {
  if (rows <= 0 || rows > max_rows_ || max_sets_ <= 0) return nullptr;
  auto it = sets_.find(rows);
  if (it == sets_.end()) {
    if (static_cast<int>(sets_.size()) >= max_sets_) {
      auto oldest = std::min_element(sets_.begin(), sets_.end(), [](const auto& a, const auto& b) {
        return a.second->last_used < b.second->last_used;
      });
      sets_.erase(oldest);
      ++stats_.evicted;
    }
    it = sets_.emplace(rows, std::make_unique<Set>(backend_, rows)).first;
  }
  it->second->last_used = ++clock_;
  stats_.sets = static_cast<int64_t>(sets_.size());
  return it->second.get();
}

StepGraphStats Model::step_graph_stats() const {
  if (step_graphs_ == nullptr) return {};
  std::lock_guard<std::mutex> lock(step_graphs_->mu());
  return step_graphs_->stats();
}

// ---- The step's arrays and segments ----

namespace {

// The step's inputs lie in one packed array (Scratch::PackingOf), so ExtendBatch uploads them in
// one Scratch::UploadPacked: token ids (int32) and positions (int64) of its rows, then `engram`
// Engram hash ids (int64; may be 0).
Scratch::Packing<3> InputPacking(int64_t rows, int64_t engram) {
  return Scratch::PackingOf<3>({rows * static_cast<int64_t>(sizeof(int32_t)),
                                rows * static_cast<int64_t>(sizeof(int64_t)),
                                engram * static_cast<int64_t>(sizeof(int64_t))});
}

}  // namespace

absl::Status Model::AllocateStepArrays(Scratch& ws, int64_t R, StepArrays& a) const {
  const ModelConfig& c = config_;
  const int64_t D = c.dim, hc = c.hc_mult, H = c.n_heads, hd = c.head_dim;
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  const int64_t nel = static_cast<int64_t>(c.engram_layer_ids.size());
  const int64_t per = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  a = StepArrays{};
  a.rows = R;
  const Scratch::Packing<3> in = InputPacking(R, nel * R * per);
  ASSIGN_OR_RETURN(uint8_t * inputs, ws.Alloc<uint8_t>(in.bytes));
  a.ids = reinterpret_cast<int32_t*>(inputs + in.at[0]);
  a.pos = reinterpret_cast<int64_t*>(inputs + in.at[1]);
  a.engram_ids = reinterpret_cast<int64_t*>(inputs + in.at[2]);
  ASSIGN_OR_RETURN(a.h, ws.Alloc<float>(R * hc * D));
  ASSIGN_OR_RETURN(a.pre, ws.Alloc<float>(R * hc));
  ASSIGN_OR_RETURN(a.main_hidden, ws.Filled<float>(std::max<int64_t>(1, R * nt * D), 0.f));
  ASSIGN_OR_RETURN(a.x, ws.Alloc<float>(R * D));
  ASSIGN_OR_RETURN(a.y, ws.Alloc<float>(R * D));
  ASSIGN_OR_RETURN(a.qr, ws.Alloc<float>(R * c.q_lora_rank));
  ASSIGN_OR_RETURN(a.q, ws.Alloc<float>(R * H * hd));
  ASSIGN_OR_RETURN(a.kv, ws.Alloc<float>(R * hd));
  ASSIGN_OR_RETURN(a.qi, ws.Alloc<float>(R * c.index_n_heads * c.index_head_dim));
  ASSIGN_OR_RETURN(a.w, ws.Alloc<float>(R * c.index_n_heads));
  ASSIGN_OR_RETURN(a.o, ws.Alloc<float>(R * H * hd));
  ASSIGN_OR_RETURN(a.cmp_kv, ws.Alloc<float>(R * hd));
  ASSIGN_OR_RETURN(a.cmp_score, ws.Alloc<float>(R * hd));
  ASSIGN_OR_RETURN(a.mtp_kv, ws.Alloc<float>(std::max(1, c.n_mtp_layers) * R * hd));
  ASSIGN_OR_RETURN(a.logits, ws.Alloc<float>(R * c.vocab_size));
  RETURN_IF_ERROR(a.mix.Allocate(ws, R, hc));
  ASSIGN_OR_RETURN(a.pre0, ws.Copy(FirstPreMix(R)));
  ASSIGN_OR_RETURN(a.o_order, ws.Copy(OutputGroupOrder(R)));
  return absl::OkStatus();
}

absl::Status Model::StepSegment(Scratch& outer, int s, const StepArrays& a) const {
  const ModelConfig& c = config_;
  const int64_t R = a.rows, D = c.dim, hc = c.hc_mult;
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  const int64_t per = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  Scratch ws(backend_, outer.pool(), &outer);
  HcMix m = a.mix;  // the step's arrays (HcBefore* take the mixes by non-const reference)
  if (s == 0) {
    RETURN_IF_ERROR(
        backend_.Embed(weights_->embed.plain(), D, a.ids, R, static_cast<int>(hc), a.h));
    RETURN_IF_ERROR(backend_.Copy(a.pre, a.pre0, R * hc * static_cast<int64_t>(sizeof(float))));
  } else {
    // The rest of layer s - 1 after its attention (Block's order). Decode-step rows are
    // single-token reference calls (Backend::HcMixesSingleToken).
    const int l = s - 1;
    const LayerWeights& L = weights_->layers[l];
    RETURN_IF_ERROR(FinishAttention(ws, l, a.o, R, a.pos, a.y, a.o_order));
    RETURN_IF_ERROR(HcBeforeFfn(L, /*single_token=*/true, R, a.y, a.h, a.pre, m, a.x));
    RETURN_IF_ERROR(backend_.RmsNorm(a.x, L.ffn_norm.data(), R, D, c.norm_eps, a.x));
    RETURN_IF_ERROR(Moe(ws, l, a.x, R, a.y, nullptr));
    RETURN_IF_ERROR(HcAfterFfn(R, a.y, a.h, m));
  }
  if (s == c.n_layers) {
    if (c.n_mtp_layers > 0)  // the DSpark layers' window rows (DSparkSeedFrom's)
      RETURN_IF_ERROR(DSparkSeedRows(ws, a.main_hidden, R, a.pos, a.mtp_kv));
    return HeadLogits(ws, DeviceResidual{a.h, a.pre}, R, /*all_logits=*/true, nullptr, a.logits)
        .status();
  }
  // Layer s up to its attention.
  const int l = s;
  const LayerRole& role = roles_[l];
  const LayerWeights& L = weights_->layers[l];
  if (role.has_engram) {
    const int64_t li = std::find(c.engram_layer_ids.begin(), c.engram_layer_ids.end(), l) -
                       c.engram_layer_ids.begin();
    RETURN_IF_ERROR(EngramFromIds(ws, l, a.engram_ids + li * R * per, R, a.h,
                                  /*single_token_calls=*/true));
  }
  if (role.is_dspark_target) {
    const int64_t ti =
        std::find(c.dspark_target_layer_ids.begin(), c.dspark_target_layer_ids.end(), l) -
        c.dspark_target_layer_ids.begin();
    RETURN_IF_ERROR(
        backend_.HcMean(R, a.h, static_cast<int>(hc), D, a.main_hidden + ti * D, nt * D));
  }
  RETURN_IF_ERROR(HcBeforeAttention(L, /*single_token=*/true, R, a.h, a.pre, m, a.x));
  RETURN_IF_ERROR(backend_.RmsNorm(a.x, L.attn_norm.data(), R, D, c.norm_eps, a.x));
  // The attention's row-independent projections, once for every row (Model::AttentionRows).
  RETURN_IF_ERROR(QueryProjection(ws, l, a.x, R, a.pos, a.qr, a.q));
  RETURN_IF_ERROR(StageKv(ws, l, a.x, R, a.pos, a.kv));
  if (role.compress_ratio > 0 && role.is_index_source) {
    RETURN_IF_ERROR(IndexQueries(ws, l, a.x, a.qr, R, a.pos, a.qi, a.w));
  }
  // A KV source's compressor projections (Model::Compress's first ops; StepCompress the rest).
  if (role.compress_ratio > 0 && role.is_kv_source)
    return CompressorProjections(l, a.x, R, a.cmp_kv, a.cmp_score);
  return absl::OkStatus();
}

absl::Status Model::PoolSingleRows(Scratch& ws, int l, const StepArrays& a,
                                   std::span<StepSequence> seqs, float* latents,
                                   vector<int64_t>& gpos, const int64_t** gpos_dev,
                                   vector<int64_t>& first, vector<int64_t>& count) const {
  const int64_t hd = config_.head_dim, B = static_cast<int64_t>(seqs.size());
  const int ratio = roles_[l].compress_ratio;
  // What PoolGroups does for one row at position p: the row into the log (when it logs p) and
  // into the tail's slot p % ratio; when p ends a group, the tail pooled. Here every sequence's
  // row goes to its four destinations in four PackRows (a kF32 stream of one-row pages: the
  // destinations), and the tails of the groups that end are gathered (UnpackRows, a page per
  // tail) and pooled in one CompressPool.
  constexpr kernels::RowCodec kCodec = kernels::RowCodec::kF32;
  vector<uint8_t*> dst(4 * B, nullptr);  // [log kv | log score | tail kv | tail score]
  vector<uint8_t*> groups;               // [tail kv of each group | tail score of each]
  vector<uint8_t*> group_scores;
  float* spare = nullptr;  // rows of the sequences that fail (nothing reads them)
  auto bytes = [](float* f) { return reinterpret_cast<uint8_t*>(f); };
  for (int64_t b = 0; b < B; ++b) {
    StepSequence& q = seqs[b];
    const int64_t p = q.call->start_pos;
    SequenceState::Source& src = q.state->sources[l];
    if (q.status->ok()) {
      *q.status = [&]() -> absl::Status {
        const bool logs = CompressorLog::LogsPosition(p, p, src.ratio, q.state->cut_block_tokens);
        ASSIGN_OR_RETURN(src.log,
                         CompressorLog::Make(backend_, hd, logs ? 1 : 0, std::move(src.log)));
        if (logs) {
          ASSIGN_OR_RETURN(auto row, src.log->ClaimRow(p));
          dst[b] = bytes(row.first);
          dst[B + b] = bytes(row.second);
        }
        ASSIGN_OR_RETURN(auto slot, src.tail.WritableSlot(p % ratio));
        dst[2 * B + b] = bytes(slot.first);
        dst[3 * B + b] = bytes(slot.second);
        if ((p + 1) % ratio == 0) {  // the tail's [ratio, dim] arrays begin `slot` rows before
          groups.push_back(bytes(slot.first - (p % ratio) * hd));
          group_scores.push_back(bytes(slot.second - (p % ratio) * hd));
          first[b] = static_cast<int64_t>(gpos.size());
          count[b] = 1;
          gpos.push_back(p + 1 - ratio);
        }
        return absl::OkStatus();
      }();
    }
    for (int64_t k = 0; k < 4; ++k) {
      if (dst[k * B + b] != nullptr) continue;
      if (spare == nullptr) {
        ASSIGN_OR_RETURN(spare, ws.Alloc<float>(4 * B * hd));
      }
      dst[k * B + b] = bytes(spare + (k * B + b) * hd);
    }
  }
  const int64_t E = static_cast<int64_t>(groups.size());
  groups.insert(groups.end(), group_scores.begin(), group_scores.end());
  // The destinations, the tails and the groups' positions, in one upload.
  ASSIGN_OR_RETURN(const auto up, ws.CopyAll(dst, groups, gpos));
  uint8_t* const* pages = std::get<0>(up);
  uint8_t* const* tails = std::get<1>(up);
  *gpos_dev = std::get<2>(up);
  for (int64_t k = 0; k < 4; ++k) {
    const float* rows = k % 2 == 0 ? a.cmp_kv : a.cmp_score;
    RETURN_IF_ERROR(backend_.PackRows(kCodec, rows, B, hd, pages + k * B, 1, nullptr, 0));
  }
  if (E == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(float* kv, ws.Alloc<float>(2 * E * ratio * hd));
  float* score = kv + E * ratio * hd;
  RETURN_IF_ERROR(backend_.UnpackRows(kCodec, tails, ratio, hd, nullptr, 0, E * ratio, kv));
  RETURN_IF_ERROR(backend_.UnpackRows(kCodec, tails + E, ratio, hd, nullptr, 0, E * ratio, score));
  return backend_.CompressPool(kv, score, E, ratio, hd, latents);
}

absl::Status Model::StepCompress(Scratch& ws, int l, const StepArrays& a,
                                 std::span<StepSequence> seqs) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = weights_->layers[l].attn;
  const int64_t hd = c.head_dim, B = static_cast<int64_t>(seqs.size());
  const int ratio = roles_[l].compress_ratio;
  // Each sequence's entries: latents rows [first[b], first[b] + count[b]).
  vector<int64_t> first(B, 0), count(B, 0);
  float* latents = nullptr;
  const int64_t* gpos_dev = nullptr;
  int64_t ne = 0;
  if (ratio == 1) {  // every row is an entry (its projection normed in the segment)
    latents = a.cmp_kv;
    gpos_dev = a.pos;
    ne = a.rows;
    for (int64_t b = 0; b < B; ++b) {
      first[b] = seqs[b].row0;
      count[b] = seqs[b].call->rows;
    }
  } else {
    ASSIGN_OR_RETURN(latents, ws.Alloc<float>(a.rows * hd));  // a group per row at most
    vector<int64_t> gpos;
    const int64_t* gpos_up = nullptr;  // gpos in backend memory, when PoolSingleRows put it there
    const bool one_row_each = std::all_of(seqs.begin(), seqs.end(),
                                          [](const StepSequence& q) { return q.call->rows == 1; });
    if (one_row_each) {
      RETURN_IF_ERROR(PoolSingleRows(ws, l, a, seqs, latents, gpos, &gpos_up, first, count));
    } else {
      for (int64_t b = 0; b < B; ++b) {
        StepSequence& q = seqs[b];
        if (!q.status->ok()) continue;
        vector<int64_t> pos(q.call->rows);
        for (int64_t i = 0; i < q.call->rows; ++i) pos[i] = q.call->start_pos + i;
        first[b] = static_cast<int64_t>(gpos.size());
        *q.status =
            PoolGroups(ws, q.state->sources[l], q.state->cut_block_tokens, a.cmp_kv + q.row0 * hd,
                       a.cmp_score + q.row0 * hd, pos, latents + first[b] * hd, gpos);
        if (!q.status->ok()) gpos.resize(first[b]);
        count[b] = static_cast<int64_t>(gpos.size()) - first[b];
      }
    }
    ne = static_cast<int64_t>(gpos.size());
    if (ne == 0) return absl::OkStatus();
    RETURN_IF_ERROR(backend_.RmsNorm(latents, A.cmp_norm.data(), ne, hd, c.norm_eps, latents));
    if (gpos_up != nullptr) {
      gpos_dev = gpos_up;
    } else {
      ASSIGN_OR_RETURN(gpos_dev, ws.Copy(gpos));
    }
  }
  ASSIGN_OR_RETURN(float* keys, ws.Alloc<float>(ne * c.index_head_dim));
  RETURN_IF_ERROR(FinishLatents(ws, l, latents, ne, gpos_dev, keys));
  return StepAppend(l, latents, keys, first, count, seqs);
}

absl::Status Model::StepAppend(int l, const float* latents, const float* keys,
                               const vector<int64_t>& first, const vector<int64_t>& count,
                               std::span<StepSequence> seqs) const {
  const int64_t hd = config_.head_dim, ihd = config_.index_head_dim;
  const auto B = static_cast<int64_t>(seqs.size());
  vector<const KvRows*> kv_streams, key_streams;
  for (int64_t b = 0; b < B; ++b) {
    if (!seqs[b].status->ok() || count[b] == 0) continue;
    const SequenceState::Source& s = seqs[b].state->sources[l];
    kv_streams.push_back(&s.kv);
    key_streams.push_back(&s.keys);
  }
  if (kv_streams.empty()) return absl::OkStatus();
  JoinedPages kvs, ks;
  if (!kvs.Layout(kv_streams) || !ks.Layout(key_streams)) {  // each sequence on its own
    for (int64_t b = 0; b < B; ++b) {
      StepSequence& q = seqs[b];
      if (!q.status->ok() || count[b] == 0) continue;
      *q.status =
          AppendLatents(l, *q.state, latents + first[b] * hd, keys + first[b] * ihd, count[b]);
    }
    return absl::OkStatus();
  }
  // Every block the entries touch, reserved first (a sequence whose pool is full fails alone,
  // appending nothing), then each entry's row in the joined tables: one PackRows per stream kind
  // for each run of sequences whose entries are consecutive in `latents`.
  vector<char> in(seqs.size(), 0);
  vector<int32_t> kv_rows, key_rows;
  for (int64_t b = 0; b < B; ++b) {
    StepSequence& q = seqs[b];
    if (!q.status->ok() || count[b] == 0) continue;
    SequenceState::Source& s = q.state->sources[l];
    absl::Status st = s.kv.Reserve(count[b]);
    if (st.ok()) {
      st = s.keys.Reserve(count[b]);
      if (!st.ok()) s.kv.Truncate(s.kv.rows());
    }
    if (!st.ok()) {
      *q.status = st;
      continue;
    }
    in[b] = 1;
    // Only the blocks the entries go to (those Reserve holds).
    const int64_t kv0 = kvs.Append(s.kv, s.kv.rows()), key0 = ks.Append(s.keys, s.keys.rows());
    for (int64_t j = 0; j < count[b]; ++j) {
      kv_rows.push_back(static_cast<int32_t>(kv0 + j));
      key_rows.push_back(static_cast<int32_t>(key0 + j));
    }
  }
  if (kv_rows.empty()) return absl::OkStatus();
  const auto n = static_cast<int64_t>(kv_rows.size());
  vector<int32_t> rows = std::move(kv_rows);
  rows.insert(rows.end(), key_rows.begin(), key_rows.end());
  vector<uint8_t*> tables = kvs.pages;
  tables.insert(tables.end(), ks.pages.begin(), ks.pages.end());
  Scratch local(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(const auto up, local.CopyAll(rows, tables));  // one upload for the layer
  const int32_t* rows_dev = std::get<0>(up);
  uint8_t* const* tables_dev = std::get<1>(up);
  uint8_t* const* kv_pages = tables_dev;
  uint8_t* const* key_pages = tables_dev + kvs.pages.size();
  absl::Status packed = absl::OkStatus();
  for (int64_t b0 = 0, at = 0; b0 < B && packed.ok();) {  // at: the run's first entry in rows
    if (!in[b0]) {
      ++b0;
      continue;
    }
    int64_t b1 = b0 + 1, m = count[b0];
    for (; b1 < B && (in[b1] || count[b1] == 0 || !seqs[b1].status->ok()); ++b1) {
      if (!in[b1]) continue;
      if (first[b1] != first[b0] + m) break;
      m += count[b1];
    }
    packed = backend_.PackRows(kvs.codec, latents + first[b0] * hd, m, hd, kv_pages, kvs.page_rows,
                               rows_dev + at, 0);
    if (packed.ok()) {
      packed = backend_.PackRows(ks.codec, keys + first[b0] * ihd, m, ihd, key_pages, ks.page_rows,
                                 rows_dev + n + at, 0);
    }
    at += m;
    b0 = b1;
  }
  for (int64_t b = 0; b < B; ++b) {
    if (!in[b]) continue;
    SequenceState::Source& s = seqs[b].state->sources[l];
    if (!packed.ok()) {  // nothing appended: the reservations given back
      s.kv.Truncate(s.kv.rows());
      s.keys.Truncate(s.keys.rows());
      *seqs[b].status = packed;
      continue;
    }
    s.kv.Commit(count[b]);
    s.keys.Commit(count[b]);
    s.n += count[b];
    seqs[b].state->published_keys = l;
  }
  return absl::OkStatus();
}

absl::Status Model::AllocateStepKv(Scratch& ws, std::span<const StepSequence> seqs, int64_t rows,
                                   StepKv& kv) const {
  const ModelConfig& c = config_;
  const int64_t W = c.window_size, hd = c.head_dim, B = static_cast<int64_t>(seqs.size());
  const bool compressed = std::any_of(roles_.begin(), roles_.end(),
                                      [](const LayerRole& r) { return r.compress_ratio > 0; });
  const int64_t topk = compressed ? c.index_topk : 0;
  kv = StepKv{};
  kv.seqs = B;
  kv.rows = rows;
  kv.kv_ext_start = B * W + rows;
  ASSIGN_OR_RETURN(kv.kv, ws.Alloc<float>(kv.kv_ext_start * hd));
  ASSIGN_OR_RETURN(kv.ext, ws.Alloc<float>(std::max<int64_t>(1, rows * topk) * hd));
  ASSIGN_OR_RETURN(kv.idx, ws.Alloc<int32_t>(rows * (W + topk)));
  kv.batched_rings = std::all_of(seqs.begin(), seqs.end(),
                                 [&](const StepSequence& b) { return b.call->rows <= W; });
  if (kv.batched_rings) {
    vector<int32_t> ring_rows(rows);
    for (int64_t i = 0; i < B; ++i) {
      const StepSequence& b = seqs[i];
      for (int64_t r = 0; r < b.call->rows; ++r)
        ring_rows[b.row0 + r] = static_cast<int32_t>(i * W + (b.call->start_pos + r) % W);
    }
    ASSIGN_OR_RETURN(kv.ring_rows, ws.Copy(ring_rows));
    ASSIGN_OR_RETURN(kv.pages, ws.Alloc<uint8_t*>((c.n_layers + c.n_mtp_layers) * B));
  }
  return absl::OkStatus();
}

bool Model::RingsBatched(int l, std::span<const StepSequence> seqs, const StepKv* kv) const {
  if (kv == nullptr || !kv->batched_rings) return false;
  return std::all_of(seqs.begin(), seqs.end(), [&](const StepSequence& b) {
    const SwaRing& ring = b.state->swa[l];
    return !b.status->ok() || (ring.window() == config_.window_size &&
                               ring.dim() == config_.head_dim && ring.backend() == &backend_);
  });
}

namespace {

// The page of a ring nothing reads (a failed sequence's), made on first use.
absl::StatusOr<uint8_t*> SparePage(Scratch& ws, int64_t window, int64_t dim, uint8_t*& spare) {
  if (spare == nullptr) {
    ASSIGN_OR_RETURN(
        spare,
        ws.Filled<uint8_t>(window * kernels::RowCodecBytes(kernels::RowCodec::kSwaSlot, dim), 0));
  }
  return spare;
}

// Layer l's ring pages of the step's sequences into pages[0..B): each OK sequence's ring made
// writable (a sequence whose ring fails takes the error), a failed one's the spare page.
// (Model::StepSequence, private to Model: a template parameter here.)
template <typename StepSequence>
absl::Status LayerRingPages(Scratch& ws, int l, std::span<StepSequence> seqs, int64_t window,
                            int64_t dim, uint8_t*& spare, uint8_t** pages) {
  for (size_t i = 0; i < seqs.size(); ++i) {
    StepSequence& b = seqs[i];
    if (b.status->ok()) {
      absl::StatusOr<uint8_t*> page = b.state->swa[l].WritableBlock();
      if (page.ok()) {
        pages[i] = *page;
        continue;
      }
      *b.status = page.status();
    }
    ASSIGN_OR_RETURN(pages[i], SparePage(ws, window, dim, spare));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Model::PrepareStepRings(Scratch& ws, std::span<StepSequence> seqs, StepKv& kv) const {
  const int64_t L = config_.n_layers, B = static_cast<int64_t>(seqs.size());
  if (!kv.batched_rings) return absl::OkStatus();
  vector<uint8_t*> pages(L * B, nullptr);
  vector<char> prepared(L, 0);
  for (int64_t l = 0; l < L; ++l) {
    // Only layers whose rings each sequence holds alone: making them writable takes nothing from
    // the pool, so the step's pool allocations keep their order (a ring that must be allocated
    // or copied is, as before, when its layer runs). A layer not prepared here (that too, or not
    // batched now: it may be later, when a sequence of another ring shape fails) has StepRings
    // upload its pages itself.
    prepared[l] = RingsBatched(static_cast<int>(l), seqs, &kv) &&
                  std::all_of(seqs.begin(), seqs.end(), [&](const StepSequence& b) {
                    return !b.status->ok() || b.state->swa[l].exclusive();
                  });
    if (prepared[l]) {  // (a layer StepRings goes through itself leaves its pages unread)
      RETURN_IF_ERROR(LayerRingPages(ws, static_cast<int>(l), seqs, config_.window_size,
                                     config_.head_dim, kv.spare, pages.data() + l * B));
    }
  }
  RETURN_IF_ERROR(ws.Upload(kv.pages, pages.data(), L * B));
  kv.prepared = std::move(prepared);
  return absl::OkStatus();
}

absl::Status Model::StepRings(Scratch& ws, int l, bool read, const float* kv_rows,
                              std::span<StepSequence> seqs, StepKv* kv) const {
  const int64_t W = config_.window_size, hd = config_.head_dim;
  if (read && kv == nullptr) return absl::InternalError("step rings: nowhere to read them to");
  const int64_t B = static_cast<int64_t>(seqs.size());
  if (read) {
    RETURN_IF_ERROR(backend_.Copy(kv->kv + B * W * hd, kv_rows,
                                  kv->rows * hd * static_cast<int64_t>(sizeof(float))));
  }
  if (!RingsBatched(l, seqs, kv)) {
    for (StepSequence& b : seqs) {
      if (!b.status->ok()) continue;
      SwaRing& ring = b.state->swa[l];
      if (read) *b.status = ring.ReadWindowTo(kv->kv + (&b - seqs.data()) * W * hd);
      if (b.status->ok())
        *b.status = ring.WritePositionsFrom(b.call->start_pos, b.call->rows, kv_rows + b.row0 * hd);
    }
    return absl::OkStatus();
  }
  // Every ring's block (made writable: what ReadWindowTo would read, as WritePositionsFrom would
  // write it) is page b of the step's paged stream of B * W rows: uploaded with every main
  // layer's at the step's start (PrepareStepRings) or here.
  constexpr kernels::RowCodec kCodec = kernels::RowCodec::kSwaSlot;
  uint8_t** layer_pages = kv->pages + static_cast<int64_t>(l) * B;
  if (static_cast<size_t>(l) >= kv->prepared.size() || !kv->prepared[l]) {
    vector<uint8_t*> pages(B, nullptr);
    RETURN_IF_ERROR(LayerRingPages(ws, l, seqs, W, hd, kv->spare, pages.data()));
    RETURN_IF_ERROR(ws.Upload(layer_pages, pages.data(), B));
  }
  if (read)
    RETURN_IF_ERROR(backend_.UnpackRows(kCodec, layer_pages, W, hd, nullptr, 0, B * W, kv->kv));
  return backend_.PackRows(kCodec, kv_rows, kv->rows, hd, layer_pages, W, kv->ring_rows, 0);
}

absl::Status Model::StepIndexer(int l, const StepArrays& a, std::span<StepSequence> seqs,
                                vector<char>& indexed) const {
  const ModelConfig& c = config_;
  const LayerRole& role = roles_[l];
  const int ratio = role.compress_ratio;
  const auto B = static_cast<int64_t>(seqs.size());
  const int64_t nI = c.index_n_heads, ihd = c.index_head_dim;
  indexed.assign(seqs.size(), 0);
  if (ratio <= 0 || !role.is_index_source) return absl::OkStatus();
  // What Attention's indexer would do for each sequence (its key count nk and k), and per row:
  // its key source (the reference's stale keys), whose page table it reads, the keys it scores
  // and the keys it sees.
  struct Run {
    int64_t b0 = 0, b1 = 0, row0 = 0, rows = 0, g0 = 0, k = 0, width = 0;
    const uint8_t* mask = nullptr;
    int64_t mask_cols = 0;
  };
  vector<Run> runs;
  vector<int64_t> rpp, valid, visible, cols;
  vector<const uint8_t* const*> tables;
  bool codec_known = false;
  kernels::RowCodec codec = kernels::RowCodec::kF32;
  for (int64_t b = 0; b < B; ++b) {
    const StepSequence& q = seqs[b];
    if (!q.status->ok()) continue;
    const Call& call = *q.call;
    const SequenceState& state = *q.state;
    auto src = state.sources.find(role.kv_source);
    if (src == state.sources.end()) continue;
    const int64_t nk = LayerKeyCount(l, call, src->second);
    const int64_t k = std::min<int64_t>(c.index_topk, nk);
    if (nk <= 0 || k <= 0) continue;
    const auto at = tables.size();
    bool fits = true;
    for (int64_t i = 0; i < call.rows && fits; ++i) {
      const RowKeys rk = IndexRowKeys(l, call, state, nk, call.start_pos + i);
      auto it = state.sources.find(rk.source);
      if (it == state.sources.end()) {
        fits = false;
        break;
      }
      const KvRows& keys = it->second.keys;
      const kernels::RowCodec kc = KvRowCodec(keys.format());
      fits = keys.dim() == ihd && (!codec_known || kc == codec);
      if (!fits) break;
      codec = kc;
      codec_known = true;
      absl::StatusOr<uint8_t* const*> pages = keys.Pages();
      if (!pages.ok()) return pages.status();
      tables.push_back(*pages);
      rpp.push_back(keys.rows_per_block());
      valid.push_back(rk.scored);
      visible.push_back(rk.visible);
      cols.push_back(nk);
    }
    if (!fits) {  // Attention scores this sequence itself
      for (auto* v : {&rpp, &valid, &visible, &cols}) v->resize(at);
      tables.resize(at);
      continue;
    }
    const bool masked = role.uses_candidates && call.cand_cols > 0;
    Run* run = runs.empty() ? nullptr : &runs.back();
    const bool joins =
        run != nullptr && run->b1 == b && run->k == k && (run->mask != nullptr) == masked &&
        (!masked ||
         (call.cand_cols == run->mask_cols && call.cand == run->mask + run->rows * run->mask_cols));
    if (!joins) {
      runs.push_back(Run{b, b, q.row0, 0, static_cast<int64_t>(at), k, 0,
                         masked ? call.cand : nullptr, masked ? call.cand_cols : 0});
      run = &runs.back();
    }
    run->b1 = b + 1;
    run->rows += call.rows;
    run->width = std::max(run->width, nk);
  }
  if (runs.empty()) return absl::OkStatus();
  const auto G = static_cast<int64_t>(tables.size());
  vector<int64_t> values;
  for (const vector<int64_t>* v : {&rpp, &valid, &visible, &cols})
    values.insert(values.end(), v->begin(), v->end());
  Scratch ws(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(const auto up, ws.CopyAll(values, tables));  // one upload for the layer
  const int64_t* dev = std::get<0>(up);
  const int64_t *rpp_dev = dev, *valid_dev = dev + G, *visible_dev = dev + 2 * G,
                *cols_dev = dev + 3 * G;
  const uint8_t* const* const* tables_dev = std::get<1>(up);
  // The top-k (and the candidate masks) outlive the layer: in the calls' scratch (the step's).
  Scratch& kept = *seqs[runs.front().b0].call->scratch;
  int64_t topk_rows = 0;
  for (const Run& run : runs) topk_rows += run.rows * run.k;
  ASSIGN_OR_RETURN(int32_t * topk, kept.Alloc<int32_t>(topk_rows));
  for (const Run& run : runs) {
    const int64_t n = run.width;
    uint8_t* cand = nullptr;
    if (role.is_candidate_source) {
      ASSIGN_OR_RETURN(cand, kept.Alloc<uint8_t>(run.rows * n));
    }
    const int64_t cr =
        std::clamp<int64_t>(kIndexerScoresPerCall / n, 1, std::min(run.rows, kIndexerRowsPerCall));
    ASSIGN_OR_RETURN(float* score, ws.Alloc<float>(cr * n));
    for (int64_t r0 = 0; r0 < run.rows; r0 += cr) {
      const int64_t m = std::min(cr, run.rows - r0), g = run.g0 + r0, row = run.row0 + r0;
      RETURN_IF_ERROR(backend_.IndexerScoresPaged(a.qi + row * nI * ihd, a.w + row * nI,
                                                  static_cast<int>(nI), codec, tables_dev + g,
                                                  rpp_dev + g, valid_dev + g, n, ihd, m, score));
      if (cand != nullptr) {
        RETURN_IF_ERROR(backend_.CandidateMaskRows(score, m, n, c.candidate_block_size,
                                                   visible_dev + g, cols_dev + g,
                                                   c.candidate_topk_blocks, cand + r0 * n));
      }
      RETURN_IF_ERROR(
          backend_.SelectTopKRows(score, m, n, run.k, visible_dev + g, 0,
                                  run.mask != nullptr ? run.mask + r0 * run.mask_cols : nullptr,
                                  run.mask_cols, topk + r0 * run.k));
    }
    int64_t at = 0;
    for (int64_t b = run.b0; b < run.b1; ++b) {
      Call& call = *seqs[b].call;
      call.topk_k = run.k;
      call.topk.assign(call.rows * run.k, -1);
      call.topk_dev = topk + at * run.k;
      call.topk_batched = true;
      if (cand != nullptr) {
        call.cand = cand + at * n;
        call.cand_cols = n;
      }
      indexed[b] = 1;
      at += call.rows;
    }
    topk += run.rows * run.k;
  }
  return absl::OkStatus();
}

absl::Status Model::StepGather(int l, std::span<StepSequence> seqs, const vector<char>& indexed,
                               StepKv* kv, vector<int64_t>& ext_rows) const {
  const LayerRole& role = roles_[l];
  const int ratio = role.compress_ratio;
  const auto B = static_cast<int64_t>(seqs.size());
  const int64_t hd = config_.head_dim;
  ext_rows.assign(seqs.size(), -1);
  if (ratio <= 0 || kv == nullptr) return absl::OkStatus();
  // The sequences whose top-k StepIndexer made (at an index source: now), each over its source.
  vector<const KvRows*> streams(seqs.size(), nullptr);
  for (int64_t b = 0; b < B; ++b) {
    const StepSequence& q = seqs[b];
    const Call& call = *q.call;
    if (!q.status->ok() || !call.topk_batched || call.topk_dev == nullptr || call.topk_k <= 0 ||
        (role.is_index_source && !indexed[b]))
      continue;
    auto src = q.state->sources.find(role.kv_source);
    if (src == q.state->sources.end() || LayerKeyCount(l, call, src->second) <= 0 ||
        src->second.kv.dim() != hd)
      continue;
    streams[b] = &src->second.kv;
  }
  // Runs of consecutive sequences whose top-k rows lie one after another, of one codec and k:
  // one GatherRows each, a page table per row (the entries are the keys themselves).
  vector<const uint8_t* const*> tables;
  vector<int64_t> rpp;
  struct Run {
    int64_t b0, b1, rows, k, g0;
  };
  vector<Run> runs;
  for (int64_t b = 0; b < B; ++b) {
    if (streams[b] == nullptr) continue;
    const Call& call = *seqs[b].call;
    const kernels::RowCodec codec = KvRowCodec(streams[b]->format());
    Run* run = runs.empty() ? nullptr : &runs.back();
    if (run == nullptr || run->b1 != b || call.topk_k != run->k ||
        call.topk_dev != seqs[run->b0].call->topk_dev + run->rows * run->k ||
        codec != KvRowCodec(streams[run->b0]->format())) {
      runs.push_back(Run{b, b, 0, call.topk_k, static_cast<int64_t>(rpp.size())});
      run = &runs.back();
    }
    ASSIGN_OR_RETURN(uint8_t* const* pages, streams[b]->Pages());
    for (int64_t i = 0; i < call.rows; ++i) {
      tables.push_back(pages);
      rpp.push_back(streams[b]->rows_per_block());
    }
    run->b1 = b + 1;
    run->rows += call.rows;
  }
  if (runs.empty()) return absl::OkStatus();
  Scratch local(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(const auto up, local.CopyAll(tables, rpp));  // one upload for the layer
  const uint8_t* const* const* tables_dev = std::get<0>(up);
  const int64_t* rpp_dev = std::get<1>(up);
  for (const Run& run : runs) {
    RETURN_IF_ERROR(backend_.GatherRows(KvRowCodec(streams[run.b0]->format()), tables_dev + run.g0,
                                        rpp_dev + run.g0, run.k, hd, seqs[run.b0].call->topk_dev, 0,
                                        run.rows * run.k, kv->ext + kv->ext_used * hd));
    for (int64_t b = run.b0; b < run.b1; ++b) {
      ext_rows[b] = kv->ext_used;
      kv->ext_used += seqs[b].call->rows * run.k;
    }
  }
  return absl::OkStatus();
}

absl::Status Model::StepAttention(Scratch& ws, int l, const StepArrays& a,
                                  std::span<StepSequence> seqs, StepKv* shared) const {
  const ModelConfig& c = config_;
  const int64_t D = c.dim, H = c.n_heads, hd = c.head_dim;
  const bool indexer = roles_[l].compress_ratio > 0 && roles_[l].is_index_source;
  const bool compressed =
      shared != nullptr && roles_[l].compress_ratio > 0 && roles_[l].is_kv_source;
  vector<char> indexed;      // StepIndexer's sequences
  vector<int64_t> ext_rows;  // StepGather's
  auto rows_of = [&](const StepSequence& b) {
    AttentionRows rows;
    const int64_t r0 = b.row0;
    rows.qr = a.qr + r0 * c.q_lora_rank;
    rows.q = a.q + r0 * H * hd;
    rows.kv = a.kv + r0 * hd;
    rows.qi = indexer ? a.qi + r0 * c.index_n_heads * c.index_head_dim : nullptr;
    rows.w = indexer ? a.w + r0 * c.index_n_heads : nullptr;
    rows.o = a.o + r0 * H * hd;
    rows.step = shared;
    rows.seq = &b - seqs.data();
    rows.row0 = r0;
    rows.compressed = compressed;
    rows.indexed = !indexed.empty() && indexed[rows.seq] != 0;
    rows.ext_row = ext_rows.empty() ? -1 : ext_rows[rows.seq];
    return rows;
  };
  // Shared: the window first, every sequence's ring as it was before the step (then its rows
  // written into it), and the step's new rows after them (StepKv).
  if (shared != nullptr) {
    shared->ext_used = shared->idx_used = 0;
    RETURN_IF_ERROR(StepRings(ws, l, /*read=*/true, a.kv, seqs, shared));
    if (compressed) RETURN_IF_ERROR(StepCompress(ws, l, a, seqs));
    if (indexer) RETURN_IF_ERROR(StepIndexer(l, a, seqs, indexed));
    RETURN_IF_ERROR(StepGather(l, seqs, indexed, shared, ext_rows));
  }
  // Each sequence's own part; with `shared`, its lists' layout, then every list's window part
  // in one copy, each top-k part over it, and runs of consecutive sequences whose lists have the
  // same length (rows and lists adjacent) in one SparseAttention.
  struct Run {
    int64_t row0 = 0, rows = 0, list_len = 0, idx_offset = 0;
  };
  vector<Run> runs;
  vector<std::pair<const StepSequence*, StepKv::Lists>> lists;
  for (StepSequence& b : seqs) {
    if (b.status->ok()) *b.status = Attention(l, a.x + b.row0 * D, *b.call, *b.state, rows_of(b));
    if (shared == nullptr || !b.status->ok()) continue;
    const StepKv::Lists& li = shared->lists;
    lists.emplace_back(&b, li);
    Run* run = runs.empty() ? nullptr : &runs.back();
    if (run == nullptr || li.list_len != run->list_len || b.row0 != run->row0 + run->rows ||
        li.idx_offset != run->idx_offset + run->rows * run->list_len) {
      runs.push_back(Run{b.row0, 0, li.list_len, li.idx_offset});
      run = &runs.back();
    }
    run->rows += b.call->rows;
  }
  if (shared != nullptr && !lists.empty()) {
    vector<int32_t> window(shared->idx_used, -1);
    for (const auto& [b, li] : lists)
      WindowLists(*b->call, li.list_len, li.ring_base, li.new_base, window.data() + li.idx_offset);
    auto it = std::find_if(shared->window_parts.begin(), shared->window_parts.end(),
                           [&](const auto& part) { return part.first == window; });
    if (it == shared->window_parts.end()) {
      ASSIGN_OR_RETURN(const int32_t* uploaded, ws.Copy(window));
      shared->window_parts.emplace_back(std::move(window), uploaded);
      it = std::prev(shared->window_parts.end());
    }
    RETURN_IF_ERROR(backend_.Copy(shared->idx, it->second,
                                  shared->idx_used * static_cast<int64_t>(sizeof(int32_t))));
    // Each top-k part over it: one TopKSlots per run of lists whose top-k rows, gathered rows
    // and lists follow one another (a StepGather run).
    StepKv::Lists::Slots run;
    int64_t run_len = 0;
    auto write = [&]() -> absl::Status {
      if (run.topk == nullptr) return absl::OkStatus();
      return backend_.TopKSlots(run.topk, run.rows, run.k, run.base, /*per_slot=*/true, run.list,
                                run_len, c.window_size);
    };
    for (const auto& [b, li] : lists) {
      const StepKv::Lists::Slots& t = li.slots;
      if (t.topk == nullptr) continue;
      if (run.topk != nullptr && t.k == run.k && li.list_len == run_len &&
          t.topk == run.topk + run.rows * run.k && t.base == run.base + run.rows * run.k &&
          t.list == run.list + run.rows * run_len) {
        run.rows += t.rows;
        continue;
      }
      RETURN_IF_ERROR(write());
      run = t;
      run_len = li.list_len;
    }
    RETURN_IF_ERROR(write());
    for (const Run& run : runs) {
      kernels::SparseAttentionArgs args = LayerAttentionArgs(l, run.rows, run.list_len);
      args.q = a.q + run.row0 * H * hd;
      args.kv = shared->kv;
      args.kv_ext = shared->ext;
      args.kv_ext_start = shared->kv_ext_start;
      args.idx = shared->idx + run.idx_offset;
      args.out = a.o + run.row0 * H * hd;
      RETURN_IF_ERROR(backend_.SparseAttention(args));
    }
  }
  // A failed sequence's rows carry zeros from here on (finite, so the batch's shared steps run
  // on; rows are independent, so its neighbours' results do not change).
  const float* zeros = nullptr;
  for (StepSequence& b : seqs) {
    if (b.status->ok()) continue;
    if (zeros == nullptr) {
      ASSIGN_OR_RETURN(zeros, ws.Filled<float>(a.rows * H * hd, 0.f));
    }
    RETURN_IF_ERROR(backend_.Copy(a.o + b.row0 * H * hd, zeros,
                                  b.call->rows * H * hd * static_cast<int64_t>(sizeof(float))));
  }
  return absl::OkStatus();
}

// ---- ExtendBatch ----

// What ExtendBatch's steps share: the batch's sequences and what each asks for (`status`:
// ExtendBatch's, sized), their rows' inputs on the host, the step's graph set, its calls and the
// attention's shared buffers.
struct Model::StepBatch {
  std::span<SequenceState* const> states;
  std::span<const vector<int32_t>> tokens;
  std::span<const LogitsRequest> outs;
  std::span<absl::Status> status;
  vector<int32_t> ids;                 // [R] the sequences' tokens, one after another
  vector<int64_t> row0;                // [B] each sequence's first row
  vector<int64_t> positions;           // [R]
  vector<int64_t> engram_ids;          // [nel, R, per] the Engram hash ids by layer
  StepGraphCache::Set* set = nullptr;  // the step's graph set (null: none, or not used)
  vector<Call> calls;                  // [B] what RunStage makes for a decode-mode Extend
  vector<StepSequence> seqs;           // [B]
  StepKv shared_kv;                    // the attention's shared buffers, when `shared` is set
  StepKv* shared = nullptr;

  // What sequence b's result carries.
  LogitsOut out_of(size_t b) const { return outs.empty() ? LogitsOut::kValues : outs[b].out; }
};

absl::StatusOr<vector<ForwardResult>> Model::ExtendBatch(
    std::span<SequenceState* const> states, std::span<const vector<int32_t>> tokens,
    vector<absl::Status>& status, std::span<const LogitsRequest> outs) const {
  const ModelConfig& c = config_;
  const size_t B = states.size();
  if (tokens.size() != B) return absl::InvalidArgumentError("model: one token list per sequence");
  if (!outs.empty() && outs.size() != B)
    return absl::InvalidArgumentError("model: one logits choice per sequence");
  for (size_t b = 0; b < outs.size(); ++b) {
    absl::Status st = LogitsRequestProblem(outs[b], static_cast<int64_t>(tokens[b].size()));
    if (st.ok()) st = VerificationProblem(outs[b]);
    if (!st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", b, ": ", st.message()));
    }
  }
  status.assign(B, absl::OkStatus());
  vector<ForwardResult> out(B);
  if (B == 0) return out;
  const int64_t nel = static_cast<int64_t>(c.engram_layer_ids.size());
  const int64_t per = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  StepBatch sb{.states = states, .tokens = tokens, .outs = outs, .status = status};
  RETURN_IF_ERROR(StepInputs(sb));
  const int64_t R = static_cast<int64_t>(sb.ids.size());
  const vector<int64_t>& row0 = sb.row0;

  Scratch ws(backend_, scratch_pool_.get());
  // The step's arrays: a graph set's (held for the whole step), or this call's.
  std::unique_lock<std::mutex> graphs_lock;
  StepGraphCache::Set*& set = sb.set;
  if (step_graphs_ != nullptr) {
    graphs_lock = std::unique_lock<std::mutex>(step_graphs_->mu());
    set = step_graphs_->Get(R);
    if (set != nullptr && set->failed) {
      // A failed set's graphs are not launched again, nor its arrays used.
      set->segments.clear();
      set->held.reset();
      set = nullptr;
    }
    if (set != nullptr && set->held == nullptr) {
      set->held = std::make_unique<Scratch>(backend_, set->arena.get());
      if (!AllocateStepArrays(*set->held, R, set->arrays).ok()) {
        set->held.reset();  // no memory for them: this row count runs op by op
        set->failed = true;
        ++step_graphs_->stats().failures;
        set = nullptr;
      }
    }
  }
  StepArrays own;
  if (set == nullptr) RETURN_IF_ERROR(AllocateStepArrays(ws, R, own));
  Scratch& arrays_scratch = set != nullptr ? *set->held : ws;
  const StepArrays& a = set != nullptr ? set->arrays : own;
  // The inputs in one Upload, into the array AllocateStepArrays laid out for R rows.
  RETURN_IF_ERROR(arrays_scratch.UploadPacked(a.ids, InputPacking(R, nel * R * per), sb.ids,
                                              sb.positions, sb.engram_ids));

  vector<Call>& calls = sb.calls;
  vector<StepSequence>& seqs = sb.seqs;
  calls.resize(B);
  seqs.resize(B);
  for (size_t b = 0; b < B; ++b) {
    Call& k = calls[b];  // what RunStage makes for a decode-mode Extend
    k.start_pos = states[b]->pos;
    k.rows = static_cast<int64_t>(tokens[b].size());
    k.prefill = false;
    k.per_row_keys = true;
    k.published_at_start = states[b]->published_keys;
    k.scratch = &ws;
    k.pos_dev = a.pos + row0[b];  // its rows' positions, uploaded with the step's
    seqs[b] = StepSequence{&k, states[b], row0[b], &status[b]};
  }
  RETURN_IF_ERROR(StepLayers(ws, sb, a));
  RETURN_IF_ERROR(StepResults(ws, arrays_scratch, sb, a, out));
  for (size_t b = 0; b < B; ++b) {
    if (!status[b].ok()) out[b] = ForwardResult{};
  }
  return out;
}

absl::Status Model::StepInputs(StepBatch& sb) const {
  const ModelConfig& c = config_;
  const std::span<SequenceState* const> states = sb.states;
  const std::span<const vector<int32_t>> tokens = sb.tokens;
  const size_t B = states.size();
  const int64_t nel = static_cast<int64_t>(c.engram_layer_ids.size());
  const int64_t per = int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads;
  vector<int32_t>& ids = sb.ids;
  vector<int64_t>& row0 = sb.row0;
  vector<int64_t>& positions = sb.positions;
  row0.assign(B, 0);
  vector<vector<int64_t>> hashes(B);  // per sequence [rows, nel, per]
  for (size_t b = 0; b < B; ++b) {
    if (!Batchable(*states[b], tokens[b])) {
      return absl::InvalidArgumentError(
          absl::StrCat("model: sequence ", b, " cannot join a batched decode step"));
    }
    row0[b] = static_cast<int64_t>(ids.size());
    ids.insert(ids.end(), tokens[b].begin(), tokens[b].end());
    for (size_t i = 0; i < tokens[b].size(); ++i)
      positions.push_back(states[b]->pos + static_cast<int64_t>(i));
    if (nel > 0) hashes[b] = EngramHashes(*states[b], tokens[b]);
  }
  const int64_t R = static_cast<int64_t>(ids.size());
  // The Engram hash ids by layer: [nel, R, per].
  vector<int64_t>& engram_ids = sb.engram_ids;
  engram_ids.assign(nel * R * per, 0);
  for (size_t b = 0; b < B; ++b) {
    const auto n = static_cast<int64_t>(tokens[b].size());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t li = 0; li < nel; ++li) {
        std::copy_n(hashes[b].data() + (i * nel + li) * per, per,
                    engram_ids.data() + (li * R + row0[b] + i) * per);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Model::StepLayers(Scratch& ws, StepBatch& sb, const StepArrays& a) const {
  const ModelConfig& c = config_;
  StepGraphCache::Set* set = sb.set;
  const int64_t R = static_cast<int64_t>(sb.ids.size());
  const std::span<const vector<int32_t>> tokens = sb.tokens;
  vector<StepSequence>& seqs = sb.seqs;
  // Each segment: launched as a graph when its set has recorded it; recorded and launched on the
  // set's second step; else op by op (on the set's arena on its first step, which sizes it).
  const bool launch = set != nullptr && set->segments.size() == static_cast<size_t>(c.n_layers) + 1;
  const bool record = set != nullptr && !launch && set->uses >= 1;
  if (record) set->segments.clear();  // what an earlier step that failed midway recorded
  // A launch that fails fails the step: how much of the graph ran is unknown, so the segment
  // cannot run again op by op. Its row count's graphs are not trusted again: that row count runs
  // op by op from the next step on.
  auto launch_graph = [&](kernels::Graph& g) -> absl::Status {
    ++step_graphs_->stats().launched;
    absl::Status st = backend_.LaunchGraph(g);
    if (!st.ok()) {
      set->failed = true;
      ++step_graphs_->stats().failures;
    }
    return st;
  };
  auto run_segment = [&](int s) -> absl::Status {
    if (set == nullptr) return StepSegment(ws, s, a);
    if (launch) return launch_graph(*set->segments[s]);
    Scratch seg(backend_, set->arena.get());
    if (!record || set->failed) return StepSegment(seg, s, a);
    // Record the segment (nothing runs), then launch it. A failed capture leaves nothing run:
    // the segment runs op by op, and so does this row count from now on.
    absl::Status st = backend_.BeginCapture();
    if (st.ok()) {
      st = StepSegment(seg, s, a);
      absl::StatusOr<std::unique_ptr<kernels::Graph>> g = backend_.EndCapture();
      if (st.ok()) st = g.status();
      if (st.ok()) {
        ++step_graphs_->stats().captured;
        set->segments.push_back(std::move(*g));
        return launch_graph(*set->segments.back());
      }
    }
    set->failed = true;
    set->segments.clear();
    ++step_graphs_->stats().failures;
    return StepSegment(seg, s, a);
  };
  // The attention's shared buffers, when every sequence's lists are built on the backend.
  StepKv& shared_kv = sb.shared_kv;
  StepKv*& shared = sb.shared;
  if (std::all_of(tokens.begin(), tokens.end(), [&](const vector<int32_t>& t) {
        return static_cast<int64_t>(t.size()) <= options_.device_list_rows;
      })) {
    RETURN_IF_ERROR(AllocateStepKv(ws, seqs, R, shared_kv));
    RETURN_IF_ERROR(PrepareStepRings(ws, std::span<StepSequence>(seqs), shared_kv));
    shared = &shared_kv;
  }
  for (int s = 0; s <= c.n_layers; ++s) {
    RETURN_IF_ERROR(run_segment(s));
    if (s < c.n_layers)
      RETURN_IF_ERROR(StepAttention(ws, s, a, std::span<StepSequence>(seqs), shared));
  }
  if (step_graphs_ != nullptr) {
    const bool as_graphs = launch || (record && !set->failed);
    ++(as_graphs ? step_graphs_->stats().graph_steps : step_graphs_->stats().eager_steps);
  }
  if (set != nullptr) ++set->uses;
  return absl::OkStatus();
}

absl::Status Model::StepResults(Scratch& ws, Scratch& arrays_scratch, StepBatch& sb,
                                const StepArrays& a, vector<ForwardResult>& out) const {
  const ModelConfig& c = config_;
  const std::span<SequenceState* const> states = sb.states;
  const std::span<const vector<int32_t>> tokens = sb.tokens;
  const std::span<const LogitsRequest> outs = sb.outs;
  const std::span<absl::Status> status = sb.status;
  const vector<int64_t>& row0 = sb.row0;
  const size_t B = states.size();
  const int64_t R = static_cast<int64_t>(sb.ids.size());
  const int64_t D = c.dim;
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  // The head's logits of every row are in a.logits (the last segment; rows are independent, the
  // residual stays in backend memory), then each sequence's slices: every row's values in one
  // download when every sequence wants them, else every row's argmax in one and the values of
  // the sequences that want them one download each.
  // The DSpark inputs: on a device backend they stay there (each state keeps its rows, and a
  // hand-off reads the kept one: KeepMainHidden, MainHiddenOf), else they come down.
  const bool mh_on_backend = nt > 0 && backend_.memory_kind() != kernels::MemoryKind::kHost;
  Hidden all;
  all.rows = R;
  if (nt > 0 && !mh_on_backend) {
    RETURN_IF_ERROR(arrays_scratch.DownloadTo(a.main_hidden, R * nt * D, all.main_hidden));
  }
  float* head = a.logits;
  const bool all_values = std::all_of(
      outs.begin(), outs.end(), [](const LogitsRequest& o) { return o.out == LogitsOut::kValues; });
  // A sequence's penalties touch its own rows only (before the argmax of every row; the rows of
  // a sequence that wants values are not touched). A sampled sequence's draws then overwrite its
  // rows' argmax, so every token comes down in one download.
  const int64_t V = c.vocab_size;
  ForwardResult every;
  std::vector<std::vector<Logprobs>> logprobs(B);  // per sequence asking for them
  Scratch head_ws(backend_, scratch_pool_.get(), &arrays_scratch);
  if (all_values) {
    RETURN_IF_ERROR(LogitsToHost(head_ws, head, R, LogitsOut::kValues, every));
  } else {
    RETURN_IF_ERROR(StepTokens(head_ws, sb, head, every, logprobs));
  }
  for (size_t b = 0; b < B; ++b) {
    if (!status[b].ok()) continue;
    SequenceState& state = *states[b];
    const int64_t n = sb.calls[b].rows, pos = state.pos, r0 = row0[b];
    if (options_.stale_index_keys) {
      state.published_keys = DecodeKeySource(c.n_layers, pos + n - 1, sb.calls[b]);
    }
    Hidden io;
    io.rows = n;
    if (nt > 0 && !mh_on_backend) {
      io.main_hidden.assign(all.main_hidden.begin() + r0 * nt * D,
                            all.main_hidden.begin() + (r0 + n) * nt * D);
    }
    ForwardResult r;
    if (all_values) {
      r.logits.assign(every.logits.begin() + r0 * V, every.logits.begin() + (r0 + n) * V);
    } else if (sb.out_of(b) == LogitsOut::kValues) {
      if (absl::Status st = head_ws.DownloadTo(head + r0 * V, n * V, r.logits); !st.ok()) return st;
    } else {
      r.tokens.assign(every.tokens.begin() + r0,
                      every.tokens.begin() + r0 + (sb.out_of(b) == LogitsOut::kVerify ? 2 : n));
      r.logprobs = std::move(logprobs[b]);
    }
    r.rows = n;
    if (absl::Status st = Commit(state, tokens[b], pos + n, io); !st.ok()) {
      status[b] = st;
      continue;
    }
    if (mh_on_backend) {
      if (absl::Status st = KeepMainHidden(state, a.main_hidden + r0 * nt * D, n, pos + n);
          !st.ok()) {
        status[b] = st;
        continue;
      }
    }
    r.main_hidden = std::move(io.main_hidden);
    out[b] = std::move(r);
  }
  // The DSpark layers' windows take the committed sequences' rows (DSparkSeedFrom's writes, of
  // rows the last segment made).
  for (int t = 0; t < c.n_mtp_layers; ++t) {
    RETURN_IF_ERROR(StepRings(ws, c.n_layers + t, /*read=*/false, a.mtp_kv + t * R * c.head_dim,
                              std::span<StepSequence>(sb.seqs), sb.shared));
  }
  return absl::OkStatus();
}

absl::Status Model::StepTokens(Scratch& head_ws, const StepBatch& sb, float* head,
                               ForwardResult& every, vector<vector<Logprobs>>& logprobs) const {
  const std::span<const vector<int32_t>> tokens = sb.tokens;
  const std::span<const LogitsRequest> outs = sb.outs;
  const std::span<absl::Status> status = sb.status;
  const vector<int64_t>& row0 = sb.row0;
  const size_t B = sb.states.size();
  const int64_t R = static_cast<int64_t>(sb.ids.size()), V = config_.vocab_size;
  std::vector<const float*> raw(B, nullptr);  // rows whose logprobs are asked for, unpenalized
  for (size_t b = 0; b < B; ++b) {
    if (!status[b].ok() || sb.out_of(b) == LogitsOut::kValues) continue;
    const auto n = static_cast<int64_t>(tokens[b].size());
    ASSIGN_OR_RETURN(raw[b], RawRows(head_ws, head + row0[b] * V, n, outs[b]));
    if (outs[b].penalties != nullptr)
      RETURN_IF_ERROR(Penalize(head_ws, head + row0[b] * V, n, *outs[b].penalties));
  }
  ASSIGN_OR_RETURN(int32_t * best, head_ws.Alloc<int32_t>(R));
  RETURN_IF_ERROR(backend_.Argmax(head, R, V, best));
  // Each row's token for its logprobs: its slot of `best`, or a verification's own array.
  std::vector<int32_t*> chosen(B, nullptr);
  for (size_t b = 0; b < B; ++b) chosen[b] = best + row0[b];
  for (size_t b = 0; b < B; ++b) {
    if (status[b].ok() && sb.out_of(b) == LogitsOut::kSample) {
      RETURN_IF_ERROR(DrawTokens(head_ws, head + row0[b] * V,
                                 static_cast<int64_t>(tokens[b].size()), *outs[b].sample,
                                 best + row0[b]));
    }
    // A verification's verdict takes the first two of its rows' slots (it has >= 2 rows).
    // With logprobs, each row's token goes to an array of its own.
    if (status[b].ok() && sb.out_of(b) == LogitsOut::kVerify) {
      const auto n = static_cast<int64_t>(tokens[b].size());
      if (outs[b].top_logprobs >= 0) {
        ASSIGN_OR_RETURN(chosen[b], head_ws.Alloc<int32_t>(n));
      } else {
        chosen[b] = nullptr;
      }
      RETURN_IF_ERROR(
          VerifyTokens(head_ws, head + row0[b] * V, n, outs[b], best + row0[b], chosen[b]));
    }
  }
  for (size_t b = 0; b < B; ++b) {
    if (!status[b].ok() || sb.out_of(b) == LogitsOut::kValues || outs[b].top_logprobs < 0) continue;
    RETURN_IF_ERROR(LogprobsToHost(head_ws, raw[b], static_cast<int64_t>(tokens[b].size()),
                                   chosen[b], outs[b].top_logprobs, logprobs[b]));
  }
  RETURN_IF_ERROR(head_ws.DownloadTo(best, R, every.tokens));
  return absl::OkStatus();
}

}  // namespace epd::model
