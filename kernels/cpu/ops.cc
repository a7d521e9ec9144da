#include "kernels/cpu/ops.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/cpu/numerics.h"
#include "kernels/hc_math.h"
#include "kernels/torch_math.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EPD_AVX2_PATH 1
// AVX2 without FMA: every product is rounded before its sum, as in the scalar code.
#define EPD_AVX2 __attribute__((target("avx2")))
#endif

namespace epd::kernels::cpu {
namespace {

// What the CPU has, detected once: AVX2 (every SIMD path) and FMA (TorchExpN's lanes besides).
struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
};
CpuFeatures DetectFeatures() {
  CpuFeatures f;
#ifdef EPD_AVX2_PATH
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = f.avx2 && __builtin_cpu_supports("fma");
#endif
  return f;
}
const CpuFeatures& Features() {
  static const CpuFeatures features = DetectFeatures();
  return features;
}
// The switch (ops.h): per thread, set only by ScopedScalarKernels (REVIEW: a process-wide switch
// let one test's setting leak into others).
thread_local bool t_scalar = false;
inline bool UseSimd() { return !t_scalar && Features().avx2; }

// The reference's plain matmuls, in their summation order (kernels/torch_math.h, shared with the
// CUDA kernels): fp32 in index order (DotSeq), bf16 in oneDNN's pairwise order (DotDp).
using torch_math::DotDp;
using torch_math::DotDpFrom;
using torch_math::DotSeq;

// ---- Packed weights: checkpoint codes decoded on the fly (exact element values) ----
const float* E4M3Values() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[i] = DecodeE4M3(static_cast<uint8_t>(i));
    return a;
  }();
  return t.data();
}
const float* E8M0Values() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[i] = DecodeE8M0(static_cast<uint8_t>(i));
    return a;
  }();
  return t.data();
}

// The scales of a packed weight as floats (into `buf`).
const float* DecodeScales(const QuantWeight& w, std::vector<float>& buf) {
  const int64_t n = w.scale_codes.bytes();
  buf.resize(n);
  const uint8_t* c = w.scale_codes.as<uint8_t>();
  const float* t = E8M0Values();
  for (int64_t i = 0; i < n; ++i) buf[i] = t[c[i]];
  return buf.data();
}

// Rows [o, o + n) of a packed weight as floats: out [n, in].
void DecodeRowsScalar(const QuantWeight& w, int64_t o, int64_t n, float* out) {
  const int64_t k = w.in;
  if (w.format == WeightFormat::kFp8E4M3) {
    const uint8_t* c = w.codes.as<uint8_t>() + o * k;
    const float* t = E4M3Values();
    for (int64_t i = 0; i < n * k; ++i) out[i] = t[c[i]];
  } else {
    const uint8_t* c = w.codes.as<uint8_t>() + o * (k / 2);
    for (int64_t i = 0; i < n * k / 2; ++i) {
      out[2 * i] = kE2M1Values[c[i] & 0xf];
      out[2 * i + 1] = kE2M1Values[c[i] >> 4];
    }
  }
}

#ifdef EPD_AVX2_PATH
// DecodeRowsScalar for in % 8 == 0, 8 elements per instruction (the same values, bit for bit).
EPD_AVX2 void DecodeRowsAvx(const QuantWeight& w, int64_t o, int64_t n, float* out) {
  const int64_t k = w.in;
  if (w.format == WeightFormat::kFp8E4M3) {
    const uint8_t* c = w.codes.as<uint8_t>() + o * k;
    const __m256i m7f = _mm256_set1_epi32(0x7f), m80 = _mm256_set1_epi32(0x80),
                  bias = _mm256_set1_epi32(120 << 23), eight = _mm256_set1_epi32(8);
    const __m256 sub_scale = _mm256_set1_ps(0x1p-9f),
                 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    for (int64_t i = 0; i < n * k; i += 8) {
      const __m256i b =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
      const __m256i em = _mm256_and_si256(b, m7f);
      // Normal: exponent field + (127 - 7); subnormal (exponent 0): mantissa * 2^-9.
      const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), bias));
      const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), sub_scale);
      __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(eight, em)));
      v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, m80), 24)));
      v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, m7f)));
      _mm256_storeu_ps(out + i, v);
    }
  } else {
    const uint8_t* c = w.codes.as<uint8_t>() + o * (k / 2);
    const __m256 lut = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
                  m0f = _mm256_set1_epi32(0xf), m8 = _mm256_set1_epi32(8);
    for (int64_t i = 0; i < n * k / 2; i += 4) {
      int32_t word;
      std::memcpy(&word, c + i, 4);
      const __m256i code =
          _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), m0f);
      const __m256 mag = _mm256_permutevar8x32_ps(lut, code);  // low 3 bits pick the magnitude
      _mm256_storeu_ps(out + 2 * i, _mm256_or_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(
                                                          _mm256_and_si256(code, m8), 28))));
    }
  }
}
#endif

// LinearQuant's outputs o_begin .. out-1 of the quantized rows q [rows, in] / s [rows, nb], one
// output at a time: y[r, o] = bf16(sum over blocks b in order of DotSeq(q_r, w_o) over block b *
// s[r, b] * the weight's scale of block b). The block sum is the reference's: fp32, in K order
// from +0 (MODEL.md; golden set d is sensitive to it). A packed weight row is decoded into wdec
// [in] first (by DecodeRowsAvx when `avx`: the same values).
void QuantOutputs(const float* q, const float* s, int64_t rows, const QuantWeight& w,
                  const float* scales, int64_t o_begin, [[maybe_unused]] bool avx, float* wdec,
                  float* y) {
  const int64_t k = w.in, nb = (k + 31) / 32, scols = w.scale_cols();
  for (int64_t o = o_begin; o < w.out; ++o) {
    const float* wr = wdec;
    if (!w.packed()) {
      wr = w.values.data() + o * k;
#ifdef EPD_AVX2_PATH
    } else if (avx) {
      DecodeRowsAvx(w, o, 1, wdec);
#endif
    } else {
      DecodeRowsScalar(w, o, 1, wdec);
    }
    const float* ws = scales + (o / w.block_rows) * scols;
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * k;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t b0 = b * 32;
        // Products of E4M3/E2M1 values are exact; their sum is not always (a small product
        // next to large ones loses low bits), so the order is the reference's.
        acc += DotSeq(qr + b0, wr + b0, std::min<int64_t>(32, k - b0)) * s[r * nb + b] *
               ws[b0 / w.block_cols];
      }
      y[r * w.out + o] = RoundBf16(acc);
    }
  }
}

#ifdef EPD_AVX2_PATH
// A plain weight's elements as fp32: fp32 values as they are, bf16 bits widened (exactly).
inline float Widen(float v) { return v; }
inline float Widen(uint16_t b) { return Bf16BitsToF32(b); }
EPD_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
EPD_AVX2 inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The 8x8 transpose of rows r0..r7 (8 floats each) into c: c[i] = element i of the 8 rows.
EPD_AVX2 inline void Transpose8x8(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5,
                                  __m256 r6, __m256 r7, __m256 c[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
               t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
               t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  c[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  c[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  c[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  c[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  c[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  c[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  c[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  c[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Lane j = DotSeq (dp = false) or DotDp (dp = true) of x and rows[j], n % 8 == 0: 8x8 tiles are
// transposed so that lane j walks row j's elements in the dot's order. W: float or bf16 bits.
template <typename W>
EPD_AVX2 inline __m256 DotOrdered8(const float* x, const W* const* rows, int64_t n, bool dp) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    // c[i]: element d+i of the 8 rows.
    __m256 c[8];
    Transpose8x8(Load8(rows[0] + d), Load8(rows[1] + d), Load8(rows[2] + d), Load8(rows[3] + d),
                 Load8(rows[4] + d), Load8(rows[5] + d), Load8(rows[6] + d), Load8(rows[7] + d), c);
    for (int i = 0; i < 8; ++i) {
      const int e = dp ? (i ^ 1) : i;
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(x[d + e]), c[e]));
    }
  }
  return acc;
}

// y[r, o] = f(DotSeq or DotDp of x[r], w[o]) for 8 outputs at a time; f = RoundBf16 when `round`.
// y's rows are `ldy` apart. W: float, or bf16 bits widened as they are loaded (the same values,
// so the same bits, from half the bytes).
template <typename W>
EPD_AVX2 void LinearOrderedAvx(const float* x, int64_t rows, const W* w, int64_t out, int64_t in,
                               float* y, int64_t ldy, bool round, bool dp) {
  const int64_t n8 = in / 8 * 8, o8 = out / 8 * 8;
  alignas(32) float d[8];
  const W* wr[8];
  // The dot of x[r] and weight row `row`'s elements [n8, in) onto s, in the dot's order (n8 is
  // even, so DotDp's pairs are unchanged by starting there).
  auto tail = [&](const float* xr, const W* row, float s) {
    float t[8];
    for (int64_t i = n8; i < in; ++i) t[i - n8] = Widen(row[i]);
    if (dp) return DotDpFrom(xr + n8, t, 0, in - n8, s);
    for (int64_t i = n8; i < in; ++i) s += xr[i] * t[i - n8];
    return s;
  };
  if (rows < 4) {
    // Few rows (decode, mHC mixes): transpose the weight tiles in registers for each row.
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * in;
      float* yr = y + r * ldy;
      for (int64_t o = 0; o < o8; o += 8) {
        for (int k = 0; k < 8; ++k) wr[k] = w + (o + k) * in;
        _mm256_store_ps(d, DotOrdered8(xr, wr, n8, dp));
        for (int k = 0; k < 8; ++k) {
          const float s = tail(xr, wr[k], d[k]);
          yr[o + k] = round ? RoundBf16(s) : s;
        }
      }
    }
  } else {
    // Many rows: the group's 8 weight rows are transposed once (wt[i * 8 + k] = w[o + k][i]) and
    // reused for every row of x.
    thread_local std::vector<float> wt;
    wt.resize(in * 8);
    for (int64_t o = 0; o < o8; o += 8) {
      for (int k = 0; k < 8; ++k) wr[k] = w + (o + k) * in;
      for (int64_t i = 0; i < in; ++i) {
        for (int k = 0; k < 8; ++k) wt[i * 8 + k] = Widen(wr[k][i]);
      }
      const float* t = wt.data();
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * in;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        if (dp) {
          for (; i + 2 <= in; i += 2) {
            acc = _mm256_add_ps(
                acc, _mm256_mul_ps(_mm256_set1_ps(xr[i + 1]), _mm256_loadu_ps(t + (i + 1) * 8)));
            acc = _mm256_add_ps(acc,
                                _mm256_mul_ps(_mm256_set1_ps(xr[i]), _mm256_loadu_ps(t + i * 8)));
          }
        }
        for (; i < in; ++i)
          acc =
              _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(xr[i]), _mm256_loadu_ps(t + i * 8)));
        _mm256_store_ps(d, acc);
        float* yr = y + r * ldy + o;
        for (int k = 0; k < 8; ++k) yr[k] = round ? RoundBf16(d[k]) : d[k];
      }
    }
  }
  // The last out % 8 outputs, one row at a time.
  thread_local std::vector<float> row;
  row.resize(in);
  for (int64_t o = o8; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) row[i] = Widen(w[o * in + i]);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * in;
      const float s = dp ? DotDp(xr, row.data(), in) : DotSeq(xr, row.data(), in);
      y[r * ldy + o] = round ? RoundBf16(s) : s;
    }
  }
}

// QuantizeFp8Row for k % 32 == 0 (blocks with a NaN take the scalar code).
EPD_AVX2 void QuantizeFp8RowAvx(const float* x, int64_t k, float* q, float* scales) {
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(448.f),
               nlim = _mm256_set1_ps(-448.f), sub = _mm256_set1_ps(0x1p-6f);
  const __m256i half = _mm256_set1_epi32(0x7ffff), one = _mm256_set1_epi32(1),
                mask = _mm256_set1_epi32(static_cast<int>(0xfff00000u));
  for (int64_t b0 = 0, bi = 0; b0 < k; b0 += 32, ++bi) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(x + b0 + 8 * c);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[c], v[c], _CMP_UNORD_Q));
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
    }
    if (_mm256_movemask_ps(nan) != 0) {
      QuantizeFp8Row(x + b0, 32, q + b0, scales + bi);
      continue;
    }
    alignas(32) float l[8];
    _mm256_store_ps(l, amax);
    float m = 0.f;
    for (float e : l) m = std::max(m, e);
    m = std::max(m, 1e-4f);
    const float sc = Pow2Ceil(m * (1.f / 448.f));
    scales[bi] = sc;
    const __m256 sv = _mm256_set1_ps(sc);
    for (int c = 0; c < 4; ++c) {
      // clamp(x / s) then RoundE4M3 (no NaN here).
      const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[c], sv), nlim), lim);
      const __m256 a = _mm256_andnot_ps(sign, y);
      const __m256 rs =
          _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                        _mm256_set1_ps(0x1p-9f));
      __m256i u = _mm256_castps_si256(a);
      u = _mm256_add_epi32(u,
                           _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 20), one)));
      __m256 rn = _mm256_min_ps(_mm256_castsi256_ps(_mm256_and_si256(u, mask)), lim);
      __m256 r = _mm256_blendv_ps(rn, rs, _mm256_cmp_ps(a, sub, _CMP_LT_OQ));
      r = _mm256_blendv_ps(r, lim, _mm256_cmp_ps(a, lim, _CMP_GE_OQ));
      _mm256_storeu_ps(q + b0 + 8 * c, _mm256_or_ps(r, _mm256_and_ps(sign, y)));
    }
  }
}

// wt[i * 8 + j] = w[j * k + i] for the 8 rows of w [8, k] (k % 8 == 0), 8x8 tiles transposed in
// registers.
EPD_AVX2 inline void Transpose8Rows(const float* w, int64_t k, float* wt) {
  __m256 c[8];
  for (int64_t i = 0; i < k; i += 8) {
    Transpose8x8(_mm256_loadu_ps(w + i), _mm256_loadu_ps(w + k + i),
                 _mm256_loadu_ps(w + 2 * k + i), _mm256_loadu_ps(w + 3 * k + i),
                 _mm256_loadu_ps(w + 4 * k + i), _mm256_loadu_ps(w + 5 * k + i),
                 _mm256_loadu_ps(w + 6 * k + i), _mm256_loadu_ps(w + 7 * k + i), c);
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wt + (i + j) * 8, c[j]);
  }
}

// Rows r .. r+NR-1 of LinearQuant's 8 outputs at o (AVX2 lanes = the outputs): each quantization
// block's dot in K order from +0 (lane j walks output j's elements in order: the transposed
// weight group wt[i * 8 + j]), times the row's act scale and the outputs' weight scales, added to
// the running sum in block order; the NR rows interleave to hide the adds' latency. The same
// operations as QuantOutputs' scalar loop, lane for lane.
template <int NR>
EPD_AVX2 inline void QuantRowsAvx(const float* q, const float* s, int64_t r, int64_t k,
                                  int64_t nb, const float* wt, const float* wsT, float* y,
                                  int64_t ldy) {
  __m256 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 d[NR];
    for (int j = 0; j < NR; ++j) d[j] = _mm256_setzero_ps();
    const float* wb = wt + b * 32 * 8;
    for (int i = 0; i < 32; ++i) {
      const __m256 wv = _mm256_loadu_ps(wb + i * 8);
      for (int j = 0; j < NR; ++j)
        d[j] = _mm256_add_ps(d[j], _mm256_mul_ps(_mm256_set1_ps(q[(r + j) * k + b * 32 + i]), wv));
    }
    const __m256 wsv = _mm256_loadu_ps(wsT + b * 8);
    for (int j = 0; j < NR; ++j)
      acc[j] = _mm256_add_ps(
          acc[j], _mm256_mul_ps(_mm256_mul_ps(d[j], _mm256_set1_ps(s[(r + j) * nb + b])), wsv));
  }
  alignas(32) float res[8];
  for (int j = 0; j < NR; ++j) {
    _mm256_store_ps(res, acc[j]);
    for (int o = 0; o < 8; ++o) y[(r + j) * ldy + o] = RoundBf16(res[o]);
  }
}

// QuantRowsAvx<1> for a row alone (decode): C blocks' dots run as C independent chains (each
// still in K order from +0), then join the running sum in block order: the same operations, 1/C of
// the add latency (8 chains keep AVX2's two adders busy).
template <int C>
EPD_AVX2 inline void QuantRowAvx(const float* q, const float* s, int64_t r, int64_t k, int64_t nb,
                                 const float* wt, const float* wsT, float* y, int64_t ldy) {
  const float* xr = q + r * k;
  const float* sr = s + r * nb;
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + C <= nb; b += C) {
    __m256 d[C];
    for (int j = 0; j < C; ++j) d[j] = _mm256_setzero_ps();
    const float* wb = wt + b * 32 * 8;
    for (int i = 0; i < 32; ++i) {
      for (int j = 0; j < C; ++j)
        d[j] = _mm256_add_ps(d[j], _mm256_mul_ps(_mm256_set1_ps(xr[(b + j) * 32 + i]),
                                                 _mm256_loadu_ps(wb + (j * 32 + i) * 8)));
    }
    for (int j = 0; j < C; ++j)
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d[j], _mm256_set1_ps(sr[b + j])),
                                             _mm256_loadu_ps(wsT + (b + j) * 8)));
  }
  for (; b < nb; ++b) {
    __m256 d = _mm256_setzero_ps();
    const float* wb = wt + b * 32 * 8;
    for (int i = 0; i < 32; ++i)
      d = _mm256_add_ps(d, _mm256_mul_ps(_mm256_set1_ps(xr[b * 32 + i]), _mm256_loadu_ps(wb + i * 8)));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(sr[b])),
                                           _mm256_loadu_ps(wsT + b * 8)));
  }
  alignas(32) float res[8];
  _mm256_store_ps(res, acc);
  for (int o = 0; o < 8; ++o) y[r * ldy + o] = RoundBf16(res[o]);
}

// LinearQuant for in % 32 == 0: rows quantized first, then 8 outputs at a time for every row
// (the weight group stays in cache), the same per-output operations as the scalar code. The
// group's 8 weight rows are decoded to their element values (packed weights, exact) and
// transposed once into wt, so that each lane's block dot runs in K order.
EPD_AVX2 void LinearQuantAvx(const float* x, int64_t rows, const QuantWeight& w, float* y) {
  const int64_t k = w.in, nb = k / 32, scols = w.scale_cols(), o8 = w.out / 8 * 8;
  thread_local std::vector<float> q, s, wsT, wdec, sdec, wt;
  thread_local std::vector<int64_t> bcol;
  bcol.resize(nb);
  for (int64_t b = 0; b < nb; ++b) bcol[b] = b * 32 / w.block_cols;
  q.resize(rows * k);
  s.resize(rows * nb);
  wsT.resize(nb * 8);
  wt.resize(k * 8);
  const float* scales = w.packed() ? DecodeScales(w, sdec) : w.scales.data();
  wdec.resize(8 * k);
  for (int64_t r = 0; r < rows; ++r)
    QuantizeFp8RowAvx(x + r * k, k, q.data() + r * k, s.data() + r * nb);
  for (int64_t o = 0; o < o8; o += 8) {
    if (w.block_rows % 8 == 0) {  // the 8 outputs share one scale row
      const float* wsr = scales + (o / w.block_rows) * scols;
      for (int64_t b = 0; b < nb; ++b) {
        _mm256_storeu_ps(wsT.data() + b * 8, _mm256_set1_ps(wsr[bcol[b]]));
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const float* wsr = scales + ((o + j) / w.block_rows) * scols;
        for (int64_t b = 0; b < nb; ++b) wsT[b * 8 + j] = wsr[bcol[b]];
      }
    }
    const float* wr;
    if (w.packed()) {
      DecodeRowsAvx(w, o, 8, wdec.data());
      wr = wdec.data();
    } else {
      wr = w.values.data() + o * k;
    }
    Transpose8Rows(wr, k, wt.data());
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      QuantRowsAvx<4>(q.data(), s.data(), r, k, nb, wt.data(), wsT.data(), y + o, w.out);
    for (; r < rows; ++r) {
      if (nb >= 8) {
        QuantRowAvx<8>(q.data(), s.data(), r, k, nb, wt.data(), wsT.data(), y + o, w.out);
      } else {
        QuantRowAvx<4>(q.data(), s.data(), r, k, nb, wt.data(), wsT.data(), y + o, w.out);
      }
    }
  }
  QuantOutputs(q.data(), s.data(), rows, w, scales, o8, /*avx=*/true, wdec.data(), y);
}
#endif

}  // namespace

bool SimdEnabled() { return UseSimd(); }

ScopedScalarKernels::ScopedScalarKernels(bool scalar) : active_(scalar), prev_(t_scalar) {
  if (active_) t_scalar = true;
}
ScopedScalarKernels::~ScopedScalarKernels() {
  if (active_) t_scalar = prev_;
}

void LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) {
#ifdef EPD_AVX2_PATH
  if (UseSimd() && w.in % 32 == 0) return LinearQuantAvx(x, rows, w, y);
#endif
  const int64_t k = w.in;
  const int64_t nb = (k + 31) / 32;
  std::vector<float> q(rows * k), s(rows * nb), wdec, sdec;
  const float* scales = w.packed() ? DecodeScales(w, sdec) : w.scales.data();
  if (w.packed()) wdec.resize(k);
  for (int64_t r = 0; r < rows; ++r)
    QuantizeFp8Row(x + r * k, k, q.data() + r * k, s.data() + r * nb);
  QuantOutputs(q.data(), s.data(), rows, w, scales, 0, /*avx=*/false, wdec.data(), y);
}

namespace {

// Calls fn(wf, o0, n) for blocks of the weight's outputs, wf holding outputs o0 .. o0+n-1 as fp32
// rows [n, in]: the weight itself in its fp32 form; bf16 bits widened (exactly) block by block
// into a scratch of at most 256 KiB, so the scalar dots read fp32 either way (the SIMD path
// widens as it loads instead).
template <typename Fn>
void ForF32Rows(PlainWeight w, int64_t out, int64_t in, Fn fn) {
  if (w.dtype == PlainDtype::kF32) {
    fn(static_cast<const float*>(w.data), 0, out);
    return;
  }
  const auto* bits = static_cast<const uint16_t*>(w.data);
  const int64_t block = std::max<int64_t>(8, (int64_t{1} << 16) / std::max<int64_t>(in, 1) / 8 * 8);
  thread_local std::vector<float> wf;
  for (int64_t o0 = 0; o0 < out; o0 += block) {
    const int64_t n = std::min(block, out - o0);
    wf.resize(n * in);
    Bf16BitsToF32N(bits + o0 * in, n * in, wf.data());
    fn(static_cast<const float*>(wf.data()), o0, n);
  }
}

// LinearBf16 (bf16: DotDp, rounded) and LinearF32 (DotSeq).
void PlainLinear(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in, float* y,
                 bool bf16) {
#ifdef EPD_AVX2_PATH
  if (UseSimd()) {
    if (w.dtype == PlainDtype::kBf16) {
      return LinearOrderedAvx(x, rows, static_cast<const uint16_t*>(w.data), out, in, y, out,
                              /*round=*/bf16, /*dp=*/bf16);
    }
    return LinearOrderedAvx(x, rows, static_cast<const float*>(w.data), out, in, y, out,
                            /*round=*/bf16, /*dp=*/bf16);
  }
#endif
  ForF32Rows(w, out, in, [&](const float* wf, int64_t o0, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * in;
      for (int64_t o = 0; o < n; ++o) {
        y[r * out + o0 + o] =
            bf16 ? RoundBf16(DotDp(xr, wf + o * in, in)) : DotSeq(xr, wf + o * in, in);
      }
    }
  });
}

}  // namespace

void LinearBf16(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in, float* y) {
  PlainLinear(x, rows, w, out, in, y, /*bf16=*/true);
}

void LinearF32(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in, float* y) {
  PlainLinear(x, rows, w, out, in, y, /*bf16=*/false);
}

void RmsNormBf16(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = 1.f / std::sqrt(TorchMeanSquare(xr, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = RoundBf16(w[i] * (xr[i] * inv));
  }
}

void Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs, const float* cos,
          const float* sin, bool inverse) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * n_pairs;
    const float* s = sin + r * n_pairs;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * stride + offset;
      for (int i = 0; i < n_pairs; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        const float si = inverse ? -s[i] : s[i];
        v[2 * i] = RoundBf16(a * c[i] - b * si);
        v[2 * i + 1] = RoundBf16(a * si + b * c[i]);
      }
    }
  }
}

namespace {
inline const float* KvRow(const SparseAttentionArgs& a, int32_t t) {
  return t >= a.kv_ext_start ? a.kv_ext + (t - a.kv_ext_start) * a.head_dim
                             : a.kv + static_cast<int64_t>(t) * a.head_dim;
}

}  // namespace

float TorchExp(float d) { return torch_math::TorchExp(d); }

#ifdef EPD_AVX2_PATH
namespace {
// TorchExp of 8 lanes: the same operations (FMA where Sleef fuses).
__attribute__((target("avx2,fma"))) void TorchExpAvx(const float* x, float* y, int64_t n) {
  const __m256 r_ln2 = _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934f),
               l2u = _mm256_set1_ps(-0.693145751953125f),
               l2l = _mm256_set1_ps(-1.428606765330187045e-06f), one = _mm256_set1_ps(1.f),
               lo = _mm256_set1_ps(-104.f), hi = _mm256_set1_ps(100.f),
               inf = _mm256_set1_ps(INFINITY);
  const __m256i bias = _mm256_set1_epi32(0x7f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_loadu_ps(x + i);
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, r_ln2));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, l2u, d);
    s = _mm256_fmadd_ps(qf, l2l, s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(one, _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i q1 = _mm256_srai_epi32(q, 1), q2 = _mm256_sub_epi32(q, q1);
    u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q1, bias), 23)));
    u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q2, bias), 23)));
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, lo, _CMP_LT_OQ), u);
    u = _mm256_blendv_ps(u, inf, _mm256_cmp_ps(hi, d, _CMP_LT_OQ));
    u = _mm256_or_ps(u, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
    _mm256_storeu_ps(y + i, u);
  }
  for (; i < n; ++i) y[i] = TorchExp(x[i]);
}
}  // namespace
#endif

void TorchExpN(const float* x, float* y, int64_t n) {
#ifdef EPD_AVX2_PATH
  if (UseSimd() && Features().fma) return TorchExpAvx(x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = TorchExp(x[i]);
}

float TorchSum(const float* x, int64_t n) { return torch_math::TorchSum(x, n); }

float TorchChunkSum(const float* x, int64_t n) { return TorchSum(x, n); }

float TorchMeanSquare(const float* x, int64_t n) { return torch_math::TorchMeanSquare(x, n); }

#ifdef EPD_AVX2_PATH
namespace {
// SparseAttention for head_dim % 8 == 0: the same operations, 8 keys (scores) or 8 dims (the
// P.V update) per instruction.
EPD_AVX2 void SparseAttentionAvx(const SparseAttentionArgs& a) {
  const int hd = a.head_dim;
  std::vector<float> num(hd), cs(hd), p(64);
  const float* rows[64];
  int js[64];
  alignas(32) float d8[8];
  for (int64_t r = 0; r < a.rows; ++r) {
    const int32_t* idx = a.idx + r * a.list_len;
    for (int h = 0; h < a.heads; ++h) {
      const float* q = a.q + (r * a.heads + h) * hd;
      float* out = a.out + (r * a.heads + h) * hd;
      float m = -1e30f, den = 0.f;
      std::fill(num.begin(), num.end(), 0.f);
      for (int64_t c0 = 0; c0 < a.list_len; c0 += 64) {
        const int64_t n = std::min<int64_t>(64, a.list_len - c0);
        int nv = 0;
        for (int64_t j = 0; j < n; ++j) {
          const int32_t t = idx[c0 + j];
          p[j] = -INFINITY;
          if (t < 0) continue;
          rows[nv] = KvRow(a, t);
          js[nv++] = static_cast<int>(j);
        }
        if (nv == 0) continue;  // alpha = exp(0) = 1, every p is 0: the chunk is a no-op
        float cmax = -INFINITY;
        int v = 0;
        for (; v + 8 <= nv; v += 8) {
          _mm256_store_ps(d8, DotOrdered8(q, rows + v, hd, /*dp=*/false));
          for (int k = 0; k < 8; ++k) p[js[v + k]] = d8[k] * a.scale;
        }
        for (; v < nv; ++v) p[js[v]] = DotSeq(q, rows[v], hd) * a.scale;
        for (int k = 0; k < nv; ++k) cmax = std::max(cmax, p[js[k]]);
        const float m_new = std::max(m, cmax);
        const float alpha = TorchExp(m - m_new);
        for (int64_t j = 0; j < n; ++j) p[j] -= m_new;  // -1 entries: -inf - m_new = -inf -> 0
        TorchExpN(p.data(), p.data(), n);
        std::fill(cs.begin(), cs.end(), 0.f);
        for (int k = 0; k < nv; ++k) {
          const __m256 pb = _mm256_set1_ps(RoundBf16(p[js[k]]));
          const float* kr = rows[k];
          for (int d = 0; d < hd; d += 8) {
            _mm256_storeu_ps(cs.data() + d,
                             _mm256_add_ps(_mm256_loadu_ps(cs.data() + d),
                                           _mm256_mul_ps(pb, _mm256_loadu_ps(kr + d))));
          }
        }
        const __m256 av = _mm256_set1_ps(alpha);
        for (int d = 0; d < hd; d += 8)
          _mm256_storeu_ps(num.data() + d,
                           _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(num.data() + d), av),
                                         _mm256_loadu_ps(cs.data() + d)));
        den = den * alpha + TorchChunkSum(p.data(), n);
        m = m_new;
      }
      den += TorchExp(a.sink[h] - m);
      for (int d = 0; d < hd; ++d) out[d] = RoundBf16(num[d] / den);
    }
  }
}
}  // namespace
#endif

// The reference kernel (MODEL.md §3 step 8), per row and head, over the list in 64-entry chunks:
// scores s = DotSeq(q, k) * scale (-1 entries: -inf); m' = max(m, chunk max); alpha = exp(m -
// m'); p = exp(s - m') (0 for -1 entries); den = den * alpha + TorchChunkSum(p) (the chunk's
// probabilities summed first, in torch's order); the chunk's numerator cs = sum of bf16(p_j) * k_j
// in list order from +0, then num = num * alpha + cs (the reference forms the chunk's sum first);
// finally den += exp(sink - m), out = bf16(num / den).
void SparseAttention(const SparseAttentionArgs& a) {
#ifdef EPD_AVX2_PATH
  if (UseSimd() && a.head_dim % 8 == 0) return SparseAttentionAvx(a);
#endif
  const int hd = a.head_dim;
  std::vector<float> num(hd), cs(hd), p(64);
  for (int64_t r = 0; r < a.rows; ++r) {
    const int32_t* idx = a.idx + r * a.list_len;
    for (int h = 0; h < a.heads; ++h) {
      const float* q = a.q + (r * a.heads + h) * hd;
      float* out = a.out + (r * a.heads + h) * hd;
      float m = -1e30f, den = 0.f;
      std::fill(num.begin(), num.end(), 0.f);
      for (int64_t c0 = 0; c0 < a.list_len; c0 += 64) {
        const int64_t n = std::min<int64_t>(64, a.list_len - c0);
        float cmax = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          const int32_t t = idx[c0 + j];
          if (t < 0) {
            p[j] = -INFINITY;
            continue;
          }
          p[j] = DotSeq(q, KvRow(a, t), hd) * a.scale;
          cmax = std::max(cmax, p[j]);
        }
        const float m_new = std::max(m, cmax);
        const float alpha = TorchExp(m - m_new);
        std::fill(cs.begin(), cs.end(), 0.f);
        for (int64_t j = 0; j < n; ++j) {
          const int32_t t = idx[c0 + j];
          if (t < 0) {
            p[j] = 0.f;
            continue;
          }
          p[j] = TorchExp(p[j] - m_new);
          const float pb = RoundBf16(p[j]);
          const float* k = KvRow(a, t);
          for (int d = 0; d < hd; ++d) cs[d] += pb * k[d];
        }
        for (int d = 0; d < hd; ++d) num[d] = num[d] * alpha + cs[d];
        den = den * alpha + TorchChunkSum(p.data(), n);
        m = m_new;
      }
      den += TorchExp(a.sink[h] - m);
      for (int d = 0; d < hd; ++d) out[d] = RoundBf16(num[d] / den);
    }
  }
}

#ifdef EPD_AVX2_PATH
namespace {
// IndexerScores for heads % 4 == 0: lanes are (4 heads) x (2 keys); 8 keys per pass.
EPD_AVX2 int64_t IndexerScoresAvx(const float* q, const float* w, int heads, const float* keys,
                                  int64_t n, int64_t dim, float* score) {
  const int groups = heads / 4;
  // qd[g][e] = [q_{4g..4g+3}[e], q_{4g..4g+3}[e]]
  std::vector<float> qd(static_cast<size_t>(groups) * dim * 8);
  for (int g = 0; g < groups; ++g) {
    for (int64_t e = 0; e < dim; ++e) {
      for (int j = 0; j < 8; ++j) qd[(g * dim + e) * 8 + j] = q[(4 * g + j % 4) * dim + e];
    }
  }
  std::vector<float> dots(static_cast<size_t>(heads) * 8);
  const int64_t n8 = n / 8 * 8;
  for (int64_t t0 = 0; t0 < n8; t0 += 8) {
    const float* k0 = keys + t0 * dim;
    for (int g = 0; g < groups; ++g) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const float* qg = qd.data() + g * dim * 8;
      // DotDp's order: e = 1, 0, 3, 2, ...; an odd last element last.
      for (int64_t i = 0; i < dim; ++i) {
        const int64_t e = (i ^ 1) < dim ? (i ^ 1) : i;
        const __m256 qv = _mm256_loadu_ps(qg + e * 8);
        const float* ke = k0 + e;
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(qv, _mm256_set_m128(_mm_broadcast_ss(ke + dim),
                                                                 _mm_broadcast_ss(ke))));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(qv, _mm256_set_m128(_mm_broadcast_ss(ke + 3 * dim),
                                                                 _mm_broadcast_ss(ke + 2 * dim))));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(qv, _mm256_set_m128(_mm_broadcast_ss(ke + 5 * dim),
                                                                 _mm_broadcast_ss(ke + 4 * dim))));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(qv, _mm256_set_m128(_mm_broadcast_ss(ke + 7 * dim),
                                                                 _mm_broadcast_ss(ke + 6 * dim))));
      }
      // dots[key][head]: lanes 0-3 -> key 2i, lanes 4-7 -> key 2i+1.
      const __m256 acc[4] = {a0, a1, a2, a3};
      for (int i = 0; i < 4; ++i) {
        _mm_storeu_ps(dots.data() + (2 * i) * heads + 4 * g, _mm256_castps256_ps128(acc[i]));
        _mm_storeu_ps(dots.data() + (2 * i + 1) * heads + 4 * g, _mm256_extractf128_ps(acc[i], 1));
      }
    }
    for (int i = 0; i < 8; ++i) {
      float acc = 0.f;
      for (int h = 0; h < heads; ++h) {
        const float s = std::max(RoundBf16(dots[i * heads + h]), 0.f);
        acc += RoundBf16(s * w[h]);
      }
      score[t0 + i] = RoundBf16(acc);
    }
  }
  return n8;
}
}  // namespace
#endif

void IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                   int64_t dim, float* score) {
  int64_t t = 0;
#ifdef EPD_AVX2_PATH
  if (UseSimd() && heads % 4 == 0) t = IndexerScoresAvx(q, w, heads, keys, n, dim, score);
#endif
  for (; t < n; ++t) {
    const float* kt = keys + t * dim;
    float acc = 0.f;
    for (int h = 0; h < heads; ++h) {
      const float* qh = q + h * dim;
      const float s = std::max(RoundBf16(DotDp(qh, kt, dim)), 0.f);
      acc += RoundBf16(s * w[h]);
    }
    score[t] = RoundBf16(acc);
  }
}

std::vector<int32_t> StableTopK(const float* v, int64_t n, int64_t k) {
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min(k, n);
  auto cmp = [v](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), cmp);
  idx.resize(k);
  return idx;
}

void HcMixes(const float* h, int hc, int64_t dim, const float* fn, const float* scale,
             const float* base, int sinkhorn_iters, float hc_eps, float norm_eps, float* pre,
             float* post, float* comb, bool torch_vector_exp) {
  const int64_t n = hc * dim;
  const int nm = (2 + hc) * hc;
  const float rs = 1.f / std::sqrt(TorchMeanSquare(h, n) + norm_eps);
  std::vector<float> m(nm);  // the projection's dots, each scaled by rs where it is used
#ifdef EPD_AVX2_PATH
  if (UseSimd()) {
    LinearOrderedAvx(h, 1, fn, nm, n, m.data(), nm, /*round=*/false, /*dp=*/false);
  } else
#endif
  {
    for (int j = 0; j < nm; ++j) m[j] = DotSeq(h, fn + j * n, n);
  }
  // torch.sigmoid: 1 / (1 + exp(-x)) with Sleef's exp on its vectorized path, glibc's expf on
  // its scalar path (single-token calls: 4-element tensors).
  auto sigmoid = [torch_vector_exp](float x) {
    return 1.f / (1.f + (torch_vector_exp ? TorchExp(-x) : std::exp(-x)));
  };
  for (int j = 0; j < hc; ++j) pre[j] = sigmoid((m[j] * rs) * scale[0] + base[j]) + hc_eps;
  for (int j = 0; j < hc; ++j) {
    post[j] = 2.f * sigmoid((m[hc + j] * rs) * scale[1] + base[hc + j]);
  }
  hc_math::HcComb(m.data() + 2 * hc, rs, scale[2], base + 2 * hc, hc, sinkhorn_iters, hc_eps, comb);
}

#ifdef EPD_AVX2_PATH
namespace {
// RoundBf16 of 8 lanes (RNE; NaN -> quiet NaN as F32ToBf16Bits).
EPD_AVX2 inline __m256 RoundBf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_and_si256(
      _mm256_add_epi32(
          u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                              _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))),
      _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i qnan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                                        _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan), isnan);
}

EPD_AVX2 void HcPreAvx(const float* h, int hc, int64_t dim, const float* pre, float* y) {
  for (int64_t d = 0; d < dim; d += 8) {
    __m256 s = _mm256_setzero_ps();
    for (int j = 0; j < hc; ++j) {
      s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_set1_ps(pre[j]), _mm256_loadu_ps(h + j * dim + d)));
    }
    _mm256_storeu_ps(y + d, RoundBf16x8(s));
  }
}

EPD_AVX2 void HcPostAvx(const float* y, const float* res, int hc, int64_t dim, const float* post,
                        const float* comb, float* out) {
  thread_local std::vector<float> tmp;
  tmp.resize(hc * dim);
  for (int k = 0; k < hc; ++k) {
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 s = _mm256_setzero_ps();
      for (int j = 0; j < hc; ++j) {
        s = _mm256_add_ps(
            s, _mm256_mul_ps(_mm256_set1_ps(comb[j * hc + k]), _mm256_loadu_ps(res + j * dim + d)));
      }
      s = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(post[k]), _mm256_loadu_ps(y + d)), s);
      _mm256_storeu_ps(tmp.data() + k * dim + d, RoundBf16x8(s));
    }
  }
  std::copy(tmp.begin(), tmp.end(), out);
}
}  // namespace
#endif

void HcPre(const float* h, int hc, int64_t dim, const float* pre, float* y) {
#ifdef EPD_AVX2_PATH
  if (UseSimd() && dim % 8 == 0) return HcPreAvx(h, hc, dim, pre, y);
#endif
  for (int64_t d = 0; d < dim; ++d) {
    float s = 0.f;
    for (int j = 0; j < hc; ++j) s += pre[j] * h[j * dim + d];
    y[d] = RoundBf16(s);
  }
}

void HcPost(const float* y, const float* res, int hc, int64_t dim, const float* post,
            const float* comb, float* out) {
#ifdef EPD_AVX2_PATH
  if (UseSimd() && dim % 8 == 0) return HcPostAvx(y, res, hc, dim, post, comb, out);
#endif
  std::vector<float> tmp(hc * dim);
  for (int k = 0; k < hc; ++k) {
    for (int64_t d = 0; d < dim; ++d) {
      // The reference: post * y + sum over j (torch.sum, in order j) of comb * res.
      float s = 0.f;
      for (int j = 0; j < hc; ++j) s += comb[j * hc + k] * res[j * dim + d];
      tmp[k * dim + d] = RoundBf16(post[k] * y[d] + s);
    }
  }
  std::copy(tmp.begin(), tmp.end(), out);
}

}  // namespace epd::kernels::cpu
