// The mHC (hyper-connection) steps of a block (MODEL.md §3): the mixes of each sublayer (pre,
// post, comb: HcMixRows, single-token semantics for decode rows) and the residual stream's
// updates around the attention and the FFN (HcBeforeAttention, HcBeforeFfn, HcAfterFfn). Block
// (model/model.cc) and the batched decode step's segments (model/decode_step.cc) call them.
#include "common/status_macros.h"
#include "model/model.h"
#include "model/scratch.h"

namespace epd::model {

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

}  // namespace epd::model
