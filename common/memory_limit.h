#pragma once

// The memory this process may use: the host's physical memory, capped by the cgroup's limit
// (v2 memory.max, else v1 memory.limit_in_bytes) when the process runs in one (a container, a
// Kubernetes pod with a memory limit). Default sizes (the KV pool, the G2 pool) derive from it,
// so a process in a 4 GiB pod on a 1 TiB host does not size itself for the host and get
// OOM-killed. Thread-safe.
#include <cstdint>
#include <optional>
#include <string_view>

namespace epd::common {

// min(physical memory, the cgroup's limit); 0 when the OS says neither.
int64_t UsableMemoryBytes();

// The limit in a cgroup limit file's text: "max\n" (v2) or a v1 "unlimited" value (>= 2^60)
// -> nullopt; a byte count -> it; anything else -> nullopt.
std::optional<int64_t> ParseCgroupLimit(std::string_view text);

}  // namespace epd::common
