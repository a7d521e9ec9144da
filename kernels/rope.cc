#include "kernels/rope.h"

#include <algorithm>
#include <cmath>

namespace epd::kernels {

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

void RopeCosSin(const float* freqs, int n_pairs, int64_t pos, float* cos, float* sin) {
  for (int i = 0; i < n_pairs; ++i) {
    const float ang = static_cast<float>(pos) * freqs[i];
    cos[i] = std::cos(ang);
    sin[i] = std::sin(ang);
  }
}

void RopeCosSin(const std::vector<float>& freqs, int64_t pos, float* cos, float* sin) {
  RopeCosSin(freqs.data(), static_cast<int>(freqs.size()), pos, cos, sin);
}

}  // namespace epd::kernels
