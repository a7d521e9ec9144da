#pragma once

// Prometheus metrics of the kvstore (DESIGN §6). Every family is labelled by a bounded `tier`
// ("g1", "g2", "g3"); misses also by `reason`, bad requests by `reason`. The registry is injected
// (the library never owns a process runtime). Thread-safe: prometheus-cpp counters/gauges are.
#include <string_view>

#include "kvstore/types.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace epd::kvstore {

class KvMetrics {
 public:
  struct TierMetrics {
    prometheus::Counter* lookups = nullptr;            // epd_kv_lookups_total
    prometheus::Counter* hits = nullptr;               // epd_kv_hits_total
    prometheus::Counter* evictions = nullptr;          // epd_kv_evictions_total
    prometheus::Counter* ttl_expiries = nullptr;       // epd_kv_ttl_expiries_total
    prometheus::Counter* checksum_failures = nullptr;  // epd_kv_checksum_failures_total
    prometheus::Counter* puts = nullptr;               // epd_kv_puts_total
    prometheus::Counter* gets = nullptr;               // epd_kv_gets_total
    prometheus::Counter* put_bytes = nullptr;          // epd_kv_put_bytes_total
    prometheus::Counter* get_bytes = nullptr;          // epd_kv_get_bytes_total
    prometheus::Counter* demotions = nullptr;          // epd_kv_demotions_total (G1 -> G3)
    prometheus::Gauge* bytes = nullptr;                // epd_kv_bytes
    prometheus::Gauge* entries = nullptr;              // epd_kv_entries
    prometheus::Gauge* capacity_bytes = nullptr;       // epd_kv_capacity_bytes
    prometheus::Counter* miss_absent = nullptr;        // epd_kv_misses_total{reason="absent"}
    prometheus::Counter* miss_expired = nullptr;       // epd_kv_misses_total{reason="expired"}
    prometheus::Counter* miss_checksum = nullptr;      // epd_kv_misses_total{reason="checksum"}
  };

  // Registers the families in `registry`, which must outlive this object.
  explicit KvMetrics(prometheus::Registry& registry);

  TierMetrics& tier(Tier t) { return tiers_[Index(t)]; }
  // Counts a miss of `reason` (kNone is ignored).
  void CountMiss(Tier t, MissReason reason);
  // epd_kv_bad_requests_total{reason}: reason is one of a small fixed set ("key_size",
  // "value_size", "tier", "capacity", "internal", "bulk" (a malformed bulk put)).
  void CountBadRequest(std::string_view reason);
  // epd_kv_puts_in_flight: put RPCs received and not yet answered.
  prometheus::Gauge& puts_in_flight() { return *puts_in_flight_; }
  // epd_kv_batch_calls_total{op="get"|"put"} and epd_kv_batch_keys_total{op}: batched calls.
  prometheus::Counter& batch_calls(bool put) { return put ? *batch_puts_ : *batch_gets_; }
  prometheus::Counter& batch_keys(bool put) { return put ? *batch_put_keys_ : *batch_get_keys_; }
  // epd_kv_shm_segments_mapped: client shared-memory segments the daemon has mapped right now
  // (kept across calls while the client holds the segment open; dropped within a second after
  // it closes it or dies: kvstore/shm_segment.h PeerSegmentCache).
  prometheus::Gauge& shm_mapped() { return *shm_mapped_; }
  // epd_kv_shm_bytes_total{direction="get"|"put"}: value bytes moved through client segments.
  prometheus::Counter& shm_bytes(bool put) { return put ? *shm_put_bytes_ : *shm_get_bytes_; }
  // epd_kv_shm_refused_total{reason}: segments offered and not used (values went inline);
  // reason: "open", "not_memfd", "inode", "size", "map".
  void CountShmRefused(std::string_view reason);

 private:
  static int Index(Tier t) { return t == Tier::kG2 ? 1 : (t == Tier::kG3 ? 2 : 0); }

  prometheus::Family<prometheus::Counter>* bad_requests_;
  prometheus::Gauge* puts_in_flight_;
  prometheus::Counter* batch_gets_;
  prometheus::Counter* batch_puts_;
  prometheus::Counter* batch_get_keys_;
  prometheus::Counter* batch_put_keys_;
  prometheus::Gauge* shm_mapped_;
  prometheus::Counter* shm_get_bytes_;
  prometheus::Counter* shm_put_bytes_;
  prometheus::Family<prometheus::Counter>* shm_refused_;
  TierMetrics tiers_[3];
};

}  // namespace epd::kvstore
