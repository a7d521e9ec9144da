#pragma once

// The kvstore of one node: G1 hot tier (host arena in the daemon), G2 SWA pool and G3 RocksDB
// behind one object, as the epd-kvstore daemon serves them (DESIGN §5). Knows nothing of gRPC;
// kvstore_service.h adapts it. Thread-safe: every method may be called concurrently.
//
// Tier semantics of Put: kG3/kAuto (global KV) writes G3 durably, then keeps a hot copy in G1
// when it fits a block; kG1 writes G1 only (demoted to G3 on eviction); kG2 writes the SWA pool.
// Get with kAuto tries G1, then G3 (promoting a G3 hit into G1).
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "kvstore/g1_hot_tier.h"
#include "kvstore/g2_swa_pool.h"
#include "kvstore/g3_rocksdb.h"
#include "kvstore/kv_metrics.h"
#include "kvstore/store_api.h"
#include "kvstore/types.h"
#include "prometheus/registry.h"

namespace epd::kvstore {

struct KvStoreConfig {
  std::string data_dir;  // required; G3 lives in <data_dir>/g3 unless g3.path is set
  G1Config g1;           // capacity_bytes 0 disables G1 in the daemon
  G2Config g2;
  G3Config g3;
  bool g1_write_through = true;  // Default: global-KV puts also fill G1 (hot prefix blocks)
  absl::Status Validate() const;
};

class KvStore final : public KvStoreApi {
 public:
  // `clock` and `registry` must outlive the store.
  static absl::StatusOr<std::unique_ptr<KvStore>> Open(const KvStoreConfig& config,
                                                       const common::Clock& clock,
                                                       prometheus::Registry& registry);
  ~KvStore() override;

  LookupResult Lookup(std::span<const BlockHash> chain_hashes);
  // KvStoreApi (BatchGet/BatchPut: the interface's per-key loop, no RPC to save in process).
  absl::StatusOr<LookupResult> Lookup(std::string_view config_fingerprint,
                                      std::span<const BlockHash> chain_hashes) override;
  absl::StatusOr<GetResult> Get(Tier tier, std::string_view key) override;
  absl::Status Put(Tier tier, std::string_view key, std::string_view value) override;
  // InvalidArgument (counted in epd_kv_bad_requests_total) for a malformed key or value.
  // With `dest`, a hit is copied straight into dest(n) when it returns a buffer (in_dest = true).
  absl::StatusOr<GetResult> Get(Tier tier, std::string_view key, const ValueDest& dest);
  absl::Status Put(Tier tier, std::string_view key, std::span<const uint8_t> value);
  // Pins (pin=true) or unpins a global-KV block in G1; a block only in G3 is loaded first.
  // Returns whether the block was found (and, for unpin, was pinned).
  absl::StatusOr<bool> Pin(std::string_view key, bool pin) override;
  std::vector<TierStats> Stats() const;
  // Expires G2 entries and sweeps G3 (TTL, then capacity). Called periodically by the daemon.
  void Sweep();

  KvMetrics& metrics() { return *metrics_; }
  G1HotTier* g1() { return g1_.get(); }  // null when disabled
  G2SwaPool& g2() { return *g2_; }
  G3RocksStore& g3() { return *g3_; }

 private:
  KvStore() = default;
  absl::StatusOr<BlockHash> ParseBlockKey(std::string_view key);

  std::unique_ptr<KvMetrics> metrics_;
  std::unique_ptr<G3RocksStore> g3_;
  std::unique_ptr<G2SwaPool> g2_;
  std::unique_ptr<G1HotTier> g1_;
  bool g1_write_through_ = true;
};

}  // namespace epd::kvstore
