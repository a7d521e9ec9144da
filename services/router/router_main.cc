// epd-router: the front door. This version runs the process runtime (/metrics, /health, drain);
// the OpenAI HTTP API, gRPC API and scheduler grow here (issue: end-to-end serving).
#include <CLI/CLI.hpp>
#include <iostream>

#include <spdlog/spdlog.h>

#include "services/runtime/process.h"
#include "services/runtime/shutdown.h"

int main(int argc, char** argv) {
  CLI::App app{"epd-router: OpenAI HTTP + gRPC front end of epd"};
  epd::services::RuntimeOptions runtime_options;
  epd::services::AddRuntimeFlags(app, &runtime_options);
  CLI11_PARSE(app, argc, argv);

  epd::services::ProcessRuntime runtime("epd-router", runtime_options);
  if (auto s = runtime.Start(); !s.ok()) {
    std::cerr << "epd-router: " << s.message() << "\n";
    return 1;
  }
  while (!epd::services::WaitForShutdown(std::chrono::milliseconds(500))) {
  }
  spdlog::info("epd-router: shutdown requested, draining");
  return 0;
}
