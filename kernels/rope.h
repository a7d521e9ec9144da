#pragma once

// RoPE frequency tables (MODEL.md §3 step 4): host-side constants computed once per model. The
// per-position cos/sin tables are a Backend op (Backend::RopeTables).

#include <cstdint>
#include <vector>

namespace epd::kernels {

// freq_i = fp32(1/theta^(2i/rope_dim)), optionally with YaRN (factor, original length,
// beta_fast/slow). Returns rope_dim/2 frequencies.
std::vector<float> RopeFrequencies(int rope_dim, double theta, bool yarn, double factor,
                                   double original_seq_len, double beta_fast, double beta_slow);
// cos/sin [n_pairs] at an integer position: angle = fp32(pos * freq_i).
void RopeCosSin(const std::vector<float>& freqs, int64_t pos, float* cos, float* sin);
void RopeCosSin(const float* freqs, int n_pairs, int64_t pos, float* cos, float* sin);

}  // namespace epd::kernels
