// GPU benchmarks of the CUDA backend (built only with CUDA; run by tests/gpu/device_check.sh).
// Each line states its ratio to a physical limit of one H200 SXM (NVIDIA H200 datasheet):
//   HBM3e bandwidth 4.8 TB/s; FP8 Tensor Core 3,958 TFLOPS with 2:4 sparsity = 1,979 TFLOPS dense.
// - attention: decode sparse attention (Backend::SparseAttention, the release config's 64 heads x
//   512 dims, one KV head; a list of 128 window + 512 selected entries per row) over a KV of
//   64K..1M rows, and the indexer scoring (Backend::IndexerScores, 32 heads x 128 dims) over the
//   context / 4 compressed keys of a ratio-4 layer, unpacked (IndexerScores) and straight from
//   the pool's packed pages for 1 and 32 rows (IndexerScoresPaged, a decode step's path): bytes
//   read / time against 4.8 TB/s.
// - fp8_gemm: Backend::LinearQuant on packed FP8 (and FP4 experts) weights of the release
//   config's shapes: 2*M*N*K / time against 1,979 TFLOPS, and weight bytes / time against
//   4.8 TB/s.
// - plain_gemm: Backend::LinearF32 / LinearBf16 in the model's weight forms (the LM head and a
//   group of wo_a as bf16 bits, HcMixes' fp32 projection) and the head as fp32 values (its form
//   before 2026-12-05) at M = 1, 8 and 32: weight bytes / time against 4.8 TB/s.
// - moe_gemm: Backend::GroupedLinearQuant of the release config's FP4 expert w13 over 32 experts,
//   a decode step's rows spread evenly (8 rows: one each for 8 experts; 224: 7 each; 896: 28
//   each): bytes of the experts hit / time against 4.8 TB/s.
// - launch: the host cost of one queued op (Backend::Add of one element), 10000 in a row.
// Output: one line per measurement, `BENCH <section> <case> <value> <unit> ratio=<r>`.
// Usage: cuda_bench [--quick]   (--quick: fewer iterations and contexts up to 256K)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/format.h"

namespace {

using epd::kernels::Backend;
using epd::kernels::Buffer;
using Clock = std::chrono::steady_clock;

constexpr double kHbmBytesPerS = 4.8e12;
constexpr double kFp8DenseFlops = 1979e12;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "cuda_bench: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
void Check(const T& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + std::string(s.message()));
}

Buffer Upload(Backend& b, const void* data, int64_t bytes) {
  auto buf = b.Allocate(bytes);
  Check(buf.status(), "Allocate");
  if (data != nullptr) Check(b.Upload(data, bytes, *buf), "Upload");
  return std::move(*buf);
}

// Median seconds of `iters` timed calls of f (each followed by Synchronize), after 2 warm-ups.
template <typename F>
double Time(Backend& b, int iters, F&& f) {
  for (int i = 0; i < 2; ++i) {
    Check(f(), "op");
    Check(b.Synchronize(), "Synchronize");
  }
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto a = Clock::now();
    Check(f(), "op");
    Check(b.Synchronize(), "Synchronize");
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void Attention(Backend& b, bool quick) {
  const int heads = 64, hd = 512, list_len = 640, index_heads = 32, index_dim = 128;
  std::mt19937 rng(1);
  std::vector<int64_t> contexts = {64 << 10, 128 << 10, 256 << 10};
  if (!quick) contexts.insert(contexts.end(), {512 << 10, 1 << 20});
  for (int64_t ctx : contexts) {
    // KV rows are not initialised (timing only); q, sink, idx are.
    Buffer kv = Upload(b, nullptr, ctx * hd * 4);
    for (int64_t rows : {int64_t{1}, int64_t{32}}) {
      std::vector<float> q(rows * heads * hd, 0.01f), sink(heads, 0.f);
      std::vector<int32_t> idx(rows * list_len);
      std::uniform_int_distribution<int64_t> pick(0, ctx - 129);
      for (int64_t r = 0; r < rows; ++r) {
        for (int j = 0; j < 512; ++j) idx[r * list_len + j] = static_cast<int32_t>(pick(rng));
        for (int j = 0; j < 128; ++j)
          idx[r * list_len + 512 + j] = static_cast<int32_t>(ctx - 128 + j);
      }
      Buffer qb = Upload(b, q.data(), q.size() * 4), sb = Upload(b, sink.data(), heads * 4),
             ib = Upload(b, idx.data(), idx.size() * 4),
             ob = Upload(b, nullptr, rows * heads * hd * 4);
      epd::kernels::SparseAttentionArgs a;
      a.q = qb.as<float>();
      a.kv = kv.as<const float>();
      a.sink = sb.as<float>();
      a.idx = ib.as<int32_t>();
      a.rows = rows;
      a.heads = heads;
      a.head_dim = hd;
      a.list_len = list_len;
      a.scale = 0.044f;
      a.out = ob.as<float>();
      const double s = Time(b, quick ? 5 : 20, [&] { return b.SparseAttention(a); });
      // Bytes the op must read at least: each row's listed KV rows once, q, idx; plus out.
      const double bytes = rows * (list_len * hd * 4.0 + heads * hd * 4.0 * 2 + list_len * 4.0);
      std::printf(
          "BENCH attention sparse_decode ctx=%lld rows=%lld heads=%d hd=%d list=%d  %.1f us  "
          "%.3f TB/s  ratio=%.4f (of 4.8 TB/s)\n",
          static_cast<long long>(ctx), static_cast<long long>(rows), heads, hd, list_len, s * 1e6,
          bytes / s / 1e12, bytes / s / kHbmBytesPerS);
    }
    // The indexer over the compressed keys of a ratio-4 layer (one query row).
    const int64_t n = ctx / 4;
    Buffer keys = Upload(b, nullptr, n * index_dim * 4);
    std::vector<float> q(index_heads * index_dim, 0.01f), w(index_heads, 1.f);
    Buffer qb = Upload(b, q.data(), q.size() * 4), wb = Upload(b, w.data(), w.size() * 4),
           sc = Upload(b, nullptr, n * 4);
    Check(b.Copy(keys.data(), kv.data(), n * index_dim * 4), "Copy");
    const double s = Time(b, quick ? 5 : 20, [&] {
      return b.IndexerScores(qb.as<float>(), wb.as<float>(), index_heads, keys.as<float>(), n,
                             index_dim, sc.as<float>());
    });
    const double bytes = n * index_dim * 4.0 + n * 4.0;
    std::printf(
        "BENCH attention indexer ctx=%lld keys=%lld heads=%d dim=%d  %.1f us  %.3f TB/s  "
        "ratio=%.4f (of 4.8 TB/s)\n",
        static_cast<long long>(ctx), static_cast<long long>(n), index_heads, index_dim, s * 1e6,
        bytes / s / 1e12, bytes / s / kHbmBytesPerS);
    // What a decode step runs: the same scores straight from the pool's packed index keys
    // (Backend::IndexerScoresPaged, 68 bytes a key in 64-row pages), for 1 and 32 query rows
    // (each its own sequence's keys: the bytes read grow with the rows).
    const auto codec = epd::kernels::RowCodec::kIndexKey;
    const int64_t rb = epd::kernels::RowCodecBytes(codec, index_dim), rpp = 64;
    for (int64_t rows : {int64_t{1}, int64_t{32}}) {
      // The keys are not initialised (timing only). Row r reads stream r.
      Buffer packed = Upload(b, nullptr, rows * n * rb);
      std::vector<uint8_t*> pages(static_cast<size_t>(rows * (n / rpp)));
      for (size_t p = 0; p < pages.size(); ++p)
        pages[p] = packed.as<uint8_t>() + static_cast<int64_t>(p) * rpp * rb;
      Buffer pb = Upload(b, pages.data(), static_cast<int64_t>(pages.size() * sizeof(uint8_t*)));
      std::vector<const uint8_t* const*> tables;
      for (int64_t r = 0; r < rows; ++r) tables.push_back(pb.as<uint8_t*>() + r * (n / rpp));
      std::vector<int64_t> row_rpp(rows, rpp), valid(rows, n);
      std::vector<float> qr(rows * index_heads * index_dim, 0.01f), wr(rows * index_heads, 1.f);
      Buffer tb = Upload(b, tables.data(), rows * 8), rb_rpp = Upload(b, row_rpp.data(), rows * 8),
             vb = Upload(b, valid.data(), rows * 8), qrb = Upload(b, qr.data(), qr.size() * 4),
             wrb = Upload(b, wr.data(), wr.size() * 4), scr = Upload(b, nullptr, rows * n * 4);
      const double sp = Time(b, quick ? 5 : 20, [&] {
        return b.IndexerScoresPaged(qrb.as<float>(), wrb.as<float>(), index_heads, codec,
                                    tb.as<const uint8_t* const* const>(), rb_rpp.as<int64_t>(),
                                    vb.as<int64_t>(), n, index_dim, rows, scr.as<float>());
      });
      const double pbytes = rows * (n * static_cast<double>(rb) + n * 4.0);
      std::printf(
          "BENCH attention indexer_paged ctx=%lld keys=%lld rows=%lld heads=%d dim=%d  %.1f us  "
          "%.3f TB/s  ratio=%.4f (of 4.8 TB/s)\n",
          static_cast<long long>(ctx), static_cast<long long>(n), static_cast<long long>(rows),
          index_heads, index_dim, sp * 1e6, pbytes / sp / 1e12, pbytes / sp / kHbmBytesPerS);
    }
  }
}

void Gemm(Backend& b, bool quick) {
  struct Shape {
    const char* name;
    int64_t out, in;
    epd::kernels::WeightFormat fmt;
  };
  // Release config (tests/data/configs/deepseek-v4.1-flash): hidden 5120, q_lora 1280,
  // 64 heads x 512, o_lora 1024 x 8 groups, expert intermediate 2304 (FP4).
  const Shape shapes[] = {
      {"wq_a", 1280, 5120, epd::kernels::WeightFormat::kFp8E4M3},
      {"wq_b", 32768, 1280, epd::kernels::WeightFormat::kFp8E4M3},
      {"wkv", 512, 5120, epd::kernels::WeightFormat::kFp8E4M3},
      {"wo_b", 5120, 8192, epd::kernels::WeightFormat::kFp8E4M3},
      {"expert_w13_fp4", 4608, 5120, epd::kernels::WeightFormat::kFp4E2M1},
      {"expert_w2_fp4", 5120, 2304, epd::kernels::WeightFormat::kFp4E2M1},
  };
  std::mt19937 rng(2);
  for (const Shape& sh : shapes) {
    epd::kernels::QuantWeight w;
    w.out = sh.out;
    w.in = sh.in;
    w.format = sh.fmt;
    w.block_rows = sh.fmt == epd::kernels::WeightFormat::kFp8E4M3 ? 32 : 1;
    w.block_cols = 32;
    std::vector<uint8_t> codes(w.code_bytes()), scales(w.scale_rows() * w.scale_cols(), 120);
    for (auto& c : codes) c = static_cast<uint8_t>(rng() % 0x7e);
    w.codes = Upload(b, codes.data(), codes.size());
    w.scale_codes = Upload(b, scales.data(), scales.size());
    for (int64_t m : {int64_t{1}, int64_t{8}, int64_t{32}, int64_t{128}, int64_t{2048}}) {
      if (quick && m == 2048) continue;
      std::vector<float> x(m * sh.in, 0.5f);
      Buffer xb = Upload(b, x.data(), x.size() * 4), yb = Upload(b, nullptr, m * sh.out * 4);
      const double s = Time(b, quick ? 3 : 10,
                            [&] { return b.LinearQuant(xb.as<float>(), m, w, yb.as<float>()); });
      const double flops = 2.0 * m * sh.out * sh.in;
      const double wbytes = static_cast<double>(codes.size() + scales.size());
      std::printf(
          "BENCH fp8_gemm %s M=%lld N=%lld K=%lld  %.1f us  %.2f TFLOPS  ratio=%.5f (of "
          "1979 TFLOPS dense FP8)  weights %.3f TB/s ratio=%.4f (of 4.8 TB/s)\n",
          sh.name, static_cast<long long>(m), static_cast<long long>(sh.out),
          static_cast<long long>(sh.in), s * 1e6, flops / s / 1e12, flops / s / kFp8DenseFlops,
          wbytes / s / 1e12, wbytes / s / kHbmBytesPerS);
    }
  }
}

// The plain GEMMs of a decode step: the LM head (LinearF32 129,280 x 5,120, bf16 bits; and as
// fp32 values), HcMixes' projection (fp32, 24 x 4 * 5,120) and one group of wo_a (LinearBf16
// 1,024 x 4,096, bf16 bits).
void PlainGemm(Backend& b, bool quick) {
  struct Shape {
    const char* name;
    int64_t out, in;
    bool bf16;          // LinearBf16 (else LinearF32)
    bool bf16_weights;  // held as bf16 bits (else fp32 values)
  };
  const Shape shapes[] = {{"head_bf16w", 129280, 5120, false, true},
                          {"head_f32w", 129280, 5120, false, false},
                          {"hc_mixes_f32w", 24, 4 * 5120, false, false},
                          {"wo_a_group_bf16w", 1024, 4096, true, true}};
  for (const Shape& sh : shapes) {
    const int64_t n = sh.out * sh.in, wbytes = n * (sh.bf16_weights ? 2 : 4);
    Buffer wb;
    if (sh.bf16_weights) {
      const std::vector<uint16_t> w(static_cast<size_t>(n),
                                    epd::kernels::format::F32ToBf16Bits(0.01f));
      wb = Upload(b, w.data(), wbytes);
    } else {
      const std::vector<float> w(static_cast<size_t>(n), 0.01f);
      wb = Upload(b, w.data(), wbytes);
    }
    const epd::kernels::PlainWeight pw = sh.bf16_weights
                                             ? epd::kernels::PlainWeight::Bf16(wb.as<uint16_t>())
                                             : epd::kernels::PlainWeight(wb.as<float>());
    for (int64_t m : {int64_t{1}, int64_t{8}, int64_t{32}}) {
      std::vector<float> x(m * sh.in, 0.5f);
      Buffer xb = Upload(b, x.data(), x.size() * 4), yb = Upload(b, nullptr, m * sh.out * 4);
      const double s = Time(b, quick ? 3 : 10, [&] {
        return sh.bf16 ? b.LinearBf16(xb.as<float>(), m, pw, sh.out, sh.in, yb.as<float>())
                       : b.LinearF32(xb.as<float>(), m, pw, sh.out, sh.in, yb.as<float>());
      });
      std::printf(
          "BENCH plain_gemm %s M=%lld N=%lld K=%lld  %.1f us  weights %.3f TB/s ratio=%.4f (of "
          "4.8 TB/s)\n",
          sh.name, static_cast<long long>(m), static_cast<long long>(sh.out),
          static_cast<long long>(sh.in), s * 1e6, static_cast<double>(wbytes) / s / 1e12,
          static_cast<double>(wbytes) / s / kHbmBytesPerS);
    }
  }
}

void MoeGemm(Backend& b, bool quick) {
  constexpr int kExperts = 32;
  epd::kernels::QuantWeight shape;
  shape.out = 4608;
  shape.in = 5120;
  shape.format = epd::kernels::WeightFormat::kFp4E2M1;
  shape.block_rows = 1;
  shape.block_cols = 32;
  std::mt19937 rng(3);
  const int64_t expert_bytes = shape.code_bytes() + shape.scale_rows() * shape.scale_cols();
  std::vector<epd::kernels::QuantWeight> ws(kExperts);
  std::vector<const epd::kernels::QuantWeight*> table;
  for (auto& w : ws) {
    w.out = shape.out;
    w.in = shape.in;
    w.format = shape.format;
    w.block_rows = shape.block_rows;
    w.block_cols = shape.block_cols;
    std::vector<uint8_t> codes(w.code_bytes()), scales(w.scale_rows() * w.scale_cols(), 120);
    for (auto& c : codes) c = static_cast<uint8_t>(rng());
    w.codes = Upload(b, codes.data(), codes.size());
    w.scale_codes = Upload(b, scales.data(), scales.size());
    table.push_back(&w);
  }
  for (int64_t rows : {int64_t{8}, int64_t{224}, int64_t{896}}) {
    std::vector<int64_t> starts(kExperts + 1);
    for (int g = 0; g <= kExperts; ++g) starts[g] = g * rows / kExperts;
    int hit = 0;
    for (int g = 0; g < kExperts; ++g) hit += starts[g + 1] > starts[g] ? 1 : 0;
    std::vector<float> x(rows * shape.in, 0.5f);
    Buffer xb = Upload(b, x.data(), x.size() * 4), yb = Upload(b, nullptr, rows * shape.out * 4);
    Buffer sb = Upload(b, starts.data(), starts.size() * 8);
    const double s = Time(b, quick ? 3 : 10, [&] {
      return b.GroupedLinearQuant(xb.as<float>(), rows, sb.as<int64_t>(), table.data(), kExperts,
                                  yb.as<float>());
    });
    const double bytes = static_cast<double>(hit) * static_cast<double>(expert_bytes);
    std::printf(
        "BENCH moe_gemm expert_w13_fp4 experts=%d rows=%lld hit=%d N=%lld K=%lld  %.1f us  "
        "weights %.3f TB/s ratio=%.4f (of 4.8 TB/s)\n",
        kExperts, static_cast<long long>(rows), hit, static_cast<long long>(shape.out),
        static_cast<long long>(shape.in), s * 1e6, bytes / s / 1e12, bytes / s / kHbmBytesPerS);
  }
}

void Launch(Backend& b) {
  Buffer x = Upload(b, nullptr, 256), y = Upload(b, nullptr, 256);
  const int n = 10000;
  Check(b.Synchronize(), "Synchronize");
  const auto a = Clock::now();
  for (int i = 0; i < n; ++i) Check(b.Add(x.as<float>(), y.as<float>(), 1), "Add");
  Check(b.Synchronize(), "Synchronize");
  const double s = std::chrono::duration<double>(Clock::now() - a).count();
  std::printf("BENCH launch add_1_element x%d  %.2f us per op  (host + launch; ratio=n/a)\n", n,
              s / n * 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) quick = quick || std::strcmp(argv[i], "--quick") == 0;
  auto backend = epd::kernels::MakeCudaBackend(0);
  if (!backend.ok()) {
    std::printf("cuda_bench: skipped: no GPU (%s)\n",
                std::string(backend.status().message()).c_str());
    return 2;
  }
  std::printf("cuda_bench on %s\n", epd::kernels::cuda::DeviceSummary().c_str());
  Launch(**backend);
  Gemm(**backend, quick);
  PlainGemm(**backend, quick);
  MoeGemm(**backend, quick);
  Attention(**backend, quick);
  return 0;
}
