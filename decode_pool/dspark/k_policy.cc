#include "decode_pool/dspark/k_policy.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <set>

namespace epd::decode_pool {

double StepTimeModel::Seconds(int batch, int k) const {
  return base_s + per_token_s * batch * (k + 1) + (k > 0 ? draft_s * batch : 0.0);
}

absl::StatusOr<StepTimeModel> StepTimeModel::Fit(std::span<const StepTimeSample> samples) {
  std::set<std::pair<int, int>> distinct;
  bool k0 = false, kpos = false;
  for (const StepTimeSample& s : samples) {
    distinct.insert({s.batch, s.k});
    (s.k == 0 ? k0 : kpos) = true;
  }
  if (distinct.size() < 3 || !k0 || !kpos)
    return absl::InvalidArgumentError(
        "k policy: step-time fit needs >= 3 distinct (batch, k) "
        "points including k = 0 and k > 0");
  // Normal equations A^T A x = A^T y over features [1, b(k+1), b[k>0]].
  std::array<std::array<double, 4>, 3> m{};
  for (const StepTimeSample& s : samples) {
    const double f[3] = {1.0, double(s.batch) * (s.k + 1), s.k > 0 ? double(s.batch) : 0.0};
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) m[i][j] += f[i] * f[j];
      m[i][3] += f[i] * s.seconds;
    }
  }
  for (int c = 0; c < 3; ++c) {  // Gauss-Jordan with partial pivoting
    int p = c;
    for (int r = c + 1; r < 3; ++r) {
      if (std::fabs(m[r][c]) > std::fabs(m[p][c])) p = r;
    }
    std::swap(m[c], m[p]);
    if (std::fabs(m[c][c]) < 1e-18) return absl::InvalidArgumentError("k policy: singular fit");
    for (int r = 0; r < 3; ++r) {
      if (r == c) continue;
      const double f = m[r][c] / m[c][c];
      for (int j = c; j < 4; ++j) m[r][j] -= f * m[c][j];
    }
  }
  StepTimeModel t;
  t.base_s = std::max(0.0, m[0][3] / m[0][0]);
  t.per_token_s = std::max(0.0, m[1][3] / m[1][1]);
  t.draft_s = std::max(0.0, m[2][3] / m[2][2]);
  return t;
}

double AcceptanceEstimate(float raw) { return 1.0 / (1.0 + std::exp(-static_cast<double>(raw))); }

double ExpectedEmitted(std::span<const float> raw, int k) {
  double e = 1.0, run = 1.0;
  for (int j = 0; j < k && j < static_cast<int>(raw.size()); ++j) {
    run *= AcceptanceEstimate(raw[j]);
    e += run;
  }
  return e;
}

KPolicy::KPolicy(StepTimeModel time, KPolicyOptions options) : time_(time), options_(options) {}

int KPolicy::Choose(std::span<const float> raw, int batch) const {
  const std::vector<float> one(raw.begin(), raw.end());
  std::vector<std::vector<float>> all(std::max(1, batch), one);
  return ChooseForBatch(all);
}

int KPolicy::ChooseForBatch(std::span<const std::vector<float>> raw) const {
  const int b = std::max<int>(1, static_cast<int>(raw.size()));
  int max_k = options_.max_k;
  for (const auto& r : raw) max_k = std::min<int>(max_k, static_cast<int>(r.size()));
  int best = 0;
  double best_rate = -1;
  for (int k = 0; k <= std::max(0, max_k); ++k) {
    double tokens = 0;
    for (const auto& r : raw) tokens += ExpectedEmitted(r, k);
    if (raw.empty()) tokens = 1;
    const double rate = tokens / std::max(1e-12, time_.Seconds(b, k));
    if (rate > best_rate * (1 + 1e-12)) {  // ties -> smaller k
      best_rate = rate;
      best = k;
    }
  }
  return best;
}

bool KPolicy::WorthDrafting(int batch) const {
  const int b = std::max(1, batch);
  const double rate0 = b / time_.Seconds(b, 0);
  for (int k = 1; k <= options_.max_k; ++k) {
    if (b * (k + 1.0) / time_.Seconds(b, k) > rate0) return true;
  }
  return false;
}

}  // namespace epd::decode_pool
