#include "kvstore/sharded_kv_client.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace epd::kvstore {
namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool IsTransportFailure(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace

std::vector<std::string> ShardedKvClient::ParseTargets(std::string_view list) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(absl::string_view(list.data(), list.size()), ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) out.emplace_back(part.data(), part.size());
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ShardedKvClient>> ShardedKvClient::Create(
    const std::vector<std::string>& targets, KvClientOptions options, ShardOptions shard_options) {
  if (targets.empty()) return absl::InvalidArgumentError("kvstore: no targets");
  std::set<std::string> seen;
  for (const std::string& t : targets) {
    if (t.empty() || t.find(':') == std::string::npos)
      return absl::InvalidArgumentError(absl::StrCat("kvstore target '", t, "' is not host:port"));
    if (!seen.insert(t).second)
      return absl::InvalidArgumentError(absl::StrCat("kvstore target '", t, "' is listed twice"));
  }
  std::unique_ptr<ShardedKvClient> c(new ShardedKvClient(shard_options));
  for (const std::string& t : targets) {
    c->ring_.AddNode(t);
    auto shard = std::make_unique<Shard>();
    shard->target = t;
    shard->client = KvStoreClient::Create(t, options);
    c->shards_.push_back(std::move(shard));
  }
  return c;
}

std::string ShardedKvClient::OwnerOf(std::string_view key) const {
  return ring_.NodeFor(key).value_or("");
}

size_t ShardedKvClient::ShardIndex(std::string_view key) const {
  if (shards_.size() == 1) return 0;
  const std::string owner = OwnerOf(key);
  for (size_t i = 0; i < shards_.size(); ++i)
    if (shards_[i]->target == owner) return i;
  return 0;  // unreachable: every target is on the ring
}

absl::Status ShardedKvClient::CheckUp(Shard& shard) {
  if (shards_.size() == 1) return absl::OkStatus();  // one daemon: every call tries it
  const int64_t until = shard.down_until_ms.load();
  if (until == 0 || NowMs() >= until) return absl::OkStatus();
  skipped_.fetch_add(1);
  return absl::UnavailableError(
      absl::StrCat("kvstore ", shard.target, " is down (skipped for ", until - NowMs(), " ms)"));
}

absl::Status ShardedKvClient::Note(Shard& shard, absl::Status s) {
  if (shards_.size() == 1) return s;
  if (s.ok()) {
    shard.down_until_ms.store(0);
  } else if (IsTransportFailure(s)) {
    if (shard.down_until_ms.exchange(NowMs() + options_.retry_after_ms) == 0)
      spdlog::warn("kvstore {} failed ({}); its share of the keys is a miss for {} ms",
                   shard.target, std::string(s.message()), options_.retry_after_ms);
  }
  return s;
}

absl::StatusOr<LookupResult> ShardedKvClient::Lookup(std::string_view config_fingerprint,
                                                     std::span<const BlockHash> chain_hashes) {
  if (shards_.size() == 1) return shards_[0]->client->Lookup(config_fingerprint, chain_hashes);
  const size_t n = chain_hashes.size();
  // Each daemon's blocks, in chain order.
  std::vector<std::vector<size_t>> owned(shards_.size());
  for (size_t i = 0; i < n; ++i) {
    owned[ShardIndex(AsBytes(chain_hashes[i]))].push_back(i);
  }
  size_t prefix = n;  // index of the first block not known to be cached
  std::vector<Tier> tiers(n, Tier::kG3);
  absl::Status first_error;
  size_t first_error_at = n;
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (owned[k].empty() || owned[k][0] >= prefix) continue;
    Shard& shard = *shards_[k];
    // Only the blocks before the current prefix end matter.
    std::vector<BlockHash> mine;
    for (size_t i : owned[k]) {
      if (i >= prefix) break;
      mine.push_back(chain_hashes[i]);
    }
    absl::StatusOr<LookupResult> r = absl::UnknownError("not asked");
    if (absl::Status up = CheckUp(shard); !up.ok()) {
      r = up;
    } else {
      r = shard.client->Lookup(config_fingerprint, mine);
      Note(shard, r.status()).IgnoreError();
    }
    if (!r.ok()) {
      if (owned[k][0] < first_error_at) {
        first_error_at = owned[k][0];
        first_error = r.status();
      }
      prefix = std::min(prefix, owned[k][0]);
      continue;
    }
    const size_t have = static_cast<size_t>(std::max(0, r->cached_blocks));
    for (size_t j = 0; j < have && j < mine.size() && j < r->tiers.size(); ++j)
      tiers[owned[k][j]] = r->tiers[j];
    if (have < mine.size()) prefix = std::min(prefix, owned[k][have]);
  }
  if (prefix == 0 && first_error_at == 0) return first_error;
  LookupResult out;
  out.cached_blocks = static_cast<int>(prefix);
  out.tiers.assign(tiers.begin(), tiers.begin() + static_cast<std::ptrdiff_t>(prefix));
  return out;
}

absl::StatusOr<GetResult> ShardedKvClient::Get(Tier tier, std::string_view key) {
  Shard& shard = *shards_[ShardIndex(key)];
  if (auto s = CheckUp(shard); !s.ok()) return s;
  auto r = shard.client->Get(tier, key);
  Note(shard, r.status()).IgnoreError();
  return r;
}

absl::Status ShardedKvClient::Put(Tier tier, std::string_view key, std::string_view value) {
  Shard& shard = *shards_[ShardIndex(key)];
  if (auto s = CheckUp(shard); !s.ok()) return s;
  return Note(shard, shard.client->Put(tier, key, value));
}

absl::StatusOr<bool> ShardedKvClient::Pin(std::string_view key, bool pin) {
  Shard& shard = *shards_[ShardIndex(key)];
  if (auto s = CheckUp(shard); !s.ok()) return s;
  auto r = shard.client->Pin(key, pin);
  Note(shard, r.status()).IgnoreError();
  return r;
}

absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> ShardedKvClient::BatchGet(
    Tier tier, std::span<const std::string> keys, bool stop_at_first_miss) {
  if (shards_.size() == 1) {
    Shard& shard = *shards_[0];
    auto r = shard.client->BatchGet(tier, keys, stop_at_first_miss);
    Note(shard, r.status()).IgnoreError();
    return r;
  }
  std::vector<std::vector<size_t>> owned(shards_.size());
  for (size_t i = 0; i < keys.size(); ++i) owned[ShardIndex(keys[i])].push_back(i);
  std::vector<absl::StatusOr<GetResult>> out(keys.size(), absl::UnknownError("not asked"));
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (owned[k].empty()) continue;
    Shard& shard = *shards_[k];
    std::vector<std::string> mine;
    mine.reserve(owned[k].size());
    for (size_t i : owned[k]) mine.push_back(keys[i]);
    absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> r = absl::UnknownError("not asked");
    if (absl::Status up = CheckUp(shard); !up.ok()) {
      r = up;
    } else {
      r = shard.client->BatchGet(tier, mine, /*stop_at_first_miss=*/false);
      Note(shard, r.status()).IgnoreError();
    }
    for (size_t j = 0; j < owned[k].size(); ++j) {
      out[owned[k][j]] = r.ok() ? std::move((*r)[j]) : absl::StatusOr<GetResult>(r.status());
    }
  }
  if (stop_at_first_miss) {
    bool stopped = false;
    for (auto& item : out) {
      if (stopped) {
        GetResult skipped;
        skipped.tier = tier;
        item = std::move(skipped);
      } else if (!item.ok() || !item->found) {
        stopped = true;
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<absl::Status>> ShardedKvClient::BatchPut(Tier tier,
                                                                    std::span<const KvPut> items) {
  if (shards_.size() == 1) {
    Shard& shard = *shards_[0];
    auto r = shard.client->BatchPut(tier, items);
    Note(shard, r.status()).IgnoreError();
    return r;
  }
  std::vector<std::vector<size_t>> owned(shards_.size());
  for (size_t i = 0; i < items.size(); ++i) owned[ShardIndex(items[i].key)].push_back(i);
  std::vector<absl::Status> out(items.size());
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (owned[k].empty()) continue;
    Shard& shard = *shards_[k];
    std::vector<KvPut> mine;
    for (size_t i : owned[k]) mine.push_back(items[i]);
    absl::StatusOr<std::vector<absl::Status>> r = absl::UnknownError("not asked");
    if (absl::Status up = CheckUp(shard); !up.ok()) {
      r = up;
    } else {
      r = shard.client->BatchPut(tier, mine);
      Note(shard, r.status()).IgnoreError();
    }
    for (size_t j = 0; j < owned[k].size(); ++j) out[owned[k][j]] = r.ok() ? (*r)[j] : r.status();
  }
  return out;
}

}  // namespace epd::kvstore
