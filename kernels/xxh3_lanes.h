#pragma once
// XXH3-64 with seed 0 and the default secret, written from the xxHash specification
// (doc/xxhash_spec.md, "XXH3 Algorithm Description") for code that cannot call the library: the
// CUDA backend's DigestBlocks hashes pool blocks in device memory with it, so that sealing a block
// brings 8 bytes down instead of the block (model/kv_pool.h, SealPending).
//
// The host always calls libxxhash (XXH3_64bits); this header is compiled for the host only by its
// test (tests/kernels/xxh3_lanes_test.cc), which checks Digest() against the library bit for bit
// over every length class. A long input (> 240 bytes) is split by accumulator lane: lane i's
// accumulator reads only words i and i ^ 1 of each 64-byte stripe (its own and its pair's), so
// eight threads hash one input, together reading each stripe once, and meet only for the merge.

#include <cstdint>
#include <cstring>

#include "kernels/codec.h"  // EPD_HD: __host__ __device__ under nvcc

namespace epd::kernels::xxh3 {

inline constexpr int kSecretBytes = 192;
inline constexpr int kStripe = 64;
inline constexpr int kStripesPerBlock = (kSecretBytes - kStripe) / 8;  // 16
inline constexpr int kBlock = kStripe * kStripesPerBlock;              // 1024 bytes
inline constexpr int kLanes = 8;
inline constexpr uint64_t kMidMax = 240;  // longer inputs take the lane path

// The specification's default secret, as an initializer (the CUDA side puts it in constant memory).
// clang-format off
#define EPD_XXH3_DEFAULT_SECRET                                                                    \
  {0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, \
   0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, \
   0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, \
   0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, \
   0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, \
   0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, \
   0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, \
   0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, \
   0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, \
   0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, \
   0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, \
   0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e}
// clang-format on

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1U;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77U;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3DU;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;
inline constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ULL;
inline constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ULL;

// Little-endian reads at any alignment (the secret is read at odd offsets). On the device every
// load is of an aligned 8-byte word: an unaligned word is the two aligned words around it, shifted
// together (bytes of the same aligned words, so nothing past the allocation's last word is read).
// An aligned fast path beside a memcpy fallback is not safe there: nvcc 13 merged the two into one
// 8-byte load of the unaligned address (cudaErrorMisalignedAddress on an H200, 2026-12-04).
EPD_HD uint64_t Read64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  const auto a = reinterpret_cast<uintptr_t>(p);
  const auto* w = reinterpret_cast<const uint64_t*>(a & ~uintptr_t{7});
  const unsigned shift = 8 * static_cast<unsigned>(a & 7);
  if (shift == 0) return w[0];
  return (w[0] >> shift) | (w[1] << (64 - shift));
#else
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
#endif
}
EPD_HD uint32_t Read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
EPD_HD uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
EPD_HD uint32_t Swap32(uint32_t x) {
  return (x << 24) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) | (x >> 24);
}
EPD_HD uint64_t Swap64(uint64_t x) {
  return (static_cast<uint64_t>(Swap32(static_cast<uint32_t>(x))) << 32) |
         Swap32(static_cast<uint32_t>(x >> 32));
}
// The 128-bit product of a and b, folded: low half xor high half.
EPD_HD uint64_t MulFold(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  __extension__ using U128 = unsigned __int128;
  const U128 p = static_cast<U128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}
EPD_HD uint64_t Avalanche(uint64_t x) {
  x ^= x >> 37;
  x *= kPrimeMx1;
  return x ^ (x >> 32);
}
EPD_HD uint64_t AvalancheXxh64(uint64_t x) {
  x ^= x >> 33;
  x *= kPrime64_2;
  x ^= x >> 29;
  x *= kPrime64_3;
  return x ^ (x >> 32);
}
EPD_HD uint64_t Mix16(const uint8_t* p, const uint8_t* s) {
  return MulFold(Read64(p) ^ Read64(s), Read64(p + 8) ^ Read64(s + 8));
}

// XXH3-64 of an input of at most 240 bytes (the small and medium algorithms).
EPD_HD uint64_t ShortDigest(const uint8_t* p, uint64_t len, const uint8_t* secret) {
  if (len == 0) return AvalancheXxh64(Read64(secret + 56) ^ Read64(secret + 64));
  if (len <= 3) {
    const uint32_t combined =
        static_cast<uint32_t>(p[len - 1]) | (static_cast<uint32_t>(len) << 8) |
        (static_cast<uint32_t>(p[0]) << 16) | (static_cast<uint32_t>(p[len >> 1]) << 24);
    const uint64_t flip = Read32(secret) ^ Read32(secret + 4);
    return AvalancheXxh64(flip ^ combined);
  }
  if (len <= 8) {
    const uint64_t combined = Read32(p + len - 4) | (static_cast<uint64_t>(Read32(p)) << 32);
    uint64_t v = (Read64(secret + 8) ^ Read64(secret + 16)) ^ combined;
    v ^= Rotl64(v, 49) ^ Rotl64(v, 24);
    v *= kPrimeMx2;
    v ^= (v >> 35) + len;
    v *= kPrimeMx2;
    return v ^ (v >> 28);
  }
  if (len <= 16) {
    const uint64_t lo = (Read64(secret + 24) ^ Read64(secret + 32)) ^ Read64(p);
    const uint64_t hi = (Read64(secret + 40) ^ Read64(secret + 48)) ^ Read64(p + len - 8);
    return Avalanche(len + Swap64(lo) + hi + MulFold(lo, hi));
  }
  uint64_t acc = len * kPrime64_1;
  if (len <= 128) {
    const uint64_t rounds = ((len - 1) >> 5) + 1;
    for (uint64_t i = 0; i < rounds; ++i) {
      acc += Mix16(p + i * 16, secret + i * 32);
      acc += Mix16(p + len - i * 16 - 16, secret + i * 32 + 16);
    }
    return Avalanche(acc);
  }
  for (uint64_t i = 0; i < 8; ++i) acc += Mix16(p + i * 16, secret + i * 16);
  acc = Avalanche(acc);
  const uint64_t chunks = len >> 4;
  for (uint64_t i = 8; i < chunks; ++i) acc += Mix16(p + i * 16, secret + (i - 8) * 16 + 3);
  acc += Mix16(p + len - 16, secret + 119);  // the smallest secret's end (136) less 17
  return Avalanche(acc);
}

// The long algorithm, one accumulator lane (0..7) at a time.
EPD_HD uint64_t LaneInit(int lane) {
  // clang-format off
  switch (lane) {
    case 0: return kPrime32_3;
    case 1: return kPrime64_1;
    case 2: return kPrime64_2;
    case 3: return kPrime64_3;
    case 4: return kPrime64_4;
    case 5: return kPrime32_2;
    case 6: return kPrime64_5;
    default: return kPrime32_1;
  }
  // clang-format on
}
// One stripe's step for `lane`: its word xor the secret, multiplied half by half, plus its pair
// lane's word (the specification's accumulate, acc[i ^ 1] += stripe[i], seen from i ^ 1).
EPD_HD uint64_t LaneAccumulate(uint64_t acc, const uint8_t* stripe, const uint8_t* key, int lane) {
  const uint64_t x = Read64(stripe + 8 * lane) ^ Read64(key + 8 * lane);
  return acc + Read64(stripe + 8 * (lane ^ 1)) + (x & 0xFFFFFFFFULL) * (x >> 32);
}
EPD_HD uint64_t LaneScramble(uint64_t acc, const uint8_t* secret, int lane) {
  acc ^= acc >> 47;
  acc ^= Read64(secret + kSecretBytes - kStripe + 8 * lane);
  return acc * kPrime32_1;
}
// Lane `lane`'s accumulator after the whole of an input of more than 240 bytes.
EPD_HD uint64_t LongLane(const uint8_t* p, uint64_t len, const uint8_t* secret, int lane) {
  uint64_t acc = LaneInit(lane);
  const uint64_t blocks = (len - 1) / kBlock;  // the last block, even full, is left to the end
  for (uint64_t b = 0; b < blocks; ++b) {
    for (int n = 0; n < kStripesPerBlock; ++n) {
      acc = LaneAccumulate(acc, p + b * kBlock + n * kStripe, secret + n * 8, lane);
    }
    acc = LaneScramble(acc, secret, lane);
  }
  const uint64_t start = blocks * kBlock;
  const uint64_t stripes = (len - start - 1) / kStripe;
  for (uint64_t n = 0; n < stripes; ++n) {
    acc = LaneAccumulate(acc, p + start + n * kStripe, secret + n * 8, lane);
  }
  return LaneAccumulate(acc, p + len - kStripe, secret + kSecretBytes - kStripe - 7, lane);
}
// The long algorithm's result from its eight lanes.
EPD_HD uint64_t MergeLanes(const uint64_t* acc, uint64_t len, const uint8_t* secret) {
  uint64_t r = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    r += MulFold(acc[2 * i] ^ Read64(secret + 11 + 16 * i),
                 acc[2 * i + 1] ^ Read64(secret + 11 + 16 * i + 8));
  }
  return Avalanche(r);
}

// XXH3-64 of p[0, len) in one thread (the test's entry; a kernel runs LongLane per thread).
EPD_HD uint64_t Digest(const uint8_t* p, uint64_t len, const uint8_t* secret) {
  if (len <= kMidMax) return ShortDigest(p, len, secret);
  uint64_t acc[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) acc[lane] = LongLane(p, len, secret, lane);
  return MergeLanes(acc, len, secret);
}

}  // namespace epd::kernels::xxh3
