#pragma once

namespace epd::services {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace epd::services
