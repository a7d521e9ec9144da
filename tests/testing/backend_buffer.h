#pragma once
// A test's host values copied into a backend buffer (the input of an op or a model path that takes
// backend memory). The allocation and the upload are expected to succeed.

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace epd::testing {

inline kernels::Buffer OnBackend(kernels::Backend& be, const std::vector<float>& v) {
  const auto bytes = static_cast<int64_t>(v.size() * sizeof(float));
  auto b = be.Allocate(bytes);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return {};
  EXPECT_TRUE(be.Upload(v.data(), bytes, *b).ok());
  return std::move(*b);
}

}  // namespace epd::testing
