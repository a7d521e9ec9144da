#pragma once

// Small value types shared by every kvstore tier, the daemon and its client.
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace epd::kvstore {

// 16-byte prefix-chain block hash (see chain_hash.h). Hashable with absl::Hash for in-memory maps;
// never hashed with a process-seeded hash for anything stored or sent.
using BlockHash = std::array<uint8_t, 16>;

inline constexpr size_t kBlockHashBytes = 16;

inline std::string_view AsBytes(const BlockHash& h) {
  return std::string_view(reinterpret_cast<const char*>(h.data()), h.size());
}

// The tiers of DESIGN §5. kAuto lets the store choose (G1, then G3 for global KV).
enum class Tier : int {
  kAuto = 0,
  kG1 = 1,  // per-worker block pool (device memory on a GPU, host arena elsewhere)
  kG2 = 2,  // host-DRAM SWA snapshot pool (TTL minutes)
  kG3 = 3,  // RocksDB on SSD (global KV, TTL 72 h)
};

// Bounded label value for metrics: "g1", "g2", "g3" ("auto" never reaches a metric).
std::string_view TierLabel(Tier tier);

// Where a get may place a hit's bytes directly (e.g. a client's shared-memory segment) instead of
// a std::string: returns a destination for n bytes, or null to get them the usual way. Called at
// most once per get, while the store holds the bytes (G1 page referenced, G3 value pinned).
using ValueDest = std::function<uint8_t*(size_t n)>;

// Why a get returned nothing. kNone means the value was found.
enum class MissReason : int {
  kNone = 0,
  kAbsent = 1,    // never stored, evicted, or dropped by a restart (G1/G2)
  kExpired = 2,   // its TTL passed; the caller replays/recomputes
  kChecksum = 3,  // stored bytes failed verification; never served
};

// "", "absent", "expired", "checksum" (the wire strings of GetResponse.miss_reason).
std::string_view MissReasonName(MissReason reason);

}  // namespace epd::kvstore
