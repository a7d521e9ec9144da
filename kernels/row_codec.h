#pragma once

// The packed row codecs of the KV pool (MODEL.md §4) as per-block and per-element functions shared
// by the host and the CUDA kernels (kernels/cuda/kv_rows.cu): one copy of the arithmetic, compiled
// __host__ __device__ under nvcc, so a test on the host (tests/kernels/codec_test.cc) checks the
// device's bytes and values against kernels/format.cc's PackKvEntry / PackIndexKey / PackSwaSlot
// and their Unpack functions. The CPU backend packs with kernels/format.cc itself.

#include <cstdint>

#include "kernels/codec.h"

namespace epd::kernels {

// A packed row's codec.
enum class RowCodec {
  kKvEntry,   // compressed entry: dim/2 bytes of E2M1 then dim/16 E4M3 scales (PackKvEntry)
  kIndexKey,  // index key: dim/2 bytes of E2M1 then dim/32 UE8M0 scales (PackIndexKey)
  kSwaSlot,   // SWA slot: dim E4M3 bytes then dim/32 UE8M0 scales (PackSwaSlot)
  kF32,       // dim fp32 values as they are
};

namespace row_codec {

// Bytes of one row of `codec` at `dim`.
EPD_HD int64_t RowBytes(RowCodec codec, int64_t dim) {
  switch (codec) {
    case RowCodec::kKvEntry:
      return dim / 2 + dim / 16;
    case RowCodec::kIndexKey:
      return dim / 2 + dim / 32;
    case RowCodec::kSwaSlot:
      return dim + dim / 32;
    case RowCodec::kF32:
      return dim * 4;
  }
  return dim * 4;
}
// The address of packed row r of a paged stream (`rows_per_page` rows of `row_bytes` a page):
// page r / rows_per_page, slot r % rows_per_page. Every paged op finds its rows here (the CPU
// backend, PackRows / UnpackRows / GatherRows and the paged indexer on CUDA).
template <typename Byte>
EPD_HD Byte* PagedRow(Byte* const* pages, int64_t rows_per_page, int64_t r, int64_t row_bytes) {
  return pages[r / rows_per_page] + (r % rows_per_page) * row_bytes;
}

// Elements per scale block (1 for kF32); dim must be a multiple of it.
EPD_HD int64_t Block(RowCodec codec) {
  return codec == RowCodec::kKvEntry ? 16 : (codec == RowCodec::kF32 ? 1 : 32);
}

// Packs scale block b of row x [dim] into out (the row's RowBytes): the block's scale from its
// amax, then each element's code, in the order of format.cc's PackFp4 / PackSwaSlot.
EPD_HD void PackBlock(RowCodec codec, const float* x, int64_t dim, int64_t b, uint8_t* out) {
  using namespace codec;  // NOLINT
  const int64_t block = Block(codec);
  const float* xb = x + b * block;
  if (codec == RowCodec::kF32) {
    const uint32_t u = F32Bits(xb[0]);
    for (int k = 0; k < 4; ++k) out[b * 4 + k] = static_cast<uint8_t>(u >> (8 * k));
    return;
  }
  float amax = 0.f;
  for (int64_t j = 0; j < block; ++j) amax = StdMax(amax, Abs(xb[j]));
  if (codec == RowCodec::kSwaSlot) {  // QuantizeFp8Row per 32, E4M3 codes, E8M0 scale
    const float s = Pow2Ceil(StdMax(amax, 1e-4f) * (1.f / 448.f));
    for (int64_t j = 0; j < block; ++j)
      out[b * block + j] = EncodeE4M3(RoundE4M3(Clamp(xb[j] / s, -448.f, 448.f)));
    out[dim + b] = EncodeE8M0Pow2(s);
    return;
  }
  // KvScale (E4M3 scale per 16) or IndexScale (E8M0 scale per 32), then E2M1 pairs.
  const bool kv = codec == RowCodec::kKvEntry;
  const float s = kv ? RoundE4M3(StdMax(amax, 6.f * 0x1p-9f) / 6.f)
                     : Pow2Ceil(StdMax(amax, 6.f * 0x1p-126f) * (1.f / 6.f));
  out[dim / 2 + b] = kv ? EncodeE4M3(s) : EncodeE8M0Pow2(s);
  for (int64_t j = 0; j < block; j += 2) {
    const uint8_t lo = EncodeE2M1(Clamp(xb[j] / s, -6.f, 6.f));
    const uint8_t hi = EncodeE2M1(Clamp(xb[j + 1] / s, -6.f, 6.f));
    out[(b * block + j) / 2] = static_cast<uint8_t>((lo & 0xf) | (hi << 4));
  }
}

// Element d of a packed row `in` (format.cc's Unpack*: bf16 of code value x scale).
EPD_HD float UnpackElement(RowCodec codec, const uint8_t* in, int64_t dim, int64_t d) {
  using namespace codec;  // NOLINT
  switch (codec) {
    case RowCodec::kKvEntry:
      return RoundBf16(DecodeE2M1(in[d / 2] >> (4 * (d % 2))) * DecodeE4M3(in[dim / 2 + d / 16]));
    case RowCodec::kIndexKey:
      return RoundBf16(DecodeE2M1(in[d / 2] >> (4 * (d % 2))) * DecodeE8M0(in[dim / 2 + d / 32]));
    case RowCodec::kSwaSlot:
      return RoundBf16(DecodeE4M3(in[d]) * DecodeE8M0(in[dim + d / 32]));
    case RowCodec::kF32:
      break;
  }
  uint32_t u = 0;
  for (int k = 0; k < 4; ++k) u |= static_cast<uint32_t>(in[d * 4 + k]) << (8 * k);
  return BitsF32(u);
}

}  // namespace row_codec
}  // namespace epd::kernels
