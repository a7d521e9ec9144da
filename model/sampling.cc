#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/penalty.h"
#include "kernels/sampling_math.h"

namespace epd::model {

absl::Status SamplingParams::Validate() const {
  auto bad = [](const char* f, auto v, const char* want) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: ", f, " = ", v, " (want ", want, ")"));
  };
  if (!(temperature >= 0.f) || !std::isfinite(temperature))
    return bad("temperature", temperature, ">= 0");
  if (!(top_p > 0.f && top_p <= 1.f)) return bad("top_p", top_p, "in (0, 1]");
  if (top_k < 0) return bad("top_k", top_k, ">= 0");
  if (!(min_p >= 0.f && min_p <= 1.f)) return bad("min_p", min_p, "in [0, 1]");
  if (!(repetition_penalty > 0.f) || !std::isfinite(repetition_penalty))
    return bad("repetition_penalty", repetition_penalty, "> 0");
  if (!(frequency_penalty >= -2.f && frequency_penalty <= 2.f))
    return bad("frequency_penalty", frequency_penalty, "in [-2, 2]");
  if (!(presence_penalty >= -2.f && presence_penalty <= 2.f))
    return bad("presence_penalty", presence_penalty, "in [-2, 2]");
  if (max_tokens < 1) return bad("max_tokens", max_tokens, ">= 1");
  if (top_logprobs < 0 || top_logprobs > 20) return bad("top_logprobs", top_logprobs, "in [0, 20]");
  for (const std::string& s : stop_strings) {
    if (s.empty()) return absl::InvalidArgumentError("sampling: empty stop string");
  }
  return absl::OkStatus();
}

uint64_t Rng::NextU64() {
  // SplitMix64 output function applied to seed + counter * golden gamma: a counter-based stream.
  uint64_t z = seed_ + (++counter_) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::NextUniform() { return static_cast<double>(NextU64() >> 11) * 0x1.0p-53; }

int32_t ArgMax(std::span<const float> v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

int32_t SampleFromProbs(std::span<const float> probs, double u) {
  return kernels::sampling::DrawIndex(probs.data(), static_cast<int64_t>(probs.size()), u);
}

Logprobs ComputeLogprobs(std::span<const float> logits, int32_t chosen, int n) {
  const auto V = static_cast<int64_t>(logits.size());
  const double lse = kernels::sampling::LogSumExp(logits.data(), V);
  auto lp = [&](int32_t t) { return kernels::sampling::Logprob(logits[t], lse); };
  Logprobs out;
  out.chosen = {chosen, lp(chosen)};
  n = std::min<int>(n, static_cast<int>(V));
  if (n > 0) {
    std::vector<int32_t> ids(static_cast<size_t>(n)), order;
    kernels::sampling::TopIndices(logits.data(), V, n, ids.data(), order);
    for (int32_t t : ids) out.top.push_back({t, lp(t)});
  }
  return out;
}

Sampler::Sampler(SamplingParams params, int64_t vocab, std::span<const int32_t> prompt)
    : params_(std::move(params)), vocab_(vocab), rng_(params_.seed) {
  if (params_.repetition_penalty != 1.f) prompt_tokens_.insert(prompt.begin(), prompt.end());
}

void Sampler::ApplyPenalties(std::span<float> logits, std::span<const int32_t> pending) const {
  if (!params_.has_penalties()) return;
  std::unordered_map<int32_t, int32_t> extra;
  for (int32_t t : pending) ++extra[t];
  auto count = [&](int32_t t) {
    int32_t c = 0;
    if (auto it = counts_.find(t); it != counts_.end()) c += it->second;
    if (auto it = extra.find(t); it != extra.end()) c += it->second;
    return c;
  };
  const int32_t V = static_cast<int32_t>(logits.size());
  auto repetition = [&](int32_t t) {
    if (t < 0 || t >= V || params_.repetition_penalty == 1.f) return;
    logits[t] = kernels::RepetitionPenalized(logits[t], params_.repetition_penalty);
  };
  auto additive = [&](int32_t t) {
    if (t < 0 || t >= V) return;
    const int32_t c = count(t);
    if (c > 0) {
      logits[t] = kernels::AdditivePenalized(logits[t], c, params_.frequency_penalty,
                                             params_.presence_penalty);
    }
  };
  // Each token of prompt u generated u pending is penalized once (no set is materialized: the
  // prompt may be long).
  for (int32_t t : prompt_tokens_) repetition(t);
  for (const auto& [t, c] : counts_) {
    if (!prompt_tokens_.contains(t)) repetition(t);
    additive(t);
  }
  for (const auto& [t, c] : extra) {
    if (counts_.contains(t)) continue;
    if (!prompt_tokens_.contains(t)) repetition(t);
    additive(t);
  }
}

void Sampler::PenaltyEntries(std::span<const int32_t> drafts, int64_t rows,
                             std::vector<int64_t>& at, std::vector<int32_t>& counts) const {
  if (!params_.has_penalties()) return;
  const bool repetition = params_.repetition_penalty != 1.f;
  for (int64_t j = 0; j < rows && j <= static_cast<int64_t>(drafts.size()); ++j) {
    std::unordered_map<int32_t, int32_t> extra;
    for (int64_t i = 0; i < j; ++i) ++extra[drafts[i]];
    auto count = [&](int32_t t) {
      int32_t c = 0;
      if (auto it = counts_.find(t); it != counts_.end()) c += it->second;
      if (auto it = extra.find(t); it != extra.end()) c += it->second;
      return c;
    };
    // The tokens ApplyPenalties touches, each once: the prompt's (repetition only), the
    // generated ones, then the pending ones.
    auto add = [&](int32_t t) {
      if (t < 0 || t >= vocab_) return;
      const int32_t c = count(t);
      if (!repetition && c == 0) return;
      at.push_back(j * vocab_ + t);
      counts.push_back(c);
    };
    for (int32_t t : prompt_tokens_) add(t);
    for (const auto& [t, c] : counts_) {
      if (!prompt_tokens_.contains(t)) add(t);
    }
    for (const auto& [t, c] : extra) {
      if (!counts_.contains(t) && !prompt_tokens_.contains(t)) add(t);
    }
  }
}

int32_t Sampler::Greedy(std::span<const float> logits, std::span<const int32_t> pending) const {
  if (!params_.has_penalties()) return ArgMax(logits);
  std::vector<float> l(logits.begin(), logits.end());
  ApplyPenalties(l, pending);
  return ArgMax(l);
}

void Sampler::Probabilities(std::span<const float> logits, std::span<const int32_t> pending,
                            std::vector<float>& probs) const {
  const int64_t V = static_cast<int64_t>(logits.size());
  probs.assign(V, 0.f);
  if (params_.greedy()) {
    probs[Greedy(logits, pending)] = 1.f;
    return;
  }
  std::vector<float> l(logits.begin(), logits.end());
  ApplyPenalties(l, pending);
  std::vector<int32_t> order;
  kernels::sampling::FilteredProbs(l.data(), V, DrawParams(), probs.data(), order);
}

kernels::SampleParams Sampler::DrawParams() const {
  return {.temperature = params_.temperature,
          .top_k = params_.top_k,
          .top_p = params_.top_p,
          .min_p = params_.min_p};
}

int32_t Sampler::Sample(std::span<const float> logits, std::span<const int32_t> pending) {
  if (params_.greedy()) return Greedy(logits, pending);
  std::vector<float> probs;
  Probabilities(logits, pending, probs);
  return SampleFromProbs(probs, rng_.NextUniform());
}

void Sampler::Accept(int32_t token) { ++counts_[token]; }

bool Sampler::IsStopToken(int32_t token) const {
  return std::find(params_.stop_token_ids.begin(), params_.stop_token_ids.end(), token) !=
         params_.stop_token_ids.end();
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
  for (const std::string& s : stops_) max_len_ = std::max(max_len_, s.size());
}

StopMatcher::Result StopMatcher::Feed(std::string_view delta) {
  Result r;
  if (stopped_) return r;
  held_.append(delta);
  // Earliest complete match in the held text (held text never contains a full earlier match).
  size_t best = std::string::npos;
  for (const std::string& s : stops_) best = std::min(best, held_.find(s));
  if (best != std::string::npos) {
    r.emit = held_.substr(0, best);
    r.stopped = stopped_ = true;
    held_.clear();
    return r;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  const size_t lim = std::min(held_.size(), max_len_ == 0 ? 0 : max_len_ - 1);
  for (size_t n = lim; n > 0 && hold == 0; --n) {
    std::string_view tail(held_.data() + held_.size() - n, n);
    for (const std::string& s : stops_) {
      if (s.size() > n && std::string_view(s).substr(0, n) == tail) {
        hold = n;
        break;
      }
    }
  }
  r.emit = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  r.held_bytes = held_.size();
  return r;
}

std::string StopMatcher::Flush() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace epd::model
