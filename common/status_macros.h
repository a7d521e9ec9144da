#pragma once

// Status propagation helpers in the absl style (no exceptions across module boundaries).
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define EPD_CONCAT_INNER_(a, b) a##b
#define EPD_CONCAT_(a, b) EPD_CONCAT_INNER_(a, b)

// RETURN_IF_ERROR(expr): returns the status of `expr` from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                                   \
  do {                                                          \
    ::absl::Status epd_status_ = (expr);                        \
    if (!epd_status_.ok()) return epd_status_;                  \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): evaluates a StatusOr, returns its status on error,
// otherwise moves the value into `lhs` (which may be a declaration).
#define ASSIGN_OR_RETURN(lhs, expr) \
  EPD_ASSIGN_OR_RETURN_IMPL_(EPD_CONCAT_(epd_statusor_, __LINE__), lhs, expr)
#define EPD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
