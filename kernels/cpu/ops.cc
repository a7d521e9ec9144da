#include "kernels/cpu/ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/cpu/numerics.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EPD_AVX2_PATH 1
// AVX2 without FMA: every product is rounded before its sum, as in the scalar code.
#define EPD_AVX2 __attribute__((target("avx2")))
#endif

namespace epd::kernels::cpu {
namespace {

bool DetectSimd() {
#ifdef EPD_AVX2_PATH
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}
bool SimdSupported() {
  static const bool supported = DetectSimd();
  return supported;
}
// Per-thread switch (REVIEW: the process-wide switch let one test's setting leak into others).
thread_local bool t_scalar = false;
inline bool UseSimd() { return !t_scalar && SimdSupported(); }

// Dot product with 8 independent fp32 lanes (vectorisable); used where the reference's own
// accumulation order is unspecified (plain bf16/fp32 matmuls).
inline float Dot8(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

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

#ifdef EPD_AVX2_PATH
// [v0..v7] -> [tree(v0), ..., tree(v7)] with tree(v) = ((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)), the
// lane combination of Dot8.
EPD_AVX2 inline __m256 Tree8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5,
                             __m256 v6, __m256 v7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Dot8(x, w + k*ldw, n8) for k = 0..7 (n8 a multiple of 8), in one vector.
EPD_AVX2 inline __m256 Dot8x8(const float* x, const float* w, int64_t ldw, int64_t n8) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const float* wi = w + i;
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(xv, _mm256_loadu_ps(wi)));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(xv, _mm256_loadu_ps(wi + ldw)));
    a2 = _mm256_add_ps(a2, _mm256_mul_ps(xv, _mm256_loadu_ps(wi + 2 * ldw)));
    a3 = _mm256_add_ps(a3, _mm256_mul_ps(xv, _mm256_loadu_ps(wi + 3 * ldw)));
    a4 = _mm256_add_ps(a4, _mm256_mul_ps(xv, _mm256_loadu_ps(wi + 4 * ldw)));
    a5 = _mm256_add_ps(a5, _mm256_mul_ps(xv, _mm256_loadu_ps(wi + 5 * ldw)));
    a6 = _mm256_add_ps(a6, _mm256_mul_ps(xv, _mm256_loadu_ps(wi + 6 * ldw)));
    a7 = _mm256_add_ps(a7, _mm256_mul_ps(xv, _mm256_loadu_ps(wi + 7 * ldw)));
  }
  return Tree8(a0, a1, a2, a3, a4, a5, a6, a7);
}

// Dot8 of one pair.
EPD_AVX2 inline float Dot8Avx(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[r, o] = f(Dot8(x[r], w[o], in)) for 8 outputs at a time; f = RoundBf16 when `round`.
EPD_AVX2 void LinearDot8Avx(const float* x, int64_t rows, const float* w, int64_t out, int64_t in,
                            float* y, bool round) {
  const int64_t n8 = in / 8 * 8, o8 = out / 8 * 8;
  alignas(32) float d[8];
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float* yr = y + r * out;
    for (int64_t o = 0; o < o8; o += 8) {
      _mm256_store_ps(d, Dot8x8(xr, w + o * in, in, n8));
      for (int k = 0; k < 8; ++k) {
        float s = d[k];
        const float* wk = w + (o + k) * in;
        for (int64_t i = n8; i < in; ++i) s += xr[i] * wk[i];
        yr[o + k] = round ? RoundBf16(s) : s;
      }
    }
    for (int64_t o = o8; o < out; ++o) {
      const float s = Dot8Avx(xr, w + o * in, in);
      yr[o] = round ? RoundBf16(s) : s;
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

// LinearQuant for in % 32 == 0: rows quantized first, then 8 outputs at a time for every row
// (the weight group stays in cache), the same per-output operations. Packed weights: the group's
// 8 rows are decoded to their element values first (exact), then the same loops run.
EPD_AVX2 void LinearQuantAvx(const float* x, int64_t rows, const QuantWeight& w, float* y) {
  const int64_t k = w.in, nb = k / 32, scols = w.scale_cols(), o8 = w.out / 8 * 8;
  thread_local std::vector<float> q, s, wsT, wdec, sdec;
  thread_local std::vector<int64_t> bcol;
  bcol.resize(nb);
  for (int64_t b = 0; b < nb; ++b) bcol[b] = b * 32 / w.block_cols;
  q.resize(rows * k);
  s.resize(rows * nb);
  wsT.resize(nb * 8);
  const float* scales = w.packed() ? DecodeScales(w, sdec) : w.scales.data();
  if (w.packed()) wdec.resize(8 * k);
  for (int64_t r = 0; r < rows; ++r)
    QuantizeFp8RowAvx(x + r * k, k, q.data() + r * k, s.data() + r * nb);
  alignas(32) float res[8];
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
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q.data() + r * k;
      const float* sr = s.data() + r * nb;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 d = Dot8x8(qr + b * 32, wr + b * 32, k, 32);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(sr[b])),
                                               _mm256_loadu_ps(wsT.data() + b * 8)));
      }
      _mm256_store_ps(res, acc);
      float* yr = y + r * w.out + o;
      for (int j = 0; j < 8; ++j) yr[j] = RoundBf16(res[j]);
    }
  }
  for (int64_t o = o8; o < w.out; ++o) {
    const float* wr;
    if (w.packed()) {
      DecodeRowsAvx(w, o, 1, wdec.data());
      wr = wdec.data();
    } else {
      wr = w.values.data() + o * k;
    }
    const float* wsr = scales + (o / w.block_rows) * scols;
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q.data() + r * k;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t b0 = b * 32;
        acc += Dot8(qr + b0, wr + b0, std::min<int64_t>(32, k - b0)) * s[r * nb + b] *
               wsr[b0 / w.block_cols];
      }
      y[r * w.out + o] = RoundBf16(acc);
    }
  }
}
#endif

}  // namespace

void SetSimdEnabled(bool on) { t_scalar = !on; }
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
  const int64_t scols = w.scale_cols();
  std::vector<float> q(rows * k), s(rows * nb), wdec, sdec;
  const float* scales = w.packed() ? DecodeScales(w, sdec) : w.scales.data();
  if (w.packed()) wdec.resize(k);
  for (int64_t r = 0; r < rows; ++r)
    QuantizeFp8Row(x + r * k, k, q.data() + r * k, s.data() + r * nb);
  for (int64_t o = 0; o < w.out; ++o) {
    const float* wr;
    if (w.packed()) {
      DecodeRowsScalar(w, o, 1, wdec.data());
      wr = wdec.data();
    } else {
      wr = w.values.data() + o * k;
    }
    const float* ws = scales + (o / w.block_rows) * scols;
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q.data() + r * k;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t b0 = b * 32;
        const int64_t n = std::min<int64_t>(32, k - b0);
        // Products of E4M3/E2M1 values are exact, and so are these block sums for the
        // magnitudes involved; the lanes only make the loop vectorisable.
        float d = Dot8(qr + b0, wr + b0, n);
        acc += d * s[r * nb + b] * ws[b0 / w.block_cols];
      }
      y[r * w.out + o] = RoundBf16(acc);
    }
  }
}

void LinearBf16(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y) {
#ifdef EPD_AVX2_PATH
  if (UseSimd()) return LinearDot8Avx(x, rows, w, out, in, y, /*round=*/true);
#endif
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) y[r * out + o] = RoundBf16(Dot8(x + r * in, w + o * in, in));
  }
}

void LinearF32(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y) {
#ifdef EPD_AVX2_PATH
  if (UseSimd()) return LinearDot8Avx(x, rows, w, out, in, y, /*round=*/false);
#endif
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) y[r * out + o] = Dot8(x + r * in, w + o * in, in);
  }
}

void RmsNormBf16(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float mean = static_cast<float>(ss / static_cast<double>(dim));
    const float inv = 1.f / std::sqrt(mean + eps);
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

#ifdef EPD_AVX2_PATH
namespace {
// SparseAttention for head_dim % 8 == 0: the same operations, 8 dims per instruction.
EPD_AVX2 void SparseAttentionAvx(const SparseAttentionArgs& a) {
  const int hd = a.head_dim;
  std::vector<float> num(hd), p(64);
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
        bool any = false;
        for (int64_t j = 0; j < n; ++j) {
          const int32_t t = idx[c0 + j];
          if (t < 0) {
            p[j] = -INFINITY;
            continue;
          }
          any = true;
          p[j] = Dot8Avx(q, KvRow(a, t), hd) * a.scale;
          cmax = std::max(cmax, p[j]);
        }
        if (!any) continue;  // alpha = exp(0) = 1: the scalar code's chunk is a no-op too
        const float m_new = std::max(m, cmax);
        const float alpha = std::exp(m - m_new);
        den *= alpha;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int d = 0; d < hd; d += 8)
          _mm256_storeu_ps(num.data() + d, _mm256_mul_ps(_mm256_loadu_ps(num.data() + d), av));
        for (int64_t j = 0; j < n; ++j) {
          const int32_t t = idx[c0 + j];
          if (t < 0) continue;
          const float pj = std::exp(p[j] - m_new);
          den += pj;
          const __m256 pb = _mm256_set1_ps(RoundBf16(pj));
          const float* k = KvRow(a, t);
          for (int d = 0; d < hd; d += 8) {
            _mm256_storeu_ps(num.data() + d,
                             _mm256_add_ps(_mm256_loadu_ps(num.data() + d),
                                           _mm256_mul_ps(pb, _mm256_loadu_ps(k + d))));
          }
        }
        m = m_new;
      }
      den += std::exp(a.sink[h] - m);
      for (int d = 0; d < hd; ++d) out[d] = RoundBf16(num[d] / den);
    }
  }
}
}  // namespace
#endif

void SparseAttention(const SparseAttentionArgs& a) {
#ifdef EPD_AVX2_PATH
  if (UseSimd() && a.head_dim % 8 == 0) return SparseAttentionAvx(a);
#endif
  const int hd = a.head_dim;
  std::vector<float> num(hd), p(64);
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
          const float dot = Dot8(q, KvRow(a, t), hd);
          p[j] = dot * a.scale;
          cmax = std::max(cmax, p[j]);
        }
        const float m_new = std::max(m, cmax);
        const float alpha = std::exp(m - m_new);
        den *= alpha;
        for (int d = 0; d < hd; ++d) num[d] *= alpha;
        for (int64_t j = 0; j < n; ++j) {
          const int32_t t = idx[c0 + j];
          if (t < 0) continue;
          const float pj = std::exp(p[j] - m_new);
          den += pj;
          const float pb = RoundBf16(pj);
          const float* k = KvRow(a, t);
          for (int d = 0; d < hd; ++d) num[d] += pb * k[d];
        }
        m = m_new;
      }
      den += std::exp(a.sink[h] - m);
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
      for (int64_t e = 0; e < dim; ++e) {
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
      float d = 0.f;
      for (int64_t e = 0; e < dim; ++e) d += qh[e] * kt[e];
      const float s = std::max(RoundBf16(d), 0.f);
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
             float* post, float* comb) {
  const int64_t n = hc * dim;
  const int nm = (2 + hc) * hc;
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(h[i]) * h[i];
  const float rs = 1.f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + norm_eps);
  std::vector<float> m(nm);
#ifdef EPD_AVX2_PATH
  if (UseSimd()) {
    LinearDot8Avx(h, 1, fn, nm, n, m.data(), /*round=*/false);
    for (int j = 0; j < nm; ++j) m[j] *= rs;
  } else
#endif
  {
    for (int j = 0; j < nm; ++j) m[j] = Dot8(h, fn + j * n, n) * rs;
  }
  auto sigmoid = [](float x) { return 1.f / (1.f + std::exp(-x)); };
  for (int j = 0; j < hc; ++j) pre[j] = sigmoid(m[j] * scale[0] + base[j]) + hc_eps;
  for (int j = 0; j < hc; ++j) post[j] = 2.f * sigmoid(m[hc + j] * scale[1] + base[hc + j]);
  for (int j = 0; j < hc; ++j) {
    float* row = comb + j * hc;
    float mx = -INFINITY;
    for (int k = 0; k < hc; ++k) {
      row[k] = m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
      mx = std::max(mx, row[k]);
    }
    float sum = 0.f;
    for (int k = 0; k < hc; ++k) {
      row[k] = std::exp(row[k] - mx);
      sum += row[k];
    }
    for (int k = 0; k < hc; ++k) row[k] = row[k] / sum + hc_eps;
  }
  auto col_norm = [&] {
    for (int k = 0; k < hc; ++k) {
      float s = 0.f;
      for (int j = 0; j < hc; ++j) s += comb[j * hc + k];
      for (int j = 0; j < hc; ++j) comb[j * hc + k] /= (s + hc_eps);
    }
  };
  auto row_norm = [&] {
    for (int j = 0; j < hc; ++j) {
      float s = 0.f;
      for (int k = 0; k < hc; ++k) s += comb[j * hc + k];
      for (int k = 0; k < hc; ++k) comb[j * hc + k] /= (s + hc_eps);
    }
  };
  col_norm();
  for (int it = 1; it < sinkhorn_iters; ++it) {
    row_norm();
    col_norm();
  }
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
      __m256 s = _mm256_mul_ps(_mm256_set1_ps(post[k]), _mm256_loadu_ps(y + d));
      for (int j = 0; j < hc; ++j) {
        s = _mm256_add_ps(
            s, _mm256_mul_ps(_mm256_set1_ps(comb[j * hc + k]), _mm256_loadu_ps(res + j * dim + d)));
      }
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
      float s = post[k] * y[d];
      for (int j = 0; j < hc; ++j) s += comb[j * hc + k] * res[j * dim + d];
      tmp[k * dim + d] = RoundBf16(s);
    }
  }
  std::copy(tmp.begin(), tmp.end(), out);
}

}  // namespace epd::kernels::cpu
