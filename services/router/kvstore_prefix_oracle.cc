#include "services/router/kvstore_prefix_oracle.h"

#include <spdlog/spdlog.h>

#include "kvstore/chain_hash.h"

namespace epd::services::router {

KvStorePrefixOracle::KvStorePrefixOracle(KvOracleOptions options, prometheus::Registry& metrics)
    : options_(std::move(options)) {
  kvstore::KvClientOptions client_options;
  client_options.deadline_ms = options_.lookup_deadline_ms;
  auto client = kvstore::ShardedKvClient::Create(
      kvstore::ShardedKvClient::ParseTargets(options_.target), client_options);
  if (client.ok()) {
    client_ = *std::move(client);
  } else {
    spdlog::error("epd-router: --kvstore '{}': {}; no prefix hints", options_.target,
                  std::string(client.status().message()));
  }
  auto& lookups = prometheus::BuildCounter()
                      .Name("epd_router_prefix_lookups_total")
                      .Help("Prefix lookups the router sent to the kvstore")
                      .Register(metrics);
  lookups_ = &lookups.Add({});
  auto& errors = prometheus::BuildCounter()
                     .Name("epd_router_prefix_lookup_errors_total")
                     .Help("Prefix lookups that failed (kvstore down, deadline); treated as a miss")
                     .Register(metrics);
  errors_ = &errors.Add({});
  auto& cached = prometheus::BuildCounter()
                     .Name("epd_router_prefix_cached_tokens_total")
                     .Help("Prompt tokens the kvstore reported cached")
                     .Register(metrics);
  cached_tokens_ = &cached.Add({});
}

PrefixHint KvStorePrefixOracle::Lookup(const std::vector<int32_t>& prompt_ids,
                                       const std::string& fingerprint) {
  PrefixHint hint;
  const std::string& fp = fingerprint.empty() ? options_.default_fingerprint : fingerprint;
  if (client_ == nullptr || options_.block_tokens <= 0 ||
      prompt_ids.size() < static_cast<size_t>(options_.block_tokens)) {
    return hint;
  }
  const std::vector<kvstore::BlockHash> hashes =
      kvstore::ChainHashes(prompt_ids, static_cast<size_t>(options_.block_tokens), fp);
  lookups_->Increment();
  auto result = client_->Lookup(fp, hashes);
  if (!result.ok()) {
    errors_->Increment();
    // Logged on the first failure and every 100th after, so a down daemon does not flood logs.
    if (static_cast<uint64_t>(errors_->Value()) % 100 == 1)
      spdlog::warn("epd-router: prefix lookup at {} failed ({} so far, treated as a miss): {}",
                   options_.target, errors_->Value(), std::string(result.status().message()));
    return hint;
  }
  hint.cached_tokens = result->cached_blocks * options_.block_tokens;
  cached_tokens_->Increment(hint.cached_tokens);
  return hint;
}

}  // namespace epd::services::router
