#pragma once

// PrefixOracle over epd-kvstore: chain-hashes the whole blocks of a prompt (kvstore/chain_hash.h,
// docs/kvstore.md: parent, block token ids, config fingerprint) and asks the daemon's Lookup for
// the longest cached prefix. P = cached_blocks * block_tokens.
//
// Errors (daemon down, deadline) never fail a request: Lookup returns an empty hint and counts
// epd_router_prefix_lookup_errors_total. The call has a short deadline (lookup_deadline_ms) so a
// hung daemon costs at most that per request. `workers` stays empty (the kvstore does not know
// which worker holds a block hot).
// Thread-safety: Lookup may be called concurrently (KvStoreClient is thread-safe).
#include <memory>
#include <string>

#include "kvstore/sharded_kv_client.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "services/router/prefix_oracle.h"

namespace epd::services::router {

struct KvOracleOptions {
  std::string target;  // kvstore "host:port", or several "a:1,b:2" (the hash ring of the workers)
  int block_tokens = 64;            // tokens per KV block. Default: 64 (docs/kvstore.md)
  std::string default_fingerprint;  // used when Lookup is given an empty fingerprint
  int lookup_deadline_ms = 200;     // Default: 200 ms
};

class KvStorePrefixOracle final : public PrefixOracle {
 public:
  // `metrics` must outlive the oracle.
  KvStorePrefixOracle(KvOracleOptions options, prometheus::Registry& metrics);
  PrefixHint Lookup(const std::vector<int32_t>& prompt_ids,
                    const std::string& fingerprint) override;

  double errors() const { return errors_->Value(); }
  double lookups() const { return lookups_->Value(); }

 private:
  KvOracleOptions options_;
  std::unique_ptr<kvstore::KvStoreApi> client_;  // null: the target list did not parse
  prometheus::Counter* lookups_;
  prometheus::Counter* errors_;
  prometheus::Counter* cached_tokens_;
};

}  // namespace epd::services::router
