// The CPU reference backend: host memory, one (synchronous) stream, the kernels of ops.h and the
// small per-element steps of the forward pass (routing, SwiGLU, candidate selection, ...), each
// with the operation order of the reference.
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu/ops.h"
#include "kernels/format.h"
#include "kernels/penalty.h"
#include "kernels/rope.h"
#include "kernels/sampling_math.h"

namespace epd::kernels::cpu {
namespace {

using absl::InvalidArgumentError;
using absl::OkStatus;
using absl::Status;

Status Bad(const char* op, const std::string& why) {
  return InvalidArgumentError(absl::StrCat("cpu backend: ", op, ": ", why));
}

// DigestBlocks', BlocksEqual's and CopyBlocks' block lengths: none negative.
Status BlockLengthsProblem(const char* op, const int64_t* bytes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (bytes[i] < 0) return Bad(op, absl::StrCat("block ", i, " has ", bytes[i], " bytes"));
  }
  return OkStatus();
}

class CpuBackend final : public Backend {
 public:
  std::string_view Name() const override { return "cpu"; }

  // ---- Memory ----
  MemoryKind memory_kind() const override { return MemoryKind::kHost; }
  absl::StatusOr<Buffer> Allocate(int64_t bytes, Stream stream) override {
    if (bytes < 0) return Bad("Allocate", absl::StrCat("negative size ", bytes));
    if (stream.id != 0) return Bad("Allocate", "the CPU backend has only stream 0");
    if (bytes == 0) return Buffer(nullptr, 0, memory_kind(), stream, nullptr);
    const size_t rounded = (static_cast<size_t>(bytes) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: Allocate: out of host memory for ", bytes, " bytes"));
    }
    return Buffer(p, bytes, memory_kind(), stream, [](void* q) { std::free(q); });
  }
  Status Upload(const void* host, int64_t bytes, Buffer& dst, int64_t dst_offset) override {
    if (bytes < 0 || dst_offset < 0 || dst_offset + bytes > dst.bytes()) {
      return Bad("Upload", absl::StrCat(bytes, " bytes at offset ", dst_offset,
                                        " do not fit a buffer of ", dst.bytes()));
    }
    if (bytes > 0) std::memcpy(dst.as<uint8_t>() + dst_offset, host, bytes);
    return OkStatus();
  }
  Status Download(const Buffer& src, int64_t src_offset, int64_t bytes, void* host) override {
    if (bytes < 0 || src_offset < 0 || src_offset + bytes > src.bytes()) {
      return Bad("Download", absl::StrCat(bytes, " bytes at offset ", src_offset,
                                          " are not inside a buffer of ", src.bytes()));
    }
    if (bytes > 0) std::memcpy(host, src.as<uint8_t>() + src_offset, bytes);
    return OkStatus();
  }
  Status Synchronize(Stream stream) override {
    if (stream.id != 0) return Bad("Synchronize", "the CPU backend has only stream 0");
    return OkStatus();  // every op has finished when it returns
  }
  Status Copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes < 0) return Bad("Copy", "negative size");
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return OkStatus();
  }

  // ---- Linears ----
  Status LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) override {
    if (rows < 0) return Bad("LinearQuant", "shape");
    if (std::string why = QuantWeightProblem(w); !why.empty()) return Bad("LinearQuant", why);
    cpu::LinearQuant(x, rows, w, y);
    return OkStatus();
  }
  Status LinearBf16(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                    float* y) override {
    if (rows < 0 || out < 0 || in < 0) return Bad("LinearBf16", "negative shape");
    if (std::string why = PlainWeightProblem(w); !why.empty()) return Bad("LinearBf16", why);
    cpu::LinearBf16(x, rows, w, out, in, y);
    return OkStatus();
  }
  Status LinearF32(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                   float* y) override {
    if (rows < 0 || out < 0 || in < 0) return Bad("LinearF32", "negative shape");
    if (std::string why = PlainWeightProblem(w); !why.empty()) return Bad("LinearF32", why);
    cpu::LinearF32(x, rows, w, out, in, y);
    return OkStatus();
  }

  // ---- Norms, RoPE, rounding ----
  Status RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                 float* y) override {
    if (rows < 0 || dim <= 0) return Bad("RmsNorm", "shape");
    cpu::RmsNormBf16(x, w, rows, dim, eps, y);
    return OkStatus();
  }
  Status RopeTables(const float* freqs, int n_pairs, const int64_t* positions, int64_t rows,
                    float* cos, float* sin) override {
    if (rows < 0 || n_pairs < 0) return Bad("RopeTables", "negative shape");
    for (int64_t r = 0; r < rows; ++r)
      RopeCosSin(freqs, n_pairs, positions[r], cos + r * n_pairs, sin + r * n_pairs);
    return OkStatus();
  }
  Status Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
              const float* cos, const float* sin, bool inverse) override {
    if (rows < 0 || heads < 0 || offset < 0 || offset + 2 * n_pairs > stride)
      return Bad("Rope", "the rotated pairs do not fit the row stride");
    cpu::Rope(x, rows, heads, stride, offset, n_pairs, cos, sin, inverse);
    return OkStatus();
  }
  Status RoundBf16(float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] = format::RoundBf16(x[i]);
    return OkStatus();
  }
  Status ScaleRoundBf16(float* x, int64_t n, float scale) override {
    for (int64_t i = 0; i < n; ++i) x[i] = format::RoundBf16(x[i] * scale);
    return OkStatus();
  }
  Status Add(float* x, const float* y, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
    return OkStatus();
  }

  // ---- Attention ----
  Status SparseAttention(const SparseAttentionArgs& args) override {
    if (args.rows < 0 || args.heads < 0 || args.head_dim <= 0 || args.list_len < 0)
      return Bad("SparseAttention", "shape");
    cpu::SparseAttention(args);
    return OkStatus();
  }
  Status CompressPool(const float* kv_all, const float* score_all, int64_t groups, int ratio,
                      int64_t hd, float* out_all) override {
    if (ratio < 1 || ratio > 8) return Bad("CompressPool", absl::StrCat("ratio ", ratio));
    if (groups < 0 || hd < 0) return Bad("CompressPool", "negative shape");
    for (int64_t g = 0; g < groups; ++g) {
      const float* kv = kv_all + g * ratio * hd;
      const float* score = score_all + g * ratio * hd;
      float* out = out_all + g * hd;
      for (int64_t ch = 0; ch < hd; ++ch) {
        float mx = -INFINITY;
        for (int r = 0; r < ratio; ++r) mx = std::max(mx, score[r * hd + ch]);
        float sum = 0.f;
        float e[8];
        for (int r = 0; r < ratio; ++r) {
          e[r] = std::exp(score[r * hd + ch] - mx);
          sum += e[r];
        }
        float acc = 0.f;
        for (int r = 0; r < ratio; ++r) acc += kv[r * hd + ch] * (e[r] / sum);
        out[ch] = format::RoundBf16(acc);
      }
    }
    return OkStatus();
  }
  Status IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                       int64_t dim, float* score) override {
    if (heads < 0 || n < 0 || dim < 0) return Bad("IndexerScores", "negative shape");
    cpu::IndexerScores(q, w, heads, keys, n, dim, score);
    return OkStatus();
  }
  Status MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                    int64_t mask_cols) override {
    for (int64_t t = std::max<int64_t>(valid, 0); t < n; ++t) score[t] = -INFINITY;
    if (mask != nullptr) {
      for (int64_t t = 0; t < n; ++t) {
        if (t >= mask_cols || !mask[t]) score[t] = -INFINITY;
      }
    }
    return OkStatus();
  }
  Status StableTopK(const float* v, int64_t n, int64_t k, int32_t* out) override {
    if (n < 0 || k < 0) return Bad("StableTopK", "negative size");
    const std::vector<int32_t> idx = cpu::StableTopK(v, n, k);
    std::copy(idx.begin(), idx.end(), out);
    return OkStatus();
  }
  Status CandidateMask(const float* score, int64_t n, int64_t bs, int64_t visible,
                       int64_t keep_blocks, uint8_t* mask) override {
    if (bs <= 0 || n < 0) return Bad("CandidateMask", "block size must be > 0");
    CandidateMaskRow(score, n, bs, visible, keep_blocks, mask);
    return OkStatus();
  }
  static void CandidateMaskRow(const float* score, int64_t n, int64_t bs, int64_t visible,
                               int64_t keep_blocks, uint8_t* mask) {
    const int64_t nb = (n + bs - 1) / bs;
    std::vector<float> bscore(nb, -INFINITY);
    for (int64_t t = 0; t < n; ++t) bscore[t / bs] = std::max(bscore[t / bs], score[t]);
    if (visible > 0 && (visible - 1) / bs < nb) bscore[(visible - 1) / bs] = INFINITY;
    const std::vector<int32_t> keep =
        cpu::StableTopK(bscore.data(), nb, std::min<int64_t>(keep_blocks, nb));
    std::fill(mask, mask + n, 0);
    for (int32_t b : keep) {
      if (bscore[b] == -INFINITY) continue;
      for (int64_t t = b * bs; t < std::min(n, (b + 1) * bs); ++t) mask[t] = 1;
    }
  }
  Status SelectTopK(const float* score, int64_t n, int64_t k, int64_t visible, int64_t offset,
                    int32_t* out) override {
    if (k < 0 || k > n) return Bad("SelectTopK", absl::StrCat("k ", k, " not in [0, ", n, "]"));
    SelectTopKRow(score, n, k, visible, offset, out);
    return OkStatus();
  }
  static void SelectTopKRow(const float* score, int64_t n, int64_t k, int64_t visible,
                            int64_t offset, int32_t* out) {
    std::vector<int32_t> sel = cpu::StableTopK(score, n, k);
    std::sort(sel.begin(), sel.end());
    for (int64_t j = 0; j < k; ++j) {
      out[j] = sel[j] >= visible ? -1 : static_cast<int32_t>(sel[j] + offset);
    }
  }

  Status IndexerScoresRows(const float* q, const float* w, int heads, const float* keys, int64_t n,
                           int64_t dim, int64_t rows, const int64_t* valid, float* score) override {
    if (heads < 0 || n < 0 || dim < 0 || rows < 0)
      return Bad("IndexerScoresRows", "negative shape");
    for (int64_t r = 0; r < rows; ++r) {
      if (valid[r] < 0 || valid[r] > n) {
        return Bad("IndexerScoresRows",
                   absl::StrCat("row ", r, " scores ", valid[r], " keys, not in [0, ", n, "]"));
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = score + r * n;
      cpu::IndexerScores(q + r * heads * dim, w + r * heads, heads, keys, valid[r], dim, sr);
      std::fill(sr + valid[r], sr + n, -INFINITY);
    }
    return OkStatus();
  }
  Status IndexerScoresPaged(const float* q, const float* w, int heads, RowCodec codec,
                            const uint8_t* const* const* tables, const int64_t* rows_per_page,
                            const int64_t* valid, int64_t n, int64_t dim, int64_t rows,
                            float* score) override {
    if (heads < 0 || n < 0 || dim < 0 || rows < 0)
      return Bad("IndexerScoresPaged", "negative shape");
    for (int64_t r = 0; r < rows; ++r) {
      if (valid[r] < 0 || valid[r] > n) {
        return Bad("IndexerScoresPaged",
                   absl::StrCat("row ", r, " scores ", valid[r], " keys, not in [0, ", n, "]"));
      }
      if (valid[r] == 0) continue;  // reads nothing: its table may be empty (null)
      if (Status s = TableProblem("IndexerScoresPaged", tables[r]); !s.ok()) return s;
      if (Status s = PagedProblem("IndexerScoresPaged", codec, valid[r], dim, tables[r],
                                  rows_per_page[r], nullptr, 0, /*skip_negative=*/false);
          !s.ok()) {
        return s;
      }
    }
    // Keys unpacked a chunk at a time (about 2048 keys, a multiple of 8: cache-resident), each
    // scored as IndexerScores scores it (a key's score does not depend on the others).
    const int64_t chunk = std::min<int64_t>(2048, n);
    std::vector<float> keys(static_cast<size_t>(chunk * dim));
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = score + r * n;
      for (int64_t t0 = 0; t0 < valid[r]; t0 += chunk) {
        const int64_t cnt = std::min(chunk, valid[r] - t0);
        UnpackListed(codec, tables[r], rows_per_page[r], dim, nullptr, t0, cnt, keys.data());
        cpu::IndexerScores(q + r * heads * dim, w + r * heads, heads, keys.data(), cnt, dim,
                           sr + t0);
      }
      std::fill(sr + valid[r], sr + n, -INFINITY);
    }
    return OkStatus();
  }
  Status CandidateMaskRows(const float* score, int64_t rows, int64_t n, int64_t bs,
                           const int64_t* visible, const int64_t* cols, int64_t keep_blocks,
                           uint8_t* mask) override {
    if (bs <= 0 || n < 0 || rows < 0) return Bad("CandidateMaskRows", "block size must be > 0");
    for (int64_t r = 0; r < rows && cols != nullptr; ++r) {
      if (cols[r] < 0 || cols[r] > n) {
        return Bad("CandidateMaskRows",
                   absl::StrCat("row ", r, " has ", cols[r], " columns, not in [0, ", n, "]"));
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t nr = cols != nullptr ? cols[r] : n;
      CandidateMaskRow(score + r * n, nr, bs, visible[r], keep_blocks, mask + r * n);
      std::fill(mask + r * n + nr, mask + (r + 1) * n, 0);
    }
    return OkStatus();
  }
  Status SelectTopKRows(const float* score, int64_t rows, int64_t n, int64_t k,
                        const int64_t* visible, int64_t offset, const uint8_t* mask,
                        int64_t mask_cols, int32_t* out) override {
    if (rows < 0 || n < 0) return Bad("SelectTopKRows", "negative shape");
    if (k < 0 || k > n) return Bad("SelectTopKRows", absl::StrCat("k ", k, " not in [0, ", n, "]"));
    std::vector<float> row(static_cast<size_t>(n));
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(score + r * n, score + (r + 1) * n, row.begin());
      if (mask != nullptr) {
        const uint8_t* mr = mask + r * mask_cols;
        for (int64_t t = 0; t < n; ++t) {
          if (t >= mask_cols || !mr[t]) row[t] = -INFINITY;
        }
      }
      SelectTopKRow(row.data(), n, k, visible[r], offset, out + r * k);
    }
    return OkStatus();
  }

  // ---- mHC ----
  Status HcMixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                 const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                 float norm_eps, float* pre, float* post, float* comb) override {
    return Mixes(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, pre, post,
                 comb, /*torch_vector_exp=*/true);
  }
  Status HcMixesSingleToken(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                            const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                            float norm_eps, float* pre, float* post, float* comb) override {
    return Mixes(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, pre, post,
                 comb, /*torch_vector_exp=*/false);
  }
  // HcMixes and HcMixesSingleToken: the sigmoids with torch's vectorized exp or glibc's.
  Status Mixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
               const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
               float norm_eps, float* pre, float* post, float* comb, bool torch_vector_exp) {
    if (rows < 0 || hc <= 0 || dim <= 0) return Bad("HcMixes", "shape");
    for (int64_t r = 0; r < rows; ++r) {
      cpu::HcMixes(h + r * hc * dim, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps,
                   pre + r * hc, post + r * hc, comb + r * hc * hc, torch_vector_exp);
    }
    return OkStatus();
  }
  Status HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
               float* y) override {
    if (rows < 0 || hc <= 0 || dim <= 0) return Bad("HcPre", "shape");
    for (int64_t r = 0; r < rows; ++r)
      cpu::HcPre(h + r * hc * dim, hc, dim, pre + r * hc, y + r * dim);
    return OkStatus();
  }
  Status HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                const float* post, const float* comb, float* out) override {
    if (rows < 0 || hc <= 0 || dim <= 0) return Bad("HcPost", "shape");
    for (int64_t r = 0; r < rows; ++r) {
      cpu::HcPost(y + r * dim, res + r * hc * dim, hc, dim, post + r * hc, comb + r * hc * hc,
                  out + r * hc * dim);
    }
    return OkStatus();
  }
  Status HcMean(int64_t rows, const float* h, int hc, int64_t dim, float* y,
                int64_t y_stride) override {
    if (rows < 0 || hc <= 0 || dim < 0) return Bad("HcMean", "shape");
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t d = 0; d < dim; ++d) {
        float sum = 0.f;
        for (int64_t j = 0; j < hc; ++j) sum += h[(i * hc + j) * dim + d];
        y[i * y_stride + d] = format::RoundBf16(sum / static_cast<float>(hc));
      }
    }
    return OkStatus();
  }

  // ---- MoE ----
  Status MoeRoute(const float* z, int64_t rows, int n_experts, const float* bias, int top_k,
                  float route_scale, int32_t* experts, float* weights, int32_t* ranked) override {
    const int64_t E = n_experts, K = top_k;
    if (K < 1 || K > E) return Bad("MoeRoute", absl::StrCat("top_k ", K, " of ", E, " experts"));
    std::vector<float> s(E), biased(E);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t e = 0; e < E; ++e) {
        const float v = z[r * E + e];
        const float sp = v > 20.f ? v : std::log1p(std::exp(v));
        s[e] = std::sqrt(sp);
        biased[e] = s[e] + bias[e];
      }
      std::vector<int32_t> sel = cpu::StableTopK(biased.data(), E, K);
      std::vector<float> wts(sel.size());
      float sum = 0.f;
      for (size_t j = 0; j < sel.size(); ++j) {
        wts[j] = s[sel[j]];
        sum += wts[j];
      }
      for (size_t j = 0; j < sel.size(); ++j) {
        if (sel.size() > 1) wts[j] = wts[j] / (sum + 1e-20f);
        wts[j] *= route_scale;
      }
      if (ranked != nullptr) std::copy(sel.begin(), sel.end(), ranked + r * K);
      std::vector<size_t> order(sel.size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sel[a] < sel[b]; });
      for (int64_t j = 0; j < K; ++j) {
        experts[r * K + j] = sel[order[j]];
        weights[r * K + j] = wts[order[j]];
      }
    }
    return OkStatus();
  }
  Status MoeGroup(const int32_t* experts, const float* weights, int64_t rows, int n_experts,
                  int top_k, int n_shared, int64_t* starts, int64_t* src_rows, int64_t* slot_rows,
                  float* entry_weights) override {
    const int64_t E = n_experts, K = top_k, NS = n_shared, slots = K + NS;
    if (rows < 0 || K < 1 || K > E || NS < 0)
      return Bad("MoeGroup", absl::StrCat("top_k ", K, " of ", E, " experts, ", NS, " shared"));
    // The routing must be MoeRoute's: K distinct ids in [0, E), ascending, per row.
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = experts[r * K + j];
        if (e < 0 || e >= E || (j > 0 && e <= experts[r * K + j - 1])) {
          return Bad("MoeGroup", absl::StrCat("row ", r, " does not route to ", K,
                                              " distinct experts in ascending order"));
        }
      }
    }
    // Counting sort by expert; within a list the rows stay ascending.
    std::vector<int64_t> next(E + NS + 1, 0);
    for (int64_t i = 0; i < rows * K; ++i) ++next[experts[i] + 1];
    for (int64_t s = 0; s < NS; ++s) next[E + s + 1] = rows;
    for (int64_t l = 0; l < E + NS; ++l) next[l + 1] += next[l];
    std::copy(next.begin(), next.end(), starts);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < K; ++j) {
        const int64_t at = next[experts[r * K + j]]++;
        src_rows[at] = r;
        slot_rows[at] = r * slots + j;
        entry_weights[at] = weights[r * K + j];
      }
      for (int64_t s = 0; s < NS; ++s) {
        const int64_t at = next[E + s]++;
        src_rows[at] = r;
        slot_rows[at] = r * slots + K + s;
      }
    }
    return OkStatus();
  }
  Status GroupedLinearQuant(const float* x, int64_t rows, const int64_t* starts,
                            const QuantWeight* const* ws, int n_groups, float* y) override {
    if (rows < 0 || n_groups < 0) return Bad("GroupedLinearQuant", "negative shape");
    if (std::string why = WeightGroupProblem(ws, n_groups); !why.empty())
      return Bad("GroupedLinearQuant", why);
    if (std::string why = StartsProblem(starts, n_groups, rows); !why.empty())
      return Bad("GroupedLinearQuant", why);
    for (int g = 0; g < n_groups; ++g) {
      const QuantWeight& w = *ws[g];
      const int64_t at = starts[g], n = starts[g + 1] - at;
      if (n > 0) cpu::LinearQuant(x + at * w.in, n, w, y + at * w.out);
    }
    return OkStatus();
  }
  Status SwiGlu(const float* g, const float* u, int64_t rows, int64_t inter, float lim,
                const float* row_weights, float* h) override {
    // torch's F.silu: x / (1 + exp(-x)) with Sleef's exp (its vectorized path, which covers a
    // [rows, inter] tensor whenever inter % 16 == 0, as in every released and test model; the
    // rows are kept independent of each other for batch invariance).
    std::vector<float> e(inter);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < inter; ++j) e[j] = -std::min(g[i * inter + j], lim);
      cpu::TorchExpN(e.data(), e.data(), inter);
      for (int64_t j = 0; j < inter; ++j) {
        const float uu = std::clamp(u[i * inter + j], -lim, lim);
        const float gg = std::min(g[i * inter + j], lim);
        const float silu = gg / (1.f + e[j]);
        h[i * inter + j] = format::RoundBf16(row_weights ? silu * uu * row_weights[i] : silu * uu);
      }
    }
    return OkStatus();
  }
  Status CopyRows(const float* src, const int64_t* src_rows, float* dst, const int64_t* dst_rows,
                  int64_t n, int64_t dim) override {
    if (n < 0 || dim < 0) return Bad("CopyRows", "negative shape");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t from = src_rows != nullptr ? src_rows[i] : i;
      const int64_t to = dst_rows != nullptr ? dst_rows[i] : i;
      if (from < 0 || to < 0) return Bad("CopyRows", absl::StrCat("negative row at ", i));
      std::memcpy(dst + to * dim, src + from * dim, static_cast<size_t>(dim) * sizeof(float));
    }
    return OkStatus();
  }
  Status SumSlots(const float* ys, int64_t rows, int64_t slots, int64_t dim, float* out) override {
    std::vector<float> acc(dim);
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < slots; ++j) {
        const float* y = ys + (r * slots + j) * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] += y[d];
      }
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = format::RoundBf16(acc[d]);
    }
    return OkStatus();
  }

  // ---- Engram ----
  Status Fp8RowLookup(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                      const int64_t* ids, int64_t n, float* out) override {
    if (dim % 32 != 0) return Bad("Fp8RowLookup", "dim must be a multiple of 32");
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* w = table + ids[r] * dim;
      const uint8_t* s = table_scale + ids[r] * (dim / 32);
      float* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i)
        o[i] = format::RoundBf16(format::DecodeE4M3(w[i]) * format::DecodeE8M0(s[i / 32]));
    }
    return OkStatus();
  }
  Status EngramGate(float* h, const float* e, int64_t rows, int hc, int64_t D,
                    const float* q_weight, const float* k_weight, float norm_eps) override {
    return Engram(h, e, rows, hc, D, q_weight, k_weight, norm_eps, /*torch_vector_exp=*/true);
  }
  Status EngramGateSingleToken(float* h, const float* e, int64_t rows, int hc, int64_t D,
                               const float* q_weight, const float* k_weight,
                               float norm_eps) override {
    return Engram(h, e, rows, hc, D, q_weight, k_weight, norm_eps, /*torch_vector_exp=*/false);
  }
  // The reference's torch expression, bit for bit: dot = (h * (qw * kw) * key).sum(-1) *
  // (rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps)) * fp32(dim^-0.5) (torch's sum order; the
  // two rsqrts multiplied first),
  // gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), h = bf16(h + gate * value).
  static Status Engram(float* h, const float* e, int64_t rows, int hc_, int64_t D,
                       const float* q_weight, const float* k_weight, float norm_eps,
                       bool torch_vector_exp) {
    const int64_t hc = hc_;
    const float inv_sqrt_d = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
    std::vector<float> prod(D);
    for (int64_t r = 0; r < rows; ++r) {
      const float* er = e + r * (hc + 1) * D;
      const float* value = er + hc * D;
      for (int64_t j = 0; j < hc; ++j) {
        float* hj = h + (r * hc + j) * D;
        const float* key = er + j * D;
        const float* qw = q_weight + j * D;
        const float* kw = k_weight + j * D;
        for (int64_t d = 0; d < D; ++d) prod[d] = hj[d] * (qw[d] * kw[d]) * key[d];
        const float rh = 1.f / std::sqrt(cpu::TorchMeanSquare(hj, D) + norm_eps);
        const float rk = 1.f / std::sqrt(cpu::TorchMeanSquare(key, D) + norm_eps);
        // rstd = rh * rk is formed first (the reference's expression), then S * rstd.
        const float dot = cpu::TorchSum(prod.data(), D) * (rh * rk) * inv_sqrt_d;
        const float sg = dot > 0.f ? 1.f : (dot < 0.f ? -1.f : 0.f);
        const float x = sg * std::sqrt(std::max(std::fabs(dot), 1e-6f));
        // torch.sigmoid: Sleef's exp on its vectorized path (prompts), glibc's on its scalar
        // path (a single-token call's 4 gates).
        const float gate = 1.f / (1.f + (torch_vector_exp ? cpu::TorchExp(-x) : std::exp(-x)));
        for (int64_t d = 0; d < D; ++d) hj[d] = format::RoundBf16(hj[d] + gate * value[d]);
      }
    }
    return OkStatus();
  }
  Status Embed(PlainWeight table, int64_t dim, const int32_t* ids, int64_t rows, int hc,
               float* h) override {
    if (std::string why = PlainWeightProblem(table); !why.empty()) return Bad("Embed", why);
    for (int64_t i = 0; i < rows && hc > 0; ++i) {
      const int64_t at = static_cast<int64_t>(ids[i]) * dim;
      float* first = h + i * hc * dim;
      if (table.dtype == PlainDtype::kBf16) {
        format::Bf16BitsToF32N(static_cast<const uint16_t*>(table.data) + at, dim, first);
      } else {
        std::copy_n(static_cast<const float*>(table.data) + at, dim, first);
      }
      for (int64_t j = 1; j < hc; ++j) std::copy_n(first, dim, first + j * dim);
    }
    return OkStatus();
  }

  Status QuantDequant(Qdq kind, float* x, int64_t rows, int64_t dim) override {
    for (int64_t r = 0; r < rows; ++r) {
      switch (kind) {
        case Qdq::kFp8Window:
          format::Fp8QuantDequantRow(x + r * dim, dim);
          break;
        case Qdq::kFp4Index:
          format::Fp4IndexQuantDequantRow(x + r * dim, dim);
          break;
        case Qdq::kFp4Kv:
          format::Fp4KvQuantDequantRow(x + r * dim, dim);
          break;
      }
    }
    return OkStatus();
  }

  // ---- Paged packed rows ----
  Status PackRows(RowCodec codec, const float* x, int64_t n, int64_t dim, uint8_t* const* pages,
                  int64_t rows_per_page, const int32_t* rows, int64_t first) override {
    if (Status s = PagedProblem("PackRows", codec, n, dim, pages, rows_per_page, rows, first,
                                /*skip_negative=*/false);
        !s.ok()) {
      return s;
    }
    const int64_t rb = RowCodecBytes(codec, dim);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (rows != nullptr ? rows[i] : i) + first;
      format::PackRow(codec, x + i * dim, dim, row_codec::PagedRow(pages, rows_per_page, r, rb));
    }
    return OkStatus();
  }
  Status UnpackRows(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    if (Status s = PagedProblem("UnpackRows", codec, n, dim, pages, rows_per_page, rows, first,
                                /*skip_negative=*/true);
        !s.ok()) {
      return s;
    }
    UnpackListed(codec, pages, rows_per_page, dim, rows, first, n, out);
    return OkStatus();
  }

  Status GatherRows(RowCodec codec, const uint8_t* const* const* tables,
                    const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    if (per_table <= 0 || n < 0) return Bad("GatherRows", "non-positive rows per table");
    for (int64_t g = 0; g * per_table < n; ++g) {
      const int64_t m = std::min(per_table, n - g * per_table);
      if (std::all_of(rows + g * per_table, rows + g * per_table + m,
                      [&](int32_t r) { return r + first < 0; }))
        continue;  // reads nothing: its table may be empty (null)
      if (Status s = TableProblem("GatherRows", tables[g]); !s.ok()) return s;
      if (Status s = PagedProblem("GatherRows", codec, m, dim, tables[g], rows_per_page[g],
                                  rows + g * per_table, first, /*skip_negative=*/true);
          !s.ok()) {
        return s;
      }
    }
    for (int64_t g = 0; g * per_table < n; ++g) {
      const int64_t i = g * per_table;
      UnpackListed(codec, tables[g], rows_per_page[g], dim, rows + i, first,
                   std::min(per_table, n - i), out + i * dim);
    }
    return OkStatus();
  }

  Status TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base, bool per_slot,
                   int32_t* list, int64_t list_len, int64_t offset) override {
    if (rows < 0 || k < 0 || offset < 0 || offset + k > list_len)
      return Bad("TopKSlots", absl::StrCat(k, " slots at ", offset, " in lists of ", list_len));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t t = topk[r * k + j];
        list[r * list_len + offset + j] =
            t < 0 ? -1 : static_cast<int32_t>(base + (per_slot ? r * k + j : t));
      }
    }
    return OkStatus();
  }

  Status DigestBlocks(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                      uint64_t* out) override {
    if (n < 0) return Bad("DigestBlocks", "negative block count");
    if (n == 0) return OkStatus();
    if (Status s = BlockLengthsProblem("DigestBlocks", bytes, n); !s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) out[i] = XXH3_64bits(blocks[i], static_cast<size_t>(bytes[i]));
    return OkStatus();
  }

  Status BlocksEqual(const uint8_t* const* a, const uint8_t* const* b, const int64_t* bytes,
                     int64_t n, int32_t* equal) override {
    if (n < 0) return Bad("BlocksEqual", "negative block count");
    if (n == 0) return OkStatus();
    if (Status s = BlockLengthsProblem("BlocksEqual", bytes, n); !s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) {
      equal[i] = std::memcmp(a[i], b[i], static_cast<size_t>(bytes[i])) == 0 ? 1 : 0;
    }
    return OkStatus();
  }

  Status CopyBlocks(uint8_t* const* dst, const uint8_t* const* src, const int64_t* bytes,
                    int64_t n) override {
    if (n < 0) return Bad("CopyBlocks", "negative block count");
    if (n == 0) return OkStatus();
    if (Status s = BlockLengthsProblem("CopyBlocks", bytes, n); !s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) {
      if (bytes[i] > 0) std::memcpy(dst[i], src[i], static_cast<size_t>(bytes[i]));
    }
    return OkStatus();
  }

  Status Argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    if (n <= 0) return Bad("Argmax", "empty rows");
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * n;
      out[r] = static_cast<int32_t>(std::max_element(xr, xr + n) - xr);
    }
    return OkStatus();
  }

  Status SampleLogits(const float* x, int64_t rows, int64_t n, const SampleParams& p,
                      const double* u, int32_t* out, float* probs_out) override {
    if (rows < 0) return Bad("SampleLogits", "negative rows");
    if (n <= 0) return Bad("SampleLogits", "empty rows");
    if (const char* why = sampling::ParamsProblem(p); why != nullptr)
      return Bad("SampleLogits", why);
    if (rows == 0) return OkStatus();
    for (int64_t r = 0; r < rows; ++r) {
      if (!(u[r] >= 0.0 && u[r] < 1.0))
        return Bad("SampleLogits", absl::StrCat("uniform ", r, " (", u[r], ") is outside [0, 1)"));
    }
    std::vector<float> row(probs_out != nullptr ? 0 : static_cast<size_t>(n));
    std::vector<int32_t> order;
    for (int64_t r = 0; r < rows; ++r) {
      float* probs = probs_out != nullptr ? probs_out + r * n : row.data();
      sampling::FilteredProbs(x + r * n, n, p, probs, order);
      out[r] = sampling::DrawIndex(probs, n, u[r]);
    }
    return OkStatus();
  }

  Status VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k, int64_t n,
                      const double* u, int32_t* out, int32_t* chosen) override {
    if (k < 0) return Bad("VerifyDrafts", "negative draft count");
    if (n <= 0) return Bad("VerifyDrafts", "empty rows");
    for (int64_t i = 0; i <= k; ++i) {
      if (!(u[i] >= 0.0 && u[i] < 1.0))
        return Bad("VerifyDrafts", absl::StrCat("uniform ", i, " (", u[i], ") is outside [0, 1)"));
      if (i < k && (drafts[i] < 0 || drafts[i] >= n))
        return Bad("VerifyDrafts",
                   absl::StrCat("draft ", i, " (", drafts[i], ") is outside [0, ", n, ")"));
    }
    std::vector<float> residual;
    const sampling::DraftVerdict v = sampling::VerifyDrafts(p, q, drafts, k, n, u, residual);
    out[0] = v.accepted;
    out[1] = v.token;
    if (chosen != nullptr) {
      for (int64_t r = 0; r <= k; ++r) chosen[r] = r != v.accepted && r < k ? drafts[r] : v.token;
    }
    return OkStatus();
  }

  Status TopLogprobs(const float* x, int64_t rows, int64_t n, const int32_t* chosen, int64_t top,
                     float* chosen_lp, int32_t* top_ids, float* top_lp) override {
    if (rows < 0) return Bad("TopLogprobs", "negative rows");
    if (n <= 0) return Bad("TopLogprobs", "empty rows");
    if (top < 0 || top > n)
      return Bad("TopLogprobs", absl::StrCat("top ", top, " is outside [0, ", n, "]"));
    if (rows == 0) return OkStatus();
    for (int64_t r = 0; r < rows; ++r) {
      if (chosen[r] < 0 || chosen[r] >= n)
        return Bad("TopLogprobs", absl::StrCat("chosen token ", chosen[r], " of row ", r,
                                               " is outside [0, ", n, ")"));
    }
    std::vector<int32_t> order;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * n;
      const double lse = sampling::LogSumExp(xr, n);
      chosen_lp[r] = sampling::Logprob(xr[chosen[r]], lse);
      if (top == 0) continue;
      sampling::TopIndices(xr, n, top, top_ids + r * top, order);
      for (int64_t j = 0; j < top; ++j)
        top_lp[r * top + j] = sampling::Logprob(xr[top_ids[r * top + j]], lse);
    }
    return OkStatus();
  }

  Status PenalizeLogits(float* x, int64_t total, const int64_t* at, const int32_t* counts,
                        int64_t entries, float repetition, float frequency,
                        float presence) override {
    if (entries < 0 || total < 0) return Bad("PenalizeLogits", "negative sizes");
    if (!(repetition > 0.f)) return Bad("PenalizeLogits", "the repetition penalty must be > 0");
    if (entries == 0) return OkStatus();
    for (int64_t i = 0; i < entries; ++i) {
      if (at[i] < 0 || at[i] >= total)
        return Bad("PenalizeLogits",
                   absl::StrCat("entry ", i, " at ", at[i], " is outside the ", total, " logits"));
    }
    for (int64_t i = 0; i < entries; ++i)
      x[at[i]] = Penalized(x[at[i]], counts[i], repetition, frequency, presence);
    return OkStatus();
  }

 private:
  // PackRows / UnpackRows argument checks.
  static Status PagedProblem(const char* op, RowCodec codec, int64_t n, int64_t dim,
                             const uint8_t* const* pages, int64_t rows_per_page,
                             const int32_t* rows, int64_t first, bool skip_negative) {
    if (std::string why = RowCodecProblem(codec, dim); !why.empty()) return Bad(op, why);
    if (n < 0 || rows_per_page <= 0) return Bad(op, "negative rows or non-positive page size");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (rows != nullptr ? rows[i] : i) + first;
      if (r < 0 && skip_negative) continue;
      if (r < 0) return Bad(op, absl::StrCat("negative row ", r, " at ", i));
      const uint8_t* page = pages[r / rows_per_page];
      if (page == nullptr) return Bad(op, absl::StrCat("row ", r, " is on a null page"));
    }
    return OkStatus();
  }
  // UnpackRows' work once its arguments are checked: out[i, :] = row (rows ? rows[i] : i) + first
  // of the paged stream, a negative row skipped (a top-k's -1: out row i stays as it is).
  static void UnpackListed(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page,
                           int64_t dim, const int32_t* rows, int64_t first, int64_t n, float* out) {
    const int64_t rb = RowCodecBytes(codec, dim);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (rows != nullptr ? rows[i] : i) + first;
      if (r < 0) continue;
      format::UnpackRow(codec, row_codec::PagedRow(pages, rows_per_page, r, rb), dim,
                        out + i * dim);
    }
  }
  // A page table of a multi-stream op.
  static Status TableProblem(const char* op, const uint8_t* const* table) {
    if (table == nullptr) return Bad(op, "a null page table");
    return OkStatus();
  }
};

}  // namespace
}  // namespace epd::kernels::cpu

namespace epd::kernels {
std::unique_ptr<Backend> MakeCpuBackend() { return std::make_unique<cpu::CpuBackend>(); }
}  // namespace epd::kernels
