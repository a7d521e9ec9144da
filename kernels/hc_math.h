#pragma once

// mHC's comb matrix (MODEL.md §3: the softmax of its logits, then Sinkhorn), one definition shared
// by the CPU backend (kernels/cpu/ops.cc HcMixes) and the CUDA kernel (kernels/cuda/rowwise.cu
// HcMixesKernel): compiled __host__ __device__ under nvcc (kernels/codec.h's EPD_HD), fp32
// arithmetic in the reference's order, so comb has the same bits on both.

#include <cmath>

#include "kernels/codec.h"
#include "kernels/torch_math.h"

namespace epd::kernels::hc_math {

// Divides each of comb's hc lines by (the line's sum in index order + eps): line l's element e is
// comb[l * line + e * elem] (columns: line 1, elem hc; rows: line hc, elem 1).
EPD_HD void NormalizeLines(float* comb, int hc, int line, int elem, float eps) {
  for (int l = 0; l < hc; ++l) {
    float s = 0.f;
    for (int e = 0; e < hc; ++e) s += comb[l * line + e * elem];
    for (int e = 0; e < hc; ++e) comb[l * line + e * elem] /= (s + eps);
  }
}

// Sinkhorn on comb [hc, hc]: the columns normalised, then (iters - 1) times the rows and the
// columns.
EPD_HD void Sinkhorn(float* comb, int hc, int iters, float eps) {
  NormalizeLines(comb, hc, 1, hc, eps);
  for (int it = 1; it < iters; ++it) {
    NormalizeLines(comb, hc, hc, 1, eps);
    NormalizeLines(comb, hc, 1, hc, eps);
  }
}

// comb [hc, hc] (comb[j * hc + k]: source j -> dest k) from m [hc, hc], the comb part of the
// projection's dots, and rs = 1 / the rms of h: the logits (m * rs) * scale + base, each row's
// softmax (TorchExp: torch.exp always takes its vectorized path) plus eps, then Sinkhorn.
EPD_HD void HcComb(const float* m, float rs, float scale, const float* base, int hc,
                   int sinkhorn_iters, float eps, float* comb) {
  for (int j = 0; j < hc; ++j) {
    float* row = comb + j * hc;
    float mx = -INFINITY;
    for (int k = 0; k < hc; ++k) {
      row[k] = (m[j * hc + k] * rs) * scale + base[j * hc + k];
      mx = codec::StdMax(mx, row[k]);
    }
    float sum = 0.f;
    for (int k = 0; k < hc; ++k) {
      row[k] = torch_math::TorchExp(row[k] - mx);
      sum += row[k];
    }
    for (int k = 0; k < hc; ++k) row[k] = row[k] / sum + eps;
  }
  Sinkhorn(comb, hc, sinkhorn_iters, eps);
}

}  // namespace epd::kernels::hc_math
