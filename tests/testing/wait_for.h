#pragma once

// Polling for a condition in tests that watch real processes (a log line, a metric, a port file).
#include <chrono>
#include <thread>

namespace epd::testing {

// Polls `done` every `every` up to `limit`; true once it held (it is asked once more at the end).
template <typename F>
bool WaitFor(F done, std::chrono::seconds limit,
             std::chrono::milliseconds every = std::chrono::milliseconds(100)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(every);
  }
  return done();
}

}  // namespace epd::testing
