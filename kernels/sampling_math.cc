#include "kernels/sampling_math.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace epd::kernels::sampling {

void FilteredProbs(const float* l, int64_t n, const SampleParams& p, float* probs,
                   std::vector<int32_t>& order) {
  if (n <= 0) return;
  // 1. Softmax of l / T.
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (l[i] > mx) mx = l[i];
  }
  const float inv_t = 1.f / p.temperature;
  for (int64_t i = 0; i < n; ++i) probs[i] = Weight(l[i], mx, inv_t);
  const double sum = BlockedSum(n, [&](int64_t i) { return static_cast<double>(probs[i]); });
  for (int64_t i = 0; i < n; ++i) probs[i] = static_cast<float>(probs[i] / sum);
  // 2. Top-k, then top-p over the top-k's mass (vLLM's order).
  const bool use_k = p.top_k > 0 && p.top_k < n;
  const bool use_p = p.top_p < 1.f;
  if (use_k || use_p) {
    const int64_t k = use_k ? p.top_k : n;
    order.resize(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    auto before = [&](int32_t a, int32_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    };
    if (use_p) {
      std::sort(order.begin(), order.end(), before);
    } else {
      std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
    }
    int64_t keep = k;
    if (use_p) {
      auto sorted = [&](int64_t j) { return static_cast<double>(probs[order[j]]); };
      const double kept = BlockedSum(k, sorted);
      const double top_p = p.top_p;
      const int64_t last =
          FirstPrefixHit(k, sorted, [&](int64_t, double acc) { return acc / kept >= top_p; });
      if (last >= 0) keep = last + 1;
    }
    for (int64_t j = keep; j < n; ++j) probs[order[j]] = 0.f;
  }
  // 3. Min-p.
  if (p.min_p > 0.f) {
    float pmax = 0.f;
    for (int64_t i = 0; i < n; ++i) pmax = std::max(pmax, probs[i]);
    const float cut = p.min_p * pmax;
    for (int64_t i = 0; i < n; ++i) {
      if (probs[i] < cut) probs[i] = 0.f;
    }
  }
  // 4. Renormalized.
  const double total = BlockedSum(n, [&](int64_t i) { return static_cast<double>(probs[i]); });
  for (int64_t i = 0; i < n; ++i) probs[i] = static_cast<float>(probs[i] / total);
}

int32_t DrawIndex(const float* probs, int64_t n, double u) {
  auto term = [&](int64_t i) { return probs[i] > 0.f ? static_cast<double>(probs[i]) : 0.0; };
  const double target = u * BlockedSum(n, term);
  const int64_t hit =
      FirstPrefixHit(n, term, [&](int64_t i, double acc) { return probs[i] > 0.f && target < acc; });
  if (hit >= 0) return static_cast<int32_t>(hit);
  for (int64_t i = n - 1; i >= 0; --i) {  // rounding at the top end
    if (probs[i] > 0.f) return static_cast<int32_t>(i);
  }
  return 0;
}

DraftVerdict VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k,
                          int64_t n, const double* u, std::vector<float>& residual) {
  DraftVerdict v;
  for (int64_t i = 0; i < k; ++i) {
    const float* pi = p + i * n;
    const float* qi = q + i * n;
    if (AcceptDraft(pi[drafts[i]], qi[drafts[i]], u[i])) {
      ++v.accepted;
      continue;
    }
    residual.resize(static_cast<size_t>(n));
    bool mass = false;
    for (int64_t j = 0; j < n; ++j) {
      residual[j] = std::max(0.f, pi[j] - qi[j]);
      mass |= residual[j] > 0.f;
    }
    v.token = DrawIndex(mass ? residual.data() : pi, n, u[i + 1]);
    return v;
  }
  v.token = DrawIndex(p + k * n, n, u[k]);
  return v;
}

double LogSumExp(const float* l, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (l[i] > mx) mx = l[i];
  }
  const double sum =
      BlockedSum(n, [&](int64_t i) { return static_cast<double>(Weight(l[i], mx, 1.f)); });
  return static_cast<double>(mx) + std::log(sum);
}

void TopIndices(const float* l, int64_t n, int64_t top, int32_t* ids, std::vector<int32_t>& order) {
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + top, order.end(),
                    [&](int32_t a, int32_t b) { return TopBefore(l[a], a, l[b], b); });
  std::copy_n(order.begin(), top, ids);
}

}  // namespace epd::kernels::sampling
