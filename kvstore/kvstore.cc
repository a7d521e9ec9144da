#include "kvstore/kvstore.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "kvstore/chain_hash.h"

namespace epd::kvstore {
namespace {

std::span<const uint8_t> AsSpan(const std::string& s) {
  return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

}  // namespace

absl::Status KvStoreConfig::Validate() const {
  if (data_dir.empty() && g3.path.empty()) {
    return absl::InvalidArgumentError("kvstore data_dir is empty");
  }
  if (g1.capacity_bytes > 0) {
    if (auto s = g1.Validate(); !s.ok()) return s;
  }
  return g2.Validate();
}

KvStore::~KvStore() {
  // G1 demotes into G3 on eviction; drop it first so no callback outlives G3.
  g1_.reset();
  g2_.reset();
  g3_.reset();
}

absl::StatusOr<std::unique_ptr<KvStore>> KvStore::Open(const KvStoreConfig& config,
                                                       const common::Clock& clock,
                                                       prometheus::Registry& registry) {
  if (auto s = config.Validate(); !s.ok()) return s;
  std::unique_ptr<KvStore> store(new KvStore());
  store->metrics_ = std::make_unique<KvMetrics>(registry);
  store->g1_write_through_ = config.g1_write_through;
  G3Config g3 = config.g3;
  if (g3.path.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(config.data_dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot create data dir ", config.data_dir, ": ", ec.message()));
    }
    g3.path = config.data_dir + "/g3";
  }
  auto g3_store = G3RocksStore::Open(g3, clock, *store->metrics_);
  if (!g3_store.ok()) return g3_store.status();
  store->g3_ = std::move(*g3_store);
  store->g2_ = std::make_unique<G2SwaPool>(config.g2, clock, *store->metrics_);
  if (config.g1.capacity_bytes > 0) {
    G3RocksStore* g3_ptr = store->g3_.get();
    auto g1 = G1HotTier::CreateHost(
        config.g1, *store->metrics_, [g3_ptr](const BlockHash& key, std::string bytes) {
          if (g3_ptr->Contains(key)) return;  // write-through already made it durable
          if (auto s = g3_ptr->Put(key, AsSpan(bytes)); !s.ok()) {
            spdlog::warn("kvstore: demoting a G1 block to G3 failed: {}", std::string(s.message()));
          }
        });
    if (!g1.ok()) return g1.status();
    store->g1_ = std::move(*g1);
  }
  return store;
}

absl::StatusOr<BlockHash> KvStore::ParseBlockKey(std::string_view key) {
  auto k = BlockHashFromBytes(key);
  if (!k.ok()) metrics_->CountBadRequest("key_size");
  return k;
}

LookupResult KvStore::Lookup(std::span<const BlockHash> chain_hashes) {
  LookupResult r;
  for (const BlockHash& h : chain_hashes) {
    if (g1_ != nullptr && g1_->Lookup(h)) {
      r.tiers.push_back(Tier::kG1);
    } else if (g3_->Lookup(h)) {
      r.tiers.push_back(Tier::kG3);
    } else {
      break;
    }
    ++r.cached_blocks;
  }
  if (r.cached_blocks > 0) {
    r.swa_snapshot_present = g2_->Contains(AsBytes(chain_hashes[r.cached_blocks - 1]));
  }
  return r;
}

absl::StatusOr<LookupResult> KvStore::Lookup(std::string_view /*config_fingerprint*/,
                                             std::span<const BlockHash> chain_hashes) {
  return Lookup(chain_hashes);
}

absl::StatusOr<GetResult> KvStore::Get(Tier tier, std::string_view key) {
  return Get(tier, key, nullptr);
}

absl::Status KvStore::Put(Tier tier, std::string_view key, std::string_view value) {
  return Put(
      tier, key,
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(value.data()), value.size()));
}

absl::StatusOr<GetResult> KvStore::Get(Tier tier, std::string_view key, const ValueDest& dest) {
  GetResult r;
  if (tier == Tier::kG2) {
    auto g = g2_->Get(key);
    r.found = g.value != nullptr;
    if (r.found) {
      uint8_t* out = dest ? dest(g.value->size()) : nullptr;
      if (out != nullptr) {
        if (!g.value->empty()) std::memcpy(out, g.value->data(), g.value->size());
        r.in_dest = true;
      } else {
        r.value = *g.value;
      }
    }
    r.miss = g.miss;
    r.tier = Tier::kG2;
    return r;
  }
  auto k = ParseBlockKey(key);
  if (!k.ok()) return k.status();
  if ((tier == Tier::kG1 || tier == Tier::kAuto) && g1_ != nullptr) {
    bool in_dest = false;
    std::optional<ValueChecksum> stored;
    if (auto v = g1_->ReadInto(*k, dest, &in_dest, &stored); v.has_value()) {
      r.found = true;
      r.value = std::move(*v);
      r.in_dest = in_dest;
      if (in_dest && stored.has_value()) {  // the checksum of the bytes put, not of the copy
        r.has_checksum = true;
        r.checksum = stored->value;
        r.checksum_seed = stored->seed;
      }
      r.miss = MissReason::kNone;
      r.tier = Tier::kG1;
      return r;
    }
    if (tier == Tier::kG1) {
      r.miss = MissReason::kAbsent;
      r.tier = Tier::kG1;
      return r;
    }
  }
  if (tier == Tier::kG1) {  // G1 disabled
    r.miss = MissReason::kAbsent;
    return r;
  }
  // A promotion into G1 needs the bytes: capture where dest put them.
  std::span<const uint8_t> in_dest_bytes;
  ValueDest capture;
  if (dest) {
    capture = [&](size_t n) {
      uint8_t* out = dest(n);
      if (out != nullptr) in_dest_bytes = std::span<const uint8_t>(out, n);
      return out;
    };
  }
  auto g = g3_->Get(*k, capture);
  r.miss = g.miss;
  r.tier = Tier::kG3;
  r.found = g.miss == MissReason::kNone;
  if (r.found) {
    r.value = std::move(g.value);
    r.in_dest = g.in_dest;
    if (r.in_dest) {
      r.has_checksum = true;
      r.checksum = g.checksum;
      r.checksum_seed = g.checksum_seed;
    }
    const std::span<const uint8_t> bytes = r.in_dest ? in_dest_bytes : AsSpan(r.value);
    if (tier == Tier::kAuto && g1_ != nullptr && bytes.size() <= g1_->block_bytes()) {
      // Best effort (a full G1 just skips the promotion), with G3's checksum, verified over these
      // very bytes: no second hash on the get path.
      (void)g1_->Put(*k, bytes, ValueChecksum{g.checksum, g.checksum_seed});
    }
  }
  return r;
}

absl::Status KvStore::Put(Tier tier, std::string_view key, std::span<const uint8_t> value) {
  if (tier == Tier::kG2) return g2_->Put(key, value);
  auto k = ParseBlockKey(key);
  if (!k.ok()) return k.status();
  if (tier == Tier::kG1) {
    if (g1_ == nullptr) {
      metrics_->CountBadRequest("tier");
      return absl::FailedPreconditionError(
          "G1 is disabled on this kvstore (--g1-capacity-bytes 0)");
    }
    return g1_->Put(*k, value);
  }
  if (auto s = g3_->Put(*k, value); !s.ok()) return s;
  if (g1_write_through_ && g1_ != nullptr && value.size() <= g1_->block_bytes()) {
    (void)g1_->Put(*k, value);  // best effort: durability already holds via G3
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> KvStore::Pin(std::string_view key, bool pin) {
  auto k = ParseBlockKey(key);
  if (!k.ok()) return k.status();
  if (g1_ == nullptr) {
    metrics_->CountBadRequest("tier");
    return absl::FailedPreconditionError("G1 is disabled on this kvstore; nothing to pin");
  }
  if (!pin) return g1_->Unpin(*k);
  if (g1_->Pin(*k)) return true;
  auto g = g3_->Get(*k);
  if (g.miss != MissReason::kNone) return false;
  if (auto s = g1_->Put(*k, AsSpan(g.value), ValueChecksum{g.checksum, g.checksum_seed}); !s.ok())
    return s;
  return g1_->Pin(*k);
}

std::vector<TierStats> KvStore::Stats() const {
  std::vector<TierStats> out;
  if (g1_ != nullptr) {
    auto s = g1_->stats();
    out.push_back({Tier::kG1, s.entries, s.bytes, s.capacity_bytes});
  } else {
    out.push_back({Tier::kG1, 0, 0, 0});
  }
  auto s2 = g2_->stats();
  out.push_back({Tier::kG2, s2.entries, s2.bytes, s2.capacity_bytes});
  auto s3 = g3_->stats();
  out.push_back({Tier::kG3, s3.entries, s3.bytes, s3.capacity_bytes});
  return out;
}

void KvStore::Sweep() {
  const size_t expired2 = g2_->ExpireNow();
  const auto r3 = g3_->Sweep();
  if (expired2 + r3.expired + r3.evicted > 0) {
    spdlog::info("kvstore sweep: G2 expired {}, G3 expired {}, G3 evicted {}", expired2, r3.expired,
                 r3.evicted);
  }
}

}  // namespace epd::kvstore
