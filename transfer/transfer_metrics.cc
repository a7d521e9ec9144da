#include "transfer/transfer_metrics.h"

namespace epd::transfer {
namespace {
std::string S(absl::string_view v) { return std::string(v); }
}  // namespace

TransferMetrics::TransferMetrics(prometheus::Registry& registry)
    : bytes_(prometheus::BuildCounter()
                 .Name("epd_transfer_bytes_total")
                 .Help("Payload bytes moved by KV transfers, per segment kind and transport")
                 .Register(registry)),
      duration_(prometheus::BuildHistogram()
                    .Name("epd_transfer_duration_seconds")
                    .Help("Time from claim to the last byte of a segment kind (recv) or to the "
                          "receiver's confirmation (send)")
                    .Register(registry)),
      failures_(prometheus::BuildCounter()
                    .Name("epd_transfer_failures_total")
                    .Help("Failed KV transfers, per segment kind, transport and reason")
                    .Register(registry)),
      accounting_(prometheus::BuildCounter()
                      .Name("epd_transfer_accounting_errors_total")
                      .Help("Offers whose manifest or checksums differ from the receiver's own "
                            "expectation, per segment kind")
                      .Register(registry)),
      handshake_(prometheus::BuildCounter()
                     .Name("epd_transfer_handshake_refused_total")
                     .Help("Connections refused at handshake, per reason")
                     .Register(registry)),
      selftest_(prometheus::BuildGauge()
                    .Name("epd_transfer_selftest_bandwidth_bytes_per_second")
                    .Help("Bandwidth measured by the startup self-test, per transport")
                    .Register(registry)) {
  auto& gauges = prometheus::BuildGauge()
                     .Name("epd_transfer_outstanding")
                     .Help("Outstanding transfer resources (registrations, allocations, transfers)")
                     .Register(registry);
  registrations_ = &gauges.Add({{"resource", "registrations"}});
  allocations_ = &gauges.Add({{"resource", "allocations"}});
  live_transfers_ = &gauges.Add({{"resource", "transfers"}});
}

void TransferMetrics::AddBytes(absl::string_view segment, absl::string_view transport,
                               absl::string_view direction, double bytes) {
  bytes_.Add({{"segment", S(segment)}, {"transport", S(transport)}, {"direction", S(direction)}})
      .Increment(bytes);
}

void TransferMetrics::ObserveDuration(absl::string_view segment, absl::string_view transport,
                                      absl::string_view direction, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30};
  duration_
      .Add({{"segment", S(segment)}, {"transport", S(transport)}, {"direction", S(direction)}},
           kBuckets)
      .Observe(seconds);
}

void TransferMetrics::AddFailure(absl::string_view segment, absl::string_view transport,
                                 absl::string_view reason) {
  failures_.Add({{"segment", S(segment)}, {"transport", S(transport)}, {"reason", S(reason)}})
      .Increment();
}

void TransferMetrics::AddAccountingError(absl::string_view segment) {
  accounting_.Add({{"segment", S(segment)}}).Increment();
}

void TransferMetrics::AddHandshakeRefused(absl::string_view reason) {
  handshake_.Add({{"reason", S(reason)}}).Increment();
}

void TransferMetrics::SetSelfTestBandwidth(absl::string_view transport, double bytes_per_second) {
  selftest_.Add({{"transport", S(transport)}}).Set(bytes_per_second);
}

}  // namespace epd::transfer
