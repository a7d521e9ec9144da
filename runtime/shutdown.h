#pragma once

// Graceful shutdown: SIGTERM/SIGINT flip a process-wide flag and wake waiters. The process then
// drains (stops taking work, finishes what it has within a deadline) and exits 0.
#include <chrono>

namespace epd::runtime {

// Installs the handlers. Call once from main() before starting threads.
void InstallShutdownHandlers();

// True once SIGTERM or SIGINT arrived (or RequestShutdown was called).
bool ShutdownRequested();

// Blocks until shutdown is requested or `timeout` passes; returns ShutdownRequested().
bool WaitForShutdown(std::chrono::milliseconds timeout);

// Triggers shutdown from inside the process (tests, fatal errors).
void RequestShutdown();

}  // namespace epd::runtime
