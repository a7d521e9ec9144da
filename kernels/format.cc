#include "kernels/format.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace epd::kernels::format {

const float kE2M1Values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                               -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

void RoundBf16InPlace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = RoundBf16(x[i]);
}

void Bf16BitsToF32N(const void* bits, int64_t n, float* out) {
  const auto* p = static_cast<const uint8_t*>(bits);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, p + 2 * i, 2);
    out[i] = Bf16BitsToF32(b);
  }
}

uint8_t EncodeE4M3(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7e;  // saturate to 448 (S.1111.110)
  // Exponent of a, at least the minimum normal exponent (-6); quantum = 2^(e-3).
  int e;
  if (a < 0x1p-6f) {
    e = -6;
  } else {
    std::frexp(a, &e);
    e -= 1;
  }
  const float quantum = std::ldexp(1.f, e - 3);
  float m = std::nearbyint(a / quantum);  // exact division by a power of two; RNE
  float v = m * quantum;
  if (v > 448.f) v = 448.f;
  // Re-encode v exactly.
  if (v == 0.f) return sign;
  if (v < 0x1p-6f) return sign | static_cast<uint8_t>(v / 0x1p-9f);  // subnormal: mantissa * 2^-9
  int ev;
  float fr = std::frexp(v, &ev);  // v = fr * 2^ev, fr in [0.5, 1)
  int exp_field = ev - 1 + 7;
  int mant = static_cast<int>((fr * 2.f - 1.f) * 8.f);
  return sign | static_cast<uint8_t>((exp_field << 3) | mant);
}

float DecodeE4M3(uint8_t code) {
  const float sign = (code & 0x80) ? -1.f : 1.f;
  const int exp_field = (code >> 3) & 0xf;
  const int mant = code & 0x7;
  if (exp_field == 0xf && mant == 0x7) return std::nanf("");
  if (exp_field == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(1.f + mant / 8.f, exp_field - 7);
}

float RoundE4M3(float x) {
  // Bit-identical to DecodeE4M3(EncodeE4M3(x)) (checked on random and boundary values in
  // numerics_test); the one copy shared with the CUDA kernels.
  return codec::RoundE4M3(x);
}

float RoundE4M3Reference(float x) { return DecodeE4M3(EncodeE4M3(x)); }

float DecodeE8M0(uint8_t code) {
  if (code == 255) return std::nanf("");
  return std::ldexp(1.f, static_cast<int>(code) - 127);
}

uint8_t EncodeE8M0(float p) {
  int e;
  std::frexp(p, &e);
  return static_cast<uint8_t>(std::clamp(e - 1 + 127, 0, 254));
}

float Pow2Ceil(float v) { return codec::Pow2Ceil(v); }

uint8_t EncodeE2M1(float x) { return codec::EncodeE2M1(x); }

void QuantizeFp8Row(const float* x, int64_t k, float* q, float* scales) {
  const float inv448 = 1.f / 448.f;
  for (int64_t b0 = 0, bi = 0; b0 < k; b0 += 32, ++bi) {
    const int64_t n = std::min<int64_t>(32, k - b0);
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[b0 + i]));
    amax = std::max(amax, 1e-4f);
    const float s = Pow2Ceil(amax * inv448);
    scales[bi] = s;
    for (int64_t i = 0; i < n; ++i) {
      q[b0 + i] = RoundE4M3(std::clamp(x[b0 + i] / s, -448.f, 448.f));
    }
  }
}

void Fp8QuantDequantRow(float* x, int64_t k) {
  float q[32], s;
  for (int64_t b0 = 0; b0 < k; b0 += 32) {
    const int64_t n = std::min<int64_t>(32, k - b0);
    QuantizeFp8Row(x + b0, n, q, &s);
    for (int64_t i = 0; i < n; ++i) x[b0 + i] = RoundBf16(q[i] * s);
  }
}

namespace {

float IndexScale(const float* x, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return Pow2Ceil(std::max(amax, 6.f * 0x1p-126f) * (1.f / 6.f));
}

float KvScale(const float* x, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return RoundE4M3(std::max(amax, 6.f * 0x1p-9f) / 6.f);
}

}  // namespace

void Fp4IndexQuantDequantRow(float* x, int64_t k) {
  for (int64_t b0 = 0; b0 < k; b0 += 32) {
    const int64_t n = std::min<int64_t>(32, k - b0);
    const float s = IndexScale(x + b0, n);
    for (int64_t i = 0; i < n; ++i) {
      x[b0 + i] = RoundBf16(DecodeE2M1(EncodeE2M1(std::clamp(x[b0 + i] / s, -6.f, 6.f))) * s);
    }
  }
}

void Fp4KvQuantDequantRow(float* x, int64_t k) {
  for (int64_t b0 = 0; b0 < k; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, k - b0);
    const float s = KvScale(x + b0, n);
    for (int64_t i = 0; i < n; ++i) {
      x[b0 + i] = RoundBf16(DecodeE2M1(EncodeE2M1(std::clamp(x[b0 + i] / s, -6.f, 6.f))) * s);
    }
  }
}

int64_t PackedKvEntryBytes(int64_t dim) { return dim / 2 + dim / 16; }
int64_t PackedIndexKeyBytes(int64_t dim) { return dim / 2 + dim / 32; }
int64_t PackedSwaSlotBytes(int64_t dim) { return dim + dim / 32; }

namespace {

void PackFp4(const float* x, int64_t dim, int block, bool e4m3_scale, uint8_t* out) {
  uint8_t* scale_out = out + dim / 2;
  for (int64_t b0 = 0, bi = 0; b0 < dim; b0 += block, ++bi) {
    const float s = e4m3_scale ? KvScale(x + b0, block) : IndexScale(x + b0, block);
    scale_out[bi] = e4m3_scale ? EncodeE4M3(s) : EncodeE8M0(s);
    for (int64_t i = 0; i < block; i += 2) {
      uint8_t lo = EncodeE2M1(std::clamp(x[b0 + i] / s, -6.f, 6.f));
      uint8_t hi = EncodeE2M1(std::clamp(x[b0 + i + 1] / s, -6.f, 6.f));
      out[(b0 + i) / 2] = PackE2M1Pair(lo, hi);
    }
  }
}

// Scale decoding tables (the same values as DecodeE4M3 / DecodeE8M0, computed once).
struct ScaleTables {
  float e4m3[256], e8m0[256];
  ScaleTables() {
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = DecodeE4M3(static_cast<uint8_t>(c));
      e8m0[c] = DecodeE8M0(static_cast<uint8_t>(c));
    }
  }
};
const ScaleTables& Scales() {
  static const ScaleTables t;
  return t;
}

void UnpackFp4Block(const uint8_t* codes, int64_t b0, int64_t end, float s, float* out) {
  for (int64_t i = b0; i < end; i += 2) {
    const uint8_t code = codes[i / 2];
    out[i] = RoundBf16(kE2M1Values[code & 0xf] * s);
    out[i + 1] = RoundBf16(kE2M1Values[code >> 4] * s);
  }
}

#if defined(__x86_64__)
// 16 elements (8 code bytes) per iteration: the E2M1 value from a permute of the 8 magnitudes
// with the sign bit moved to bit 31, times the block's scale. Bit-identical to UnpackFp4Block
// for a finite scale: an E2M1 value (<= 2 significant bits) times an E8M0 or E4M3 scale (<= 4
// bits) is exact in fp32 and in bf16 (the smallest product, 2^-128, is far above bf16's
// subnormal step), so the RoundBf16 there changes nothing; a NaN scale takes that path.
__attribute__((target("avx2"))) void UnpackFp4Avx(const uint8_t* in, int64_t dim, int block,
                                                  const float* table, float* out) {
  const __m256 mag = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i low4 = _mm256_set1_epi32(0xf), bit3 = _mm256_set1_epi32(8);
  const uint8_t* scale_in = in + dim / 2;
  for (int64_t b0 = 0; b0 < dim; b0 += block) {
    const float s = table[scale_in[b0 / block]];
    if (s != s) {
      UnpackFp4Block(in, b0, b0 + block, s, out);
      continue;
    }
    const __m256 sv = _mm256_set1_ps(s);
    for (int64_t i = b0; i < b0 + block; i += 16) {
      const __m256i c =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + i / 2)));
      const __m256i lo = _mm256_and_si256(c, low4), hi = _mm256_srli_epi32(c, 4);
      const __m256 vlo = _mm256_mul_ps(
          _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, lo),
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(lo, bit3), 28))),
          sv);
      const __m256 vhi = _mm256_mul_ps(
          _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, hi),
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(hi, bit3), 28))),
          sv);
      const __m256 a = _mm256_unpacklo_ps(vlo, vhi);  // lo0 hi0 lo1 hi1 | lo4 hi4 lo5 hi5
      const __m256 b = _mm256_unpackhi_ps(vlo, vhi);  // lo2 hi2 lo3 hi3 | lo6 hi6 lo7 hi7
      _mm256_storeu_ps(out + i, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(out + i + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
  }
}

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}
#endif

void UnpackFp4(const uint8_t* in, int64_t dim, int block, bool e4m3_scale, float* out) {
  // The scale is decoded once per block (a table); the KV pool reads every key through this.
  const uint8_t* scale_in = in + dim / 2;
  const float* table = e4m3_scale ? Scales().e4m3 : Scales().e8m0;
#if defined(__x86_64__)
  if (block % 16 == 0 && dim % block == 0 && HaveAvx2())
    return UnpackFp4Avx(in, dim, block, table, out);
#endif
  for (int64_t b0 = 0; b0 < dim; b0 += block)
    UnpackFp4Block(in, b0, std::min<int64_t>(dim, b0 + block), table[scale_in[b0 / block]], out);
}

}  // namespace

void PackKvEntry(const float* x, int64_t dim, uint8_t* out) { PackFp4(x, dim, 16, true, out); }
void UnpackKvEntry(const uint8_t* in, int64_t dim, float* out) {
  UnpackFp4(in, dim, 16, true, out);
}
void PackIndexKey(const float* x, int64_t dim, uint8_t* out) { PackFp4(x, dim, 32, false, out); }
void UnpackIndexKey(const uint8_t* in, int64_t dim, float* out) {
  UnpackFp4(in, dim, 32, false, out);
}

void PackSwaSlot(const float* x, int64_t dim, uint8_t* out) {
  float q[32], s;
  for (int64_t b0 = 0, bi = 0; b0 < dim; b0 += 32, ++bi) {
    QuantizeFp8Row(x + b0, 32, q, &s);
    for (int i = 0; i < 32; ++i) out[b0 + i] = EncodeE4M3(q[i]);
    out[dim + bi] = EncodeE8M0(s);
  }
}

namespace {

void UnpackSwaBlock(const uint8_t* in, int64_t b0, int64_t end, const float* e4m3, float s,
                    float* out) {
  for (int64_t i = b0; i < end; ++i) out[i] = RoundBf16(e4m3[in[i]] * s);
}

#if defined(__x86_64__)
// 8 elements per iteration: the E4M3 values gathered from the table, times the block's scale.
// Bit-identical to UnpackSwaBlock for scale codes 10..244 (2^-117..2^117): an E4M3 value (<= 4
// significant bits, 2^-9 <= |v| <= 448) times such a power of two is a normal fp32 number with
// <= 4 significant bits, exact in fp32 and in bf16, so the RoundBf16 there changes nothing (a NaN
// code stays the table's NaN). Other scale codes take that path.
__attribute__((target("avx2"))) void UnpackSwaAvx(const uint8_t* in, int64_t dim, const float* e4m3,
                                                  const float* e8m0, float* out) {
  for (int64_t b0 = 0; b0 < dim; b0 += 32) {
    const uint8_t code = in[dim + b0 / 32];
    if (code < 10 || code > 244) {
      UnpackSwaBlock(in, b0, b0 + 32, e4m3, e8m0[code], out);
      continue;
    }
    const __m256 sv = _mm256_set1_ps(e8m0[code]);
    for (int64_t i = b0; i < b0 + 32; i += 8) {
      const __m256i idx =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(e4m3, idx, 4), sv));
    }
  }
}
#endif

}  // namespace

void UnpackSwaSlot(const uint8_t* in, int64_t dim, float* out) {
  // Decoded through the tables (the same values as DecodeE4M3 / DecodeE8M0): the model reads
  // every ring slot of the window through this at each step.
  const ScaleTables& t = Scales();
#if defined(__x86_64__)
  if (dim % 32 == 0 && HaveAvx2()) return UnpackSwaAvx(in, dim, t.e4m3, t.e8m0, out);
#endif
  for (int64_t b0 = 0; b0 < dim; b0 += 32)
    UnpackSwaBlock(in, b0, std::min<int64_t>(dim, b0 + 32), t.e4m3, t.e8m0[in[dim + b0 / 32]], out);
}

void PackRow(RowCodec codec, const float* x, int64_t dim, uint8_t* out) {
  switch (codec) {
    case RowCodec::kKvEntry:
      return PackKvEntry(x, dim, out);
    case RowCodec::kIndexKey:
      return PackIndexKey(x, dim, out);
    case RowCodec::kSwaSlot:
      return PackSwaSlot(x, dim, out);
    case RowCodec::kF32:
      std::memcpy(out, x, static_cast<size_t>(dim) * sizeof(float));
      return;
  }
}

void UnpackRow(RowCodec codec, const uint8_t* in, int64_t dim, float* out) {
  switch (codec) {
    case RowCodec::kKvEntry:
      return UnpackKvEntry(in, dim, out);
    case RowCodec::kIndexKey:
      return UnpackIndexKey(in, dim, out);
    case RowCodec::kSwaSlot:
      return UnpackSwaSlot(in, dim, out);
    case RowCodec::kF32:
      std::memcpy(out, in, static_cast<size_t>(dim) * sizeof(float));
      return;
  }
}

}  // namespace epd::kernels::format
