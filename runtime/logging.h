#pragma once

// Structured logging for every epd process: one JSON object per line on stderr
// ({"ts":..,"level":..,"proc":..,"msg":..}), or plain text when EPD_LOG_FORMAT=text.
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace epd::runtime {

// Configures the default spdlog logger. `level`: trace|debug|info|warn|error. Thread-safe after.
absl::Status InitLogging(std::string_view process_name, std::string_view level);

}  // namespace epd::runtime
