#pragma once

// The golden reference's fp32 arithmetic (torch 1.13 on the CPU; docs/model.md, "Numerics: the
// reference's arithmetic, reproduced"), one scalar definition of each shared by the CPU backend
// (kernels/cpu/ops.cc: the scalar paths, which the AVX2 paths equal bit for bit) and the CUDA
// kernels (kernels/cuda/*.cu, compiled with -fmad=false, so every product is rounded before it is
// added and the explicit fmaf calls are the only fused operations, as on the CPU).
//
// - TorchExp: torch's vectorized fp32 exp (Sleef expf u10 with FMA).
// - TorchSumOf / TorchSum / TorchMeanSquare: torch's SumKernel order for `sum(-1)` and
//   `square().mean(-1)` over a contiguous last dim (AVX2 build).
// - DotSeq: an fp32 matmul's dot in index order (reference BLAS sgemm).
// - DotDp: a bf16 matmul's dot in oneDNN's vdpbf16ps order (per pair, the odd element first).

#include <cmath>
#include <cstdint>

#include "kernels/codec.h"

namespace epd::kernels::torch_math {

// Keeps the compiler from re-associating a two-adds-per-iteration reduction: GCC 12.2 -O2/-O3
// miscompiles DotDp's loop without it (its vectorizer returns a wrong sum, not another order).
#if defined(__CUDA_ARCH__)
#define EPD_OPAQUE(v) (void)0
#elif defined(__x86_64__)
#define EPD_OPAQUE(v) asm("" : "+x"(v))
#elif defined(__aarch64__)
#define EPD_OPAQUE(v) asm("" : "+w"(v))
#else
#define EPD_OPAQUE(v) asm("" : "+m"(v))
#endif

EPD_HD float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

EPD_HD float RoundToEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // the default rounding mode: to nearest, ties to even
#endif
}

// torch 1.13's CPU fp32 exp (Sleef_expf8_u10 of its AVX2 kernels, which fuses its multiply-adds):
// q = rint(d / ln 2), s = d - q ln2 (two FMA steps), a degree-6 polynomial by FMA, scaled by
// 2^q in two halves; 0 below -104, inf above 100, NaN -> all-ones NaN (Sleef ORs the NaN mask
// in). Bit for bit with torch.exp on every float (checked on 7M values).
EPD_HD float TorchExp(float d) {
  if (d != d) return codec::BitsF32(0xffffffffu);
  if (d < -104.f) return 0.f;
  if (d > 100.f) return INFINITY;
  const float qf = RoundToEven(d * 1.442695040888963407359924681001892137426645954152985934f);
  const int q = static_cast<int>(qf);
  float s = Fma(qf, -0.693145751953125f, d);
  s = Fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = Fma(u, s, 0.00139304355252534151077271f);
  u = Fma(u, s, 0.00833336077630519866943359f);
  u = Fma(u, s, 0.0416664853692054748535156f);
  u = Fma(u, s, 0.166666671633720397949219f);
  u = Fma(u, s, 0.5f);
  u = 1.0f + Fma(s * s, u, s);
  const float lo = codec::BitsF32(static_cast<uint32_t>((q >> 1) + 0x7f) << 23);
  const float hi = codec::BitsF32(static_cast<uint32_t>((q - (q >> 1)) + 0x7f) << 23);
  return u * lo * hi;
}

namespace internal {
// torch's multi_row_sum: kRows x lanes accumulators over `size` steps, with cascade levels every
// 2^level_power steps (blocks move up a level, so long sums stay accurate). load(i, k, l) is the
// element of step i, row k, lane l.
template <int kRows, typename Load>
EPD_HD void MultiRowSum(int64_t size, const Load& load, float (&out)[kRows][8], int lanes) {
  constexpr int kLevels = 4;
  int64_t level_power = 4;  // max(4, CeilLog2(size) / 4)
  {
    int64_t c = 0;
    while ((int64_t{1} << c) < size) ++c;
    const int64_t c1 = c > 1 ? c : 1;
    level_power = c1 / kLevels > 4 ? c1 / kLevels : 4;
  }
  const int64_t step = int64_t{1} << level_power, mask0 = step - 1;
  float acc[kLevels][kRows][8];
  for (int lv = 0; lv < kLevels; ++lv) {
    for (int k = 0; k < kRows; ++k) {
      for (int l = 0; l < 8; ++l) acc[lv][k][l] = 0.f;
    }
  }
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int k = 0; k < kRows; ++k) {
        for (int l = 0; l < lanes; ++l) acc[0][k][l] += load(i, k, l);
      }
    }
    for (int lv = 1; lv < kLevels; ++lv) {
      for (int k = 0; k < kRows; ++k) {
        for (int l = 0; l < lanes; ++l) {
          acc[lv][k][l] += acc[lv - 1][k][l];
          acc[lv - 1][k][l] = 0.f;
        }
      }
      if ((i & (mask0 << (lv * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) {
    for (int k = 0; k < kRows; ++k) {
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += load(i, k, l);
    }
  }
  for (int lv = 1; lv < kLevels; ++lv) {
    for (int k = 0; k < kRows; ++k) {
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[lv][k][l];
    }
  }
  for (int k = 0; k < kRows; ++k) {
    for (int l = 0; l < lanes; ++l) out[k][l] = acc[0][k][l];
  }
}

template <typename Elem>
struct ScalarLoad {  // n < 8: step i, row k = element 4i + k
  const Elem& elem;
  EPD_HD float operator()(int64_t i, int k, int) const { return elem(4 * i + k); }
};
template <typename Elem>
struct VectorLoad {  // n >= 8: step i, row k, lane l = element 8(4i + k) + l
  const Elem& elem;
  EPD_HD float operator()(int64_t i, int k, int l) const { return elem(8 * (4 * i + k) + l); }
};
struct PlainElem {
  const float* x;
  EPD_HD float operator()(int64_t i) const { return x[i]; }
};
struct SquareElem {
  const float* x;
  EPD_HD float operator()(int64_t i) const { return x[i] * x[i]; }
};
}  // namespace internal

// torch 1.13's CPU fp32 sum of n elements elem(0..n-1) over a contiguous last dim (ReduceOps'
// SumKernel, AVX2 build), in its order. n >= 8 (vectorized_inner_sum, 8-float vectors
// v_i = elem(8i..8i+7)): row_sum over the n/8 vectors with 4 accumulators (multi_row_sum over
// groups of 4 vectors, leftover vectors into the first, then acc_0 + acc_1 + acc_2 + acc_3), then
// s = 0 + the n % 8 leftover elements in order + the 8 lanes in order. n < 8 (scalar_inner_sum):
// the same row_sum over scalars.
template <typename Elem>
EPD_HD float TorchSumOf(int64_t n, const Elem& elem) {
  float p[4][8];
  if (n < 8) {
    internal::MultiRowSum<4>(n / 4, internal::ScalarLoad<Elem>{elem}, p, 1);
    for (int64_t i = n / 4 * 4; i < n; ++i) p[0][0] += elem(i);
    for (int k = 1; k < 4; ++k) p[0][0] += p[k][0];
    return p[0][0];
  }
  const int64_t nv = n / 8;
  internal::MultiRowSum<4>(nv / 4, internal::VectorLoad<Elem>{elem}, p, 8);
  for (int64_t i = nv / 4 * 4; i < nv; ++i) {
    for (int l = 0; l < 8; ++l) p[0][l] += elem(8 * i + l);
  }
  for (int k = 1; k < 4; ++k) {
    for (int l = 0; l < 8; ++l) p[0][l] += p[k][l];
  }
  float s = 0.f;
  for (int64_t i = nv * 8; i < n; ++i) s += elem(i);
  for (int l = 0; l < 8; ++l) s += p[0][l];
  return s;
}

EPD_HD float TorchSum(const float* x, int64_t n) { return TorchSumOf(n, internal::PlainElem{x}); }

// torch's `x.square().mean(-1)` in fp32: the squares (rounded), TorchSum, then / n.
EPD_HD float TorchMeanSquare(const float* x, int64_t n) {
  return TorchSumOf(n, internal::SquareElem{x}) / static_cast<float>(n);
}

// An fp32 matmul's dot (torch on the reference BLAS, sgemm's dot loop): index order.
EPD_HD float DotSeq(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// s + a bf16 matmul's dot over elements [i, n) (i even): torch -> oneDNN, whose AVX512-BF16
// kernels accumulate with vdpbf16ps: per pair of elements, the odd one's product is added first,
// then the even one's: 1, 0, 3, 2, ...; an odd last element comes last. Products of bf16 values
// are exact in fp32.
EPD_HD float DotDpFrom(const float* a, const float* b, int64_t i, int64_t n, float s) {
  for (; i + 2 <= n; i += 2) {
    s += a[i + 1] * b[i + 1];
    EPD_OPAQUE(s);
    s += a[i] * b[i];
  }
  if (i < n) s += a[i] * b[i];
  return s;
}
EPD_HD float DotDp(const float* a, const float* b, int64_t n) { return DotDpFrom(a, b, 0, n, 0.f); }

}  // namespace epd::kernels::torch_math
