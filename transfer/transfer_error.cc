#include "transfer/transfer_error.h"

#include "absl/strings/cord.h"

namespace epd::transfer {
namespace {
constexpr absl::string_view kReasonUrl = "type.epd.dev/transfer.reason";
constexpr absl::string_view kFieldUrl = "type.epd.dev/transfer.field";
}  // namespace

absl::Status WithTransferError(absl::Status status, absl::string_view reason,
                               absl::string_view field) {
  if (status.ok()) return status;
  status.SetPayload(kReasonUrl, absl::Cord(reason));
  if (field.empty()) {
    status.ErasePayload(kFieldUrl);
  } else {
    status.SetPayload(kFieldUrl, absl::Cord(field));
  }
  return status;
}

std::optional<TransferErrorInfo> TransferErrorOf(const absl::Status& status) {
  auto reason = status.GetPayload(kReasonUrl);
  if (!reason.has_value()) return std::nullopt;
  TransferErrorInfo info;
  info.reason = std::string(*reason);
  if (auto field = status.GetPayload(kFieldUrl)) info.field = std::string(*field);
  return info;
}

}  // namespace epd::transfer
