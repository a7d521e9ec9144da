// Parity of a candidate Backend against the CPU reference, op by op, over the Backend interface
// (as llama.cpp's test-backend-ops does). One table of cases, one per name of
// kernels::kBackendOpNames; a name without a case FAILS, and the list itself is checked against the
// declarations of kernels/backend.h.
//
// Two binaries are built from this file:
// - backend_parity_test (label unit): candidate = the CPU backend with its SIMD (AVX2) paths,
//   reference = the scalar CPU code. The SIMD contract is bit-identity, so every case is exact.
//   This runs in CI (and under ASan/UBSan) and exercises the harness itself.
// - backend_parity_cuda_test (label gpu, EPD_PARITY_CUDA): candidate = the CUDA backend on cuda:0;
//   without a GPU every case reports "skipped: no GPU". Each case applies the tolerance written
//   next to it: exact wherever the result is exact by construction (bf16 rounding, codecs,
//   integer outputs, top-k, routing choices, argmax); the ops that call exp/log1p/cos/sin allow
//   the last-bit differences between glibc's fp32 functions and the GPU's (kernels/cuda/
//   common.cuh); LinearBf16/LinearF32 allow the summation-order freedom of their contract.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/format.h"
#include "kernels/penalty.h"
#include "kernels/rope.h"
#include "kernels/sampling_math.h"
#include "kernels/torch_math.h"
#include "tests/testing/test_cpu_backend.h"

#if defined(EPD_PARITY_CUDA)
#include "kernels/cuda/cuda_backend.h"
#define EPD_PARITY_SUITE CudaVsCpuReference
#else
#define EPD_PARITY_SUITE CpuSimdVsScalar
#endif

namespace epd::kernels {
namespace {

using format::RoundBf16;

// ---- Tolerances ----
struct Tol {
  enum Kind { kExact, kUlps, kRel } kind = kExact;
  double v = 0;
  static Tol Exact() { return {kExact, 0}; }
  // fp32 units in the last place (a bf16 ulp is 65536 of them).
  static Tol Ulps(double n) { return {kUlps, n}; }
  static Tol Bf16Ulps(double n) { return {kUlps, n * 65536}; }
  // |a - b| <= v * max |reference| over the tensor.
  static Tol Rel(double v) { return {kRel, v}; }
};

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// Distance on the ordered fp32 line (-0 and +0 are 0 apart).
int64_t UlpDistance(float a, float b) {
  auto ord = [](float f) -> int64_t {
    const uint32_t u = Bits(f);
    return (u & 0x80000000u) ? -static_cast<int64_t>(u & 0x7fffffffu) : static_cast<int64_t>(u);
  };
  return std::llabs(ord(a) - ord(b));
}

// ---- The two sides ----
// Host data in and out of one backend's memory.
class Side {
 public:
  Side(Backend& b, std::string name) : b_(b), name_(std::move(name)) {}
  Backend& b() { return b_; }
  const std::string& name() const { return name_; }

  template <typename T>
  T* In(const std::vector<T>& host) {
    Buffer& buf = New(static_cast<int64_t>(host.size() * sizeof(T)));
    if (!host.empty()) {
      auto s = b_.Upload(host.data(), static_cast<int64_t>(host.size() * sizeof(T)), buf);
      EXPECT_TRUE(s.ok()) << name_ << ": " << s;
    }
    return buf.as<T>();
  }
  // An output of n elements, filled with a poison pattern (0x7f bytes: a NaN for floats).
  template <typename T>
  T* Out(int64_t n) {
    return In(std::vector<T>(n, Poison<T>()));
  }
  template <typename T>
  std::vector<T> Read(const T* p, int64_t n) {
    std::vector<T> host(n);
    auto s = b_.Synchronize();
    EXPECT_TRUE(s.ok()) << name_ << ": " << s;
    for (Buffer& buf : bufs_) {
      const auto* base = buf.as<uint8_t>();
      const auto* q = reinterpret_cast<const uint8_t*>(p);
      if (q >= base && q + n * sizeof(T) <= base + buf.bytes()) {
        s = b_.Download(buf, q - base, static_cast<int64_t>(n * sizeof(T)), host.data());
        EXPECT_TRUE(s.ok()) << name_ << ": " << s;
        return host;
      }
    }
    ADD_FAILURE() << name_ << ": Read of a pointer this side did not allocate";
    return host;
  }
  // Packed QuantWeight in this backend's memory (codes/scale_codes uploaded).
  QuantWeight Packed(const QuantWeight& shape, const std::vector<uint8_t>& codes,
                     const std::vector<uint8_t>& scale_codes) {
    QuantWeight w;
    w.out = shape.out;
    w.in = shape.in;
    w.block_rows = shape.block_rows;
    w.block_cols = shape.block_cols;
    w.format = shape.format;
    w.codes = Alloc(codes);
    w.scale_codes = Alloc(scale_codes);
    return w;
  }

 public:
  // The bytes Out fills an output with.
  template <typename T>
  static T Poison() {
    T t;
    std::memset(&t, 0x7f, sizeof(T));
    return t;
  }

 private:
  Buffer& New(int64_t bytes) {
    auto buf = b_.Allocate(std::max<int64_t>(bytes, 1));
    EXPECT_TRUE(buf.ok()) << name_ << ": " << buf.status();
    bufs_.push_back(buf.ok() ? std::move(*buf) : Buffer());
    return bufs_.back();
  }
  Buffer Alloc(const std::vector<uint8_t>& bytes) {
    auto buf = b_.Allocate(static_cast<int64_t>(bytes.size()));
    EXPECT_TRUE(buf.ok()) << name_ << ": " << buf.status();
    if (!buf.ok()) return Buffer();
    auto s = b_.Upload(bytes.data(), static_cast<int64_t>(bytes.size()), *buf);
    EXPECT_TRUE(s.ok()) << name_ << ": " << s;
    return std::move(*buf);
  }

  Backend& b_;
  std::string name_;
  std::vector<Buffer> bufs_;
};

struct Env {
  Side& ref;
  Side& cand;
  std::mt19937& rng;
  bool cand_is_cpu;  // the CPU SIMD candidate: every tolerance is exact (same libm, same order)
};

#define EXPECT_OP_OK(side, expr)                                            \
  do {                                                                      \
    const absl::Status st_ = (expr);                                        \
    EXPECT_TRUE(st_.ok()) << (side).name() << ": " << #expr << ": " << st_; \
  } while (0)

// Compares reference and candidate outputs element by element.
void Compare(const Env& env, const std::vector<float>& ref, const std::vector<float>& cand, Tol tol,
             const std::string& what) {
  ASSERT_EQ(ref.size(), cand.size()) << what;
  if (env.cand_is_cpu) tol = Tol::Exact();
  double max_ref = 0;
  for (float v : ref) {
    if (std::isfinite(v)) max_ref = std::max(max_ref, std::fabs(static_cast<double>(v)));
  }
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float a = ref[i], b = cand[i];
    bool ok;
    if (std::isnan(a) || std::isnan(b)) {
      ok = std::isnan(a) && std::isnan(b);
    } else if (tol.kind == Tol::kExact) {
      ok = Bits(a) == Bits(b);
    } else if (tol.kind == Tol::kUlps) {
      ok = UlpDistance(a, b) <= static_cast<int64_t>(tol.v) || Bits(a) == Bits(b);
    } else {
      ok = a == b || std::fabs(static_cast<double>(a) - b) <= tol.v * max_ref;
    }
    if (!ok) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " elements differ beyond "
                    << (tol.kind == Tol::kExact ? "exact"
                                                : (tol.kind == Tol::kUlps ? "ulps" : "rel"))
                    << " " << tol.v << "; first at " << first << ": reference "
                    << (first >= 0 ? ref[first] : 0.f) << " candidate "
                    << (first >= 0 ? cand[first] : 0.f);
}
template <typename T>
void CompareExact(const std::vector<T>& ref, const std::vector<T>& cand, const std::string& what) {
  ASSERT_EQ(ref.size(), cand.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (ref[i] != cand[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " differ; first at " << first
                    << ": reference " << (first >= 0 ? +ref[first] : 0) << " candidate "
                    << (first >= 0 ? +cand[first] : 0);
}

// ---- Random inputs ----
std::vector<float> Normal(std::mt19937& rng, int64_t n, float sigma = 1.f) {
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
std::vector<float> Bf16(std::mt19937& rng, int64_t n, float sigma = 1.f) {
  auto v = Normal(rng, n, sigma);
  for (auto& x : v) x = RoundBf16(x);
  return v;
}
// Rows [rows, dim] of bf16 values (or ones) with eight pairs +B ... -B (B = 2^25) at random
// places: a running sum holding B loses the low bits of the terms added meanwhile and the result
// is small, so a kernel that sums in another order than the reference shows it in the bits
// (plain random inputs hide that under the bf16 rounding). columns: the pairs cancel down the
// columns instead (a sum over rows).
std::vector<float> Cancelling(std::mt19937& rng, int64_t rows, int64_t dim, bool ones = false,
                              bool columns = false) {
  if (columns) {
    const auto t = Cancelling(rng, dim, rows, ones);
    std::vector<float> v(t.size());
    for (int64_t c = 0; c < dim; ++c) {
      for (int64_t r = 0; r < rows; ++r) v[r * dim + c] = t[c * rows + r];
    }
    return v;
  }
  auto v = ones ? std::vector<float>(rows * dim, 1.f) : Bf16(rng, rows * dim);
  std::uniform_int_distribution<int64_t> pos(0, dim - 1);
  for (int64_t r = 0; r < rows && dim >= 2; ++r) {
    for (int k = 0; k < 8; ++k) {
      const int64_t i = pos(rng), j = pos(rng);
      if (i == j) continue;
      const float b = (k % 2 ? -1.f : 1.f) * 33554432.f;
      v[r * dim + i] = b;
      v[r * dim + j] = -b;
    }
  }
  return v;
}
// Values from a small set (ties), with -0, +0 and -inf.
std::vector<float> Tied(std::mt19937& rng, int64_t n) {
  const float set[] = {-0.f, 0.f, 1.f, -1.f, 2.5f, 2.5f, -INFINITY, 0.5f, 3.f};
  std::uniform_int_distribution<int> d(0, 8);
  std::vector<float> v(n);
  for (auto& x : v) x = set[d(rng)];
  return v;
}
// E4M3 codes without the NaN codes.
std::vector<uint8_t> Fp8Codes(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& c : v) {
    do {
      c = static_cast<uint8_t>(d(rng));
    } while ((c & 0x7f) == 0x7f);
  }
  return v;
}
std::vector<uint8_t> Bytes(std::mt19937& rng, int64_t n, int lo = 0, int hi = 255) {
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<uint8_t> v(n);
  for (auto& c : v) c = static_cast<uint8_t>(d(rng));
  return v;
}

// ---- Golden inputs (tests/data/golden/v41-tiny-a: the reference's own activations) ----
// The repository root: $EPD_SOURCE_DIR (a prebuilt binary run elsewhere, tests/gpu/
// pack_prebuilt.sh), else the source folder this binary was built from.
std::string SourceDir() {
  const char* dir = std::getenv("EPD_SOURCE_DIR");
  return dir != nullptr ? dir : EPD_DEFAULT_SOURCE_DIR;
}
std::string GoldenPath(const std::string& rel) {
  return SourceDir() + "/tests/data/golden/v41-tiny-a/" + rel;
}
std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
// debug/*.bin: raw bf16 bit patterns; [301, 256] for the attention/FFN inputs.
std::vector<float> GoldenBf16(const std::string& rel) {
  const std::string b = ReadFile(GoldenPath(rel));
  std::vector<float> v(b.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t u;
    std::memcpy(&u, b.data() + 2 * i, 2);
    v[i] = format::Bf16BitsToF32(u);
  }
  return v;
}
// logits_*.bin: raw little-endian fp32.
std::vector<float> GoldenF32(const std::string& rel) {
  const std::string b = ReadFile(GoldenPath(rel));
  std::vector<float> v(b.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}
constexpr int64_t kGoldenRows = 301, kGoldenHidden = 256, kGoldenVocab = 512;
constexpr int32_t kGoldenFirstToken = 99;  // manifest.json results.generated_ids[0]

// ---- The cases ----
using Case = std::function<void(Env&)>;

std::map<std::string, Case>& Cases() {
  static std::map<std::string, Case> cases;
  return cases;
}
struct Register {
  Register(const char* name, Case c) { Cases()[name] = std::move(c); }
};
#define PARITY_CASE(Op)                                           \
  void Op##Case(Env& env);                                        \
  const Register kRegister##Op(#Op, [](Env& e) { Op##Case(e); }); \
  void Op##Case(Env& env)

// ---- Memory ----
PARITY_CASE(Allocate) {
  // Tolerance: exact (bytes). Bad sizes are refused by both.
  const std::vector<uint8_t> bytes = Bytes(env.rng, 1000);
  for (Side* s : {&env.ref, &env.cand}) {
    auto buf = s->b().Allocate(1000);
    ASSERT_TRUE(buf.ok()) << s->name() << ": " << buf.status();
    EXPECT_EQ(buf->bytes(), 1000);
    EXPECT_EQ(buf->kind(), s->b().memory_kind());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 64, 0u) << s->name();
    ASSERT_TRUE(s->b().Upload(bytes.data(), 1000, *buf).ok());
    std::vector<uint8_t> back(1000);
    ASSERT_TRUE(s->b().Download(*buf, 0, 1000, back.data()).ok());
    CompareExact(bytes, back, s->name() + " round trip");
    EXPECT_EQ(s->b().Allocate(-1).status().code(), absl::StatusCode::kInvalidArgument);
    auto empty = s->b().Allocate(0);
    ASSERT_TRUE(empty.ok());
    EXPECT_TRUE(empty->empty());
  }
}

PARITY_CASE(Upload) {
  // Tolerance: exact. Out-of-range uploads are refused by both.
  const std::vector<uint8_t> base = Bytes(env.rng, 256), part = Bytes(env.rng, 100);
  std::vector<std::vector<uint8_t>> got;
  for (Side* s : {&env.ref, &env.cand}) {
    auto buf = s->b().Allocate(256);
    ASSERT_TRUE(buf.ok());
    ASSERT_TRUE(s->b().Upload(base.data(), 256, *buf).ok());
    ASSERT_TRUE(s->b().Upload(part.data(), 100, *buf, 77).ok());
    EXPECT_EQ(s->b().Upload(part.data(), 100, *buf, 200).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s->b().Upload(part.data(), -1, *buf, 0).code(), absl::StatusCode::kInvalidArgument);
    std::vector<uint8_t> back(256);
    ASSERT_TRUE(s->b().Download(*buf, 0, 256, back.data()).ok());
    got.push_back(back);
  }
  std::vector<uint8_t> want = base;
  std::copy(part.begin(), part.end(), want.begin() + 77);
  CompareExact(want, got[0], "reference");
  CompareExact(want, got[1], "candidate");
}

PARITY_CASE(Download) {
  // Tolerance: exact. Out-of-range downloads are refused by both.
  const std::vector<uint8_t> base = Bytes(env.rng, 300);
  std::vector<std::vector<uint8_t>> got;
  for (Side* s : {&env.ref, &env.cand}) {
    auto buf = s->b().Allocate(300);
    ASSERT_TRUE(buf.ok());
    ASSERT_TRUE(s->b().Upload(base.data(), 300, *buf).ok());
    std::vector<uint8_t> back(120);
    ASSERT_TRUE(s->b().Download(*buf, 150, 120, back.data()).ok());
    EXPECT_EQ(s->b().Download(*buf, 250, 120, back.data()).code(),
              absl::StatusCode::kInvalidArgument);
    got.push_back(back);
  }
  CompareExact(got[0], got[1], "bytes [150, 270)");
  CompareExact(std::vector<uint8_t>(base.begin() + 150, base.begin() + 270), got[0], "reference");
}

PARITY_CASE(Synchronize) {
  // Tolerance: exact. An op queued before Synchronize is complete after it; stream 99 is refused.
  const auto x = Bf16(env.rng, 4096), y = Bf16(env.rng, 4096);
  std::vector<std::vector<float>> out;
  for (Side* s : {&env.ref, &env.cand}) {
    float* px = s->In(x);
    EXPECT_OP_OK(*s, s->b().Add(px, s->In(y), 4096));
    EXPECT_OP_OK(*s, s->b().Synchronize(Stream{0}));
    EXPECT_EQ(s->b().Synchronize(Stream{99}).code(), absl::StatusCode::kInvalidArgument);
    out.push_back(s->Read(px, 4096));
  }
  Compare(env, out[0], out[1], Tol::Exact(), "x + y");
}

PARITY_CASE(Copy) {
  // Tolerance: exact.
  const auto x = Normal(env.rng, 777);
  std::vector<std::vector<float>> out;
  for (Side* s : {&env.ref, &env.cand}) {
    const float* src = s->In(x);
    float* dst = s->Out<float>(777);
    EXPECT_OP_OK(*s, s->b().Copy(dst + 10, src + 20, 700 * sizeof(float)));
    EXPECT_EQ(s->b().Copy(dst, src, -4).code(), absl::StatusCode::kInvalidArgument);
    out.push_back(s->Read(dst, 777));
  }
  Compare(env, out[0], out[1], Tol::Exact(), "copy");
  EXPECT_EQ(Bits(out[1][10]), Bits(x[20]));
}

// ---- Linears ----
// A released-layout LinearQuant weight's shape (FP8: 32x32 blocks; FP4: 1x32), no bytes.
QuantWeight QuantShape(int64_t out, int64_t in, WeightFormat fmt) {
  QuantWeight shape;
  shape.out = out;
  shape.in = in;
  shape.format = fmt;
  shape.block_rows = fmt == WeightFormat::kFp8E4M3 ? 32 : 1;
  shape.block_cols = 32;
  return shape;
}
// Random codes for `shape` (no FP8 NaN codes).
std::vector<uint8_t> RandomCodes(std::mt19937& rng, const QuantWeight& shape) {
  return shape.format == WeightFormat::kFp8E4M3 ? Fp8Codes(rng, shape.out * shape.in)
                                                : Bytes(rng, shape.out * shape.in / 2);
}
// Random E8M0 scales near 1 for `shape`.
std::vector<uint8_t> RandomScales(std::mt19937& rng, const QuantWeight& shape) {
  return Bytes(rng, shape.scale_rows() * shape.scale_cols(), 118, 130);
}
// Activations of mixed magnitudes (per-32 scales differ between blocks).
std::vector<float> MixedActivations(std::mt19937& rng, int64_t n) {
  auto x = Bf16(rng, n);
  for (int64_t i = 0; i < n; ++i) x[i] = RoundBf16(x[i] * std::ldexp(1.f, (i / 32) % 7 - 3));
  return x;
}

void LinearQuantShape(Env& env, int64_t rows, int64_t out, int64_t in, WeightFormat fmt) {
  const QuantWeight shape = QuantShape(out, in, fmt);
  const auto codes = RandomCodes(env.rng, shape);
  const auto scales = RandomScales(env.rng, shape);
  const auto x = MixedActivations(env.rng, rows * in);
  // The decoded form of the same weight.
  QuantWeight dec;
  dec.out = out;
  dec.in = in;
  dec.format = fmt;
  dec.block_rows = shape.block_rows;
  dec.block_cols = shape.block_cols;
  dec.values.resize(out * in);
  for (int64_t i = 0; i < out * in; ++i) {
    dec.values[i] = fmt == WeightFormat::kFp8E4M3
                        ? format::DecodeE4M3(codes[i])
                        : format::DecodeE2M1(i % 2 ? codes[i / 2] >> 4 : codes[i / 2] & 0xf);
  }
  for (uint8_t c : scales) dec.scales.push_back(format::DecodeE8M0(c));
  std::vector<std::vector<float>> packed_out, dec_out;
  for (Side* s : {&env.ref, &env.cand}) {
    const QuantWeight w = s->Packed(shape, codes, scales);
    const float* px = s->In(x);
    float* y = s->Out<float>(rows * out);
    float* y2 = s->Out<float>(rows * out);
    EXPECT_OP_OK(*s, s->b().LinearQuant(px, rows, w, y));
    EXPECT_OP_OK(*s, s->b().LinearQuant(px, rows, dec, y2));
    packed_out.push_back(s->Read(y, rows * out));
    dec_out.push_back(s->Read(y2, rows * out));
  }
  const std::string what = std::string(fmt == WeightFormat::kFp8E4M3 ? "FP8" : "FP4") + " [" +
                           std::to_string(out) + ", " + std::to_string(in) + "]";
  // Tolerance: exact (per-32 quantization, exact block products, fp32 block sum in block order).
  Compare(env, packed_out[0], packed_out[1], Tol::Exact(), what + " packed");
  Compare(env, dec_out[0], dec_out[1], Tol::Exact(), what + " decoded");
  Compare(env, packed_out[1], dec_out[1], Tol::Exact(), what + " candidate packed == decoded");
}

// A sum whose value depends on the order of its block terms: every weight is 1 (scale 1), a row's
// block 0 is 2^20 (term +2^25), block 1 is -2^20 (term -2^25) and the other blocks are 2^-10
// (terms 2^-5, below half an ulp of 2^25). In block order the big terms cancel first and the small
// ones add up to (nb - 2) / 32; in any other order the small ones are lost against a big one.
// bf16 rounding of the output hides most order changes of random inputs; not these.
void LinearQuantInBlockOrder(Env& env, int64_t rows, int64_t out, WeightFormat fmt) {
  const int64_t in = 34 * 32;  // more than one 32-block pass of the skinny tiles
  const QuantWeight shape = QuantShape(out, in, fmt);
  const std::vector<uint8_t> codes(
      static_cast<size_t>(fmt == WeightFormat::kFp8E4M3 ? out * in : out * in / 2),
      fmt == WeightFormat::kFp8E4M3 ? 0x38 : 0x22);  // E4M3 1.0; two E2M1 1.0
  const std::vector<uint8_t> scales(static_cast<size_t>(shape.scale_rows() * shape.scale_cols()),
                                    127);  // E8M0 1.0
  std::vector<float> x(static_cast<size_t>(rows * in), std::ldexp(1.f, -10));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < 32; ++i) {
      x[r * in + i] = std::ldexp(1.f, 20);
      x[r * in + 32 + i] = -std::ldexp(1.f, 20);
    }
  }
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    const QuantWeight w = s->Packed(shape, codes, scales);
    float* y = s->Out<float>(rows * out);
    EXPECT_OP_OK(*s, s->b().LinearQuant(s->In(x), rows, w, y));
    res.push_back(s->Read(y, rows * out));
  }
  EXPECT_EQ(res[0][0], 1.f) << "the reference adds the terms in block order";
  Compare(env, res[0], res[1], Tol::Exact(), "block order, " + std::to_string(rows) + " rows");
}

PARITY_CASE(LinearQuant) {
  LinearQuantShape(env, 5, 72, 96, WeightFormat::kFp8E4M3);
  LinearQuantShape(env, 3, 40, 80, WeightFormat::kFp8E4M3);  // K % 32 != 0: a short last block
  LinearQuantShape(env, 4, 40, 64, WeightFormat::kFp4E2M1);
  LinearQuantShape(env, 1, 9, 128, WeightFormat::kFp4E2M1);
  // Decode-sized calls. At most 8 rows take skinny tiles on CUDA (a warp per output, 32 K blocks
  // a pass): a short last block (scalar loads), several passes (K > 1024) with a last pass of 2
  // blocks, a full 8-row tile with FP4 over two whole passes, outputs not a multiple of the 8
  // warps. 9 to 16 rows with at least 8 K blocks spread K over the grid: 16 rows with FP4, 12 rows
  // at the boundary of 8 blocks.
  LinearQuantShape(env, 1, 72, 1000, WeightFormat::kFp8E4M3);
  LinearQuantShape(env, 7, 64, 256, WeightFormat::kFp8E4M3);
  LinearQuantShape(env, 2, 20, 1088, WeightFormat::kFp8E4M3);
  LinearQuantShape(env, 3, 17, 1100, WeightFormat::kFp8E4M3);
  LinearQuantShape(env, 8, 24, 2048, WeightFormat::kFp4E2M1);
  LinearQuantShape(env, 16, 130, 512, WeightFormat::kFp4E2M1);
  LinearQuantShape(env, 12, 40, 256, WeightFormat::kFp8E4M3);
  // The terms in block order on every path: skinny tiles, K over the grid, 16-row tiles.
  LinearQuantInBlockOrder(env, 3, 20, WeightFormat::kFp8E4M3);
  LinearQuantInBlockOrder(env, 1, 9, WeightFormat::kFp4E2M1);
  LinearQuantInBlockOrder(env, 12, 20, WeightFormat::kFp8E4M3);
  LinearQuantInBlockOrder(env, 20, 20, WeightFormat::kFp8E4M3);
  // Golden activations (the reference's layer-5 FFN input [301, 256]) through a random FP8 weight.
  {
    const auto g = GoldenBf16("debug/ffn_in_layer5_prefill.bin");
    ASSERT_EQ(static_cast<int64_t>(g.size()), kGoldenRows * kGoldenHidden);
    QuantWeight shape;
    shape.out = 96;
    shape.in = kGoldenHidden;
    const auto codes = Fp8Codes(env.rng, shape.out * shape.in);
    const auto scales = Bytes(env.rng, shape.scale_rows() * shape.scale_cols(), 118, 130);
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      const QuantWeight w = s->Packed(shape, codes, scales);
      float* y = s->Out<float>(kGoldenRows * shape.out);
      EXPECT_OP_OK(*s, s->b().LinearQuant(s->In(g), kGoldenRows, w, y));
      res.push_back(s->Read(y, kGoldenRows * shape.out));
    }
    Compare(env, res[0], res[1], Tol::Exact(), "FP8 on golden activations");
  }
  // Bad packed bytes: refused by both.
  QuantWeight shape;
  shape.out = 8;
  shape.in = 64;
  for (Side* s : {&env.ref, &env.cand}) {
    QuantWeight w = s->Packed(shape, Fp8Codes(env.rng, 8 * 63), Bytes(env.rng, 2, 127, 127));
    const float* px = s->In(Bf16(env.rng, 64));
    float* y = s->Out<float>(8);
    EXPECT_EQ(s->b().LinearQuant(px, 1, w, y).code(), absl::StatusCode::kInvalidArgument)
        << s->name();
  }
}

void PlainLinear(Env& env, bool bf16) {
  for (auto [rows, out, in, cancelling] :
       {std::tuple<int64_t, int64_t, int64_t, bool>{5, 37, 203, false},
        {1, 64, 256, false},
        {17, 9, 7, false},
        {2, 3, 0, false},
        {3, 70, 203, true},
        // At most 8 rows run as chains on CUDA (128 elements a chunk): a full 8-row block over
        // 3 chunks, 8 chunks with a short last one, one element past a chunk.
        {8, 33, 300, true},
        {1, 5, 1000, true},
        {6, 40, 129, false},
        // The CPU widens bf16 bits in blocks of 64 outputs at this K: three and a short fourth.
        {5, 203, 1000, false},
        {1, 203, 1000, true}}) {
    // cancelling: x of ones and weight rows that cancel, so a change of the dots' order shows.
    const auto x =
        cancelling ? Cancelling(env.rng, rows, in, /*ones=*/true) : Bf16(env.rng, rows * in);
    const auto w = cancelling ? Cancelling(env.rng, out, in) : Bf16(env.rng, out * in, 0.05f);
    // The same weight in its bf16 form (the model's): its values' 16 bits.
    std::vector<uint16_t> bits(w.size());
    for (size_t i = 0; i < w.size(); ++i) bits[i] = format::F32ToBf16Bits(w[i]);
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      const float* px = s->In(x);
      for (const PlainWeight pw : {PlainWeight(s->In(w)), PlainWeight::Bf16(s->In(bits))}) {
        float* y = s->Out<float>(rows * out);
        EXPECT_OP_OK(*s, bf16 ? s->b().LinearBf16(px, rows, pw, out, in, y)
                              : s->b().LinearF32(px, rows, pw, out, in, y));
        res.push_back(s->Read(y, rows * out));
      }
    }
    // Tolerance: exact (the reference's orders, kernels/torch_math.h: LinearBf16 in DotDp's
    // pairwise order, then bf16; LinearF32 in DotSeq's index order), and the two weight forms
    // give the same bits on either side.
    const std::string what = "[" + std::to_string(rows) + ", " + std::to_string(out) + ", " +
                             std::to_string(in) + "]" + (cancelling ? " cancelling" : "");
    Compare(env, res[0], res[2], Tol::Exact(), what);
    Compare(env, res[0], res[3], Tol::Exact(), what + ", candidate's weight as bf16 bits");
    Compare(env, res[0], res[1], Tol::Exact(), what + ", reference's weight as bf16 bits");
  }
  // A weight of an unknown dtype: refused by both.
  for (Side* s : {&env.ref, &env.cand}) {
    PlainWeight pw(s->In(Bf16(env.rng, 8 * 16)));
    pw.dtype = static_cast<PlainDtype>(7);
    float* y = s->Out<float>(8);
    const float* px = s->In(Bf16(env.rng, 16));
    EXPECT_EQ(
        (bf16 ? s->b().LinearBf16(px, 1, pw, 8, 16, y) : s->b().LinearF32(px, 1, pw, 8, 16, y))
            .code(),
        absl::StatusCode::kInvalidArgument)
        << s->name();
  }
}
PARITY_CASE(LinearBf16) { PlainLinear(env, true); }
PARITY_CASE(LinearF32) { PlainLinear(env, false); }

// ---- Norms, RoPE, rounding ----
PARITY_CASE(RmsNorm) {
  // Tolerance: exact (TorchMeanSquare: torch's sum order; fp32 scaling; bf16).
  const int64_t rows = 3, dim = 517;
  const auto x = Bf16(env.rng, rows * dim, 3.f), w = Bf16(env.rng, dim);
  std::vector<std::vector<float>> res, alias;
  for (Side* s : {&env.ref, &env.cand}) {
    float* y = s->Out<float>(rows * dim);
    float* px = s->In(x);
    EXPECT_OP_OK(*s, s->b().RmsNorm(px, s->In(w), rows, dim, 1e-6f, y));
    res.push_back(s->Read(y, rows * dim));
    EXPECT_OP_OK(*s, s->b().RmsNorm(px, s->In(w), rows, dim, 1e-6f, px));  // in place
    alias.push_back(s->Read(px, rows * dim));
    EXPECT_EQ(s->b().RmsNorm(px, px, 1, 0, 1e-6f, px).code(), absl::StatusCode::kInvalidArgument);
  }
  Compare(env, res[0], res[1], Tol::Exact(), "rmsnorm");
  Compare(env, alias[0], alias[1], Tol::Exact(), "rmsnorm in place");
  // Each side's out-of-place RmsNorm of xv [r, d].
  auto norm = [&](const std::vector<float>& xv, const std::vector<float>& wv, int64_t r, int64_t d,
                  float eps) {
    std::vector<std::vector<float>> out;
    for (Side* s : {&env.ref, &env.cand}) {
      float* y = s->Out<float>(r * d);
      EXPECT_OP_OK(*s, s->b().RmsNorm(s->In(xv), s->In(wv), r, d, eps, y));
      out.push_back(s->Read(y, r * d));
    }
    return out;
  };
  // Squares of 2^25 beside small ones: torch's sum order (TorchMeanSquare's lanes) shows.
  const auto rc = norm(Cancelling(env.rng, rows, dim), w, rows, dim, 1e-6f);
  Compare(env, rc[0], rc[1], Tol::Exact(), "rmsnorm, wide magnitudes");
  // Golden: the reference's layer-3 attention input [301, 256], eps 1e-20 as the config.
  const auto g = GoldenBf16("debug/attn_in_layer3_prefill.bin");
  ASSERT_EQ(static_cast<int64_t>(g.size()), kGoldenRows * kGoldenHidden);
  const auto gold = norm(g, Bf16(env.rng, kGoldenHidden), kGoldenRows, kGoldenHidden, 1e-20f);
  Compare(env, gold[0], gold[1], Tol::Exact(), "rmsnorm on golden activations");
  Compare(env, res[1], alias[1], Tol::Exact(), "candidate in place == out of place");
}

PARITY_CASE(RopeTables) {
  // Tolerance: 1 fp32 ulp (cos/sin: glibc's fp32 functions vs the GPU's correctly rounded ones).
  const std::vector<float> freqs = RopeFrequencies(64, 10000.0, true, 16.0, 4096.0, 32.0, 1.0);
  const std::vector<int64_t> pos = {0, 1, 17, 4095, 65535, 1000000, 7};
  const int n_pairs = static_cast<int>(freqs.size());
  const int64_t rows = static_cast<int64_t>(pos.size());
  std::vector<std::vector<float>> c, sn;
  for (Side* s : {&env.ref, &env.cand}) {
    float* pc = s->Out<float>(rows * n_pairs);
    float* ps = s->Out<float>(rows * n_pairs);
    EXPECT_OP_OK(*s, s->b().RopeTables(s->In(freqs), n_pairs, s->In(pos), rows, pc, ps));
    c.push_back(s->Read(pc, rows * n_pairs));
    sn.push_back(s->Read(ps, rows * n_pairs));
  }
  Compare(env, c[0], c[1], Tol::Ulps(1), "cos");
  Compare(env, sn[0], sn[1], Tol::Ulps(1), "sin");
}

PARITY_CASE(Rope) {
  // Tolerance: exact (fp32 products and differences, bf16), on the same tables.
  const int64_t rows = 3;
  const int heads = 4, stride = 96, offset = 32, n_pairs = 32;
  const std::vector<float> freqs = RopeFrequencies(64, 10000.0, false, 1, 1, 1, 1);
  std::vector<float> cs(rows * n_pairs), sn(rows * n_pairs);
  for (int64_t r = 0; r < rows; ++r)
    RopeCosSin(freqs, 100 * r + 3, cs.data() + r * n_pairs, sn.data() + r * n_pairs);
  const auto x = Bf16(env.rng, rows * heads * stride);
  for (bool inverse : {false, true}) {
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      float* px = s->In(x);
      EXPECT_OP_OK(
          *s, s->b().Rope(px, rows, heads, stride, offset, n_pairs, s->In(cs), s->In(sn), inverse));
      EXPECT_EQ(s->b().Rope(px, rows, heads, 40, offset, n_pairs, nullptr, nullptr, inverse).code(),
                absl::StatusCode::kInvalidArgument);
      res.push_back(s->Read(px, rows * heads * stride));
    }
    Compare(env, res[0], res[1], Tol::Exact(), inverse ? "inverse" : "forward");
  }
}

std::vector<float> WithSpecials(std::mt19937& rng, int64_t n) {
  auto v = Normal(rng, n, 100.f);
  const float specials[] = {NAN,         INFINITY,    -INFINITY,
                            -0.f,        0.f,         1e-40f,
                            -1e-42f,     3.4e38f,     1.00390625f /* a bf16 tie */,
                            1.01171875f, -2.00781250f};
  for (size_t i = 0; i < std::size(specials); ++i) v[i * 7] = specials[i];
  return v;
}

PARITY_CASE(RoundBf16) {
  // Tolerance: exact (RNE, NaN kept NaN).
  const auto x = WithSpecials(env.rng, 1000);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* px = s->In(x);
    EXPECT_OP_OK(*s, s->b().RoundBf16(px, 1000));
    res.push_back(s->Read(px, 1000));
  }
  Compare(env, res[0], res[1], Tol::Exact(), "round");
}

PARITY_CASE(ScaleRoundBf16) {
  // Tolerance: exact.
  const auto x = WithSpecials(env.rng, 1000);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* px = s->In(x);
    EXPECT_OP_OK(*s, s->b().ScaleRoundBf16(px, 1000, 0.0883883f));
    res.push_back(s->Read(px, 1000));
  }
  Compare(env, res[0], res[1], Tol::Exact(), "scale round");
}

PARITY_CASE(Add) {
  // Tolerance: exact.
  const auto x = WithSpecials(env.rng, 999), y = Normal(env.rng, 999);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* px = s->In(x);
    EXPECT_OP_OK(*s, s->b().Add(px, s->In(y), 999));
    res.push_back(s->Read(px, 999));
  }
  Compare(env, res[0], res[1], Tol::Exact(), "add");
}

// ---- Attention ----
PARITY_CASE(SparseAttention) {
  // Tolerance: exact (kernels/torch_math.h on both: DotSeq scores, TorchExp in the online
  // softmax, each chunk's probabilities summed by TorchSum, bf16 probabilities).
  const int64_t rows = 3, kv_rows = 300, ext_rows = 50, list_len = 150;
  const int heads = 4, hd = 64;
  const auto q = Bf16(env.rng, rows * heads * hd), kv = Bf16(env.rng, kv_rows * hd),
             ext = Bf16(env.rng, ext_rows * hd), sink = Normal(env.rng, heads);
  std::vector<int32_t> idx(rows * list_len);
  std::uniform_int_distribution<int32_t> pick(-1, kv_rows + ext_rows - 1);
  for (auto& t : idx) t = pick(env.rng);
  for (int64_t j = 64; j < 128; ++j) idx[1 * list_len + j] = -1;      // a chunk with no entry
  for (int64_t j = 0; j < list_len; ++j) idx[2 * list_len + j] = -1;  // a row with none
  idx[2 * list_len + 149] = 5;
  // Each side's outputs of one SparseAttention over these inputs (ext: the second KV buffer, from
  // list entry ext_start on; empty: none).
  auto attend = [&](const std::vector<float>& qv, const std::vector<float>& kvv,
                    const std::vector<float>& extv, int64_t ext_start,
                    const std::vector<float>& sinkv, const std::vector<int32_t>& idxv, int64_t r,
                    int h, int d, int64_t len, float scale) {
    std::vector<std::vector<float>> out;
    for (Side* s : {&env.ref, &env.cand}) {
      SparseAttentionArgs a;
      a.q = s->In(qv);
      a.kv = s->In(kvv);
      if (!extv.empty()) {
        a.kv_ext = s->In(extv);
        a.kv_ext_start = ext_start;
      }
      a.sink = s->In(sinkv);
      a.idx = s->In(idxv);
      a.rows = r;
      a.heads = h;
      a.head_dim = d;
      a.list_len = len;
      a.scale = scale;
      a.out = s->Out<float>(r * h * d);
      EXPECT_OP_OK(*s, s->b().SparseAttention(a));
      out.push_back(s->Read(a.out, r * h * d));
    }
    return out;
  };
  const auto res = attend(q, kv, ext, kv_rows, sink, idx, rows, heads, hd, list_len, 0.125f);
  Compare(env, res[0], res[1], Tol::Exact(), "attention");

  // Inputs whose sums change with their order, over the CUDA kernel's block shapes (1, 2 and 4
  // heads a block, a last block of 3; whole KV rows in shared memory, and at head_dim 1024, past
  // an H200's shared memory, 64-dim tiles): scores (q of ones, KV rows that cancel) and values
  // (q = 0, so every probability is 1, and KV columns that cancel across entries).
  struct Shape {
    int64_t rows;
    int heads, hd;
    int64_t list_len;
  };
  for (const Shape& sh : {Shape{1, 8, 512, 640}, Shape{130, 6, 64, 100}, Shape{100, 11, 64, 70},
                          Shape{20, 64, 160, 130}, Shape{2, 3, 1024, 100}}) {
    for (bool values : {false, true}) {
      const int64_t n_kv = 120;
      auto qc = Cancelling(env.rng, sh.rows * sh.heads, sh.hd, /*ones=*/true);
      if (values) std::fill(qc.begin(), qc.end(), 0.f);
      const auto kvc = Cancelling(env.rng, n_kv, sh.hd, false, /*columns=*/values);
      const auto sinkc = Normal(env.rng, sh.heads);
      std::vector<int32_t> idxc(sh.rows * sh.list_len);
      std::uniform_int_distribution<int32_t> pick_c(-1, n_kv - 1);
      for (auto& t : idxc) t = pick_c(env.rng);
      const auto rc =
          attend(qc, kvc, {}, 0, sinkc, idxc, sh.rows, sh.heads, sh.hd, sh.list_len, 0.0625f);
      Compare(env, rc[0], rc[1], Tol::Exact(),
              absl::StrCat(sh.rows, " rows of ", sh.heads, " heads of ", sh.hd, ", ",
                           values ? "values" : "scores", " in order"));
    }
  }
}

PARITY_CASE(CompressPool) {
  // Tolerance: 1 bf16 ulp (exp of the softmax). Several groups in one call equal one call per
  // group on each side (groups are independent).
  for (int ratio : {4, 8, 1}) {
    const int64_t dim = 128, groups = 3;
    const auto kv = Bf16(env.rng, groups * ratio * dim),
               score = Normal(env.rng, groups * ratio * dim, 2.f);
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      const float *pk = s->In(kv), *ps = s->In(score);
      float* out = s->Out<float>(groups * dim);
      EXPECT_OP_OK(*s, s->b().CompressPool(pk, ps, groups, ratio, dim, out));
      EXPECT_EQ(s->b().CompressPool(nullptr, nullptr, 1, 9, dim, out).code(),
                absl::StatusCode::kInvalidArgument);
      res.push_back(s->Read(out, groups * dim));
      float* one = s->Out<float>(groups * dim);
      for (int64_t g = 0; g < groups; ++g) {
        EXPECT_OP_OK(*s, s->b().CompressPool(pk + g * ratio * dim, ps + g * ratio * dim, 1, ratio,
                                             dim, one + g * dim));
      }
      Compare(env, res.back(), s->Read(one, groups * dim), Tol::Exact(),
              s->name() + ": groups in one call vs one call per group");
    }
    Compare(env, res[0], res[1], Tol::Bf16Ulps(1), "ratio " + std::to_string(ratio));
  }
}

PARITY_CASE(IndexerScores) {
  // Tolerance: exact (fp32 dots in oneDNN's pair order, DotDp; bf16 steps; heads in order).
  for (int heads : {8, 6}) {
    const int64_t n = 37, dim = 64;
    const auto q = Bf16(env.rng, heads * dim), w = Bf16(env.rng, heads),
               keys = Bf16(env.rng, n * dim);
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      float* out = s->Out<float>(n);
      EXPECT_OP_OK(*s, s->b().IndexerScores(s->In(q), s->In(w), heads, s->In(keys), n, dim, out));
      res.push_back(s->Read(out, n));
    }
    Compare(env, res[0], res[1], Tol::Exact(), std::to_string(heads) + " heads");
  }
  // Keys whose dots change with the order of their sum (DotDp's pairs, not index order), at the
  // release config's index heads and dim, at an odd dim, and at dims whose 32 key rows exceed a
  // GPU's shared memory (CUDA runs them in tiles of dims: two tiles; three, the last one odd);
  // and keys of no dims (every dot 0: no tile runs, and the kernel must not read its shared
  // memory unwritten).
  struct Shape {
    int heads;
    int64_t dim, n;
  };
  for (auto [heads, dim, n] :
       {Shape{64, 128, 300}, {6, 63, 300}, {64, 2050, 70}, {8, 4099, 40}, {6, 0, 40}}) {
    const auto q = Cancelling(env.rng, heads, dim, /*ones=*/true), w = Bf16(env.rng, heads),
               keys = Cancelling(env.rng, n, dim);
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      float* out = s->Out<float>(n);
      EXPECT_OP_OK(*s, s->b().IndexerScores(s->In(q), s->In(w), heads, s->In(keys), n, dim, out));
      res.push_back(s->Read(out, n));
    }
    Compare(env, res[0], res[1], Tol::Exact(),
            absl::StrCat(heads, " heads of ", dim, ", pairs in order"));
  }
}

PARITY_CASE(MaskScores) {
  // Tolerance: exact.
  const int64_t n = 200;
  const auto score = Normal(env.rng, n);
  const auto mask = Bytes(env.rng, n, 0, 1);
  for (bool with_mask : {false, true}) {
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      float* p = s->In(score);
      EXPECT_OP_OK(*s, s->b().MaskScores(p, n, 150, with_mask ? s->In(mask) : nullptr, 180));
      res.push_back(s->Read(p, n));
    }
    Compare(env, res[0], res[1], Tol::Exact(), with_mask ? "with mask" : "without mask");
  }
}

PARITY_CASE(StableTopK) {
  // Tolerance: exact (indices; ties to the lower index; -0 == +0).
  for (auto [n, k] : {std::pair<int64_t, int64_t>{1000, 100}, {50, 80}, {4096, 1}}) {
    const auto v = n == 1000 ? Tied(env.rng, n) : Normal(env.rng, n);
    const int64_t m = std::min(k, n);
    std::vector<std::vector<int32_t>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      int32_t* out = s->Out<int32_t>(m);
      EXPECT_OP_OK(*s, s->b().StableTopK(s->In(v), n, k, out));
      res.push_back(s->Read(out, m));
    }
    CompareExact(res[0], res[1], "n " + std::to_string(n) + " k " + std::to_string(k));
  }
}

PARITY_CASE(CandidateMask) {
  // Tolerance: exact (0/1 mask).
  const int64_t n = 1000, block = 64;
  auto score = Normal(env.rng, n);
  for (int64_t t = 128; t < 256; ++t) score[t] = -INFINITY;  // all -inf blocks are never kept
  for (auto [visible, keep] : {std::pair<int64_t, int64_t>{900, 5}, {0, 3}, {1000, 40}}) {
    std::vector<std::vector<uint8_t>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      uint8_t* mask = s->Out<uint8_t>(n);
      EXPECT_OP_OK(*s, s->b().CandidateMask(s->In(score), n, block, visible, keep, mask));
      res.push_back(s->Read(mask, n));
    }
    CompareExact(res[0], res[1],
                 "visible " + std::to_string(visible) + " keep " + std::to_string(keep));
  }
}

PARITY_CASE(SelectTopK) {
  // Tolerance: exact (ascending index list, -1 beyond visible).
  const int64_t n = 500, k = 64;
  const auto score = Tied(env.rng, n);
  std::vector<std::vector<int32_t>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    int32_t* out = s->Out<int32_t>(k);
    EXPECT_OP_OK(*s, s->b().SelectTopK(s->In(score), n, k, 450, 1000, out));
    EXPECT_EQ(s->b().SelectTopK(s->In(score), n, n + 1, 450, 0, out).code(),
              absl::StatusCode::kInvalidArgument);
    res.push_back(s->Read(out, k));
  }
  CompareExact(res[0], res[1], "selection");
}

// The rows ops must equal their one-row ops row by row, on each side (the op's contract), and
// the two sides must agree.
PARITY_CASE(IndexerScoresRows) {
  // Tolerance: exact (IndexerScores per row, then -inf past the row's valid keys).
  const int heads = 6;
  const int64_t rows = 5, n = 70, dim = 64;
  const std::vector<int64_t> valid = {70, 0, 33, 1, 64};
  const auto q = Bf16(env.rng, rows * heads * dim), w = Bf16(env.rng, rows * heads),
             keys = Bf16(env.rng, n * dim);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    const float *pq = s->In(q), *pw = s->In(w), *pk = s->In(keys);
    float* out = s->Out<float>(rows * n);
    EXPECT_OP_OK(*s, s->b().IndexerScoresRows(pq, pw, heads, pk, n, dim, rows, s->In(valid), out));
    std::vector<float> one_by_one;
    for (int64_t r = 0; r < rows; ++r) {
      float* o = s->Out<float>(n);
      EXPECT_OP_OK(*s, s->b().IndexerScores(pq + r * heads * dim, pw + r * heads, heads, pk,
                                            valid[r], dim, o));
      EXPECT_OP_OK(*s, s->b().MaskScores(o, n, valid[r], nullptr, 0));
      const std::vector<float> row = s->Read(o, n);
      one_by_one.insert(one_by_one.end(), row.begin(), row.end());
    }
    res.push_back(s->Read(out, rows * n));
    Compare(env, res.back(), one_by_one, Tol::Exact(), s->name() + ": rows vs one row at a time");
  }
  Compare(env, res[0], res[1], Tol::Exact(), "rows");
  // A row that asks for more keys than the scores hold is refused by the CPU backend.
  EXPECT_EQ(env.ref.b()
                .IndexerScoresRows(env.ref.In(q), env.ref.In(w), heads, env.ref.In(keys), n, dim,
                                   rows, env.ref.In(std::vector<int64_t>{1, 2, 71, 3, 4}),
                                   env.ref.Out<float>(rows * n))
                .code(),
            absl::StatusCode::kInvalidArgument);
}

PARITY_CASE(CandidateMaskRows) {
  // Tolerance: exact (0/1 mask). Rows as wide as the scores, then each of its own width (rows of
  // sequences with different key counts in one call): row 0's visible block lies past its width,
  // row 3's width ends mid-block.
  const int64_t rows = 4, n = 1000, block = 64, keep = 5;
  auto score = Normal(env.rng, rows * n);
  for (int64_t t = 128; t < 256; ++t) score[n + t] = -INFINITY;  // row 1: an all -inf block
  const std::vector<int64_t> visible = {900, 0, 1000, 65}, cols = {700, 1000, 963, 70};
  for (bool with_cols : {false, true}) {
    std::vector<std::vector<uint8_t>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      const float* ps = s->In(score);
      uint8_t* mask = s->Out<uint8_t>(rows * n);
      EXPECT_OP_OK(*s, s->b().CandidateMaskRows(ps, rows, n, block, s->In(visible),
                                                with_cols ? s->In(cols) : nullptr, keep, mask));
      std::vector<uint8_t> one_by_one;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t nr = with_cols ? cols[r] : n;
        uint8_t* m = s->Out<uint8_t>(n);
        EXPECT_OP_OK(*s, s->b().CandidateMask(ps + r * n, nr, block, visible[r], keep, m));
        std::vector<uint8_t> row = s->Read(m, nr);
        row.resize(n, 0);
        one_by_one.insert(one_by_one.end(), row.begin(), row.end());
      }
      res.push_back(s->Read(mask, rows * n));
      CompareExact(res.back(), one_by_one, s->name() + ": rows vs one row at a time");
    }
    CompareExact(res[0], res[1], with_cols ? "rows of their own widths" : "rows");
  }
}

PARITY_CASE(SelectTopKRows) {
  // Tolerance: exact (ascending index lists, -1 beyond each row's visible keys), with ties.
  const int64_t rows = 6, n = 500, k = 64, mask_cols = 480;
  const auto score = Tied(env.rng, rows * n);
  const auto mask = Bytes(env.rng, rows * mask_cols, 0, 1);
  const std::vector<int64_t> visible = {450, 0, 500, 64, 1, 300};
  for (bool with_mask : {false, true}) {
    std::vector<std::vector<int32_t>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      const float* ps = s->In(score);
      const uint8_t* pm = with_mask ? s->In(mask) : nullptr;
      int32_t* out = s->Out<int32_t>(rows * k);
      EXPECT_OP_OK(*s,
                   s->b().SelectTopKRows(ps, rows, n, k, s->In(visible), 1000, pm, mask_cols, out));
      std::vector<int32_t> one_by_one;
      for (int64_t r = 0; r < rows; ++r) {
        float* row = s->In(std::vector<float>(score.begin() + r * n, score.begin() + (r + 1) * n));
        if (pm != nullptr)
          EXPECT_OP_OK(*s, s->b().MaskScores(row, n, n, pm + r * mask_cols, mask_cols));
        int32_t* o = s->Out<int32_t>(k);
        EXPECT_OP_OK(*s, s->b().SelectTopK(row, n, k, visible[r], 1000, o));
        const std::vector<int32_t> got = s->Read(o, k);
        one_by_one.insert(one_by_one.end(), got.begin(), got.end());
      }
      // The scores are not written.
      EXPECT_EQ(s->Read(ps, rows * n), score) << s->name();
      EXPECT_EQ(
          s->b().SelectTopKRows(ps, rows, n, n + 1, s->In(visible), 0, nullptr, 0, out).code(),
          absl::StatusCode::kInvalidArgument);
      res.push_back(s->Read(out, rows * k));
      CompareExact(res.back(), one_by_one, s->name() + ": rows vs one row at a time");
    }
    CompareExact(res[0], res[1], with_mask ? "rows, masked" : "rows");
  }
}

// ---- mHC ----
PARITY_CASE(HcMixes) {
  // Tolerance: 1e-5 of the largest output, though the arithmetic is the same on both
  // (kernels/torch_math.h: DotSeq projection, TorchMeanSquare, TorchExp sigmoids and softmax;
  // fp32 Sinkhorn in order): 20 Sinkhorn iterations of divisions leave no margin for a
  // compiler's contraction, which -fmad=false rules out; tighten to exact after the first GPU run.
  const int64_t rows = 3, dim = 64;
  const int hc = 4, nm = (2 + hc) * hc;
  const auto h = Bf16(env.rng, rows * hc * dim), fn = Normal(env.rng, nm * hc * dim, 0.05f),
             base = Normal(env.rng, nm, 0.5f);
  const std::vector<float> scale = {0.7f, 1.3f, 2.0f};
  std::vector<std::vector<float>> pre, post, comb;
  for (Side* s : {&env.ref, &env.cand}) {
    float* p = s->Out<float>(rows * hc);
    float* q = s->Out<float>(rows * hc);
    float* c = s->Out<float>(rows * hc * hc);
    EXPECT_OP_OK(*s, s->b().HcMixes(rows, s->In(h), hc, dim, s->In(fn), s->In(scale), s->In(base),
                                    20, 1e-6f, 1e-6f, p, q, c));
    pre.push_back(s->Read(p, rows * hc));
    post.push_back(s->Read(q, rows * hc));
    comb.push_back(s->Read(c, rows * hc * hc));
  }
  Compare(env, pre[0], pre[1], Tol::Rel(1e-5), "pre");
  Compare(env, post[0], post[1], Tol::Rel(1e-5), "post");
  Compare(env, comb[0], comb[1], Tol::Rel(1e-5), "comb");
}

PARITY_CASE(HcMixesSingleToken) {
  // Tolerance: as HcMixes (the same math; the CPU backend's sigmoids use glibc's expf here).
  const int64_t rows = 2, dim = 64;
  const int hc = 4, nm = (2 + hc) * hc;
  const auto h = Bf16(env.rng, rows * hc * dim), fn = Normal(env.rng, nm * hc * dim, 0.05f),
             base = Normal(env.rng, nm, 0.5f);
  const std::vector<float> scale = {0.7f, 1.3f, 2.0f};
  std::vector<std::vector<float>> pre, post, comb;
  for (Side* s : {&env.ref, &env.cand}) {
    float* p = s->Out<float>(rows * hc);
    float* q = s->Out<float>(rows * hc);
    float* c = s->Out<float>(rows * hc * hc);
    EXPECT_OP_OK(*s, s->b().HcMixesSingleToken(rows, s->In(h), hc, dim, s->In(fn), s->In(scale),
                                               s->In(base), 20, 1e-6f, 1e-6f, p, q, c));
    pre.push_back(s->Read(p, rows * hc));
    post.push_back(s->Read(q, rows * hc));
    comb.push_back(s->Read(c, rows * hc * hc));
  }
  Compare(env, pre[0], pre[1], Tol::Rel(1e-5), "pre");
  Compare(env, post[0], post[1], Tol::Rel(1e-5), "post");
  Compare(env, comb[0], comb[1], Tol::Rel(1e-5), "comb");
}

PARITY_CASE(HcPre) {
  // Tolerance: exact (fp32 sum over the streams in order, bf16).
  const int64_t rows = 3, dim = 100;
  const int hc = 4;
  const auto h = Bf16(env.rng, rows * hc * dim), pre = Normal(env.rng, rows * hc);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* y = s->Out<float>(rows * dim);
    EXPECT_OP_OK(*s, s->b().HcPre(rows, s->In(h), hc, dim, s->In(pre), y));
    res.push_back(s->Read(y, rows * dim));
  }
  Compare(env, res[0], res[1], Tol::Exact(), "pre mix");
}

PARITY_CASE(HcPost) {
  // Tolerance: exact; also with out aliasing res.
  const int64_t rows = 2, dim = 96;
  const int hc = 4;
  const auto y = Bf16(env.rng, rows * dim), res_in = Bf16(env.rng, rows * hc * dim),
             post = Normal(env.rng, rows * hc), comb = Normal(env.rng, rows * hc * hc, 0.3f);
  std::vector<std::vector<float>> out, alias;
  for (Side* s : {&env.ref, &env.cand}) {
    float* o = s->Out<float>(rows * hc * dim);
    float* r = s->In(res_in);
    EXPECT_OP_OK(*s, s->b().HcPost(rows, s->In(y), r, hc, dim, s->In(post), s->In(comb), o));
    out.push_back(s->Read(o, rows * hc * dim));
    EXPECT_OP_OK(*s, s->b().HcPost(rows, s->In(y), r, hc, dim, s->In(post), s->In(comb), r));
    alias.push_back(s->Read(r, rows * hc * dim));
  }
  Compare(env, out[0], out[1], Tol::Exact(), "post mix");
  Compare(env, alias[0], alias[1], Tol::Exact(), "post mix in place");
  Compare(env, out[1], alias[1], Tol::Exact(), "candidate in place == out of place");
}

PARITY_CASE(HcMean) {
  // Tolerance: exact.
  const int64_t rows = 3, dim = 50, stride = 70;
  const int hc = 4;
  const auto h = Bf16(env.rng, rows * hc * dim);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* y = s->In(std::vector<float>(rows * stride, 7.f));
    EXPECT_OP_OK(*s, s->b().HcMean(rows, s->In(h), hc, dim, y, stride));
    res.push_back(s->Read(y, rows * stride));
  }
  Compare(env, res[0], res[1], Tol::Exact(), "mean (untouched gaps stay 7)");
}

// ---- MoE ----
PARITY_CASE(MoeRoute) {
  // Tolerance: experts and their top-k order exact; weights 4 fp32 ulps (softplus: exp, log1p).
  for (int top_k : {6, 1}) {
    const int64_t rows = 7;
    const int E = 64;
    auto z = Normal(env.rng, rows * E, 3.f);
    z[3] = 25.f;  // the softplus shortcut (z > 20)
    const auto bias = Normal(env.rng, E, 0.1f);
    std::vector<std::vector<int32_t>> ex, rk;
    std::vector<std::vector<float>> wt;
    for (Side* s : {&env.ref, &env.cand}) {
      int32_t* e = s->Out<int32_t>(rows * top_k);
      int32_t* r = s->Out<int32_t>(rows * top_k);
      float* w = s->Out<float>(rows * top_k);
      EXPECT_OP_OK(*s, s->b().MoeRoute(s->In(z), rows, E, s->In(bias), top_k, 2.5f, e, w, r));
      EXPECT_EQ(s->b().MoeRoute(s->In(z), rows, E, s->In(bias), E + 1, 2.5f, e, w, r).code(),
                absl::StatusCode::kInvalidArgument);
      ex.push_back(s->Read(e, rows * top_k));
      rk.push_back(s->Read(r, rows * top_k));
      wt.push_back(s->Read(w, rows * top_k));
    }
    const std::string what = "top_k " + std::to_string(top_k);
    CompareExact(ex[0], ex[1], what + " experts");
    CompareExact(rk[0], rk[1], what + " ranked");
    Compare(env, wt[0], wt[1], Tol::Ulps(4), what + " weights");
  }
}

// A valid routing for MoeGroup: each row's top_k distinct experts in ascending order, with
// random weights; expert 0 gets no rows when `starve_first` (an empty list).
void RandomRouting(std::mt19937& rng, int64_t rows, int E, int K, bool starve_first,
                   std::vector<int32_t>* experts, std::vector<float>* weights) {
  std::vector<int32_t> ids(E);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin() + (starve_first ? 1 : 0), ids.end(), rng);
    std::vector<int32_t> pick(ids.end() - K, ids.end());
    std::sort(pick.begin(), pick.end());
    experts->insert(experts->end(), pick.begin(), pick.end());
  }
  *weights = Normal(rng, rows * K);
}

PARITY_CASE(MoeGroup) {
  // Tolerance: exact (integer bookkeeping; the weights are copied). 300 rows cross the device
  // kernel's 256-row tiles; the lists must be each expert's rows ascending, then the shared.
  for (auto [rows, E, K, NS] : {std::tuple<int64_t, int, int, int>{300, 16, 3, 1},
                                {5, 8, 1, 0},
                                {70, 4, 4, 2},
                                {0, 8, 2, 1}}) {
    std::vector<int32_t> experts;
    std::vector<float> weights;
    RandomRouting(env.rng, rows, E, K, /*starve_first=*/K < E, &experts, &weights);
    const int64_t lists = E + NS, all = rows * (K + NS);
    std::vector<std::vector<int64_t>> st, from, to;
    std::vector<std::vector<float>> ew;
    for (Side* s : {&env.ref, &env.cand}) {
      int64_t* starts = s->Out<int64_t>(lists + 1);
      int64_t* src = s->Out<int64_t>(std::max<int64_t>(all, 1));
      int64_t* slot = s->Out<int64_t>(std::max<int64_t>(all, 1));
      float* w = s->Out<float>(std::max<int64_t>(rows * K, 1));
      EXPECT_OP_OK(*s, s->b().MoeGroup(s->In(experts), s->In(weights), rows, E, K, NS, starts, src,
                                       slot, w));
      EXPECT_EQ(
          s->b()
              .MoeGroup(s->In(experts), s->In(weights), rows, E, E + 1, NS, starts, src, slot, w)
              .code(),
          absl::StatusCode::kInvalidArgument);
      st.push_back(s->Read(starts, lists + 1));
      from.push_back(s->Read(src, all));
      to.push_back(s->Read(slot, all));
      ew.push_back(s->Read(w, rows * K));
    }
    const std::string what = "rows " + std::to_string(rows) + " E " + std::to_string(E);
    CompareExact(st[0], st[1], what + " starts");
    CompareExact(from[0], from[1], what + " src_rows");
    CompareExact(to[0], to[1], what + " slot_rows");
    Compare(env, ew[0], ew[1], Tol::Exact(), what + " entry weights");
    // The reference against the definition: list e holds exactly the rows routed to e, ascending.
    const auto& starts = st[0];
    ASSERT_EQ(starts.back(), all) << what;
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int64_t> want;
      for (int64_t r = 0; r < rows; ++r) {
        for (int j = 0; j < K; ++j) {
          if (experts[r * K + j] == e) want.push_back(r * (K + NS) + j);
        }
      }
      EXPECT_EQ(std::vector<int64_t>(to[0].begin() + starts[e], to[0].begin() + starts[e + 1]),
                want)
          << what << " expert " << e;
    }
    if (K < E && rows > 0) {
      EXPECT_EQ(starts[1], 0) << what << ": expert 0 was given no rows";
    }
  }
  // A routing that is not MoeRoute's (an id out of range) is refused by the CPU backend (a
  // device backend does not read its inputs back to check).
  const std::vector<int32_t> bad = {0, 9};
  int64_t* starts = env.ref.Out<int64_t>(9);
  int64_t* src = env.ref.Out<int64_t>(2);
  int64_t* slot = env.ref.Out<int64_t>(2);
  float* w = env.ref.Out<float>(2);
  EXPECT_EQ(env.ref.b()
                .MoeGroup(env.ref.In(bad), env.ref.In(std::vector<float>{1.f, 1.f}), 1, 8, 2, 0,
                          starts, src, slot, w)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// GroupedLinearQuant over groups starting at `starts` (6 groups; a run of groups 2, 3 and 4 too),
// for several weight shapes. Tolerance: exact (the same Dot8 blocks per output as LinearQuant);
// the result must also equal one LinearQuant per group on each side (the op's contract).
void GroupedLinearQuantOver(Env& env, const std::vector<int64_t>& starts) {
  for (auto [out, in, fmt] :
       {std::tuple<int64_t, int64_t, WeightFormat>{72, 96, WeightFormat::kFp8E4M3},
        {40, 64, WeightFormat::kFp4E2M1},
        {33, 80, WeightFormat::kFp8E4M3},
        {20, 1088, WeightFormat::kFp8E4M3}}) {
    const int n_groups = static_cast<int>(starts.size()) - 1;
    const int64_t rows = starts.back();
    const QuantWeight shape = QuantShape(out, in, fmt);
    std::vector<std::vector<uint8_t>> codes, scales;
    for (int g = 0; g < n_groups; ++g) {
      codes.push_back(RandomCodes(env.rng, shape));
      scales.push_back(RandomScales(env.rng, shape));
    }
    const auto x = MixedActivations(env.rng, rows * in);
    std::vector<std::vector<float>> grouped, single;
    for (Side* s : {&env.ref, &env.cand}) {
      std::vector<QuantWeight> w;
      for (int g = 0; g < n_groups; ++g) w.push_back(s->Packed(shape, codes[g], scales[g]));
      std::vector<const QuantWeight*> ws;
      for (const QuantWeight& q : w) ws.push_back(&q);
      const float* px = s->In(x);
      float* y = s->Out<float>(rows * out);
      float* y1 = s->Out<float>(rows * out);
      EXPECT_OP_OK(*s, s->b().GroupedLinearQuant(px, rows, s->In(starts), ws.data(), n_groups, y));
      for (int g = 0; g < n_groups; ++g) {
        EXPECT_OP_OK(*s, s->b().LinearQuant(px + starts[g] * in, starts[g + 1] - starts[g], w[g],
                                            y1 + starts[g] * out));
      }
      grouped.push_back(s->Read(y, rows * out));
      single.push_back(s->Read(y1, rows * out));
      // A run of the groups (2, 3 and 4: rows 17 .. 58, or 1 .. 15; as the model makes for routed
      // and shared experts of different formats) writes only its rows: the rest keep what was
      // there.
      const std::vector<float> before(rows * out, -7.f);
      float* yr = s->In(before);
      EXPECT_OP_OK(*s,
                   s->b().GroupedLinearQuant(px, rows, s->In(starts) + 2, ws.data() + 2, 3, yr));
      std::vector<float> run = s->Read(yr, rows * out);
      std::vector<float> want = before;
      for (int64_t i = starts[2] * out; i < starts[5] * out; ++i) want[i] = grouped.back()[i];
      EXPECT_EQ(run, want) << s->name() << ": a run of groups";
      // Weights of different shapes are refused by every backend.
      QuantWeight other = s->Packed(QuantWeight{.out = out, .in = in + 32, .format = fmt},
                                    Fp8Codes(env.rng, out * (in + 32)),
                                    Bytes(env.rng, ((out + 31) / 32) * ((in + 63) / 32), 127, 127));
      std::vector<const QuantWeight*> mixed = ws;
      mixed[2] = &other;
      EXPECT_EQ(
          s->b().GroupedLinearQuant(px, rows, s->In(starts), mixed.data(), n_groups, y).code(),
          absl::StatusCode::kInvalidArgument)
          << s->name();
    }
    const std::string what = std::string(fmt == WeightFormat::kFp8E4M3 ? "FP8" : "FP4") + " [" +
                             std::to_string(out) + ", " + std::to_string(in) + "], " +
                             std::to_string(rows) + " rows";
    Compare(env, grouped[0], grouped[1], Tol::Exact(), what + " grouped");
    Compare(env, grouped[0], single[0], Tol::Exact(), what + " grouped vs per group (reference)");
    Compare(env, grouped[1], single[1], Tol::Exact(), what + " grouped vs per group (candidate)");
  }
}

PARITY_CASE(GroupedLinearQuant) {
  // A prefill's groups of 0, 17, 1, 0, 40 and 5 rows cross the device GEMM's 16-row tiles; a
  // decode step's groups of 1, 0, 3, 9, 2 and 0 rows (at most 8 a group on average) take its
  // skinny 8-row tiles, the group of 9 across two.
  GroupedLinearQuantOver(env, {0, 0, 17, 18, 18, 58, 63});
  GroupedLinearQuantOver(env, {0, 1, 1, 4, 13, 15, 15});
  // More groups than a device block has threads (the release config's 384 routed experts and
  // the shared one): the tiles' groups are found over several scans. Rows in groups 3, 4, 150
  // (9: two tiles) and 299, the rest empty.
  std::vector<int64_t> many(301, 0);
  for (int g = 0; g < 300; ++g) {
    const int64_t n = g == 3 ? 2 : g == 4 ? 1 : g == 150 ? 9 : g == 299 ? 1 : 0;
    many[g + 1] = many[g] + n;
  }
  GroupedLinearQuantOver(env, many);
  // Starts that run past the rows (or begin before row 0) are refused by the CPU backend (a
  // device backend does not read them back).
  QuantWeight shape;
  shape.out = 8;
  shape.in = 32;
  QuantWeight w = env.ref.Packed(shape, Fp8Codes(env.rng, 8 * 32), Bytes(env.rng, 1, 127, 127));
  const QuantWeight* ws[] = {&w, &w};
  float* y = env.ref.Out<float>(8 * 8);
  EXPECT_EQ(env.ref.b()
                .GroupedLinearQuant(env.ref.In(Bf16(env.rng, 8 * 32)), 8,
                                    env.ref.In(std::vector<int64_t>{0, 5, 9}), ws, 2, y)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(env.ref.b()
                .GroupedLinearQuant(env.ref.In(Bf16(env.rng, 8 * 32)), 8,
                                    env.ref.In(std::vector<int64_t>{-1, 5, 8}), ws, 2, y)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(env.ref.b()
                .GroupedLinearQuant(env.ref.In(Bf16(env.rng, 8 * 32)), 8,
                                    env.ref.In(std::vector<int64_t>{0, 6, 5}), ws, 2, y)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

PARITY_CASE(SwiGlu) {
  // Tolerance: exact (TorchExp in the SiLU on both).
  const int64_t rows = 4, inter = 96;
  auto g = Normal(env.rng, rows * inter, 4.f), u = Normal(env.rng, rows * inter, 4.f);
  g[0] = 30.f;
  u[1] = -30.f;
  const auto rw = Normal(env.rng, rows);
  for (bool weighted : {false, true}) {
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      float* h = s->Out<float>(rows * inter);
      EXPECT_OP_OK(*s, s->b().SwiGlu(s->In(g), s->In(u), rows, inter, 7.f,
                                     weighted ? s->In(rw) : nullptr, h));
      res.push_back(s->Read(h, rows * inter));
    }
    Compare(env, res[0], res[1], Tol::Exact(), weighted ? "weighted" : "plain");
  }
}

PARITY_CASE(SumSlots) {
  // Tolerance: exact (slots in order).
  const int64_t rows = 3, slots = 6, dim = 70;
  for (bool cancelling : {false, true}) {
    // cancelling: each (row, dim)'s slots hold +2^25 ... -2^25 pairs, so their order shows.
    const auto ys = cancelling ? Cancelling(env.rng, rows * slots, dim, false, /*columns=*/true)
                               : Bf16(env.rng, rows * slots * dim);
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      float* out = s->Out<float>(rows * dim);
      EXPECT_OP_OK(*s, s->b().SumSlots(s->In(ys), rows, slots, dim, out));
      res.push_back(s->Read(out, rows * dim));
    }
    Compare(env, res[0], res[1], Tol::Exact(), cancelling ? "sum, cancelling" : "sum");
  }
}

PARITY_CASE(CopyRows) {
  // Tolerance: exact (copies). A gather (destination rows in order), a scatter (source rows in
  // order) and both lists at once, as the MoE groups rows by expert and puts them back.
  const int64_t rows = 7, dim = 70;
  const auto src = Normal(env.rng, rows * dim);
  const std::vector<int64_t> gather = {6, 0, 3, 3}, scatter = {9, 2, 11, 0};
  for (int mode = 0; mode < 3; ++mode) {
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      float* dst = s->In(std::vector<float>(12 * dim, -1.f));
      EXPECT_OP_OK(*s, s->b().CopyRows(s->In(src), mode != 1 ? s->In(gather) : nullptr, dst,
                                       mode != 0 ? s->In(scatter) : nullptr, 4, dim));
      res.push_back(s->Read(dst, 12 * dim));
    }
    Compare(env, res[0], res[1], Tol::Exact(),
            mode == 0   ? "gather"
            : mode == 1 ? "scatter"
                        : "both");
  }
}

// ---- Engram ----
PARITY_CASE(Fp8RowLookup) {
  // Tolerance: exact (E4M3 x E8M0, bf16).
  const int64_t vocab = 10, dim = 64, n = 6;
  const auto table = Fp8Codes(env.rng, vocab * dim);
  const auto scales = Bytes(env.rng, vocab * dim / 32, 110, 140);
  const std::vector<int64_t> ids = {3, 0, 9, 3, 5, 1};
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* out = s->Out<float>(n * dim);
    EXPECT_OP_OK(*s, s->b().Fp8RowLookup(s->In(table), s->In(scales), dim, s->In(ids), n, out));
    EXPECT_EQ(s->b().Fp8RowLookup(nullptr, nullptr, 33, nullptr, 0, out).code(),
              absl::StatusCode::kInvalidArgument);
    res.push_back(s->Read(out, n * dim));
  }
  Compare(env, res[0], res[1], Tol::Exact(), "lookup");
}

PARITY_CASE(EngramGate) {
  // Tolerance: exact (TorchMeanSquare, TorchSum of the products, TorchExp in the gate).
  const int64_t rows = 2, D = 64;
  const int hc = 4;
  const auto h = Bf16(env.rng, rows * hc * D), e = Bf16(env.rng, rows * (hc + 1) * D),
             qw = Bf16(env.rng, hc * D), kw = Bf16(env.rng, hc * D);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* ph = s->In(h);
    EXPECT_OP_OK(*s, s->b().EngramGate(ph, s->In(e), rows, hc, D, s->In(qw), s->In(kw), 1e-6f));
    res.push_back(s->Read(ph, rows * hc * D));
  }
  Compare(env, res[0], res[1], Tol::Exact(), "gate");
}

PARITY_CASE(EngramGateSingleToken) {
  // Tolerance: 1 bf16 ulp (the gate's sigmoid takes glibc's expf on the CPU, the correctly
  // rounded ExpF on the GPU; they differ in rare last bits).
  const int64_t rows = 1, D = 64;
  const int hc = 4;
  const auto h = Bf16(env.rng, rows * hc * D), e = Bf16(env.rng, rows * (hc + 1) * D),
             qw = Bf16(env.rng, hc * D), kw = Bf16(env.rng, hc * D);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    float* ph = s->In(h);
    EXPECT_OP_OK(
        *s, s->b().EngramGateSingleToken(ph, s->In(e), rows, hc, D, s->In(qw), s->In(kw), 1e-6f));
    res.push_back(s->Read(ph, rows * hc * D));
  }
  Compare(env, res[0], res[1], Tol::Bf16Ulps(1), "gate");
}

PARITY_CASE(Embed) {
  // Tolerance: exact (copies).
  const int64_t vocab = 20, dim = 48, rows = 5;
  const int hc = 4;
  const auto table = Bf16(env.rng, vocab * dim);
  const std::vector<int32_t> ids = {19, 0, 7, 7, 3};
  std::vector<uint16_t> bits(table.size());  // the table in its bf16 form (the model's)
  for (size_t i = 0; i < table.size(); ++i) bits[i] = format::F32ToBf16Bits(table[i]);
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    for (const PlainWeight t : {PlainWeight(s->In(table)), PlainWeight::Bf16(s->In(bits))}) {
      float* h = s->Out<float>(rows * hc * dim);
      EXPECT_OP_OK(*s, s->b().Embed(t, dim, s->In(ids), rows, hc, h));
      res.push_back(s->Read(h, rows * hc * dim));
    }
  }
  Compare(env, res[0], res[2], Tol::Exact(), "embed");
  Compare(env, res[0], res[3], Tol::Exact(), "embed, candidate's table as bf16 bits");
  Compare(env, res[0], res[1], Tol::Exact(), "embed, reference's table as bf16 bits");
  // The rows are the table's: the copy is a gather, not only the same on both sides.
  for (int64_t i = 0; i < rows; ++i) {
    for (int j = 0; j < hc; ++j) {
      for (int64_t d = 0; d < dim; ++d)
        ASSERT_EQ(res[3][(i * hc + j) * dim + d], table[ids[i] * dim + d]) << i << ", " << j;
    }
  }
  // A table of an unknown dtype: refused by both.
  for (Side* s : {&env.ref, &env.cand}) {
    PlainWeight t(s->In(table));
    t.dtype = static_cast<PlainDtype>(7);
    EXPECT_EQ(s->b().Embed(t, dim, s->In(ids), rows, hc, s->Out<float>(rows * hc * dim)).code(),
              absl::StatusCode::kInvalidArgument)
        << s->name();
  }
}

// ---- Paged packed rows ----
// The codecs with the dims the cases use (each a multiple of its block).
struct PagedCodec {
  RowCodec codec;
  int64_t dim;
  const char* name;
};
constexpr PagedCodec kPagedCodecs[] = {{RowCodec::kKvEntry, 64, "kv entry"},
                                       {RowCodec::kIndexKey, 64, "index key"},
                                       {RowCodec::kSwaSlot, 96, "swa slot"},
                                       {RowCodec::kF32, 10, "f32"}};
constexpr int64_t kPages = 4, kRowsPerPage = 3;

// kPages pages of `page_bytes` on side `s` (the given bytes each) and their table.
uint8_t* const* PagesOn(Side& s, const std::vector<std::vector<uint8_t>>& bytes,
                        std::vector<uint8_t*>& pages) {
  pages.clear();
  for (const auto& b : bytes) pages.push_back(s.In(b));
  return s.In(pages);
}

PARITY_CASE(PackRows) {
  // Tolerance: exact (the packed bytes). Rows at every magnitude (the scale floors, saturation,
  // zeros, FP4/FP8 ties), in a scattered row list and as a range over page boundaries.
  for (const PagedCodec& pc : kPagedCodecs) {
    const int64_t rb = RowCodecBytes(pc.codec, pc.dim), n = 5;
    std::vector<float> x = Normal(env.rng, n * pc.dim);
    const float mags[] = {1e-7f, 1.f, 3e3f, 0.f, 6.f};
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < pc.dim; ++d) x[i * pc.dim + d] *= mags[i];
    }
    for (int64_t d = 0; d < pc.dim; d += 3) x[4 * pc.dim + d] = 0.25f * static_cast<float>(d % 7);
    const std::vector<int32_t> list = {7, 0, 11, 4, 5};
    for (int mode = 0; mode < 2; ++mode) {
      std::vector<std::vector<uint8_t>> res;
      for (Side* s : {&env.ref, &env.cand}) {
        std::vector<uint8_t*> pages;
        uint8_t* const* table = PagesOn(*s,
                                        std::vector<std::vector<uint8_t>>(
                                            kPages, std::vector<uint8_t>(kRowsPerPage * rb, 0x5a)),
                                        pages);
        EXPECT_OP_OK(*s, s->b().PackRows(pc.codec, s->In(x), n, pc.dim, table, kRowsPerPage,
                                         mode == 0 ? s->In(list) : nullptr, mode == 0 ? 0 : 2));
        std::vector<uint8_t> all;
        for (uint8_t* page : pages) {
          auto b = s->Read(page, kRowsPerPage * rb);
          all.insert(all.end(), b.begin(), b.end());
        }
        res.push_back(all);
        if (pc.codec != RowCodec::kF32) {
          EXPECT_EQ(
              s->b().PackRows(pc.codec, s->In(x), 1, 8, table, kRowsPerPage, nullptr, 0).code(),
              absl::StatusCode::kInvalidArgument)
              << s->name() << ": dim 8 is not a whole scale block";
        }
      }
      CompareExact(res[0], res[1], std::string(pc.name) + (mode == 0 ? " (list)" : " (range)"));
    }
  }
}

PARITY_CASE(UnpackRows) {
  // Tolerance: exact (codes x scales, bf16). Pages of valid codes (no NaN scales), read through a
  // scattered list with a repeated row and as a range over page boundaries.
  for (const PagedCodec& pc : kPagedCodecs) {
    const int64_t rb = RowCodecBytes(pc.codec, pc.dim);
    std::vector<std::vector<uint8_t>> bytes(kPages);
    for (auto& page : bytes) {
      for (int64_t r = 0; r < kRowsPerPage; ++r) {
        std::vector<uint8_t> row;
        switch (pc.codec) {
          case RowCodec::kKvEntry: {
            row = Bytes(env.rng, pc.dim / 2);
            auto sc = Fp8Codes(env.rng, pc.dim / 16);
            for (auto& c : sc) c &= 0x7f;  // positive scales
            row.insert(row.end(), sc.begin(), sc.end());
            break;
          }
          case RowCodec::kIndexKey: {
            row = Bytes(env.rng, pc.dim / 2);
            auto sc = Bytes(env.rng, pc.dim / 32, 100, 150);
            row.insert(row.end(), sc.begin(), sc.end());
            break;
          }
          case RowCodec::kSwaSlot: {
            row = Fp8Codes(env.rng, pc.dim);
            auto sc = Bytes(env.rng, pc.dim / 32, 100, 150);
            row.insert(row.end(), sc.begin(), sc.end());
            break;
          }
          case RowCodec::kF32: {
            auto v = Normal(env.rng, pc.dim);
            row.resize(rb);
            std::memcpy(row.data(), v.data(), static_cast<size_t>(rb));
            break;
          }
        }
        page.insert(page.end(), row.begin(), row.end());
      }
    }
    // A list; a range from row 1; a top-k list with -1s read at an offset of -2, and a range
    // from row -2 (rows below 0 leave their output rows as they were: the poison).
    const std::vector<int32_t> list = {11, 0, 4, 4, 7, 2}, topk = {-1, 5, 13, -1, 2, 9};
    const int64_t n = static_cast<int64_t>(list.size());
    const char* modes[] = {" (list)", " (range)", " (top-k with offset)", " (range from -2)"};
    for (int mode = 0; mode < 4; ++mode) {
      std::vector<std::vector<float>> res;
      for (Side* s : {&env.ref, &env.cand}) {
        std::vector<uint8_t*> pages;
        uint8_t* const* table = PagesOn(*s, bytes, pages);
        float* out = s->Out<float>(n * pc.dim);
        const int32_t* rows = mode == 0 ? s->In(list) : mode == 2 ? s->In(topk) : nullptr;
        const int64_t first = mode >= 2 ? -2 : (mode == 1 ? 1 : 0);
        EXPECT_OP_OK(*s,
                     s->b().UnpackRows(pc.codec, table, kRowsPerPage, pc.dim, rows, first, n, out));
        res.push_back(s->Read(out, n * pc.dim));
        if (mode >= 2) {
          EXPECT_EQ(Bits(res.back()[0]), Bits(Side::Poison<float>()))
              << s->name() << ": a -1 slot was written";
        }
      }
      Compare(env, res[0], res[1], Tol::Exact(), std::string(pc.name) + modes[mode]);
    }
  }
}

// Pages of valid rows of `codec` at `dim` (no NaN scales): `pages` pages of `rpp` rows.
std::vector<std::vector<uint8_t>> ValidPages(std::mt19937& rng, RowCodec codec, int64_t dim,
                                             int64_t pages, int64_t rpp) {
  const int64_t rb = RowCodecBytes(codec, dim);
  std::vector<std::vector<uint8_t>> out(pages);
  for (auto& page : out) {
    for (int64_t r = 0; r < rpp; ++r) {
      std::vector<uint8_t> row;
      switch (codec) {
        case RowCodec::kKvEntry: {
          row = Bytes(rng, dim / 2);
          auto sc = Fp8Codes(rng, dim / 16);
          for (auto& c : sc) c &= 0x7f;  // positive scales
          row.insert(row.end(), sc.begin(), sc.end());
          break;
        }
        case RowCodec::kIndexKey:
        case RowCodec::kSwaSlot: {
          row = codec == RowCodec::kIndexKey ? Bytes(rng, dim / 2) : Fp8Codes(rng, dim);
          auto sc = Bytes(rng, dim / 32, 120, 130);
          row.insert(row.end(), sc.begin(), sc.end());
          break;
        }
        case RowCodec::kF32: {
          const auto v = Bf16(rng, dim);
          const auto* bytes = reinterpret_cast<const uint8_t*>(v.data());
          row.assign(bytes, bytes + rb);
          break;
        }
      }
      page.insert(page.end(), row.begin(), row.end());
    }
  }
  return out;
}

// Two paged streams on a side (bytes[i]: the pages of stream i, rpp[i] rows each), and for each
// entry of `stream` its stream's page table and page size: a multi-stream op's arguments.
struct TwoStreams {
  std::vector<uint8_t*> pages[2];
  uint8_t* const* table[2] = {nullptr, nullptr};
  std::vector<const uint8_t* const*> tables;
  std::vector<int64_t> rows_per_page;
};
TwoStreams StreamsOn(Side& s, const std::vector<std::vector<uint8_t>> (&bytes)[2],
                     const int64_t (&rpp)[2], const std::vector<int>& stream) {
  TwoStreams t;
  for (int i = 0; i < 2; ++i) t.table[i] = PagesOn(s, bytes[i], t.pages[i]);
  for (int st : stream) {
    t.tables.push_back(t.table[st]);
    t.rows_per_page.push_back(rpp[st]);
  }
  return t;
}

PARITY_CASE(IndexerScoresPaged) {
  // Tolerance: exact (IndexerScores of each row's keys as UnpackRows decodes them, then -inf past
  // the row's valid keys). Rows over two streams of different page sizes (two sequences, or two
  // key sources), one row scoring no key (and given no page table); index-key and f32 pages.
  // At dim 2050 the CUDA kernel reads the keys in tiles of dims (above).
  const int heads = 6;
  const int64_t rows = 4, n = 50;
  const int64_t rpp[2] = {16, 8}, pages_n[2] = {4, 7};
  const std::vector<int> stream = {0, 1, 0, 1};
  const std::vector<int64_t> valid = {40, 0, 50, 33};
  for (const auto& [codec, dim] : {std::pair{RowCodec::kIndexKey, int64_t{64}},
                                   {RowCodec::kF32, int64_t{64}},
                                   {RowCodec::kF32, int64_t{2050}}}) {
    const auto q = Bf16(env.rng, rows * heads * dim), w = Bf16(env.rng, rows * heads);
    const std::vector<std::vector<uint8_t>> bytes[2] = {
        ValidPages(env.rng, codec, dim, pages_n[0], rpp[0]),
        ValidPages(env.rng, codec, dim, pages_n[1], rpp[1])};
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      TwoStreams t = StreamsOn(*s, bytes, rpp, stream);
      t.tables[1] = nullptr;  // row 1 scores no key: its table is not read
      const float *pq = s->In(q), *pw = s->In(w);
      float* out = s->Out<float>(rows * n);
      EXPECT_OP_OK(
          *s, s->b().IndexerScoresPaged(pq, pw, heads, codec, s->In(t.tables),
                                        s->In(t.rows_per_page), s->In(valid), n, dim, rows, out));
      std::vector<float> one_by_one;
      for (int64_t r = 0; r < rows; ++r) {
        float* keys = s->Out<float>(std::max<int64_t>(1, valid[r]) * dim);
        EXPECT_OP_OK(*s, s->b().UnpackRows(codec, t.table[stream[r]], rpp[stream[r]], dim, nullptr,
                                           0, valid[r], keys));
        float* o = s->Out<float>(n);
        EXPECT_OP_OK(*s, s->b().IndexerScores(pq + r * heads * dim, pw + r * heads, heads, keys,
                                              valid[r], dim, o));
        EXPECT_OP_OK(*s, s->b().MaskScores(o, n, valid[r], nullptr, 0));
        const std::vector<float> row = s->Read(o, n);
        one_by_one.insert(one_by_one.end(), row.begin(), row.end());
      }
      res.push_back(s->Read(out, rows * n));
      Compare(env, res.back(), one_by_one, Tol::Exact(),
              s->name() + ": paged vs unpacked one row at a time");
    }
    Compare(env, res[0], res[1], Tol::Exact(),
            absl::StrCat(codec == RowCodec::kF32 ? "paged f32" : "paged index keys", " of ", dim));
  }
  // A row that asks for more keys than the scores hold is refused by the CPU backend.
  const int64_t dim = 64;
  const auto q = Bf16(env.rng, rows * heads * dim), w = Bf16(env.rng, rows * heads);
  std::vector<uint8_t*> pages;
  uint8_t* const* table =
      PagesOn(env.ref, ValidPages(env.rng, RowCodec::kIndexKey, dim, pages_n[0], rpp[0]), pages);
  const std::vector<const uint8_t* const*> tables(rows, table);
  EXPECT_EQ(env.ref.b()
                .IndexerScoresPaged(env.ref.In(q), env.ref.In(w), heads, RowCodec::kIndexKey,
                                    env.ref.In(tables), env.ref.In(std::vector<int64_t>(rows, 16)),
                                    env.ref.In(std::vector<int64_t>{1, 2, 51, 3}), n, dim, rows,
                                    env.ref.Out<float>(rows * n))
                .code(),
            absl::StatusCode::kInvalidArgument);
}

PARITY_CASE(GatherRows) {
  // Tolerance: exact (UnpackRows of each group's rows from its own stream). Two streams of
  // different page sizes, three rows per table (the last group short), read at an offset of -2
  // with top-k -1s (a row below 0 leaves its output row as it was: the poison).
  const int64_t per_table = 3;
  const int64_t rpp[2] = {4, 2}, pages_n[2] = {3, 5};
  const std::vector<int32_t> rows = {-1, 5, 13, 3, 2, -1, 9, 11, 4, 7, 2};
  const std::vector<int> stream = {0, 1, 0, 1};
  const auto n = static_cast<int64_t>(rows.size());
  for (const PagedCodec& pc : kPagedCodecs) {
    const std::vector<std::vector<uint8_t>> bytes[2] = {
        ValidPages(env.rng, pc.codec, pc.dim, pages_n[0], rpp[0]),
        ValidPages(env.rng, pc.codec, pc.dim, pages_n[1], rpp[1])};
    std::vector<std::vector<float>> res;
    for (Side* s : {&env.ref, &env.cand}) {
      const TwoStreams t = StreamsOn(*s, bytes, rpp, stream);
      const int32_t* listed = s->In(rows);
      float* out = s->Out<float>(n * pc.dim);
      EXPECT_OP_OK(*s, s->b().GatherRows(pc.codec, s->In(t.tables), s->In(t.rows_per_page),
                                         per_table, pc.dim, listed, -2, n, out));
      const std::vector<float> got = s->Read(out, n * pc.dim);
      res.push_back(got);
      EXPECT_EQ(Bits(got[0]), Bits(Side::Poison<float>())) << s->name() << ": a -1 was read";
      std::vector<float> one_by_one;
      for (int64_t g = 0; g * per_table < n; ++g) {
        const int64_t m = std::min(per_table, n - g * per_table);
        float* one = s->Out<float>(m * pc.dim);
        EXPECT_OP_OK(*s, s->b().UnpackRows(pc.codec, t.table[stream[g]], rpp[stream[g]], pc.dim,
                                           listed + g * per_table, -2, m, one));
        const std::vector<float> part = s->Read(one, m * pc.dim);
        one_by_one.insert(one_by_one.end(), part.begin(), part.end());
      }
      Compare(env, got, one_by_one, Tol::Exact(),
              s->name() + " " + pc.name + ": vs each stream's UnpackRows");
    }
    Compare(env, res[0], res[1], Tol::Exact(), std::string(pc.name) + " gathered");
  }
}

PARITY_CASE(TopKSlots) {
  // Tolerance: exact (integers). Two rows of a 3-slot top-k with -1s, into lists of 7 at slot 4
  // (per slot), then at slot 3 (the entries); the other entries keep what they held.
  const std::vector<int32_t> topk = {130, -1, 129, -1, -1, 200};
  std::vector<std::vector<int32_t>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    int32_t* list = s->In(std::vector<int32_t>(14, 77));
    EXPECT_OP_OK(*s, s->b().TopKSlots(s->In(topk), 2, 3, 128, true, list, 7, 4));
    EXPECT_EQ(s->b().TopKSlots(s->In(topk), 2, 3, 128, true, list, 7, 5).code(),
              absl::StatusCode::kInvalidArgument)
        << s->name() << ": slots past the list";
    res.push_back(s->Read(list, 14));
    // Without per_slot: each slot's entry itself (+ base) at slot 3 of the same lists.
    EXPECT_OP_OK(*s, s->b().TopKSlots(s->In(topk), 2, 3, 1, false, list, 7, 3));
    res.push_back(s->Read(list, 14));
  }
  CompareExact(res[0], res[2], "top-k slots");
  CompareExact(res[1], res[3], "top-k entries");
  const std::vector<int32_t> want = {77, 77, 77, 77, 128, -1, 130, 77, 77, 77, 77, -1, -1, 133};
  EXPECT_EQ(res[0], want);
  const std::vector<int32_t> entries = {77, 77, 77, 131, -1, 130, 130, 77, 77, 77, -1, -1, 201, 133};
  EXPECT_EQ(res[1], entries);
}

PARITY_CASE(DigestBlocks) {
  // Tolerance: exact (XXH3-64: both sides must give libxxhash's value). Blocks of every length
  // class of the algorithm (empty, 1-3, 4-8, 9-16, 17-128, 129-240, then stripes and 1 KiB
  // blocks) up to a release-size pool block, one starting at an odd address.
  const std::vector<int64_t> lens = {0,   1,   3,   4,   8,    9,    16,       17,
                                     128, 129, 240, 241, 1024, 1025, 64 * 288, 57'349};
  std::vector<std::vector<uint8_t>> blocks;
  for (int64_t len : lens) blocks.push_back(Bytes(env.rng, len + 1));
  const auto n = static_cast<int64_t>(lens.size());
  std::vector<std::vector<uint64_t>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    std::vector<uint8_t*> at;
    PagesOn(*s, blocks, at);
    at[3] += 1;  // an odd address
    uint64_t* out = s->Out<uint64_t>(n);
    EXPECT_OP_OK(*s, s->b().DigestBlocks(s->In(at), s->In(lens), n, out));
    EXPECT_OP_OK(*s, s->b().DigestBlocks(s->In(at), s->In(lens), 0, out));
    EXPECT_EQ(s->b().DigestBlocks(s->In(at), s->In(lens), -1, out).code(),
              absl::StatusCode::kInvalidArgument)
        << s->name();
    res.push_back(s->Read(out, n));
  }
  CompareExact(res[0], res[1], "digests");
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(res[0][i], XXH3_64bits(blocks[i].data() + (i == 3 ? 1 : 0), lens[i])) << lens[i];
  }
  // The CPU refuses a negative length (a device cannot read it without a round trip).
  const std::vector<int64_t> bad = {-1};
  std::vector<uint8_t*> at;
  PagesOn(env.ref, {blocks[0]}, at);
  EXPECT_EQ(
      env.ref.b().DigestBlocks(env.ref.In(at), env.ref.In(bad), 1, env.ref.Out<uint64_t>(1)).code(),
      absl::StatusCode::kInvalidArgument);
}

PARITY_CASE(CopyBlocks) {
  // Tolerance: exact (bytes). Ranges of 0, 1, 15, 16, 17 and 57,349 bytes (a release-size block
  // and more), aligned and at odd addresses on either end, gathered into one staging buffer and
  // scattered back out (a hand-off's two directions); the bytes around every range are untouched.
  const std::vector<int64_t> lens = {0, 1, 15, 16, 17, 64 * 288, 57'349, 33};
  const std::vector<int64_t> src_skew = {0, 0, 3, 0, 1, 0, 5, 16};
  // Staging offsets: odd, 16-aligned (the big block and the last: 16-byte moves and a tail), and
  // gaps that must stay as they were.
  const std::vector<int64_t> dst_at = {0, 0, 1, 17, 33, 64, 64 + 64 * 288 + 7, 75'856};
  const auto n = static_cast<int64_t>(lens.size());
  std::vector<std::vector<uint8_t>> blocks;
  for (size_t i = 0; i < lens.size(); ++i) blocks.push_back(Bytes(env.rng, lens[i] + 16));
  const int64_t staging_bytes = dst_at.back() + lens.back() + 9;
  const std::vector<uint8_t> staging = Bytes(env.rng, staging_bytes);
  std::vector<std::vector<uint8_t>> gathered, scattered;
  for (Side* s : {&env.ref, &env.cand}) {
    std::vector<uint8_t*> at;
    PagesOn(*s, blocks, at);
    uint8_t* st = s->In(staging);
    std::vector<uint8_t*> to, from;
    for (int64_t i = 0; i < n; ++i) {
      to.push_back(st + dst_at[i]);
      from.push_back(at[i] + src_skew[i]);
    }
    EXPECT_OP_OK(*s,
                 s->b().CopyBlocks(s->In(to), reinterpret_cast<const uint8_t* const*>(s->In(from)),
                                   s->In(lens), n));
    gathered.push_back(s->Read(st, staging_bytes));
    // Back out to fresh blocks at other offsets.
    std::vector<std::vector<uint8_t>> fresh;
    for (size_t i = 0; i < lens.size(); ++i)
      fresh.push_back(std::vector<uint8_t>(lens[i] + 16, 0xa5));
    std::vector<uint8_t*> out_at;
    PagesOn(*s, fresh, out_at);
    std::vector<uint8_t*> back;
    std::vector<uint8_t*> staged;
    for (int64_t i = 0; i < n; ++i) {
      back.push_back(out_at[i] + (i % 2 ? 1 : 0));
      staged.push_back(st + dst_at[i]);
    }
    EXPECT_OP_OK(
        *s, s->b().CopyBlocks(s->In(back), reinterpret_cast<const uint8_t* const*>(s->In(staged)),
                              s->In(lens), n));
    std::vector<uint8_t> all;
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<uint8_t> b = s->Read(out_at[i], lens[i] + 16);
      all.insert(all.end(), b.begin(), b.end());
    }
    scattered.push_back(all);
    EXPECT_OP_OK(*s,
                 s->b().CopyBlocks(s->In(to), reinterpret_cast<const uint8_t* const*>(s->In(from)),
                                   s->In(lens), 0));
    EXPECT_EQ(s->b()
                  .CopyBlocks(s->In(to), reinterpret_cast<const uint8_t* const*>(s->In(from)),
                              s->In(lens), -1)
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << s->name();
  }
  CompareExact(gathered[0], gathered[1], "gathered");
  CompareExact(scattered[0], scattered[1], "scattered");
  // What both must hold.
  std::vector<uint8_t> want_staging = staging, want_back;
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(blocks[i].begin() + src_skew[i], lens[i], want_staging.begin() + dst_at[i]);
    std::vector<uint8_t> b(lens[i] + 16, 0xa5);
    std::copy_n(blocks[i].begin() + src_skew[i], lens[i], b.begin() + (i % 2 ? 1 : 0));
    want_back.insert(want_back.end(), b.begin(), b.end());
  }
  CompareExact(want_staging, gathered[0], "gathered vs the expected bytes");
  CompareExact(want_back, scattered[0], "scattered vs the expected bytes");
  // The CPU refuses a negative length (a device cannot read it without a round trip).
  std::vector<uint8_t*> at;
  PagesOn(env.ref, {blocks[0]}, at);
  EXPECT_EQ(env.ref.b()
                .CopyBlocks(env.ref.In(at), reinterpret_cast<const uint8_t* const*>(env.ref.In(at)),
                            env.ref.In(std::vector<int64_t>{-1}), 1)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

PARITY_CASE(BlocksEqual) {
  // Tolerance: exact (0 or 1). Pairs of equal blocks, blocks that differ in their first, middle
  // or last byte only, an empty pair, and a pair compared over a prefix they share.
  const int64_t big = 64 * 288;
  const std::vector<uint8_t> base = Bytes(env.rng, big);
  auto flip = [&](int64_t at) {
    std::vector<uint8_t> v = base;
    v[at] ^= 0x10;
    return v;
  };
  std::vector<std::vector<uint8_t>> a = {base, base, base, base, base, base};
  std::vector<std::vector<uint8_t>> b = {base,          flip(0), flip(big / 2),
                                         flip(big - 1), flip(0), flip(big - 1)};
  const std::vector<int64_t> lens = {big, big, big, big, 0, big - 1};
  const std::vector<int32_t> want = {1, 0, 0, 0, 1, 1};
  const auto n = static_cast<int64_t>(lens.size());
  std::vector<std::vector<int32_t>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    std::vector<uint8_t*> pa, pb;
    PagesOn(*s, a, pa);
    PagesOn(*s, b, pb);
    int32_t* out = s->Out<int32_t>(n);
    EXPECT_OP_OK(*s, s->b().BlocksEqual(s->In(pa), s->In(pb), s->In(lens), n, out));
    EXPECT_EQ(s->b().BlocksEqual(s->In(pa), s->In(pb), s->In(lens), -1, out).code(),
              absl::StatusCode::kInvalidArgument)
        << s->name();
    res.push_back(s->Read(out, n));
  }
  CompareExact(res[0], res[1], "equal");
  EXPECT_EQ(res[0], want);
}

PARITY_CASE(QuantDequant) {
  // Tolerance: exact (codecs and scales from the fp32 bits).
  using Q = Backend::Qdq;
  const auto g = GoldenBf16("debug/attn_in_layer6_prefill.bin");
  ASSERT_EQ(static_cast<int64_t>(g.size()), kGoldenRows * kGoldenHidden);
  for (Q kind : {Q::kFp8Window, Q::kFp4Index, Q::kFp4Kv}) {
    std::vector<std::vector<float>> gold;
    for (Side* s : {&env.ref, &env.cand}) {
      float* p = s->In(g);
      EXPECT_OP_OK(*s, s->b().QuantDequant(kind, p, kGoldenRows, kGoldenHidden));
      gold.push_back(s->Read(p, kGoldenRows * kGoldenHidden));
    }
    Compare(env, gold[0], gold[1], Tol::Exact(),
            "golden activations, kind " + std::to_string(static_cast<int>(kind)));
  }
  for (Q kind : {Q::kFp8Window, Q::kFp4Index, Q::kFp4Kv}) {
    for (int64_t dim : {int64_t{96}, int64_t{100}}) {
      const int64_t rows = 3;
      auto x = Bf16(env.rng, rows * dim, 2.f);
      for (int64_t i = 0; i < rows * dim; ++i) x[i] = RoundBf16(x[i] * std::ldexp(1.f, i % 11 - 5));
      x[5] = 0.f;
      std::vector<std::vector<float>> res;
      for (Side* s : {&env.ref, &env.cand}) {
        float* p = s->In(x);
        EXPECT_OP_OK(*s, s->b().QuantDequant(kind, p, rows, dim));
        res.push_back(s->Read(p, rows * dim));
      }
      Compare(env, res[0], res[1], Tol::Exact(),
              "kind " + std::to_string(static_cast<int>(kind)) + " dim " + std::to_string(dim));
    }
  }
}

PARITY_CASE(Argmax) {
  // Tolerance: exact (the first index of the largest value).
  const int64_t rows = 4, n = 1000;
  auto x = Tied(env.rng, rows * n);
  x[1 * n + 0] = NAN;      // a NaN first element is the answer
  x[2 * n + 500] = NAN;    // a later NaN is never taken
  x[3 * n + 999] = 1e30f;  // the last element
  std::vector<std::vector<int32_t>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    int32_t* out = s->Out<int32_t>(rows);
    EXPECT_OP_OK(*s, s->b().Argmax(s->In(x), rows, n, out));
    EXPECT_EQ(s->b().Argmax(s->In(x), 1, 0, out).code(), absl::StatusCode::kInvalidArgument);
    res.push_back(s->Read(out, rows));
  }
  CompareExact(res[0], res[1], "argmax");
  // Golden: the reference's prefill logits [301, 512]; the last row's argmax is the first
  // generated token of the golden run.
  const auto logits = GoldenF32("logits_prefill_all.bin");
  ASSERT_EQ(static_cast<int64_t>(logits.size()), kGoldenRows * kGoldenVocab);
  std::vector<std::vector<int32_t>> gold;
  for (Side* s : {&env.ref, &env.cand}) {
    int32_t* out = s->Out<int32_t>(kGoldenRows);
    EXPECT_OP_OK(*s, s->b().Argmax(s->In(logits), kGoldenRows, kGoldenVocab, out));
    gold.push_back(s->Read(out, kGoldenRows));
  }
  CompareExact(gold[0], gold[1], "argmax of the golden prefill logits");
  EXPECT_EQ(gold[1].back(), kGoldenFirstToken) << env.cand.name();
}

PARITY_CASE(PenalizeLogits) {
  // Tolerance: exact (one division or product and one subtraction per entry, kernels/penalty.h).
  // Three rows of 1000 logits (positive, negative, zero, ties), 400 distinct entries with counts
  // 0..4; the repetition penalty with and without the additive ones, and the additive alone.
  const int64_t rows = 3, n = 1000, total = rows * n;
  std::vector<float> x = Tied(env.rng, total);
  x[5] = 0.f;
  x[6] = -0.f;
  std::vector<int64_t> all(total);
  for (int64_t i = 0; i < total; ++i) all[i] = i;
  std::shuffle(all.begin(), all.end(), env.rng);
  const std::vector<int64_t> at(all.begin(), all.begin() + 400);
  std::vector<int32_t> counts(at.size());
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<int32_t>(env.rng() % 5);
  struct P {
    float r, f, p;
  };
  const P params[] = {{1.3f, 0.4f, 0.2f}, {0.8f, 0.f, 0.f}, {1.f, -0.7f, 1.5f}};
  std::vector<std::vector<float>> res;
  for (Side* s : {&env.ref, &env.cand}) {
    for (const P& q : params) {
      float* xs = s->In(x);
      EXPECT_OP_OK(*s, s->b().PenalizeLogits(xs, total, s->In(at), s->In(counts),
                                             static_cast<int64_t>(at.size()), q.r, q.f, q.p));
      res.push_back(s->Read(xs, total));
    }
    EXPECT_EQ(s->b().PenalizeLogits(s->In(x), total, s->In(at), s->In(counts), 1, 0.f, 0.f, 0.f)
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << s->name() << ": a repetition penalty of 0";
  }
  for (size_t i = 0; i < std::size(params); ++i)
    Compare(env, res[i], res[std::size(params) + i], Tol::Exact(), "penalized logits");
  // Against the host Sampler's arithmetic, entry by entry; the other logits are untouched.
  for (size_t k = 0; k < std::size(params); ++k) {
    std::vector<float> want = x;
    for (size_t i = 0; i < at.size(); ++i)
      want[at[i]] = Penalized(x[at[i]], counts[i], params[k].r, params[k].f, params[k].p);
    Compare(env, want, res[k], Tol::Exact(), "the Sampler's penalties");
  }
}

PARITY_CASE(SampleLogits) {
  // Tolerance: exact (a token; kernels/sampling_math.h is one arithmetic on both sides). Rows of
  // random logits (scale 4) and of ties (Tied: equal values, -inf), the golden prefill logits,
  // and each filter alone and together; uniforms spread over [0, 1) with both ends.
  const int64_t rows = 6, n = 1000;
  std::vector<float> x = Bf16(env.rng, rows * n, 4.f);
  const std::vector<float> tied = Tied(env.rng, 2 * n);
  std::copy(tied.begin(), tied.end(), x.begin() + 4 * n);
  std::vector<double> u = {0.0, 0.25, 0.5, 0.75, 0.9999999999, 0.3};
  const SampleParams params[] = {
      {.temperature = 1.f},
      {.temperature = 0.6f, .top_k = 50},
      {.temperature = 1.3f, .top_p = 0.9f},
      {.temperature = 0.8f, .min_p = 0.05f},
      {.temperature = 1.f, .top_k = 200, .top_p = 0.7f, .min_p = 0.02f},
      {.temperature = 2.f, .top_k = 1},
  };
  const auto golden = GoldenF32("logits_prefill_all.bin");
  ASSERT_EQ(static_cast<int64_t>(golden.size()), kGoldenRows * kGoldenVocab);
  std::vector<double> ug(kGoldenRows);
  for (int64_t r = 0; r < kGoldenRows; ++r) ug[r] = static_cast<double>(r) / kGoldenRows;
  std::vector<std::vector<int32_t>> res;
  std::vector<std::vector<float>> probs_out;  // the golden rows' distributions, per side and case
  for (Side* s : {&env.ref, &env.cand}) {
    for (const SampleParams& p : params) {
      int32_t* out = s->Out<int32_t>(rows);
      EXPECT_OP_OK(*s, s->b().SampleLogits(s->In(x), rows, n, p, s->In(u), out, nullptr));
      res.push_back(s->Read(out, rows));
      int32_t* gout = s->Out<int32_t>(kGoldenRows);
      float* gprobs = s->Out<float>(kGoldenRows * kGoldenVocab);
      EXPECT_OP_OK(*s, s->b().SampleLogits(s->In(golden), kGoldenRows, kGoldenVocab, p, s->In(ug),
                                           gout, gprobs));
      res.push_back(s->Read(gout, kGoldenRows));
      probs_out.push_back(s->Read(gprobs, kGoldenRows * kGoldenVocab));
    }
    int32_t* out = s->Out<int32_t>(1);
    EXPECT_EQ(
        s->b().SampleLogits(s->In(x), 1, n, {.temperature = 0.f}, s->In(u), out, nullptr).code(),
        absl::StatusCode::kInvalidArgument)
        << s->name() << ": temperature 0";
    EXPECT_EQ(s->b().SampleLogits(s->In(x), 1, n, {.top_p = 0.f}, s->In(u), out, nullptr).code(),
              absl::StatusCode::kInvalidArgument)
        << s->name() << ": top_p 0";
  }
  const size_t half = res.size() / 2;
  for (size_t i = 0; i < half; ++i)
    CompareExact(res[i], res[half + i], "sampled tokens, case " + std::to_string(i));
  // Against the host's arithmetic row by row (the Sampler's FilteredProbs and DrawIndex), and the
  // filters bite: top_k 1 takes the argmax whatever u.
  std::vector<float> probs(n);
  std::vector<int32_t> order;
  for (size_t c = 0; c < std::size(params); ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      sampling::FilteredProbs(x.data() + r * n, n, params[c], probs.data(), order);
      EXPECT_EQ(res[half + 2 * c][r], sampling::DrawIndex(probs.data(), n, u[r]))
          << "case " << c << " row " << r;
      EXPECT_GT(probs[res[half + 2 * c][r]], 0.f) << "a token of probability 0 was drawn";
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * n;
    EXPECT_EQ(res[half + 2 * 5][r], std::max_element(xr, xr + n) - xr) << "top_k 1, row " << r;
  }
  // The distributions written out are the host's FilteredProbs, bit for bit, on both sides.
  const size_t ph = probs_out.size() / 2;
  std::vector<float> gp(kGoldenVocab);
  for (size_t c = 0; c < std::size(params); ++c) {
    CompareExact(probs_out[c], probs_out[ph + c],
                 "golden distributions, case " + std::to_string(c));
    for (int64_t r = 0; r < kGoldenRows; r += 7) {
      sampling::FilteredProbs(golden.data() + r * kGoldenVocab, kGoldenVocab, params[c], gp.data(),
                              order);
      for (int64_t j = 0; j < kGoldenVocab; ++j) {
        ASSERT_EQ(Bits(gp[j]), Bits(probs_out[ph + c][r * kGoldenVocab + j]))
            << "case " << c << " row " << r << " entry " << j;
      }
    }
  }
}

PARITY_CASE(VerifyDrafts) {
  // Tolerance: exact (a count and a token; kernels/sampling_math.h is one arithmetic on both
  // sides). Target and draft distributions from random logits under filters (so both have
  // zeros), drafts drawn from q; k = 0, 1, 3, 5; uniforms across [0, 1) so that drafts are
  // accepted and rejected; a row where q == p (a residual without mass falls back to p), a draft
  // of target probability 0 (always rejected) and one of draft probability 0 (accepted iff p > 0).
  const int64_t n = 700, kmax = 5;
  const SampleParams tp{.temperature = 0.9f, .top_k = 300, .min_p = 0.001f};
  const SampleParams dp{.temperature = 1.2f, .top_p = 0.95f};
  std::vector<int32_t> order;
  struct Case {
    int64_t k;
    std::vector<float> p, q;
    std::vector<int32_t> drafts;
    std::vector<double> u;
  };
  std::vector<Case> cases;
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  for (int c = 0; c < 24; ++c) {
    Case cs;
    cs.k = c < 2 ? c : (c % 3 == 0 ? kmax : c % 3 == 1 ? 3 : 1);
    const std::vector<float> lp = Bf16(env.rng, (cs.k + 1) * n, 3.f);
    std::vector<float> lq = lp;  // a draft close to the target: some drafts are accepted
    for (float& v : lq) v += static_cast<float>(unif(env.rng) - 0.5);
    cs.p.resize((cs.k + 1) * n);
    cs.q.resize(std::max<int64_t>(1, cs.k) * n);
    for (int64_t i = 0; i <= cs.k; ++i)
      sampling::FilteredProbs(lp.data() + i * n, n, tp, cs.p.data() + i * n, order);
    for (int64_t i = 0; i < cs.k; ++i) {
      sampling::FilteredProbs(lq.data() + i * n, n, dp, cs.q.data() + i * n, order);
      if (c % 4 == 2 && i == 0)  // q == p: no residual mass at row 0
        std::copy_n(cs.p.data(), n, cs.q.data());
      cs.drafts.push_back(sampling::DrawIndex(cs.q.data() + i * n, n, unif(env.rng)));
    }
    if ((c % 5 == 3 || c % 4 == 2) && cs.k > 0) {  // a draft the target cannot take (with
                                                   // q == p: rejected without residual mass)
      for (int64_t j = 0; j < n; ++j) {
        if (cs.p[j] == 0.f) {
          cs.drafts[0] = static_cast<int32_t>(j);
          break;
        }
      }
    }
    if (c % 5 == 4 && c % 4 != 2 && cs.k > 0) {  // of draft probability 0, target > 0
      for (int64_t j = 0; j < n; ++j) {
        if (cs.q[j] == 0.f && cs.p[j] > 0.f) {
          cs.drafts[0] = static_cast<int32_t>(j);
          break;
        }
      }
    }
    for (int64_t i = 0; i <= cs.k; ++i) cs.u.push_back(c % 6 == 5 ? 0.0 : unif(env.rng) * 0.999);
    cases.push_back(std::move(cs));
  }
  // res: per side and case, the verdict; chosen: each row's token (odd cases only).
  std::vector<std::vector<int32_t>> res, chosen;
  for (Side* s : {&env.ref, &env.cand}) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& cs = cases[c];
      int32_t* out = s->Out<int32_t>(2);
      int32_t* rows = c % 2 == 1 ? s->Out<int32_t>(cs.k + 1) : nullptr;
      const int32_t* drafts = cs.k > 0 ? s->In(cs.drafts) : nullptr;
      const float* q = cs.k > 0 ? s->In(cs.q) : nullptr;
      EXPECT_OP_OK(*s,
                   s->b().VerifyDrafts(s->In(cs.p), q, drafts, cs.k, n, s->In(cs.u), out, rows));
      res.push_back(s->Read(out, 2));
      chosen.push_back(rows != nullptr ? s->Read(rows, cs.k + 1) : std::vector<int32_t>());
    }
    EXPECT_EQ(s->b()
                  .VerifyDrafts(s->In(cases[2].p), s->In(cases[2].q), s->In(cases[2].drafts), -1, n,
                                s->In(cases[2].u), s->Out<int32_t>(2), nullptr)
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << s->name() << ": a negative draft count";
  }
  const size_t half = res.size() / 2;
  int accepted = 0, rejected = 0, fallbacks = 0;
  std::vector<float> residual;
  for (size_t c = 0; c < half; ++c) {
    CompareExact(res[c], res[half + c], "verdict, case " + std::to_string(c));
    const Case& cs = cases[c];
    const sampling::DraftVerdict v = sampling::VerifyDrafts(
        cs.p.data(), cs.q.data(), cs.drafts.data(), cs.k, n, cs.u.data(), residual);
    EXPECT_EQ(res[half + c][0], v.accepted) << "case " << c;
    EXPECT_EQ(res[half + c][1], v.token) << "case " << c;
    if (c % 2 == 1) {  // the token at the verdict's row and at row k, else the row's draft
      CompareExact(chosen[c], chosen[half + c], "chosen, case " + std::to_string(c));
      std::vector<int32_t> want(cs.drafts.begin(), cs.drafts.begin() + cs.k);
      want.push_back(v.token);
      if (v.accepted < cs.k) want[static_cast<size_t>(v.accepted)] = v.token;
      EXPECT_EQ(chosen[half + c], want) << "case " << c;
    }
    accepted += v.accepted;
    rejected += v.accepted < cs.k;
    fallbacks += c % 4 == 2 && cs.k > 0 && v.accepted == 0;
    // The token has probability > 0 under the distribution it was drawn from.
    const float* row = cs.p.data() + v.accepted * n;
    EXPECT_GT(row[v.token], 0.f) << "case " << c << ": the token's target probability";
    if ((c % 5 == 3 || c % 4 == 2) && cs.k > 0) {
      EXPECT_EQ(v.accepted, 0) << "case " << c;
    }
  }
  EXPECT_GT(accepted, 0) << "no draft was accepted: the case tests too little";
  EXPECT_GT(rejected, 0) << "no draft was rejected: the case tests too little";
  EXPECT_GT(fallbacks, 0) << "no residual fell back to p";
  // The CPU backend refuses a draft outside the row (a device takes it as rejected).
  if (env.cand_is_cpu) {
    const std::vector<int32_t> bad = {static_cast<int32_t>(n)};
    EXPECT_EQ(env.ref.b()
                  .VerifyDrafts(env.ref.In(cases[1].p), env.ref.In(cases[1].q), env.ref.In(bad), 1,
                                n, env.ref.In(cases[1].u), env.ref.Out<int32_t>(2), nullptr)
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
}

PARITY_CASE(TopLogprobs) {
  // Tolerance: ids exact (the TopBefore order); logprobs within 2 ulps (the device's double log
  // may differ from the host's in its last bit; everything before it is one arithmetic). Rows of
  // random logits (scale 4) and of ties (Tied: equal values, -inf, +-0), top 0, 5 and the whole
  // row, and the golden prefill logits with top 20; then against the host's definition
  // (kernels/sampling_math.h), which model::ComputeLogprobs uses.
  const int64_t rows = 5, n = 1000;
  std::vector<float> x = Bf16(env.rng, rows * n, 4.f);
  const std::vector<float> tied = Tied(env.rng, 2 * n);
  std::copy(tied.begin(), tied.end(), x.begin() + 3 * n);
  x[3 * n + 7] = 3.f;  // a chosen token that is finite
  const std::vector<int32_t> chosen = {0, 999, 17, 7, 500};
  const int64_t tops[] = {0, 5, n};
  const auto golden = GoldenF32("logits_prefill_all.bin");
  ASSERT_EQ(static_cast<int64_t>(golden.size()), kGoldenRows * kGoldenVocab);
  std::vector<int32_t> gchosen(kGoldenRows);
  for (int64_t r = 0; r < kGoldenRows; ++r)
    gchosen[r] = static_cast<int32_t>((r * 37) % kGoldenVocab);
  std::vector<std::vector<float>> lps;
  std::vector<std::vector<int32_t>> ids;
  for (Side* s : {&env.ref, &env.cand}) {
    for (int64_t top : tops) {
      float* clp = s->Out<float>(rows);
      int32_t* tid = s->Out<int32_t>(std::max<int64_t>(1, rows * top));
      float* tlp = s->Out<float>(std::max<int64_t>(1, rows * top));
      EXPECT_OP_OK(*s, s->b().TopLogprobs(s->In(x), rows, n, s->In(chosen), top, clp, tid, tlp));
      lps.push_back(s->Read(clp, rows));
      lps.push_back(s->Read(tlp, rows * top));
      ids.push_back(s->Read(tid, rows * top));
    }
    const int64_t gtop = 20;
    float* clp = s->Out<float>(kGoldenRows);
    int32_t* tid = s->Out<int32_t>(kGoldenRows * gtop);
    float* tlp = s->Out<float>(kGoldenRows * gtop);
    EXPECT_OP_OK(*s, s->b().TopLogprobs(s->In(golden), kGoldenRows, kGoldenVocab, s->In(gchosen),
                                        gtop, clp, tid, tlp));
    lps.push_back(s->Read(clp, kGoldenRows));
    lps.push_back(s->Read(tlp, kGoldenRows * gtop));
    ids.push_back(s->Read(tid, kGoldenRows * gtop));
    EXPECT_EQ(s->b().TopLogprobs(s->In(x), 1, n, s->In(chosen), n + 1, clp, tid, tlp).code(),
              absl::StatusCode::kInvalidArgument)
        << s->name() << ": top above n";
  }
  const size_t lh = lps.size() / 2, ih = ids.size() / 2;
  for (size_t i = 0; i < lh; ++i)
    Compare(env, lps[i], lps[lh + i], Tol::Ulps(2), "logprobs, output " + std::to_string(i));
  for (size_t i = 0; i < ih; ++i)
    CompareExact(ids[i], ids[ih + i], "top ids, case " + std::to_string(i));
  // The host's definition, row by row, for top = 5 (outputs 2 and 3 of each side).
  std::vector<int32_t> want(5), order;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * n;
    const double lse = sampling::LogSumExp(xr, n);
    sampling::TopIndices(xr, n, 5, want.data(), order);
    for (int j = 0; j < 5; ++j) {
      EXPECT_EQ(ids[ih + 1][r * 5 + j], want[j]) << "row " << r << " entry " << j;
      if (j > 0) {
        EXPECT_GE(xr[want[j - 1]], xr[want[j]]);
      }
    }
    EXPECT_EQ(Bits(lps[lh + 2][r]), Bits(sampling::Logprob(xr[chosen[r]], lse))) << "row " << r;
  }
  // A whole row's logprobs are a distribution: their exp sums to 1.
  for (int64_t r = 0; r < rows; ++r) {
    double z = 0;
    for (int64_t j = 0; j < n; ++j) z += std::exp(static_cast<double>(lps[lh + 5][r * n + j]));
    EXPECT_NEAR(z, 1.0, 1e-4) << "row " << r;
  }
}

// ---- Graphs ----
// The candidate records when it can (CUDA, and the CPU SIMD candidate made with graphs); the
// reference (CPU scalar, no graphs) runs op by op, and refuses a capture.
PARITY_CASE(BeginCapture) {
  // Tolerance: exact (statuses). During a capture, host data cannot go in or out and a second
  // capture cannot begin; the refused calls fail the capture; after it the backend is as before.
  EXPECT_EQ(env.ref.b().BeginCapture().code(), absl::StatusCode::kUnimplemented);
  Side& s = env.cand;
  if (!s.b().supports_graphs()) GTEST_SKIP() << s.name() << " records no graphs";
  const auto x = Normal(env.rng, 64);
  float* px = s.In(x);
  auto staging = s.b().Allocate(64 * sizeof(float));
  ASSERT_TRUE(staging.ok());
  ASSERT_TRUE(s.b().BeginCapture().ok());
  EXPECT_EQ(s.b().BeginCapture().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<float> back(64);
  EXPECT_EQ(s.b().Upload(x.data(), 256, *staging, 0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.b().Download(*staging, 0, 256, back.data()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.b().Synchronize().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_OP_OK(s, s.b().RoundBf16(px, 64));  // recorded
  auto g = s.b().EndCapture();
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
  // Nothing recorded ran, and the backend works as before.
  CompareExact(x, s.Read(px, 64), "a failed capture runs nothing");
  EXPECT_OP_OK(s, s.b().RoundBf16(px, 64));
  std::vector<float> rounded = x;
  for (float& v : rounded) v = RoundBf16(v);
  CompareExact(rounded, s.Read(px, 64), "after the capture");
}

PARITY_CASE(EndCapture) {
  // Tolerance: exact (Copy, Add). A recording launched twice reads its memory's contents at each
  // launch; an empty recording launches; an end without a beginning is refused.
  Side& s = env.cand;
  EXPECT_EQ(env.ref.b().EndCapture().status().code(), absl::StatusCode::kUnimplemented);
  if (!s.b().supports_graphs()) GTEST_SKIP() << s.name() << " records no graphs";
  EXPECT_EQ(s.b().EndCapture().status().code(), absl::StatusCode::kFailedPrecondition);
  const auto a = Normal(env.rng, 300), b1 = Normal(env.rng, 300), b2 = Normal(env.rng, 300);
  float* x = s.In(a);
  float* y = s.In(b1);
  float* z = s.Out<float>(300);
  ASSERT_TRUE(s.b().BeginCapture().ok());
  EXPECT_OP_OK(s, s.b().Copy(z, x, 300 * sizeof(float)));
  EXPECT_OP_OK(s, s.b().Add(z, y, 300));
  auto g = s.b().EndCapture();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_GT((*g)->ops(), 0);
  EXPECT_EQ(Bits(s.Read(z, 300)[0]), Bits(Side::Poison<float>())) << "recorded ops ran at capture";
  std::vector<float> want(300);
  for (const auto* bv : {&b1, &b2}) {
    float* yv = s.In(*bv);
    EXPECT_OP_OK(s, s.b().Copy(y, yv, 300 * sizeof(float)));
    EXPECT_OP_OK(s, s.b().LaunchGraph(**g));
    for (int i = 0; i < 300; ++i) want[i] = a[i] + (*bv)[i];
    CompareExact(want, s.Read(z, 300), "launch after new contents");
  }
  ASSERT_TRUE(s.b().BeginCapture().ok());
  auto empty = s.b().EndCapture();
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_OP_OK(s, s.b().LaunchGraph(**empty));
}

PARITY_CASE(LaunchGraph) {
  // Tolerance: exact (each op is exact between the backends; the graph changes no arithmetic). A
  // decode-shaped program (split-K LinearQuant, RmsNorm, the MoE's routing, grouping and grouped
  // GEMM, Argmax), recorded by the candidate after an op-by-op run (a warm-up, as the model's
  // decode step graphs make), launched on two inputs, against the reference op by op.
  constexpr int64_t R = 3, K = 1000, N = 72, E = 8, TK = 2, NS = 1, NO = 40;
  const QuantWeight wshape = QuantShape(N, K, WeightFormat::kFp8E4M3);
  const QuantWeight eshape = QuantShape(NO, N, WeightFormat::kFp8E4M3);
  const auto wcodes = RandomCodes(env.rng, wshape);
  const auto wscales = RandomScales(env.rng, wshape);
  std::vector<std::vector<uint8_t>> ecodes, escales;
  for (int i = 0; i < E + NS; ++i) {
    ecodes.push_back(RandomCodes(env.rng, eshape));
    escales.push_back(RandomScales(env.rng, eshape));
  }
  const auto norm_w = Bf16(env.rng, N);
  const auto gate = Normal(env.rng, E * N, 0.3f);
  const auto bias = Normal(env.rng, E, 0.1f);
  const std::vector<std::vector<float>> inputs = {MixedActivations(env.rng, R * K),
                                                  MixedActivations(env.rng, R * K)};
  struct Outputs {
    std::vector<float> y, out;
    std::vector<int32_t> ids;
  };
  std::vector<std::vector<Outputs>> got(2);  // [side][run]
  for (int side = 0; side < 2; ++side) {
    Side& s = side == 0 ? env.ref : env.cand;
    const QuantWeight w = s.Packed(wshape, wcodes, wscales);
    std::vector<QuantWeight> experts;
    for (int i = 0; i < E + NS; ++i) experts.push_back(s.Packed(eshape, ecodes[i], escales[i]));
    std::vector<const QuantWeight*> ews;
    for (const QuantWeight& e : experts) ews.push_back(&e);
    float* x = s.In(inputs[0]);
    const float* nw = s.In(norm_w);
    const float* gw = s.In(gate);
    const float* bw = s.In(bias);
    float* y = s.Out<float>(R * N);
    float* z = s.Out<float>(R * E);
    int32_t* sel = s.Out<int32_t>(R * TK);
    float* wts = s.Out<float>(R * TK);
    int64_t* starts = s.Out<int64_t>(E + NS + 1);
    int64_t* from = s.Out<int64_t>(R * (TK + NS));
    int64_t* to = s.Out<int64_t>(R * (TK + NS));
    float* ew = s.Out<float>(R * TK);
    float* yg = s.Out<float>(R * (TK + NS) * N);
    float* out = s.Out<float>(R * (TK + NS) * NO);
    int32_t* ids = s.Out<int32_t>(R * (TK + NS));
    auto program = [&]() -> absl::Status {
      RETURN_IF_ERROR(s.b().LinearQuant(x, R, w, y));
      RETURN_IF_ERROR(s.b().RmsNorm(y, nw, R, N, 1e-6f, y));
      RETURN_IF_ERROR(s.b().LinearF32(y, R, gw, E, N, z));
      RETURN_IF_ERROR(s.b().MoeRoute(z, R, E, bw, TK, 1.5f, sel, wts));
      RETURN_IF_ERROR(s.b().MoeGroup(sel, wts, R, E, TK, NS, starts, from, to, ew));
      RETURN_IF_ERROR(s.b().CopyRows(y, from, yg, nullptr, R * (TK + NS), N));
      RETURN_IF_ERROR(s.b().GroupedLinearQuant(yg, R * (TK + NS), starts, ews.data(), E + NS, out));
      return s.b().Argmax(out, R * (TK + NS), NO, ids);
    };
    auto read = [&] {
      return Outputs{s.Read(y, R * N), s.Read(out, R * (TK + NS) * NO), s.Read(ids, R * (TK + NS))};
    };
    auto poison = [&] {
      float* p = s.Out<float>(R * (TK + NS) * NO);
      EXPECT_OP_OK(s, s.b().Copy(out, p, R * (TK + NS) * NO * sizeof(float)));
      EXPECT_OP_OK(s, s.b().Copy(y, p, R * N * sizeof(float)));
    };
    EXPECT_OP_OK(s, program());  // op by op on input 0
    got[side].push_back(read());
    std::unique_ptr<Graph> g;
    if (side == 1 && s.b().supports_graphs()) {
      ASSERT_TRUE(s.b().BeginCapture().ok());
      const absl::Status recorded = program();
      auto ended = s.b().EndCapture();
      ASSERT_TRUE(recorded.ok()) << recorded;
      ASSERT_TRUE(ended.ok()) << ended.status();
      g = std::move(*ended);
    }
    for (size_t run = 0; run < inputs.size(); ++run) {
      float* xi = s.In(inputs[run]);
      EXPECT_OP_OK(s, s.b().Copy(x, xi, R * K * sizeof(float)));
      poison();
      EXPECT_OP_OK(s, g != nullptr ? s.b().LaunchGraph(*g) : program());
      got[side].push_back(read());
    }
    if (side == 1 && g == nullptr) GTEST_SKIP() << s.name() << " records no graphs";
  }
  for (size_t run = 0; run < got[0].size(); ++run) {
    const std::string what = run == 0 ? "op by op" : "launch " + std::to_string(run);
    Compare(env, got[0][run].y, got[1][run].y, Tol::Exact(), what + ": normed projection");
    Compare(env, got[0][run].out, got[1][run].out, Tol::Exact(), what + ": grouped experts");
    CompareExact(got[0][run].ids, got[1][run].ids, what + ": argmax");
  }
  // The two inputs route differently somewhere (the launches are not one result twice).
  EXPECT_NE(got[1][1].out, got[1][2].out);
  // A graph is its backend's only.
  auto other = testing::MakeTestCpuBackend({.graphs = true});
  ASSERT_TRUE(other->BeginCapture().ok());
  auto foreign = other->EndCapture();
  ASSERT_TRUE(foreign.ok());
  EXPECT_EQ(env.cand.b().LaunchGraph(**foreign).code(), absl::StatusCode::kInvalidArgument);
}

// ---- The table against the interface (checked once, in the unit binary) ----
#if !defined(EPD_PARITY_CUDA)
TEST(BackendParityTable, EveryOpOfTheInterfaceHasACase) {
  for (std::string_view op : kBackendOpNames) {
    EXPECT_EQ(Cases().count(std::string(op)), 1u) << "no parity case for Backend::" << op;
  }
  std::set<std::string> names(std::begin(kBackendOpNames), std::end(kBackendOpNames));
  for (const auto& [name, c] : Cases()) {
    EXPECT_EQ(names.count(name), 1u) << "case " << name << " is not an op of kBackendOpNames";
  }
}

// The comparison itself can fail: a one-ulp difference under an exact tolerance, a two-bf16-ulp
// difference under a one-bf16-ulp tolerance, and a changed index are all reported.
TEST(BackendParityTable, TheComparisonCatchesADifference) {
  auto ref = testing::MakeTestCpuBackend({.simd = false});
  Side a(*ref, "a"), b(*ref, "b");
  std::mt19937 rng(1);
  Env gpu_like{a, b, rng, /*cand_is_cpu=*/false};
  const std::vector<float> x = {1.f, 2.f, 3.f};
  std::vector<float> y = x;
  y[1] = std::nextafter(2.f, 3.f);
  EXPECT_NONFATAL_FAILURE(Compare(gpu_like, x, y, Tol::Exact(), "t"), "1 of 3 elements differ");
  Compare(gpu_like, x, y, Tol::Ulps(1), "within one ulp");
  std::vector<float> z = x;
  z[2] = RoundBf16(3.f + 2 * 0.015625f);  // two bf16 ulps above 3
  EXPECT_NONFATAL_FAILURE(Compare(gpu_like, x, z, Tol::Bf16Ulps(1), "t"), "1 of 3 elements");
  std::vector<float> nan = x;
  nan[0] = NAN;
  EXPECT_NONFATAL_FAILURE(Compare(gpu_like, x, nan, Tol::Rel(1.0), "t"), "1 of 3 elements");
  EXPECT_NONFATAL_FAILURE(CompareExact(std::vector<int32_t>{4, 5}, std::vector<int32_t>{4, 6}, "t"),
                          "1 of 2 differ");
  // The CPU SIMD candidate is always held to exact.
  Env cpu{a, b, rng, /*cand_is_cpu=*/true};
  EXPECT_NONFATAL_FAILURE(Compare(cpu, x, y, Tol::Ulps(4), "t"), "1 of 3 elements differ");
}

TEST(BackendParityTable, CancellingInputsShowAChangeOfSummationOrder) {
  // Guards Cancelling(): on its rows, index order (DotSeq) and oneDNN's pair order (DotDp) give
  // other sums, so a case fed with them tells the two orders apart.
  std::mt19937 rng(5);
  const int64_t rows = 64, dim = 128;
  const std::vector<float> ones(dim, 1.f), v = Cancelling(rng, rows, dim);
  int64_t differ = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = v.data() + r * dim;
    differ += torch_math::DotSeq(ones.data(), x, dim) != torch_math::DotDp(ones.data(), x, dim);
  }
  EXPECT_GT(differ, rows / 4);
}

TEST(BackendParityTable, OpListMatchesTheDeclarationsOfBackendH) {
  std::ifstream in(SourceDir() + "/kernels/backend.h");
  ASSERT_TRUE(in) << "cannot read kernels/backend.h";
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  // Every "virtual absl::Status Name(" or "virtual absl::StatusOr<T> Name(" (no std::regex: GCC 12
  // warns inside it under the sanitizers).
  std::set<std::string> declared;
  const std::string key = "virtual absl::Status";
  for (size_t p = text.find(key); p != std::string::npos; p = text.find(key, p + 1)) {
    size_t q = p + key.size();
    if (text.compare(q, 2, "Or") == 0) {  // StatusOr<...>, angle brackets nested
      int depth = 0;
      do {
        if (text[q] == '<') ++depth;
        if (text[q] == '>') --depth;
        ++q;
      } while (q < text.size() && (depth > 0 || text[q - 1] != '>'));
    }
    while (q < text.size() && std::isspace(static_cast<unsigned char>(text[q]))) ++q;
    size_t e = q;
    while (e < text.size() && (std::isalnum(static_cast<unsigned char>(text[e])) || text[e] == '_'))
      ++e;
    if (e < text.size() && text[e] == '(') declared.insert(text.substr(q, e - q));
  }
  const std::set<std::string> listed(std::begin(kBackendOpNames), std::end(kBackendOpNames));
  EXPECT_EQ(declared, listed) << "kBackendOpNames must name every Status-returning op";
  EXPECT_GE(declared.size(), 30u);
}
#endif

// ---- The parameterised run ----
class BackendParity : public ::testing::TestWithParam<std::string_view> {
 protected:
  void SetUp() override {
    ref_ = testing::MakeTestCpuBackend({.simd = false});
#if defined(EPD_PARITY_CUDA)
    auto cuda = MakeCudaBackend(0);
    if (!cuda.ok()) {
      GTEST_SKIP() << "skipped: no GPU (" << cuda.status().message() << ")";
    }
    cand_ = std::move(*cuda);
    cand_is_cpu_ = false;
#else
    cand_ = testing::MakeTestCpuBackend({.simd = true, .graphs = true});
    cand_is_cpu_ = true;
#endif
  }
  std::unique_ptr<Backend> ref_, cand_;
  bool cand_is_cpu_ = true;
};

TEST_P(BackendParity, MatchesTheCpuReference) {
  const std::string op(GetParam());
  auto it = Cases().find(op);
  ASSERT_NE(it, Cases().end()) << "no parity case for Backend::" << op;
  Side ref(*ref_, "cpu-scalar");
  Side cand(*cand_, cand_is_cpu_ ? "cpu-simd" : "cuda:0");
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(op)&0xffffffffu));
  Env env{ref, cand, rng, cand_is_cpu_};
  it->second(env);
}

INSTANTIATE_TEST_SUITE_P(EPD_PARITY_SUITE, BackendParity, ::testing::ValuesIn(kBackendOpNames),
                         [](const ::testing::TestParamInfo<std::string_view>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace epd::kernels
