#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/cpu/numerics.h"

namespace epd::kernels::cpu {
namespace {

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

}  // namespace

void LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) {
  const int64_t k = w.in;
  const int64_t nb = (k + 31) / 32;
  const int64_t scols = w.scale_cols();
  std::vector<float> q(k), s(nb);
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeFp8Row(x + r * k, k, q.data(), s.data());
    float* yr = y + r * w.out;
    for (int64_t o = 0; o < w.out; ++o) {
      const float* wr = w.values.data() + o * k;
      const float* ws = w.scales.data() + (o / w.block_rows) * scols;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t b0 = b * 32;
        const int64_t n = std::min<int64_t>(32, k - b0);
        // Products of E4M3/E2M1 values are exact, and so are these block sums for the
        // magnitudes involved; the lanes only make the loop vectorisable.
        float d = Dot8(q.data() + b0, wr + b0, n);
        acc += d * s[b] * ws[b0 / w.block_cols];
      }
      yr[o] = RoundBf16(acc);
    }
  }
}

void LinearBf16(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) y[r * out + o] = RoundBf16(Dot8(x + r * in, w + o * in, in));
  }
}

void LinearF32(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y) {
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

void SparseAttention(const SparseAttentionArgs& a) {
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
          const float dot = Dot8(q, a.kv + static_cast<int64_t>(t) * hd, hd);
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
          const float* k = a.kv + static_cast<int64_t>(t) * hd;
          for (int d = 0; d < hd; ++d) num[d] += pb * k[d];
        }
        m = m_new;
      }
      den += std::exp(a.sink[h] - m);
      for (int d = 0; d < hd; ++d) out[d] = RoundBf16(num[d] / den);
    }
  }
}

std::vector<float> RopeFrequencies(int rope_dim, double theta, bool yarn, double factor,
                                   double original_seq_len, double beta_fast, double beta_slow) {
  const int n = rope_dim / 2;
  std::vector<float> f(n);
  for (int i = 0; i < n; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(rope_dim);
    f[i] = 1.f / std::pow(static_cast<float>(theta), e);
  }
  if (yarn) {
    auto corr = [&](double rot) {
      return rope_dim * std::log(original_seq_len / (rot * 2 * M_PI)) / (2 * std::log(theta));
    };
    double low = std::max(std::floor(corr(beta_fast)), 0.0);
    double high = std::min(std::ceil(corr(beta_slow)), static_cast<double>(rope_dim - 1));
    if (low == high) high += 0.001;
    for (int i = 0; i < n; ++i) {
      float ramp =
          (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low);
      ramp = std::clamp(ramp, 0.f, 1.f);
      const float smooth = 1.f - ramp;
      f[i] = f[i] / static_cast<float>(factor) * (1.f - smooth) + f[i] * smooth;
    }
  }
  return f;
}

void RopeCosSin(const std::vector<float>& freqs, int64_t pos, float* cos, float* sin) {
  for (size_t i = 0; i < freqs.size(); ++i) {
    const float ang = static_cast<float>(pos) * freqs[i];
    cos[i] = std::cos(ang);
    sin[i] = std::sin(ang);
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
  for (int j = 0; j < nm; ++j) m[j] = Dot8(h, fn + j * n, n) * rs;
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

void HcPre(const float* h, int hc, int64_t dim, const float* pre, float* y) {
  for (int64_t d = 0; d < dim; ++d) {
    float s = 0.f;
    for (int j = 0; j < hc; ++j) s += pre[j] * h[j * dim + d];
    y[d] = RoundBf16(s);
  }
}

void HcPost(const float* y, const float* res, int hc, int64_t dim, const float* post,
            const float* comb, float* out) {
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

namespace {

class CpuBackend final : public Backend {
 public:
  std::string_view Name() const override { return "cpu"; }
  void LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) override {
    cpu::LinearQuant(x, rows, w, y);
  }
  void LinearBf16(const float* x, int64_t rows, const float* w, int64_t out, int64_t in,
                  float* y) override {
    cpu::LinearBf16(x, rows, w, out, in, y);
  }
  void LinearF32(const float* x, int64_t rows, const float* w, int64_t out, int64_t in,
                 float* y) override {
    cpu::LinearF32(x, rows, w, out, in, y);
  }
  void RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
               float* y) override {
    cpu::RmsNormBf16(x, w, rows, dim, eps, y);
  }
  void Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
            const float* cos, const float* sin, bool inverse) override {
    cpu::Rope(x, rows, heads, stride, offset, n_pairs, cos, sin, inverse);
  }
  void SparseAttention(const SparseAttentionArgs& args) override { cpu::SparseAttention(args); }
  void HcMixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
               const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
               float norm_eps, float* pre, float* post, float* comb) override {
    for (int64_t r = 0; r < rows; ++r) {
      cpu::HcMixes(h + r * hc * dim, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps,
                   pre + r * hc, post + r * hc, comb + r * hc * hc);
    }
  }
  void HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
             float* y) override {
    for (int64_t r = 0; r < rows; ++r)
      cpu::HcPre(h + r * hc * dim, hc, dim, pre + r * hc, y + r * dim);
  }
  void HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
              const float* post, const float* comb, float* out) override {
    for (int64_t r = 0; r < rows; ++r) {
      cpu::HcPost(y + r * dim, res + r * hc * dim, hc, dim, post + r * hc, comb + r * hc * hc,
                  out + r * hc * dim);
    }
  }
  void QuantDequant(Qdq kind, float* x, int64_t rows, int64_t dim) override {
    for (int64_t r = 0; r < rows; ++r) {
      switch (kind) {
        case Qdq::kFp8Window:
          Fp8QuantDequantRow(x + r * dim, dim);
          break;
        case Qdq::kFp4Index:
          Fp4IndexQuantDequantRow(x + r * dim, dim);
          break;
        case Qdq::kFp4Kv:
          Fp4KvQuantDequantRow(x + r * dim, dim);
          break;
      }
    }
  }
};

}  // namespace
}  // namespace epd::kernels::cpu

namespace epd::kernels {
std::unique_ptr<Backend> MakeCpuBackend() { return std::make_unique<cpu::CpuBackend>(); }
}  // namespace epd::kernels
