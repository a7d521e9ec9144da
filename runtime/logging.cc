#include "runtime/logging.h"

#include <cstdlib>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace epd::runtime {

absl::Status InitLogging(std::string_view process_name, std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError("unknown log level '" + std::string(level) +
                                      "' (use trace, debug, info, warn, error)");
  }
  auto logger = spdlog::stderr_logger_mt(std::string(process_name) + "-" +
                                         std::to_string(reinterpret_cast<uintptr_t>(&level)));
  const char* fmt = std::getenv("EPD_LOG_FORMAT");
  if (fmt && std::string_view(fmt) == "text") {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ " + std::string(process_name) + "[%P] %v");
  } else {
    // Messages are free text; keep them JSON-safe by convention (no raw quotes in %v is not
    // guaranteed, so consumers should treat msg as a string token up to the closing "}").
    logger->set_pattern(R"({"ts":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l","proc":")" +
                            std::string(process_name) + R"(","pid":%P,"msg":"%v"})",
                        spdlog::pattern_time_type::utc);
  }
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return absl::OkStatus();
}

}  // namespace epd::runtime
