#include "common/memory_limit.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <string>

namespace epd::common {
namespace {

std::optional<int64_t> ReadLimit(const char* path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseCgroupLimit(ss.str());
}

}  // namespace

std::optional<int64_t> ParseCgroupLimit(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  if (text.empty() || text == "max") return std::nullopt;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v <= 0) return std::nullopt;
  if (v >= (int64_t{1} << 60)) return std::nullopt;  // cgroup v1's "no limit" (page-rounded max)
  return v;
}

int64_t UsableMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  int64_t bytes = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  std::optional<int64_t> limit = ReadLimit("/sys/fs/cgroup/memory.max");
  if (!limit) limit = ReadLimit("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  if (limit) bytes = bytes > 0 ? std::min(bytes, *limit) : *limit;
  return bytes;
}

}  // namespace epd::common
