#pragma once

// Where the scheduler learns how much of a prompt is already cached. The kvstore client
// implements this (chain-hashed blocks, DESIGN.md §3); until then NoPrefixOracle says "nothing".
#include <cstdint>
#include <string>
#include <vector>

namespace epd::services::router {

struct PrefixHint {
  int32_t cached_tokens = 0;         // longest cached prefix P, whole blocks
  std::vector<std::string> workers;  // worker ids that hold it hot (HBM), best first
};

// Thread-safe: called concurrently from request threads. Must not block for long; on any
// error return an empty hint (a miss costs compute, never correctness).
class PrefixOracle {
 public:
  virtual ~PrefixOracle() = default;
  virtual PrefixHint Lookup(const std::vector<int32_t>& prompt_ids,
                            const std::string& fingerprint) = 0;
};

class NoPrefixOracle final : public PrefixOracle {
 public:
  PrefixHint Lookup(const std::vector<int32_t>&, const std::string&) override { return {}; }
};

}  // namespace epd::services::router
