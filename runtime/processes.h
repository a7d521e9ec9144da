#pragma once

// Finding processes by their command line (read from /proc): `epd chaos` and the `epd serve`
// tests use it to list a cluster's processes, and its orphans, by their data directory.

#include <sys/types.h>

#include <set>
#include <string>

namespace epd::runtime {

// Live (not zombie) processes whose command line contains `needle`, except `except` and this
// process.
std::set<pid_t> ProcessesNaming(const std::string& needle, pid_t except);

}  // namespace epd::runtime
