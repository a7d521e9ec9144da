// The UCX bulk path of epd-kvstore, against the real daemon process over real UCX on 127.0.0.1:
// bit-identical round trips of several sizes (0 B to multi-MiB, several 4 MiB chunks), small
// values inline, corrupt/truncated transfers fail only their request (named, counted, nothing
// visible, nothing leaked), a client SIGKILLed mid-put leaves nothing and the daemon serves the
// next client, SIGKILL + restart keeps every acknowledged bulk put, concurrent bulk clients.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/cluster_secret.h"
#include "kvstore/bulk.h"
#include "kvstore/kvstore_client.h"
#include "transfer/fault_wire.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx_wire.h"
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

void StartDaemon(const TempDir& dir, const std::string& data_dir, const std::string& tag, Daemon* d,
                 std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--g1-capacity-bytes",  std::to_string(64 * kBlock),
                                "--swa-capacity-bytes", std::to_string(256 << 20),
                                "--bulk-deadline-ms",   "10000"};
  args.insert(args.end(), extra.begin(), extra.end());
  testing::StartDaemonWith(dir, data_dir, tag, d, std::move(args));
}

// Sum of every exposed sample of `family` whose label text contains all of `labels`
// (e.g. {"direction=\"put\"", "reason=\"checksum\""}). -1 when /metrics cannot be read.
double Scrape(int port, const std::string& family, const std::vector<std::string>& labels = {}) {
  auto body = HttpGet(port, "/metrics");
  if (!body.has_value()) return -1;
  std::istringstream in(*body);
  std::string line;
  double total = 0;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, family + "{") && !absl::StartsWith(line, family + " ")) continue;
    bool match = true;
    for (const auto& l : labels) match &= absl::StrContains(line, l);
    if (match) total += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return total;
}

// Polls until the daemon's transfer engine holds no transfer and no registered memory.
bool DaemonTransfersDrain(int port) {
  for (int i = 0; i < 200; ++i) {
    if (Scrape(port, "epd_transfer_outstanding", {"resource=\"transfers\""}) == 0 &&
        Scrape(port, "epd_transfer_outstanding", {"resource=\"registrations\""}) == 0)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

// Polls until Scrape(...) >= want (the daemon collects a get's outcome in the background).
double WaitForAtLeast(int port, const std::string& family, const std::vector<std::string>& labels,
                      double want) {
  double v = -1;
  for (int i = 0; i < 200; ++i) {
    v = Scrape(port, family, labels);
    if (v >= want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return v;
}

KvClientOptions Bulk(uint64_t min_bytes = 0) {
  KvClientOptions o;
  o.bulk = BulkTransport::kUcx;
  o.bulk_min_bytes = min_bytes;
  return o;
}

// The inline client these tests compare with (kUcx is the default).
KvClientOptions Inline() {
  KvClientOptions o;
  o.bulk = BulkTransport::kInline;
  return o;
}

std::string Value(int i) { return Payload(i, kBlock); }

TEST(KvStoreBulkTest, RoundTripIsBitIdenticalForEverySizeAndTier) {
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d));
  auto bulk = KvStoreClient::Create(d.target(), Bulk());
  auto inline_client = KvStoreClient::Create(d.target(), Inline());
  const std::vector<size_t> sizes = {0, 1, 4095, kBlock, (1 << 20) + 7, (9 << 20) + 3};
  uint64_t total = 0;
  int key = 0;
  for (Tier tier : {Tier::kG3, Tier::kG2}) {
    for (size_t n : sizes) {
      const std::string v = Payload(1000 + key, n);
      const std::string k(AsBytes(Key(key++)));
      ASSERT_TRUE(bulk->Put(tier, k, v).ok()) << n;
      auto g = bulk->Get(tier, k);
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_TRUE(g->found) << n;
      EXPECT_EQ(g->value.size(), n);
      EXPECT_TRUE(g->value == v) << "bulk get of " << n << " bytes differs";
      // What the bulk put stored is what an inline reader sees.
      auto gi = inline_client->Get(tier, k);
      ASSERT_TRUE(gi.ok() && gi->found) << n;
      EXPECT_TRUE(gi->value == v) << "inline get of a bulk put of " << n << " bytes differs";
      total += n;
    }
  }
  // The bytes really went over UCX, both ways (the engine counts what it moved).
  EXPECT_GE(Scrape(d.metrics_port, "epd_transfer_bytes_total", {"direction=\"recv\""}), total);
  EXPECT_GE(Scrape(d.metrics_port, "epd_transfer_bytes_total", {"direction=\"send\""}), total);
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_transfer_errors_total"), 0);
  EXPECT_EQ(bulk->transfer_errors(), 0);
  EXPECT_TRUE(DaemonTransfersDrain(d.metrics_port));

  // Below the threshold, values stay inline: no transfer bytes move.
  auto thresholded = KvStoreClient::Create(d.target(), Bulk(64 << 10));
  const double before = Scrape(d.metrics_port, "epd_transfer_bytes_total");
  const std::string small = Payload(7, 1000);
  ASSERT_TRUE(thresholded->Put(Tier::kG3, AsBytes(Key(500)), small).ok());
  auto gs = thresholded->Get(Tier::kG3, AsBytes(Key(500)));
  ASSERT_TRUE(gs.ok() && gs->found);
  EXPECT_EQ(gs->value, small);
  EXPECT_EQ(Scrape(d.metrics_port, "epd_transfer_bytes_total"), before);
  // A miss over bulk is a plain miss.
  auto miss = bulk->Get(Tier::kG3, AsBytes(Key(501)));
  ASSERT_TRUE(miss.ok());
  EXPECT_FALSE(miss->found);
  EXPECT_EQ(miss->miss, MissReason::kAbsent);
}

TEST(KvStoreBulkTest, RoundTripOverTheUcxTcpListener) {
  // --ucx-listener: the daemon's endpoint is a UCX sockaddr listener (how remote clients reach it).
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d, {"--ucx-listener"}));
  auto bulk = KvStoreClient::Create(d.target(), Bulk());
  int key = 0;
  for (size_t n : {size_t{0}, kBlock, size_t{(5 << 20) + 1}}) {
    const std::string v = Payload(50 + key, n);
    const std::string k(AsBytes(Key(key++)));
    absl::Status put = bulk->Put(Tier::kG3, k, v);
    ASSERT_TRUE(put.ok()) << n << ": " << put << "\n" << d.proc.ReadLog();
    auto g = bulk->Get(Tier::kG3, k);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(g->found);
    EXPECT_TRUE(g->value == v) << n;
  }
  EXPECT_GE(Scrape(d.metrics_port, "epd_transfer_bytes_total", {"transport=\"tcp\""}),
            kBlock + (5 << 20) + 1);
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_transfer_errors_total"), 0);
}

TEST(KvStoreBulkTest, CorruptOrTruncatedPutFailsOnlyThatRequestNamedAndCounted) {
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d));
  struct Case {
    transfer::FaultPlan::Action action;
    std::string reason;
  };
  int key = 0;
  for (const Case& c : {Case{transfer::FaultPlan::Action::kCorrupt, "checksum"},
                        Case{transfer::FaultPlan::Action::kTruncate, "truncated"}}) {
    SCOPED_TRACE(c.reason);
    KvClientOptions o = Bulk();
    transfer::FaultPlan plan;
    plan.action = c.action;
    plan.target = transfer::FaultPlan::Target::kData;
    plan.nth = 0;
    plan.corrupt_offset = 12345;
    o.debug_wrap_wire = [plan](std::unique_ptr<transfer::Wire> inner) {
      return transfer::MakeFaultWire(std::move(inner), plan);
    };
    auto faulty = KvStoreClient::Create(d.target(), o);
    const std::string k(AsBytes(Key(key++)));
    absl::Status s = faulty->Put(Tier::kG3, k, Payload(1, 3 << 20));
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(absl::StrContains(s.message(), c.reason == "checksum" ? "checksum" : "bytes")) << s;
    EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_transfer_errors_total",
                     {"direction=\"put\"", "reason=\"" + c.reason + "\""}),
              1)
        << HttpGet(d.metrics_port, "/metrics").value_or("");
    // Nothing of it is visible, and the daemon serves the next (healthy) client.
    auto clean = KvStoreClient::Create(d.target(), Bulk());
    auto g = clean->Get(Tier::kAuto, k);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_FALSE(g->found);
    const std::string good = Payload(2, 3 << 20);
    ASSERT_TRUE(clean->Put(Tier::kG3, k, good).ok());
    auto g2 = clean->Get(Tier::kG3, k);
    ASSERT_TRUE(g2.ok() && g2->found);
    EXPECT_TRUE(g2->value == good);
    EXPECT_TRUE(DaemonTransfersDrain(d.metrics_port));
  }
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_puts_total", {"tier=\"g3\""}), 2);
}

TEST(KvStoreBulkTest, CorruptOrTruncatedGetFailsThatRequestOnTheClientAndIsCounted) {
  for (const std::string fault : {"corrupt", "truncate"}) {
    SCOPED_TRACE(fault);
    TempDir dir;
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(
        StartDaemon(dir, dir.File("data"), "run", &d, {"--debug-bulk-fault", fault}));
    auto inline_client = KvStoreClient::Create(d.target(), Inline());
    const std::string v = Payload(3, 2 << 20);
    ASSERT_TRUE(inline_client->Put(Tier::kG3, AsBytes(Key(1)), v).ok());
    auto bulk = KvStoreClient::Create(d.target(), Bulk());
    auto g = bulk->Get(Tier::kG3, AsBytes(Key(1)));
    ASSERT_FALSE(g.ok()) << "a damaged transfer was returned as a value";
    EXPECT_TRUE(absl::StrContains(g.status().message(), fault == "corrupt" ? "checksum" : "bytes"))
        << g.status();
    EXPECT_EQ(bulk->transfer_errors(), 1);
    // The daemon stays up and still serves the value inline, intact.
    auto gi = inline_client->Get(Tier::kG3, AsBytes(Key(1)));
    ASSERT_TRUE(gi.ok() && gi->found);
    EXPECT_TRUE(gi->value == v);
    EXPECT_TRUE(DaemonTransfersDrain(d.metrics_port));
    // The daemon (sender) counts the failed get too; its reason is what it saw (the receiver's
    // END, or its own chunk send failing once the receiver gave up), the client names the cause.
    EXPECT_EQ(
        WaitForAtLeast(d.metrics_port, "epd_kv_transfer_errors_total", {"direction=\"get\""}, 1), 1)
        << HttpGet(d.metrics_port, "/metrics").value_or("");
  }
}

TEST(KvStoreBulkTest, DaemonWithoutBulkEndpointServesUcxClientsInline) {
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d, {"--bulk", "off"}));
  auto client = KvStoreClient::Create(d.target(), Bulk());
  const std::string v = Payload(4, 2 << 20);
  ASSERT_TRUE(client->Put(Tier::kG3, AsBytes(Key(1)), v).ok());
  auto g = client->Get(Tier::kG3, AsBytes(Key(1)));
  ASSERT_TRUE(g.ok() && g->found) << g.status();
  EXPECT_TRUE(g->value == v);
  EXPECT_EQ(Scrape(d.metrics_port, "epd_transfer_bytes_total"), 0);
}

TEST(KvStoreBulkTest, WrongClusterTokenIsRefusedWithTheCause) {
  TempDir dir;
  Daemon d;
  // The daemon has the test binary's secret ($EPD_CLUSTER_SECRET, tests/testing/test_main.cc).
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d));
  KvClientOptions o = Bulk();
  o.cluster_token = "secret-b-of-another-cluster";
  auto client = KvStoreClient::Create(d.target(), o);
  absl::Status s = client->Put(Tier::kG3, AsBytes(Key(1)), Value(1));
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "cluster authentication failed")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "secret-b")) << s;
  o.cluster_token = "";  // the environment's
  auto good = KvStoreClient::Create(d.target(), o);
  EXPECT_TRUE(good->Put(Tier::kG3, AsBytes(Key(1)), Value(1)).ok());
}

TEST(KvStoreBulkTest, ClientKilledMidPutLeavesNothingVisibleAndTheDaemonServesTheNextClient) {
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d));
  // 32 MiB in 8 chunks of 4 MiB, each held 400 ms: the transfer takes > 3 s.
  Subprocess peer = Subprocess::Start(
      {BinaryPath("kvstore_bulk_peer"), "--target", d.target(), "--key", "7", "--bytes",
       std::to_string(32 << 20), "--seed", "7", "--chunk-delay-ms", "400"},
      dir.File("peer.log"));
  bool in_flight = false;
  for (int i = 0; i < 400 && !in_flight; ++i) {
    in_flight = Scrape(d.metrics_port, "epd_kv_puts_in_flight") == 1;
    if (!in_flight) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(in_flight) << "the bulk put never reached the daemon: " << peer.ReadLog();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // some chunks have landed
  peer.Signal(SIGKILL);
  ASSERT_TRUE(peer.Wait(std::chrono::seconds(10)).has_value());
  // The daemon notices the dead peer, fails the put (counted), frees everything.
  bool failed = false;
  for (int i = 0; i < 400 && !failed; ++i) {
    failed = Scrape(d.metrics_port, "epd_kv_transfer_errors_total", {"direction=\"put\""}) >= 1 &&
             Scrape(d.metrics_port, "epd_kv_puts_in_flight") == 0;
    if (!failed) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(failed) << HttpGet(d.metrics_port, "/metrics").value_or("");
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_transfer_errors_total",
                   {"direction=\"put\"", "reason=\"peer_down\""}),
            1);
  EXPECT_TRUE(DaemonTransfersDrain(d.metrics_port));
  EXPECT_EQ(Scrape(d.metrics_port, "epd_transfer_outstanding", {"resource=\"allocations\""}), 0);
  // Nothing visible; the next client is served (bulk and inline).
  auto next = KvStoreClient::Create(d.target(), Bulk());
  auto g = next->Get(Tier::kAuto, AsBytes(Key(7)));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_FALSE(g->found);
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_entries", {"tier=\"g3\""}), 0);
  const std::string v = Payload(8, 5 << 20);
  ASSERT_TRUE(next->Put(Tier::kG3, AsBytes(Key(8)), v).ok());
  auto g8 = next->Get(Tier::kG3, AsBytes(Key(8)));
  ASSERT_TRUE(g8.ok() && g8->found);
  EXPECT_TRUE(g8->value == v);
}

TEST(KvStoreBulkTest, ClientKilledMidGetFreesTheSendAndTheDaemonServesTheNextClient) {
  TempDir dir;
  Daemon d;
  // The daemon's get sends crawl (4 MiB chunks 400 ms apart): 32 MiB take > 3 s.
  ASSERT_NO_FATAL_FAILURE(
      StartDaemon(dir, dir.File("data"), "run", &d, {"--debug-bulk-fault", "delay"}));
  const std::string v = Payload(9, 32 << 20);
  ASSERT_TRUE(KvStoreClient::Create(d.target(), Inline())->Put(Tier::kG3, AsBytes(Key(9)), v).ok());
  Subprocess peer = Subprocess::Start({BinaryPath("kvstore_bulk_peer"), "--target", d.target(),
                                       "--key", "9", "--bytes", "0", "--seed", "0", "--get"},
                                      dir.File("peer.log"));
  bool sending = false;
  for (int i = 0; i < 400 && !sending; ++i) {
    sending = Scrape(d.metrics_port, "epd_transfer_outstanding", {"resource=\"transfers\""}) >= 1;
    if (!sending) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(sending) << "the bulk get never started: " << peer.ReadLog();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // some chunks are on the way
  peer.Signal(SIGKILL);
  ASSERT_TRUE(peer.Wait(std::chrono::seconds(10)).has_value());
  EXPECT_EQ(peer.ReadLog().find("get ok"), std::string::npos) << peer.ReadLog();
  EXPECT_GE(
      WaitForAtLeast(d.metrics_port, "epd_kv_transfer_errors_total", {"direction=\"get\""}, 1), 1);
  EXPECT_TRUE(DaemonTransfersDrain(d.metrics_port));
  // The next client is served: inline at once, and over bulk (slowly, through the slow link).
  auto next = KvStoreClient::Create(d.target(), Inline());
  auto g = next->Get(Tier::kG3, AsBytes(Key(9)));
  ASSERT_TRUE(g.ok() && g->found) << g.status();
  EXPECT_TRUE(g->value == v);
  const std::string small = Payload(10, kBlock);
  auto bulk = KvStoreClient::Create(d.target(), Bulk());
  ASSERT_TRUE(bulk->Put(Tier::kG3, AsBytes(Key(10)), small).ok());
  auto gb = bulk->Get(Tier::kG3, AsBytes(Key(10)));
  ASSERT_TRUE(gb.ok() && gb->found) << gb.status();
  EXPECT_TRUE(gb->value == small);
}

TEST(KvStoreBulkTest, SigkillThenRestartServesEveryAcknowledgedBulkPutBitIdentical) {
  TempDir dir;
  const std::string data = dir.File("data");
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run1", &d));
  {
    auto c = KvStoreClient::Create(d.target(), Bulk());
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(c->Put(Tier::kG3, AsBytes(Key(i)), Value(i)).ok());
  }
  const testing::KilledWrites writes = testing::PutWhileKilling(
      d,
      [&] {
        KvClientOptions o = Bulk();
        o.deadline_ms = 5000;
        return KvStoreClient::Create(d.target(), o);
      },
      Value, 40);
  ASSERT_GE(writes.acked.size(), 10u);

  Daemon d2;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, data, "run2", &d2));
  auto c2 = KvStoreClient::Create(d2.target(), Bulk());
  for (int i = 0; i < 20; ++i) {
    auto g = c2->Get(Tier::kAuto, AsBytes(Key(i)));
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(g->found) << "acknowledged block " << i << " lost";
    EXPECT_TRUE(g->value == Value(i)) << i;
  }
  ASSERT_NO_FATAL_FAILURE(testing::ExpectAckedServedAndAttemptsWholeOrAbsent(*c2, writes, Value));
  EXPECT_EQ(Scrape(d2.metrics_port, "epd_kv_checksum_failures_total"), 0);
}

TEST(KvStoreBulkTest, ConcurrentBulkClientsNeverLoseOrMixValues) {
  TempDir dir;
  Daemon d;
  ASSERT_NO_FATAL_FAILURE(StartDaemon(dir, dir.File("data"), "run", &d));
  constexpr int kThreads = 6;
  constexpr int kOps = 30;
  std::atomic<int> errors{0}, mixed{0};
  auto shared = KvStoreClient::Create(d.target(), Bulk(4096));
  std::vector<std::thread> threads;
  // Sizes alternate between inline (< 4 KiB) and bulk, so both paths interleave.
  auto val = [](int k) { return Payload(k, k % 4 == 0 ? 1000 : kBlock + (k % 7) * 4096); };
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto own = KvStoreClient::Create(d.target(), Bulk(4096));
      KvStoreClient* c = (t % 2 == 0) ? own.get() : shared.get();
      for (int i = 0; i < kOps; ++i) {
        const int same = i % 10;
        const int mine = 10000 + t * 1000 + i;
        const Tier tier = (i % 3 == 0) ? Tier::kG2 : Tier::kG3;
        if (!c->Put(tier, AsBytes(Key(same)), val(same)).ok()) ++errors;
        if (!c->Put(tier, AsBytes(Key(mine)), val(mine)).ok()) ++errors;
        for (int k : {same, mine, 10000 + ((t + 1) % kThreads) * 1000 + i / 2}) {
          auto g = c->Get(tier, AsBytes(Key(k)));
          if (!g.ok()) {
            ++errors;
          } else if (g->found && g->value != val(k)) {
            ++mixed;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(mixed.load(), 0);
  auto check = KvStoreClient::Create(d.target(), Bulk());
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kOps; ++i) {
      const int k = 10000 + t * 1000 + i;
      const Tier tier = (i % 3 == 0) ? Tier::kG2 : Tier::kG3;
      auto g = check->Get(tier, AsBytes(Key(k)));
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_TRUE(g->found) << k;
      EXPECT_TRUE(g->value == val(k));
    }
  }
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_transfer_errors_total"), 0);
  EXPECT_TRUE(DaemonTransfersDrain(d.metrics_port));
}

// The client's bulk metrics live where the owning process says: with KvClientOptions::registry
// the engine it creates counts its epd_transfer_* bytes there (the process's /metrics); with
// KvClientOptions::bulk_engine the process's own engine carries the values.
TEST(KvStoreBulkTest, TheClientsEngineAndItsMetricsAreTheOwningProcesss) {
  TempDir dir;
  Daemon d;
  StartDaemon(dir, dir.File("data"), "d", &d);
  const std::string value = Payload(42, (1 << 20) + 3);
  prometheus::Registry process_registry;
  {
    KvClientOptions o = Bulk();
    o.registry = &process_registry;
    auto c = KvStoreClient::Create(d.target(), o);
    ASSERT_TRUE(c->Put(Tier::kG3, AsBytes(Key(1)), value).ok());
    auto g = c->Get(Tier::kG3, AsBytes(Key(1)));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(g->value == value);
  }
  EXPECT_GE(testing::MetricValue(process_registry, "epd_transfer_bytes_total", {}),
            2.0 * static_cast<double>(value.size()));

  prometheus::Registry engine_registry;
  transfer::EngineOptions eo;
  eo.config_fingerprint = kBulkFingerprint;
  eo.cluster_token = common::ClusterSecretFromEnv();
  eo.node_name = "test-process";
  auto engine = transfer::TransferEngine::Create(transfer::MakeUcxWire(transfer::UcxOptions{}), eo,
                                                 engine_registry, common::SystemClock::Get());
  ASSERT_TRUE(engine.ok()) << engine.status();
  {
    KvClientOptions o = Bulk();
    o.bulk_engine = engine->get();
    auto c = KvStoreClient::Create(d.target(), o);
    ASSERT_TRUE(c->Put(Tier::kG3, AsBytes(Key(2)), value).ok());
    auto g = c->Get(Tier::kG3, AsBytes(Key(2)));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(g->value == value);
  }
  EXPECT_GE(testing::MetricValue(engine_registry, "epd_transfer_bytes_total", {}),
            2.0 * static_cast<double>(value.size()));
  (*engine)->Shutdown();
}

}  // namespace
}  // namespace epd::kvstore
