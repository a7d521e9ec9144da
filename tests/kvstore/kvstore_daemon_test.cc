// epd-kvstore as a real process: SIGKILL + restart on the same data dir serves every
// acknowledged block bit-identical and never a torn one; concurrent clients never lose or mix
// values; /metrics carries the tier families; bad input is named and counted; SWA snapshots are
// routed over two daemons by consistent hashing.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvstore/kvstore_client.h"
#include "kvstore/sharded_kv_client.h"
#include "tests/kvstore/daemon_util.h"
#include "tests/kvstore/test_util.h"
#include "tests/testing/subprocess.h"

namespace epd::kvstore {
namespace {

using epd::testing::BinaryPath;
using epd::testing::HttpGet;
using epd::testing::Subprocess;
using epd::testing::TempDir;
using testing::Key;
using testing::Payload;

constexpr size_t kBlock = 64 * 890;

using testing::Daemon;

// Starts epd-kvstore on `data_dir`; `tag` names its log and port file inside `dir`.
void StartDaemon(const TempDir& dir, const std::string& data_dir, const std::string& tag, Daemon* d,
                 std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--g1-capacity-bytes", std::to_string(64 * kBlock),
                                "--swa-capacity-bytes", std::to_string(64 << 20)};
  args.insert(args.end(), extra.begin(), extra.end());
  testing::StartDaemonWith(dir, data_dir, tag, d, std::move(args));
}

// Value of one exposition line "name{labels} value" (labels written exactly as exposed).
double Scrape(int port, const std::string& series) {
  auto body = HttpGet(port, "/metrics");
  if (!body.has_value()) return -1;
  const size_t at = body->find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(body->substr(at + series.size() + 2));
}

std::string Value(int i) { return Payload(i, kBlock); }

TEST(KvStoreDaemonTest, SigkillThenRestartServesEveryAcknowledgedBlockBitIdentical) {
  TempDir dir;
  const std::string data = dir.File("data");
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run1", &d));
  // 40 blocks acknowledged before any trouble (half via G3, half via G1 write-back/demotion).
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE(d.client->Put(Tier::kG3, AsBytes(Key(i)), Value(i)).ok()) << i;
  }
  // Writers keep putting while the daemon is SIGKILLed under them.
  const testing::KilledWrites writes = testing::PutWhileKilling(
      d, [&] { return KvStoreClient::Create(d.target()); }, Value, 60);
  ASSERT_GE(writes.acked.size(), 10u);

  Daemon d2;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run2", &d2));
  for (int i = 0; i < 40; ++i) {
    auto g = d2.client->Get(Tier::kAuto, AsBytes(Key(i)));
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(g->found) << "acknowledged block " << i << " lost: " << MissReasonName(g->miss);
    EXPECT_EQ(g->value, Value(i)) << i;
  }
  ASSERT_NO_FATAL_FAILURE(
      testing::ExpectAckedServedAndAttemptsWholeOrAbsent(*d2.client, writes, Value));
  EXPECT_EQ(Scrape(d2.metrics_port, "epd_kv_checksum_failures_total{tier=\"g3\"}"), 0);
}

TEST(KvStoreDaemonTest, PutWhoseAckNeverArrivedIsAbsentAfterRestart) {
  TempDir dir;
  const std::string data = dir.File("data");
  {
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run1", &d));
    ASSERT_TRUE(d.client->Put(Tier::kG3, AsBytes(Key(1)), Value(1)).ok());
    d.proc.Signal(SIGKILL);
    ASSERT_TRUE(d.proc.Wait(std::chrono::seconds(10)).has_value());
  }
  {
    // This run holds every put for 30 s after receiving it: kill it with one in flight.
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run2", &d, {"--debug-put-delay-ms", "30000"}));
    absl::Status put_status;
    std::thread writer([&] { put_status = d.client->Put(Tier::kG3, AsBytes(Key(2)), Value(2)); });
    bool in_flight = false;
    for (int i = 0; i < 400 && !in_flight; ++i) {
      in_flight = Scrape(d.metrics_port, "epd_kv_puts_in_flight") == 1;
      if (!in_flight) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    ASSERT_TRUE(in_flight) << "the put never reached the daemon";
    d.proc.Signal(SIGKILL);
    ASSERT_TRUE(d.proc.Wait(std::chrono::seconds(10)).has_value());
    writer.join();
    EXPECT_FALSE(put_status.ok()) << "a put was acknowledged by a killed daemon";
  }
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run3", &d));
  auto g1 = d.client->Get(Tier::kAuto, AsBytes(Key(1)));
  ASSERT_TRUE(g1.ok());
  ASSERT_TRUE(g1->found);
  EXPECT_EQ(g1->value, Value(1));
  auto g2 = d.client->Get(Tier::kAuto, AsBytes(Key(2)));
  ASSERT_TRUE(g2.ok());
  EXPECT_FALSE(g2->found);
  EXPECT_EQ(g2->miss, MissReason::kAbsent);
}

TEST(KvStoreDaemonTest, SigtermDrainsToCleanExitAndDataSurvives) {
  TempDir dir;
  const std::string data = dir.File("data");
  {
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run1", &d));
    for (int i = 0; i < 5; ++i) {
      ASSERT_TRUE(d.client->Put(Tier::kAuto, AsBytes(Key(i)), Value(i)).ok());
    }
    d.proc.Signal(SIGTERM);
    auto rc = d.proc.Wait(std::chrono::seconds(15));
    ASSERT_TRUE(rc.has_value()) << "did not exit after SIGTERM";
    EXPECT_EQ(*rc, 0) << d.proc.ReadLog();
    EXPECT_NE(d.proc.ReadLog().find("draining"), std::string::npos);
  }
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run2", &d));
  for (int i = 0; i < 5; ++i) {
    auto g = d.client->Get(Tier::kAuto, AsBytes(Key(i)));
    ASSERT_TRUE(g.ok() && g->found) << i;
    EXPECT_EQ(g->value, Value(i));
    EXPECT_EQ(g->tier, Tier::kG3);  // G1 is memory only; after a restart G3 serves
  }
}

TEST(KvStoreDaemonTest, BadFlagsExitWithAClearError) {
  TempDir dir;
  Subprocess p = Subprocess::Start({BinaryPath("epd-kvstore"), "--data-dir", dir.File("d"),
                                    "--g1-capacity-bytes", "10", "--block-bytes", "56960"},
                                   dir.File("bad.log"));
  auto rc = p.Wait(std::chrono::seconds(15));
  ASSERT_TRUE(rc.has_value());
  EXPECT_NE(*rc, 0);
  EXPECT_NE(p.ReadLog().find("capacity_bytes"), std::string::npos) << p.ReadLog();
}

TEST(KvStoreDaemonTest, ConcurrentClientsNeverLoseOrMixValues) {
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d));
  constexpr int kThreads = 8;
  constexpr int kOps = 60;
  std::atomic<int> errors{0}, mixed{0};
  auto shared = KvStoreClient::Create(d.target());
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto own = KvStoreClient::Create(d.target());
      KvStoreClient* c = (t % 2 == 0) ? own.get() : shared.get();
      for (int i = 0; i < kOps; ++i) {
        const int same = i % 10;                // keys every thread writes
        const int mine = 10000 + t * 1000 + i;  // keys only this thread writes
        const Tier tier = (i % 3 == 0) ? Tier::kG2 : Tier::kG3;
        if (!c->Put(tier, AsBytes(Key(same)), Value(same)).ok()) ++errors;
        if (!c->Put(tier, AsBytes(Key(mine)), Value(mine)).ok()) ++errors;
        for (int k : {same, mine, 10000 + ((t + 1) % kThreads) * 1000 + i / 2}) {
          auto g = c->Get(tier, AsBytes(Key(k)));
          if (!g.ok()) {
            ++errors;
          } else if (g->found && g->value != Value(k)) {
            ++mixed;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(mixed.load(), 0);
  // Nothing acknowledged was lost.
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kOps; ++i) {
      const int k = 10000 + t * 1000 + i;
      const Tier tier = (i % 3 == 0) ? Tier::kG2 : Tier::kG3;
      auto g = d.client->Get(tier, AsBytes(Key(k)));
      ASSERT_TRUE(g.ok());
      ASSERT_TRUE(g->found) << k;
      EXPECT_EQ(g->value, Value(k));
    }
  }
}

TEST(KvStoreDaemonTest, MetricsLookupPinStatsAndBadInput) {
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d));
  std::vector<int32_t> tokens(64 * 4);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7);
  const auto chain = ChainHashes(tokens, 64, "fp");
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(d.client->Put(Tier::kG3, AsBytes(chain[i]), Value(i)).ok());
  }
  ASSERT_TRUE(d.client->Put(Tier::kG2, AsBytes(chain[1]), "swa-snapshot").ok());
  auto lookup = d.client->Lookup("fp", chain);
  ASSERT_TRUE(lookup.ok()) << lookup.status();
  EXPECT_EQ(lookup->cached_blocks, 2);
  EXPECT_TRUE(lookup->swa_snapshot_present);
  auto pinned = d.client->Pin(AsBytes(chain[0]), true);
  ASSERT_TRUE(pinned.ok() && *pinned);
  auto stats = d.client->Stats();
  ASSERT_TRUE(stats.ok());
  ASSERT_EQ(stats->size(), 3u);
  EXPECT_EQ((*stats)[2].tier, Tier::kG3);
  EXPECT_EQ((*stats)[2].entries, 2u);
  EXPECT_EQ((*stats)[2].bytes, 2 * kBlock);

  auto bad = d.client->Put(Tier::kG3, "short-key", "v");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.message()).find("16 bytes"), std::string::npos) << bad;
  auto miss = d.client->Get(Tier::kG3, AsBytes(chain[3]));
  ASSERT_TRUE(miss.ok());  // the process stays up and answers
  EXPECT_EQ(miss->miss, MissReason::kAbsent);

  const int p = d.metrics_port;
  EXPECT_EQ(Scrape(p, "epd_kv_bad_requests_total{reason=\"key_size\"}"), 1);
  EXPECT_EQ(Scrape(p, "epd_kv_puts_total{tier=\"g3\"}"), 2);
  EXPECT_EQ(Scrape(p, "epd_kv_puts_total{tier=\"g2\"}"), 1);
  EXPECT_EQ(Scrape(p, "epd_kv_bytes{tier=\"g3\"}"), 2.0 * kBlock);
  EXPECT_GE(Scrape(p, "epd_kv_lookups_total{tier=\"g1\"}"), 3);
  EXPECT_GE(Scrape(p, "epd_kv_hits_total{tier=\"g1\"}"), 2);
  EXPECT_EQ(Scrape(p, "epd_kv_misses_total{reason=\"absent\",tier=\"g3\"}"), 1);
  for (const char* family :
       {"epd_kv_evictions_total{tier=\"g1\"}", "epd_kv_ttl_expiries_total{tier=\"g2\"}",
        "epd_kv_checksum_failures_total{tier=\"g3\"}", "epd_kv_gets_total{tier=\"g3\"}"}) {
    EXPECT_GE(Scrape(p, family), 0) << family << " missing";
  }
  if (epd::testing::RunCommand("command -v promtool >/dev/null") == 0) {
    auto body = HttpGet(p, "/metrics");
    ASSERT_TRUE(body.has_value());
    std::ofstream(dir.File("scrape.txt")) << *body;
    std::string out;
    EXPECT_EQ(epd::testing::RunCommand(
                  "promtool check metrics < " + dir.File("scrape.txt") + " 2>&1", &out),
              0)
        << out;
  }
}

TEST(KvStoreDaemonTest, SwaSnapshotsAreShardedOverDaemonsByConsistentHashing) {
  TempDir dir;
  Daemon a, b;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data-a"), "a", &a));
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data-b"), "b", &b));
  ShardedSwaClient sharded({a.target(), b.target()});
  std::map<std::string, int> owned;
  for (int i = 0; i < 100; ++i) {
    const std::string key(AsBytes(Key(i)));
    ASSERT_TRUE(sharded.Put(key, Payload(i, 300)).ok());
    const std::string owner = sharded.OwnerOf(key);
    ++owned[owner];
    KvStoreClient* owner_client = owner == a.target() ? a.client.get() : b.client.get();
    KvStoreClient* other_client = owner == a.target() ? b.client.get() : a.client.get();
    auto on_owner = owner_client->Get(Tier::kG2, key);
    auto on_other = other_client->Get(Tier::kG2, key);
    ASSERT_TRUE(on_owner.ok() && on_other.ok());
    EXPECT_TRUE(on_owner->found);
    EXPECT_FALSE(on_other->found);
    auto routed = sharded.Get(key);
    ASSERT_TRUE(routed.ok());
    EXPECT_EQ(routed->value, Payload(i, 300));
  }
  EXPECT_GT(owned[a.target()], 25);
  EXPECT_GT(owned[b.target()], 25);
}


// Several daemons as one store (kvstore/sharded_kv_client.h): blocks and snapshots live on their
// owner of the hash ring; Lookup finds the whole prefix across daemons; when one daemon dies its
// share becomes a miss (Lookup ends there, its gets fail fast once marked down), the other
// daemon's share stays readable and writable.
TEST(KvStoreDaemonTest, ShardedClientPlacesKeysOnTheRingAndALostDaemonIsOnlyItsShare) {
  TempDir dir;
  Daemon a, b;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data-a"), "a", &a));
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data-b"), "b", &b));
  KvClientOptions o;
  o.deadline_ms = 2000;
  auto made = ShardedKvClient::Create({a.target(), b.target()}, o, {.retry_after_ms = 60000});
  ASSERT_TRUE(made.ok()) << made.status();
  ShardedKvClient& store = **made;
  EXPECT_FALSE(ShardedKvClient::Create({a.target(), a.target()}).ok());
  EXPECT_FALSE(ShardedKvClient::Create({"nohostport"}).ok());
  EXPECT_EQ(ShardedKvClient::ParseTargets(" x:1, y:2 ,,"), (std::vector<std::string>{"x:1", "y:2"}));

  constexpr int kBlocks = 40;
  std::vector<BlockHash> chain;
  std::map<std::string, int> owned;
  for (int i = 0; i < kBlocks; ++i) {
    chain.push_back(Key(i));
    const std::string key(AsBytes(Key(i)));
    ASSERT_TRUE(store.Put(Tier::kG3, key, Payload(i, 200)).ok());
    const std::string owner = store.OwnerOf(key);
    ++owned[owner];
    KvStoreClient* other = owner == a.target() ? b.client.get() : a.client.get();
    auto there = other->Get(Tier::kG3, key);
    ASSERT_TRUE(there.ok());
    EXPECT_FALSE(there->found) << "block " << i << " is on both daemons";
  }
  ASSERT_GT(owned[a.target()], 5);
  ASSERT_GT(owned[b.target()], 5);
  auto all = store.Lookup("fp", chain);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->cached_blocks, kBlocks);
  // A gap on one daemon ends the prefix there.
  std::vector<BlockHash> gapped = chain;
  gapped.insert(gapped.begin() + 7, Key(9999));
  auto cut = store.Lookup("fp", gapped);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(cut->cached_blocks, 7);

  // b dies: the prefix ends at b's first block; a's blocks stay readable; b's fail (fast after
  // the first failure) and nothing blocks a's writes.
  b.proc.Signal(SIGKILL);
  b.proc.Wait(std::chrono::seconds(10));
  int first_b = -1;
  for (int i = 0; i < kBlocks && first_b < 0; ++i)
    if (store.OwnerOf(AsBytes(Key(i))) == b.target()) first_b = i;
  ASSERT_GE(first_b, 0);
  auto after = store.Lookup("fp", chain);
  if (first_b == 0) {
    EXPECT_FALSE(after.ok());
  } else {
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->cached_blocks, first_b);
  }
  for (int i = 0; i < kBlocks; ++i) {
    const std::string key(AsBytes(Key(i)));
    auto got = store.Get(Tier::kG3, key);
    if (store.OwnerOf(key) == a.target()) {
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->value, Payload(i, 200));
    } else {
      EXPECT_TRUE(absl::IsUnavailable(got.status()) || absl::IsDeadlineExceeded(got.status()))
          << got.status();
    }
  }
  EXPECT_GT(store.skipped_calls(), 0u) << "b's keys were not skipped after it failed";
  for (int i = kBlocks; i < kBlocks + 20; ++i) {
    const std::string key(AsBytes(Key(i)));
    absl::Status s = store.Put(Tier::kG3, key, Payload(i, 50));
    EXPECT_EQ(s.ok(), store.OwnerOf(key) == a.target()) << s;
  }
}

}  // namespace
}  // namespace epd::kvstore
