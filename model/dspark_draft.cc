// DSpark drafting (MODEL.md §3 "DSpark"; docs/dspark.md): the DSpark stages' window rings
// seeded from the main model's DSpark inputs (DSparkSeed, DSparkSeedFrom, DSparkSeedRows), and
// the draft pass (Draft): the stages over a block of the last token and noise tokens, attending
// to their rings and to each other, then the Markov chain of draft ids and their confidences on
// the backend. Verifying the drafts is a decode step with a LogitsOut::kVerify result
// (model/logits.cc); rolling back the rejected ones is Checkpoint / Rollback (model/model.cc).
#include <algorithm>
#include <memory>
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

absl::Status Model::DraftProblem(const SequenceState& state, int32_t last_token, LogitsOut lo,
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
  return absl::OkStatus();
}

absl::StatusOr<DraftResult> Model::Draft(SequenceState& state, int32_t last_token,
                                         std::span<const int32_t> forced_ids, LogitsOut lo,
                                         const LogitPenalties* penalties,
                                         const SampleRequest* sample) const {
  RETURN_IF_ERROR(DraftProblem(state, last_token, lo, penalties, sample));
  const ModelConfig& c = config_;
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
