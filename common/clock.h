#pragma once

// Injectable time source. Production code takes a Clock&; tests pass a FakeClock and never sleep.
#include <atomic>
#include <chrono>
#include <cstdint>

namespace epd::common {

class Clock {
 public:
  virtual ~Clock() = default;
  // Milliseconds since the Unix epoch (wall time: used for TTLs that survive restarts).
  virtual int64_t NowUnixMs() const = 0;
  // Monotonic nanoseconds (for durations and deadlines within one process).
  virtual int64_t NowMonoNs() const = 0;
};

// The real clock. Thread-safe.
class SystemClock final : public Clock {
 public:
  int64_t NowUnixMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  int64_t NowMonoNs() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  static SystemClock& Get() {
    static SystemClock clock;
    return clock;
  }
};

// A clock that moves only when told to. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(int64_t start_unix_ms = 1'700'000'000'000) : unix_ms_(start_unix_ms) {}
  int64_t NowUnixMs() const override { return unix_ms_.load(); }
  int64_t NowMonoNs() const override { return mono_ns_.load(); }
  void AdvanceMs(int64_t ms) {
    unix_ms_ += ms;
    mono_ns_ += ms * 1'000'000;
  }

 private:
  std::atomic<int64_t> unix_ms_;
  std::atomic<int64_t> mono_ns_{0};
};

}  // namespace epd::common
