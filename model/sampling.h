#pragma once

// Token sampling for generation (greedy, temperature, top-k, top-p, min-p, repetition /
// frequency / presence penalties, per-request seed), stop conditions (token ids, stop strings on
// incremental text, max tokens) and top logprobs.
//
// Semantics (docs/dspark.md, "Sampling"):
//   1. penalties on the raw logits: repetition (HF/vLLM: l > 0 ? l / r : l * r, over prompt and
//      generated tokens), frequency (l -= f * count) and presence (l -= p * [count > 0]) over
//      generated tokens only (OpenAI);
//   2. temperature 0 = argmax of the penalized logits, first index on ties (the reference rule);
//   3. T > 0: probs = softmax(l / T), then top-k (ties: lower index kept), top-p (smallest
//      prefix of the descending order whose mass reaches p, at least one token), min-p (keep
//      probs >= min_p * max prob), renormalize, and draw exactly from that distribution by
//      inverse CDF with a counter-based uniform. The reference draws with Gumbel-max over
//      torch's global RNG; any exact sampler of the same distribution is equivalent in law.
//      The arithmetic (exp, blocked sums) is kernels/sampling_math.h's, which a backend's
//      SampleLogits shares: a draw on the GPU takes the token a draw here takes.
//
// Randomness: Rng is counter-based (SplitMix64 of seed + counter): same seed and same sequence of
// draws -> same output, no global state. Thread-safety: Sampler, Rng and StopMatcher are not
// thread-safe (one per request); the free functions are reentrant.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "kernels/sampling_math.h"

namespace epd::model {

struct SamplingParams {
  float temperature = 0.f;                // 0 = greedy. Default: 0
  float top_p = 1.f;                      // (0, 1]; 1 = off. Default: 1
  int32_t top_k = 0;                      // 0 = off. Default: 0
  float min_p = 0.f;                      // [0, 1]; 0 = off. Default: 0
  float repetition_penalty = 1.f;         // > 0; 1 = off. Default: 1
  float frequency_penalty = 0.f;          // [-2, 2]. Default: 0
  float presence_penalty = 0.f;           // [-2, 2]. Default: 0
  uint64_t seed = 0;                      // per-request seed. Default: 0
  std::vector<int32_t> stop_token_ids;    // generation ends on (and excludes) these. Default: none
  std::vector<std::string> stop_strings;  // text stops (StopMatcher). Default: none
  int32_t max_tokens = 256;               // >= 1. Default: 256
  int32_t top_logprobs = 0;               // [0, 20]. Default: 0

  // Names the first bad field.
  [[nodiscard]] absl::Status Validate() const;
  bool greedy() const { return temperature <= 0.f; }
  bool has_penalties() const {
    return repetition_penalty != 1.f || frequency_penalty != 0.f || presence_penalty != 0.f;
  }
};

// Counter-based uniform source: value i is a pure function of (seed, i).
class Rng {
 public:
  explicit Rng(uint64_t seed) : seed_(seed) {}
  uint64_t NextU64();
  // Uniform in [0, 1) with 53 random bits.
  double NextUniform();
  uint64_t counter() const { return counter_; }
  // Back to an earlier counter(): the draws after it are made again (a step that drew uniforms
  // for the backend and then failed).
  void Rewind(uint64_t counter) { counter_ = counter; }

 private:
  uint64_t seed_;
  uint64_t counter_ = 0;
};

// First index of the maximum (the reference's greedy rule).
int32_t ArgMax(std::span<const float> v);

// Draws an index from `probs` (non-negative, any positive sum) by inverse CDF with u in [0, 1).
int32_t SampleFromProbs(std::span<const float> probs, double u);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.f;
};
struct Logprobs {
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;  // descending, ties -> lower id first
};
// log_softmax of the raw logits (T = 1, no penalties or filters): the chosen token and the top n
// (kernels/sampling_math.h: the arithmetic Backend::TopLogprobs shares).
Logprobs ComputeLogprobs(std::span<const float> logits, int32_t chosen, int n);

// Per-request sampler. Owns the request's token history (for penalties) and its Rng.
class Sampler {
 public:
  Sampler(SamplingParams params, int64_t vocab, std::span<const int32_t> prompt = {});

  const SamplingParams& params() const { return params_; }
  int64_t vocab() const { return vocab_; }
  Rng& rng() { return rng_; }

  // logits [vocab] -> penalized logits, as if `pending` had been generated after the history.
  void ApplyPenalties(std::span<float> logits, std::span<const int32_t> pending = {}) const;
  // The same for `rows` rows of vocab() logits elsewhere (Backend::PenalizeLogits): row j as if
  // drafts[0, j) had been generated. Appends, per logit a penalty changes, its index j * vocab +
  // token to `at` and the token's generated count (drafts included) to `counts`, each logit once.
  // Needs rows <= drafts.size() + 1.
  void PenaltyEntries(std::span<const int32_t> drafts, int64_t rows, std::vector<int64_t>& at,
                      std::vector<int32_t>& counts) const;
  // The distribution a T > 0 draw uses (penalties, temperature, top-k, top-p, min-p,
  // renormalized) into probs [vocab]; for T = 0 a one-hot at the greedy token.
  void Probabilities(std::span<const float> logits, std::span<const int32_t> pending,
                     std::vector<float>& probs) const;
  // The filters of a T > 0 draw, as a backend's SampleLogits takes them.
  kernels::SampleParams DrawParams() const;
  // Greedy token of the penalized logits.
  int32_t Greedy(std::span<const float> logits, std::span<const int32_t> pending = {}) const;
  // Draws the next token (greedy when T = 0; else one uniform from rng()).
  int32_t Sample(std::span<const float> logits, std::span<const int32_t> pending = {});
  // Appends a generated token to the history.
  void Accept(int32_t token);
  bool IsStopToken(int32_t token) const;

 private:
  SamplingParams params_;
  int64_t vocab_;
  Rng rng_;
  std::unordered_set<int32_t> prompt_tokens_;
  std::unordered_map<int32_t, int32_t> counts_;  // generated token -> count
};

// Stop-string matcher on incremental text. Feed() the newly detokenized text; it returns the
// text safe to emit now and holds back any suffix that could still start a stop string. On a
// match, the text before the stop string is emitted and the stop string and what follows are
// dropped (OpenAI semantics).
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  struct Result {
    std::string emit;
    bool stopped = false;
    size_t held_bytes = 0;  // bytes held back after this call
  };
  Result Feed(std::string_view delta);
  // End of generation without a match: returns the held text.
  std::string Flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  size_t max_len_ = 0;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace epd::model
