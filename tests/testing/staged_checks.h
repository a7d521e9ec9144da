#pragma once

// Staged execution equals the monolithic forward bit for bit, on any backend: the checks of
// tests/model/staged_test.cc (CPU) and tests/gpu/cuda_model_test.cc (CUDA) share these bodies.
#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "model/model.h"

namespace epd::testing {

// Rows [from, to) of a forward's logits.
inline std::vector<float> LogitRows(const model::Model& m, const model::ForwardResult& r,
                                    int64_t from, int64_t to) {
  const int64_t V = m.config().vocab_size;
  return std::vector<float>(r.logits.begin() + from * V, r.logits.begin() + to * V);
}

// A prefill in chunks of 150, 77 and the rest (odd split points for the ratio-2 tails) gives the
// monolithic prefill's rows, and both states continue identically (decode and DSpark drafts).
// The prompt must be longer than 227 tokens.
inline void ExpectChunkedPrefillEqualsMonolithic(const model::Model& m,
                                                 const std::vector<int32_t>& prompt) {
  using Mode = model::Model::ExtendMode;
  ASSERT_GT(prompt.size(), 227u);
  auto mono = m.NewSequence();
  auto full = m.Prefill(*mono, prompt, true);
  ASSERT_TRUE(full.ok()) << full.status();
  auto staged = m.NewSequence();
  std::span<const int32_t> p(prompt);
  auto a = m.Prefill(*staged, p.subspan(0, 150), true);
  auto b = m.Extend(*staged, p.subspan(150, 77), true, nullptr, Mode::kPrefillChunk);
  auto c = m.Extend(*staged, p.subspan(227), true, nullptr, Mode::kPrefillChunk);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->logits, LogitRows(m, *full, 0, 150));
  EXPECT_EQ(b->logits, LogitRows(m, *full, 150, 227));
  EXPECT_EQ(c->logits, LogitRows(m, *full, 227, static_cast<int64_t>(prompt.size())));
  for (int32_t t : {99, 143, 448}) {
    auto x = m.Decode(*mono, t);
    auto y = m.Decode(*staged, t);
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(x->logits, y->logits);
    if (m.config().n_mtp_layers == 0) continue;
    auto dx = m.Draft(*mono, t);
    auto dy = m.Draft(*staged, t);
    ASSERT_TRUE(dx.ok() && dy.ok());
    EXPECT_EQ(dx->logits, dy->logits);
  }
}

// A verification-shaped step (last token + drafts, ratio-2 groups completing inside the call)
// gives the rows of decoding its tokens one at a time. The prompt must hold 271 tokens.
inline void ExpectMultiTokenDecodeEqualsSequentialDecode(const model::Model& m,
                                                         const std::vector<int32_t>& prompt) {
  ASSERT_GE(prompt.size(), 271u);
  std::span<const int32_t> p(prompt);
  auto seq = m.NewSequence();
  auto multi = m.NewSequence();
  ASSERT_TRUE(m.Prefill(*seq, p.subspan(0, 260), false).ok());
  ASSERT_TRUE(m.Prefill(*multi, p.subspan(0, 260), false).ok());
  for (auto [from, n] : {std::pair<int, int>{260, 5}, {265, 6}}) {
    std::vector<float> want;
    for (int i = 0; i < n; ++i) {
      auto r = m.Decode(*seq, prompt[from + i]);
      ASSERT_TRUE(r.ok());
      want.insert(want.end(), r->logits.begin(), r->logits.end());
    }
    auto got = m.Extend(*multi, p.subspan(from, n), true);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->logits, want) << "step at " << from;
  }
  if (m.config().n_mtp_layers == 0) return;
  auto dx = m.Draft(*seq, 7);
  auto dy = m.Draft(*multi, 7);
  ASSERT_TRUE(dx.ok() && dy.ok());
  EXPECT_EQ(dx->logits, dy->logits);
}

}  // namespace epd::testing
