#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "common/clock.h"
#include "common/fingerprint.h"
#include "common/hash.h"
#include "common/memory_limit.h"
#include "common/status_macros.h"

namespace epd::common {
namespace {

TEST(HashTest, Xxh3IsStableAcrossRuns) {
  // Published xxHash3 test vector: XXH3_64bits("", 0) = 0x2D06800538D394C2.
  EXPECT_EQ(Xxh3_64(std::string_view("")), 0x2D06800538D394C2ull);
  EXPECT_NE(Xxh3_64(std::string_view("a")), Xxh3_64(std::string_view("b")));
}

TEST(HashTest, HexOf128BitDigest) {
  std::string s = "epd";
  auto d = Xxh3_128(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
  std::string hex = ToHex(d);
  EXPECT_EQ(hex.size(), 32u);
  EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos);
}

TEST(FingerprintTest, KeyOrderAndWhitespaceDoNotMatter) {
  std::string a = CanonicalJson(R"({"b": 1, "a": [1, 2]})");
  std::string b = CanonicalJson(R"({"a":[1,2],"b":1})");
  EXPECT_EQ(a, b);
  EXPECT_EQ(ConfigFingerprint({a, 1, true}), ConfigFingerprint({b, 1, true}));
}

TEST(FingerprintTest, EveryInputChangesIt) {
  std::string cfg = CanonicalJson(R"({"hidden_size":256})");
  std::string base = ConfigFingerprint({cfg, 1, true});
  EXPECT_NE(base, ConfigFingerprint({cfg, 1, false}));
  EXPECT_NE(base, ConfigFingerprint({cfg, 2, true}));
  EXPECT_NE(base, ConfigFingerprint({CanonicalJson(R"({"hidden_size":257})"), 1, true}));
}

TEST(FingerprintTest, MalformedJsonGivesEmpty) { EXPECT_EQ(CanonicalJson("{nope"), ""); }

TEST(ClockTest, FakeClockMovesOnlyWhenTold) {
  FakeClock clock(1000);
  EXPECT_EQ(clock.NowUnixMs(), 1000);
  clock.AdvanceMs(60'000);
  EXPECT_EQ(clock.NowUnixMs(), 61'000);
  EXPECT_EQ(clock.NowMonoNs(), 60'000'000'000);
}

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}
absl::Status UseHalf(int x, int* out) {
  ASSIGN_OR_RETURN(*out, Half(x));
  RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, PropagateErrors) {
  int v = 0;
  EXPECT_TRUE(UseHalf(8, &v).ok());
  EXPECT_EQ(v, 4);
  auto s = UseHalf(3, &v);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd");
}


// Default sizes come from the memory the process may use: a cgroup limit's text parsed as the
// kernel writes it (v2 "max", v1's page-rounded 2^63 for no limit), and the usable figure never
// above the host's memory nor above this process's cgroup limit when it has one.
TEST(MemoryLimitTest, CgroupLimitsAreParsedAndCapTheHostsMemory) {
  EXPECT_EQ(ParseCgroupLimit("max\n"), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("4294967296\n"), int64_t{4} << 30);
  EXPECT_EQ(ParseCgroupLimit("9223372036854771712\n"), std::nullopt);  // v1: no limit
  EXPECT_EQ(ParseCgroupLimit(""), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("12x"), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("-5"), std::nullopt);
  const int64_t host = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  const int64_t usable = UsableMemoryBytes();
  EXPECT_GT(usable, 0);
  EXPECT_LE(usable, host);
  std::ifstream v2("/sys/fs/cgroup/memory.max");
  if (v2) {
    std::stringstream ss;
    ss << v2.rdbuf();
    if (auto limit = ParseCgroupLimit(ss.str())) {
      EXPECT_LE(usable, *limit);
    }
  }
}

}  // namespace
}  // namespace epd::common
