#pragma once

// The scalar number codecs shared by the host (kernels/format.*, the CPU backend) and the CUDA
// kernels (kernels/cuda/*.cu): one copy of each, compiled as __host__ __device__ under nvcc and as
// plain inline functions elsewhere. Pure bit manipulation and IEEE fp32 arithmetic, so a value
// decoded or rounded on the GPU is bit-identical to the host's (the CUDA kernels are compiled
// with -fmad=false so no product is fused into an add).
//
// bf16: round to nearest even, NaN -> quiet NaN. E4M3 (float8_e4m3fn): bias 7, max 448,
// subnormal quantum 2^-9, no inf, code 0x7f/0xff = NaN. E8M0: 2^(code-127), 255 = NaN.
// E2M1 (FP4): codes 0..7 = {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define EPD_HD __host__ __device__ __forceinline__
#else
#define EPD_HD inline
#endif

namespace epd::kernels::codec {

EPD_HD uint32_t F32Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
EPD_HD float BitsF32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
EPD_HD bool IsNan(float f) { return (F32Bits(f) & 0x7fffffffu) > 0x7f800000u; }
EPD_HD float Abs(float f) { return BitsF32(F32Bits(f) & 0x7fffffffu); }
// The IEEE round-to-nearest-even of x to an integer value (std::nearbyint in the default mode).
EPD_HD float RintF(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}
// std::clamp(v, lo, hi): a NaN v passes through.
EPD_HD float Clamp(float v, float lo, float hi) { return v < lo ? lo : (hi < v ? hi : v); }
// std::max(a, b) / std::min(a, b) with their exact NaN and signed-zero behaviour.
EPD_HD float StdMax(float a, float b) { return a < b ? b : a; }
EPD_HD float StdMin(float a, float b) { return b < a ? b : a; }

// ---- bf16 ----
EPD_HD uint16_t F32ToBf16Bits(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // qNaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
EPD_HD float Bf16BitsToF32(uint16_t b) { return BitsF32(static_cast<uint32_t>(b) << 16); }
EPD_HD float RoundBf16(float f) { return Bf16BitsToF32(F32ToBf16Bits(f)); }

// ---- E4M3 ----
// Value of an E4M3 code (NaN codes give a quiet NaN).
EPD_HD float DecodeE4M3(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const uint32_t em = code & 0x7f;
  if (em == 0x7f) return BitsF32(0x7fc00000u);
  if ((em >> 3) == 0) {  // subnormal: mantissa * 2^-9 (exact)
    return BitsF32(F32Bits(static_cast<float>(em) * 0x1p-9f) | sign);
  }
  // (1 + m/8) * 2^(e-7): fp32 exponent field e - 7 + 127.
  return BitsF32(sign | (((em >> 3) + 120u) << 23) | ((em & 7u) << 20));
}
// RNE onto the E4M3 grid, saturating at ±448 (the value of EncodeE4M3(x)); NaN -> NaN.
EPD_HD float RoundE4M3(float x) {
  if (IsNan(x)) return BitsF32(0x7fc00000u);
  const float a = Abs(x);
  float r;
  if (a >= 448.f) {
    r = 448.f;
  } else if (a < 0x1p-6f) {
    r = RintF(a * 512.f) * 0x1p-9f;
  } else {
    uint32_t u = F32Bits(a);
    u += 0x7ffffu + ((u >> 20) & 1u);
    u &= 0xfff00000u;
    r = BitsF32(u);
    if (r > 448.f) r = 448.f;
  }
  return (F32Bits(x) & 0x80000000u) ? -r : r;
}

// The E4M3 code of x (format::EncodeE4M3: RNE, |x| >= 448 -> ±448, NaN -> 0x7f), from the
// bits of RoundE4M3(x).
EPD_HD uint8_t EncodeE4M3(float x) {
  if (IsNan(x)) return 0x7f;
  const float r = RoundE4M3(x);
  const uint8_t sign = (F32Bits(r) & 0x80000000u) ? 0x80 : 0x00;
  const float a = Abs(r);
  if (a < 0x1p-6f) return sign | static_cast<uint8_t>(a * 512.f);  // subnormal (or zero)
  const uint32_t u = F32Bits(a);
  return sign | static_cast<uint8_t>(((((u >> 23) & 0xffu) - 120u) << 3) | ((u >> 20) & 7u));
}

// ---- E8M0 ----
EPD_HD float DecodeE8M0(uint8_t code) {
  if (code == 255) return BitsF32(0x7fc00000u);
  if (code == 0) return BitsF32(0x00400000u);  // 2^-127 (an fp32 subnormal)
  return BitsF32(static_cast<uint32_t>(code) << 23);
}
// 2^ceil(log2(v)) for v > 0 from the fp32 bits: exponent + (mantissa != 0), clamped to normals.
EPD_HD float Pow2Ceil(float v) {
  const uint32_t u = F32Bits(v);
  int exp = static_cast<int>((u >> 23) & 0xff);
  if ((u & 0x7fffff) != 0) exp += 1;
  exp = exp < 1 ? 1 : (exp > 254 ? 254 : exp);
  return BitsF32(static_cast<uint32_t>(exp) << 23);
}

// The E8M0 code of a normal power of two p (format::EncodeE8M0 on Pow2Ceil's outputs): its
// exponent field.
EPD_HD uint8_t EncodeE8M0Pow2(float p) { return static_cast<uint8_t>((F32Bits(p) >> 23) & 0xffu); }

// ---- E2M1 ----
// Round to nearest with ties to the even code; |x| > 6 saturates.
EPD_HD uint8_t EncodeE2M1(float x) {
  const uint8_t sign = (F32Bits(x) & 0x80000000u) ? 0x8 : 0x0;
  const float a = Abs(x);
  uint8_t c;
  if (a <= 0.25f)
    c = 0;
  else if (a < 0.75f)
    c = 1;
  else if (a <= 1.25f)
    c = 2;
  else if (a < 1.75f)
    c = 3;
  else if (a <= 2.5f)
    c = 4;
  else if (a < 3.5f)
    c = 5;
  else if (a <= 5.f)
    c = 6;
  else
    c = 7;
  return sign | c;
}
// Value of an E2M1 code (the low 4 bits): m = 0 -> 0, 1 -> 0.5, else (1 + (m&1)/2) * 2^((m>>1)-1).
EPD_HD float DecodeE2M1(uint8_t code) {
  const uint32_t m = code & 7u;
  const uint32_t sign = static_cast<uint32_t>(code & 8u) << 28;
  const uint32_t mag =
      m == 0 ? 0u : (m == 1 ? 0x3f000000u : ((126u + (m >> 1)) << 23) | ((m & 1u) << 22));
  return BitsF32(sign | mag);
}

}  // namespace epd::kernels::codec
