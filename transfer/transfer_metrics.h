#pragma once

// Prometheus metrics of the transfer engine. Families are registered once per registry and shared
// by every engine using it. Thread-safe.
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace epd::transfer {

class TransferMetrics {
 public:
  explicit TransferMetrics(prometheus::Registry& registry);

  // direction: "send" | "recv".
  void AddBytes(absl::string_view segment, absl::string_view transport, absl::string_view direction,
                double bytes);
  void ObserveDuration(absl::string_view segment, absl::string_view transport,
                       absl::string_view direction, double seconds);
  void AddFailure(absl::string_view segment, absl::string_view transport, absl::string_view reason);
  void AddAccountingError(absl::string_view segment);
  void AddHandshakeRefused(absl::string_view reason);
  void SetSelfTestBandwidth(absl::string_view transport, double bytes_per_second);

  prometheus::Gauge& registrations() { return *registrations_; }
  prometheus::Gauge& allocations() { return *allocations_; }
  prometheus::Gauge& live_transfers() { return *live_transfers_; }

 private:
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Counter>& failures_;
  prometheus::Family<prometheus::Counter>& accounting_;
  prometheus::Family<prometheus::Counter>& handshake_;
  prometheus::Family<prometheus::Gauge>& selftest_;
  prometheus::Gauge* registrations_;
  prometheus::Gauge* allocations_;
  prometheus::Gauge* live_transfers_;
};

}  // namespace epd::transfer
