#pragma once

// The CPU backend's graphs (CpuBackendOptions::graphs; recording_backend.cc).
#include <map>
#include <memory>
#include <string>

#include "kernels/backend.h"

namespace epd::kernels::cpu {

// `cpu` (a CPU backend made without op_calls) with Backend::BeginCapture / EndCapture /
// LaunchGraph: ops recorded as closures. `op_calls` (optional): counts as CpuBackendOptions says.
std::unique_ptr<Backend> MakeRecordingBackend(std::unique_ptr<Backend> cpu,
                                              std::map<std::string, int64_t>* op_calls);

}  // namespace epd::kernels::cpu
