#include "kvstore/store_api.h"

namespace epd::kvstore {

absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> KvStoreApi::BatchGet(
    Tier tier, std::span<const std::string> keys, bool stop_at_first_miss) {
  std::vector<absl::StatusOr<GetResult>> out;
  out.reserve(keys.size());
  bool stopped = false;
  for (const std::string& key : keys) {
    if (stopped) {
      GetResult skipped;
      skipped.tier = tier;
      out.push_back(std::move(skipped));
      continue;
    }
    out.push_back(Get(tier, key));
    stopped = stop_at_first_miss && (!out.back().ok() || !out.back()->found);
  }
  return out;
}

absl::StatusOr<std::vector<absl::Status>> KvStoreApi::BatchPut(Tier tier,
                                                               std::span<const KvPut> items) {
  std::vector<absl::Status> out;
  out.reserve(items.size());
  for (const KvPut& it : items) out.push_back(Put(tier, it.key, it.value));
  return out;
}

}  // namespace epd::kvstore
