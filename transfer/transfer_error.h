#pragma once

// Why a transfer failed, in machine-readable form: the transfer engine attaches it to the
// absl::Status it returns (a status payload), so callers branch on it and label metrics with it
// instead of matching the message text, which is for people and may change.
//
//   reason: the engine's failure label (the `reason` of epd_transfer_failures_total): checksum,
//           truncated, accounting, rejected, rejected_accounting, lease_expired, handshake,
//           cancelled, shutdown, ...
//   field:  for an accounting failure, the manifest field that differed (dspark, byte_length,
//           checksum, ...); empty otherwise.
//
// A status rebuilt from another one's message loses the payload: pass statuses on as they are.

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace epd::transfer {

struct TransferErrorInfo {
  std::string reason;
  std::string field;
};

// `status` with `reason` and `field` attached (an OK status is returned unchanged).
absl::Status WithTransferError(absl::Status status, absl::string_view reason,
                               absl::string_view field = {});
// What WithTransferError attached, if anything.
std::optional<TransferErrorInfo> TransferErrorOf(const absl::Status& status);

}  // namespace epd::transfer
