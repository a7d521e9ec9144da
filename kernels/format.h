#pragma once

// The packed-format module: the scalar number formats of DeepSeek-V4.1 (MODEL.md §2/§3/§4)
// (bf16, FP8 E4M3, E8M0 scales, FP4 E2M1), the quantizers built from them and the packed byte
// layouts of the KV entries (compressed KV, index keys, SWA slots). model/, kvstore/ and services/
// use this module; the backends (kernels/cpu, kernels/cuda) implement the ops on top of it.
//
// Convention: a "bf16 tensor" is a float array whose every element is exactly representable in
// bf16 (i.e. already rounded with RoundBf16). All functions are pure host code and thread-safe;
// every row/block is processed independently of the others (batch-invariant).

#include <cstdint>
#include <cstring>

#include "kernels/codec.h"
#include "kernels/row_codec.h"

namespace epd::kernels::format {

// ---- bf16 ---- (the codecs are shared with the CUDA kernels: kernels/codec.h)
using codec::Bf16BitsToF32;
using codec::F32ToBf16Bits;
using codec::RoundBf16;
void RoundBf16InPlace(float* x, int64_t n);
// out[i] = the fp32 value of the i-th of n bf16 bit patterns at `bits` (exact; `bits` need not be
// 2-byte aligned: a checkpoint's tensor may start anywhere).
void Bf16BitsToF32N(const void* bits, int64_t n, float* out);

// ---- E4M3 (float8_e4m3fn: bias 7, max 448, subnormal quantum 2^-9, no inf) ----
// Round-to-nearest-even; |x| > 448 saturates to ±448; NaN -> 0x7f.
uint8_t EncodeE4M3(float x);
float DecodeE4M3(uint8_t code);
// Value of EncodeE4M3(x) (RNE onto the E4M3 grid, saturating). Fast bit-level path.
float RoundE4M3(float x);
// The same through EncodeE4M3/DecodeE4M3 (slow; for tests).
float RoundE4M3Reference(float x);

// ---- E8M0 (UE8M0 scale: 2^(byte-127); 255 = NaN) ----
float DecodeE8M0(uint8_t code);
// For a power of two p = 2^e (e in [-127, 127]) returns e + 127.
uint8_t EncodeE8M0(float power_of_two);
// 2^ceil(log2(v)) for v > 0 taken from the fp32 bits: exponent + (mantissa != 0).
float Pow2Ceil(float v);

// ---- E2M1 (FP4): codes 0..15 = {0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6}; bit 3 = sign ----
extern const float kE2M1Values[16];
// Round-to-nearest with ties to the even code; |x| > 6 saturates.
uint8_t EncodeE2M1(float x);
inline float DecodeE2M1(uint8_t code) { return kE2M1Values[code & 0xf]; }
// Packed pairs: low nibble = even element, high nibble = odd element.
inline uint8_t PackE2M1Pair(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xf) | ((odd & 0xf) << 4));
}

// ---- Activation / cache quantizers ----
// FP8 activation quantization per block of 32 along a row of length k (k % 32 tail allowed):
// amax = max(|x|, 1e-4), scale = Pow2Ceil(amax * fp32(1/448)), q = RoundE4M3(clamp(x/scale, ±448)).
// q: [k] E4M3 values (as float), scales: [ceil(k/32)].
void QuantizeFp8Row(const float* x, int64_t k, float* q, float* scales);
// In place quantize-dequantize (q * scale) of one row, blocks of 32: window KV.
void Fp8QuantDequantRow(float* x, int64_t k);
// FP4 quantize-dequantize of the indexer (blocks of 32, UE8M0 scale
// Pow2Ceil(max(amax, 6*2^-126) * fp32(1/6))). Result is bf16-exact.
void Fp4IndexQuantDequantRow(float* x, int64_t k);
// FP4 quantize-dequantize of the compressed KV (blocks of 16, E4M3 scale
// RoundE4M3(max(amax, 6*2^-9)/6)). Result is bf16-exact.
void Fp4KvQuantDequantRow(float* x, int64_t k);

// ---- Packed byte layouts (MODEL.md §4) ----
// Compressed latent entry: dim/2 bytes of E2M1 (low nibble = even element) then dim/16 E4M3 scales.
// dim = 512 gives 288 bytes. Unpack gives exactly Fp4KvQuantDequantRow(x).
int64_t PackedKvEntryBytes(int64_t dim);
void PackKvEntry(const float* x, int64_t dim, uint8_t* out);
void UnpackKvEntry(const uint8_t* in, int64_t dim, float* out);
// Index key: dim/2 bytes of E2M1 then dim/32 UE8M0 scales. dim = 128 gives 68 bytes.
int64_t PackedIndexKeyBytes(int64_t dim);
void PackIndexKey(const float* x, int64_t dim, uint8_t* out);
void UnpackIndexKey(const uint8_t* in, int64_t dim, float* out);
// SWA slot: dim E4M3 bytes then dim/32 UE8M0 scales. dim = 512 gives 528 bytes.
int64_t PackedSwaSlotBytes(int64_t dim);
void PackSwaSlot(const float* x, int64_t dim, uint8_t* out);
void UnpackSwaSlot(const uint8_t* in, int64_t dim, float* out);
// One row in `codec` (kernels/row_codec.h: the functions above by codec; kF32 copies the fp32
// bytes), row_codec::RowBytes(codec, dim) bytes.
void PackRow(RowCodec codec, const float* x, int64_t dim, uint8_t* out);
void UnpackRow(RowCodec codec, const uint8_t* in, int64_t dim, float* out);

}  // namespace epd::kernels::format
