#pragma once

// Helpers shared by the kvstore tests: deterministic payloads, keys and metric reads.
#include <cstdint>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvstore/chain_hash.h"
#include "prometheus/registry.h"

namespace epd::kvstore::testing {

// `n` deterministic pseudo-random bytes for seed `seed` (distinct seeds give distinct values).
inline std::string Payload(uint64_t seed, size_t n) {
  std::string out(n, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x1234567ull;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out[i] = static_cast<char>(x & 0xff);
  }
  return out;
}

inline std::span<const uint8_t> Bytes(const std::string& s) {
  return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// A distinct chain-hash key per integer.
inline BlockHash Key(int i) {
  const int32_t t = i;
  return ChainHash(kRootParent, std::span<const int32_t>(&t, 1), "test-fp");
}

// Sum of a metric family's series whose labels include all of `labels` (from the registry).
inline double MetricValue(prometheus::Registry& registry, const std::string& name,
                          const std::map<std::string, std::string>& labels) {
  double total = 0;
  for (const auto& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const auto& m : family.metric) {
      bool match = true;
      for (const auto& [k, v] : labels) {
        bool found = false;
        for (const auto& l : m.label) found |= (l.name == k && l.value == v);
        match &= found;
      }
      if (!match) continue;
      total += family.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
    }
  }
  return total;
}

}  // namespace epd::kvstore::testing
