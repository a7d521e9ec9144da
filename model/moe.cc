// The MoE sublayer of the forward (MODEL.md §3 step 9): routing, then every expert over its rows
// in one grouped call per projection (the backend groups the rows by expert), SwiGLU, and each
// row's sum over its experts and the shared ones in the reference's order, in chunks of
// kMoeRowsPerCall rows.
#include <algorithm>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "model/model.h"
#include "model/scratch.h"

namespace epd::model {
namespace {

using std::vector;

}  // namespace

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

}  // namespace epd::model
