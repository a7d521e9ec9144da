#pragma once

namespace epd::runtime {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace epd::runtime
