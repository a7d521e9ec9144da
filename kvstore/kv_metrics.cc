#include "kvstore/kv_metrics.h"

#include <string>

namespace epd::kvstore {

KvMetrics::KvMetrics(prometheus::Registry& registry) {
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(registry);
  };
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(registry);
  };
  auto* lookups = counter("epd_kv_lookups_total", "Key probes per tier (gets and prefix lookups)");
  auto* hits = counter("epd_kv_hits_total", "Key probes that found a servable value, per tier");
  auto* evictions = counter("epd_kv_evictions_total", "Entries evicted for capacity, per tier");
  auto* expiries = counter("epd_kv_ttl_expiries_total", "Entries dropped because their TTL passed");
  auto* checksum = counter("epd_kv_checksum_failures_total",
                           "Stored values that failed verification (served as a miss)");
  auto* puts = counter("epd_kv_puts_total", "Values stored, per tier");
  auto* gets = counter("epd_kv_gets_total", "Get requests, per tier");
  auto* put_bytes = counter("epd_kv_put_bytes_total", "Payload bytes stored, per tier");
  auto* get_bytes = counter("epd_kv_get_bytes_total", "Payload bytes served, per tier");
  auto* demotions = counter("epd_kv_demotions_total", "G1 blocks written to G3 on eviction");
  auto* misses = counter("epd_kv_misses_total", "Gets that returned nothing, per tier and reason");
  auto* bytes = gauge("epd_kv_bytes", "Payload bytes held, per tier");
  auto* entries = gauge("epd_kv_entries", "Entries held, per tier");
  auto* capacity = gauge("epd_kv_capacity_bytes", "Configured capacity, per tier");
  puts_in_flight_ =
      &gauge("epd_kv_puts_in_flight", "Put requests received and not yet answered")->Add({});
  auto* batch_calls = counter("epd_kv_batch_calls_total", "Batched get/put calls, per op");
  batch_gets_ = &batch_calls->Add({{"op", "get"}});
  batch_puts_ = &batch_calls->Add({{"op", "put"}});
  auto* batch_keys = counter("epd_kv_batch_keys_total", "Keys of batched get/put calls, per op");
  batch_get_keys_ = &batch_keys->Add({{"op", "get"}});
  batch_put_keys_ = &batch_keys->Add({{"op", "put"}});
  shm_mapped_ = &gauge("epd_kv_shm_segments_mapped",
                       "Client shared-memory segments mapped by the daemon right now")
                     ->Add({});
  auto* shm_bytes =
      counter("epd_kv_shm_bytes_total", "Value bytes moved through client shared-memory segments");
  shm_get_bytes_ = &shm_bytes->Add({{"direction", "get"}});
  shm_put_bytes_ = &shm_bytes->Add({{"direction", "put"}});
  shm_refused_ = counter("epd_kv_shm_refused_total",
                         "Shared-memory segments offered by a client and not used, per reason");
  bad_requests_ = counter("epd_kv_bad_requests_total", "Rejected requests, per reason");
  for (Tier t : {Tier::kG1, Tier::kG2, Tier::kG3}) {
    const std::string label(TierLabel(t));
    const std::map<std::string, std::string> labels{{"tier", label}};
    TierMetrics& m = tiers_[Index(t)];
    m.lookups = &lookups->Add(labels);
    m.hits = &hits->Add(labels);
    m.evictions = &evictions->Add(labels);
    m.ttl_expiries = &expiries->Add(labels);
    m.checksum_failures = &checksum->Add(labels);
    m.puts = &puts->Add(labels);
    m.gets = &gets->Add(labels);
    m.put_bytes = &put_bytes->Add(labels);
    m.get_bytes = &get_bytes->Add(labels);
    m.demotions = &demotions->Add(labels);
    m.bytes = &bytes->Add(labels);
    m.entries = &entries->Add(labels);
    m.capacity_bytes = &capacity->Add(labels);
    m.miss_absent = &misses->Add({{"tier", label}, {"reason", "absent"}});
    m.miss_expired = &misses->Add({{"tier", label}, {"reason", "expired"}});
    m.miss_checksum = &misses->Add({{"tier", label}, {"reason", "checksum"}});
  }
}

void KvMetrics::CountMiss(Tier t, MissReason reason) {
  TierMetrics& m = tier(t);
  switch (reason) {
    case MissReason::kAbsent:
      m.miss_absent->Increment();
      break;
    case MissReason::kExpired:
      m.miss_expired->Increment();
      break;
    case MissReason::kChecksum:
      m.miss_checksum->Increment();
      break;
    case MissReason::kNone:
      break;
  }
}

void KvMetrics::CountShmRefused(std::string_view reason) {
  shm_refused_->Add({{"reason", std::string(reason)}}).Increment();
}

void KvMetrics::CountBadRequest(std::string_view reason) {
  bad_requests_->Add({{"reason", std::string(reason)}}).Increment();
}

}  // namespace epd::kvstore
