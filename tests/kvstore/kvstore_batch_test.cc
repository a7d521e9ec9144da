// Batched get/put of a prefix's blocks against a real epd-kvstore: one call per prefix with a
// status per block, values through the client's shared-memory segment on the same host (or
// inline), bit-identical either way; a forged or foreign segment is refused by name, counted, and
// the values come inline; a client killed in the middle of batched gets leaves nothing mapped or
// open in the daemon; the sharded client splits a batch over its daemons.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/cluster_secret.h"
#include "runtime/grpc_auth.h"
#include "epd/v1/kvstore.grpc.pb.h"
#include "kvstore/kvstore.h"
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
using testing::Daemon;
using testing::Key;
using testing::Payload;

constexpr size_t kBlock = 64 * 890;

void StartDaemon(const TempDir& dir, const std::string& tag, Daemon* d) {
  testing::StartDaemonWith(dir, dir.File(tag), tag, d,
                           {"--g1-capacity-bytes", std::to_string(16 * kBlock), "--bulk", "off"});
}

// Value of one exposition line "name{labels} value" (labels written exactly as exposed).
double Scrape(int port, const std::string& series) {
  auto body = HttpGet(port, "/metrics");
  if (!body.has_value()) return -1;
  const size_t at = body->find("\n" + series + " ");
  if (at == std::string::npos) return 0;
  return std::stod(body->substr(at + series.size() + 2));
}

std::vector<std::string> Keys(int from, int n) {
  std::vector<std::string> keys;
  for (int i = from; i < from + n; ++i) keys.emplace_back(AsBytes(Key(i)));
  return keys;
}

// Memfd segments the process `pid` has mapped or open right now.
int MemfdRefs(pid_t pid) {
  int n = 0;
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  for (std::string line; std::getline(maps, line);) n += line.find("memfd:") != std::string::npos;
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
  if (DIR* d = opendir(fd_dir.c_str())) {
    while (dirent* e = readdir(d)) {
      char link[256];
      const ssize_t len =
          readlink(absl::StrCat(fd_dir, "/", e->d_name).c_str(), link, sizeof(link) - 1);
      if (len > 0 && std::string(link, static_cast<size_t>(len)).find("memfd:") == 0) ++n;
    }
    closedir(d);
  }
  return n;
}

// MemfdRefs(pid) once it is 0, or when `limit` has passed.
int MemfdRefsAfter(pid_t pid, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  int refs = MemfdRefs(pid);
  while (refs != 0 && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    refs = MemfdRefs(pid);
  }
  return refs;
}

// Puts 64 blocks with one BatchPut and reads them back with one BatchGet, through shared memory
// and inline; every block bit-identical, one status per block, one call each way.
TEST(KvStoreBatchTest, APrefixOf64BlocksIsOneCallEachWayThroughSharedMemoryOrInline) {
  TempDir dir;
  Daemon d;
  StartDaemon(dir, "d", &d);
  auto shm = KvStoreClient::Create(d.target());
  KvClientOptions inline_opts;
  inline_opts.shared_memory = false;
  auto inl = KvStoreClient::Create(d.target(), inline_opts);

  std::vector<std::string> values;
  for (int i = 0; i < 64; ++i) values.push_back(Payload(1000 + i, kBlock - (i % 3)));
  const std::vector<std::string> keys = Keys(0, 64);
  std::vector<KvPut> puts;
  for (int i = 0; i < 64; ++i) puts.push_back({keys[i], values[i]});
  auto put = shm->BatchPut(Tier::kG3, puts);
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_EQ(put->size(), 64u);
  for (const auto& s : *put) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(shm->shared_memory_active());
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_batch_calls_total{op=\"put\"}"), 1);
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_batch_keys_total{op=\"put\"}"), 64);
  const double put_shm = Scrape(d.metrics_port, "epd_kv_shm_bytes_total{direction=\"put\"}");
  EXPECT_GE(put_shm, 64.0 * (kBlock - 2));

  for (KvStoreClient* c : {shm.get(), inl.get()}) {
    const double shm_before = Scrape(d.metrics_port, "epd_kv_shm_bytes_total{direction=\"get\"}");
    auto got = c->BatchGet(Tier::kAuto, keys, false);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), 64u);
    for (int i = 0; i < 64; ++i) {
      ASSERT_TRUE((*got)[i].ok()) << (*got)[i].status();
      EXPECT_TRUE((*got)[i]->found) << i;
      EXPECT_TRUE((*got)[i]->value == values[i]) << "block " << i << " differs";
    }
    const double moved =
        Scrape(d.metrics_port, "epd_kv_shm_bytes_total{direction=\"get\"}") - shm_before;
    if (c == shm.get()) {
      EXPECT_GE(moved, 64.0 * (kBlock - 2)) << "the shared-memory client got values inline";
    } else {
      EXPECT_EQ(moved, 0) << "the inline client's values went through shared memory";
    }
  }
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_batch_calls_total{op=\"get\"}"), 2);
  // The daemon keeps the shared-memory client's segment mapped between calls (one mapping, the
  // same for the put and the get) ...
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_shm_segments_mapped"), 1);
  EXPECT_EQ(MemfdRefs(d.proc.pid()), 1);
  // The G3 reads kept their accounting: every block verified and counted.
  EXPECT_GE(Scrape(d.metrics_port, "epd_kv_get_bytes_total{tier=\"g3\"}") +
                Scrape(d.metrics_port, "epd_kv_get_bytes_total{tier=\"g1\"}"),
            2 * 64.0 * (kBlock - 2));
  // ... and lets it go within a second or so once the client has closed it.
  shm.reset();
  EXPECT_EQ(MemfdRefsAfter(d.proc.pid(), std::chrono::seconds(3)), 0)
      << "the daemon still maps a segment its client closed";
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_shm_segments_mapped"), 0);
}

// One status per block: a missing key is a miss, a malformed key fails alone, the rest is served;
// with stop_at_first_miss nothing after the first miss is read.
TEST(KvStoreBatchTest, EveryBlockHasItsOwnStatusAndStopAtFirstMissReadsNoFurther) {
  TempDir dir;
  Daemon d;
  StartDaemon(dir, "d", &d);
  auto c = KvStoreClient::Create(d.target());
  std::vector<std::string> keys = Keys(0, 3);
  std::vector<std::string> values{Payload(1, kBlock), Payload(2, 100), Payload(3, kBlock)};
  std::vector<KvPut> puts;
  for (int i = 0; i < 3; ++i) puts.push_back({keys[i], values[i]});
  puts.push_back({"short", "x"});  // a malformed key: only this item fails
  auto put = c->BatchPut(Tier::kG3, puts);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_TRUE((*put)[0].ok() && (*put)[1].ok() && (*put)[2].ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*put)[3])) << (*put)[3];

  // keys: 0, 1, absent, bad, 2
  std::vector<std::string> ask{keys[0], keys[1], std::string(AsBytes(Key(77))), "bad-key", keys[2]};
  auto all = c->BatchGet(Tier::kAuto, ask, false);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 5u);
  EXPECT_TRUE((*all)[0]->found && (*all)[0]->value == values[0]);
  EXPECT_TRUE((*all)[1]->found && (*all)[1]->value == values[1]);
  ASSERT_TRUE((*all)[2].ok());
  EXPECT_FALSE((*all)[2]->found);
  EXPECT_EQ((*all)[2]->miss, MissReason::kAbsent);
  EXPECT_TRUE(absl::IsInvalidArgument((*all)[3].status())) << (*all)[3].status();
  EXPECT_NE((*all)[3].status().message().find("16"), std::string_view::npos) << (*all)[3].status();
  EXPECT_TRUE((*all)[4].ok() && (*all)[4]->found && (*all)[4]->value == values[2]);

  const double g3_gets = Scrape(d.metrics_port, "epd_kv_gets_total{tier=\"g3\"}") +
                         Scrape(d.metrics_port, "epd_kv_gets_total{tier=\"g1\"}");
  auto stop = c->BatchGet(Tier::kAuto, ask, true);
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_TRUE((*stop)[0]->found && (*stop)[1]->found);
  EXPECT_FALSE((*stop)[2]->found);
  EXPECT_TRUE((*stop)[3].ok() && !(*stop)[3]->found) << "read after the first miss";
  EXPECT_TRUE((*stop)[4].ok() && !(*stop)[4]->found) << "read after the first miss";
  const double reads = Scrape(d.metrics_port, "epd_kv_gets_total{tier=\"g3\"}") +
                       Scrape(d.metrics_port, "epd_kv_gets_total{tier=\"g1\"}") - g3_gets;
  EXPECT_LE(reads, 5) << "keys after the first miss were read";  // 0, 1 (G1), absent (G1+G3)
  EXPECT_TRUE(d.proc.running());
}

// A segment the daemon cannot use (not a memfd, wrong inode, a dead pid) is refused by name and
// counted; the values come back inline and correct; the daemon stays up.
TEST(KvStoreBatchTest, AForgedSegmentIsRefusedByNameAndTheValuesComeInline) {
  TempDir dir;
  Daemon d;
  StartDaemon(dir, "d", &d);
  const std::vector<std::string> keys = Keys(0, 2);
  const std::string v0 = Payload(5, kBlock), v1 = Payload(6, kBlock);
  ASSERT_TRUE(d.client->Put(Tier::kG3, keys[0], v0).ok());
  ASSERT_TRUE(d.client->Put(Tier::kG3, keys[1], v1).ok());

  auto channel = runtime::CreateClusterChannel(d.target(), common::ClusterSecretFromEnv());
  auto stub = v1::KvStore::NewStub(channel);
  struct Case {
    int pid, fd;
    const char* reason;
  };
  const int memfd = memfd_create("epd-kv-segment", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(ftruncate(memfd, 1 << 20), 0);
  struct stat st;
  ASSERT_EQ(fstat(memfd, &st), 0);
  for (const Case& k : {Case{getpid(), 0, "not_memfd"}, Case{getpid(), memfd, "inode"},
                        Case{999999999, 3, "open"}, Case{getpid(), memfd, "not_sealed"}}) {
    v1::BatchGetRequest req;
    req.set_tier(v1::TIER_G3_ROCKSDB);
    for (const auto& key : keys) req.add_keys(key);
    req.mutable_shm()->set_pid(k.pid);
    req.mutable_shm()->set_fd(k.fd);
    // The right inode only for the unsealed memfd (a segment that could shrink under the daemon).
    req.mutable_shm()->set_inode(std::string_view(k.reason) == "not_sealed" ? st.st_ino : 1);
    req.mutable_shm()->set_size(1 << 20);
    v1::BatchGetResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->BatchGet(&ctx, req, &resp).ok());
    EXPECT_FALSE(resp.shm_used()) << k.reason;
    EXPECT_FALSE(resp.shm_refused().empty()) << k.reason;
    ASSERT_EQ(resp.items_size(), 2);
    EXPECT_TRUE(resp.items(0).found() && !resp.items(0).in_shm() && resp.items(0).value() == v0);
    EXPECT_TRUE(resp.items(1).found() && !resp.items(1).in_shm() && resp.items(1).value() == v1);
    EXPECT_EQ(
        Scrape(d.metrics_port, absl::StrCat("epd_kv_shm_refused_total{reason=\"", k.reason, "\"}")),
        1)
        << resp.shm_refused();
  }
  close(memfd);
  EXPECT_TRUE(d.proc.running());
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_shm_segments_mapped"), 0);
}

// A client process doing batched gets through shared memory is SIGKILLed at a random point: the
// daemon holds none of its memory afterwards (no memfd mapped or open) and serves the next client.
TEST(KvStoreBatchTest, AClientKilledDuringSharedMemoryGetsLeaksNothingInTheDaemon) {
  TempDir dir;
  Daemon d;
  StartDaemon(dir, "d", &d);
  std::vector<std::string> values;
  const std::vector<std::string> keys = Keys(100, 64);
  std::vector<KvPut> puts;
  for (int i = 0; i < 64; ++i) values.push_back(Payload(500 + i, kBlock));
  for (int i = 0; i < 64; ++i) puts.push_back({keys[i], values[i]});
  KvClientOptions inline_opts;  // this process maps no segment in the daemon
  inline_opts.shared_memory = false;
  auto put = KvStoreClient::Create(d.target(), inline_opts)->BatchPut(Tier::kG3, puts);
  ASSERT_TRUE(put.ok()) << put.status();

  for (int round = 0; round < 3; ++round) {
    const std::string log = dir.File(absl::StrCat("peer", round, ".log"));
    auto peer = Subprocess::Start(
        {BinaryPath("kvstore_bulk_peer"), "--target", d.target(), "--key", "100", "--bytes",
         std::to_string(kBlock), "--seed", "500", "--batch-loop", "64"},
        log);
    bool batching = false;
    for (int i = 0; i < 300 && !batching; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      batching = peer.ReadLog().find("batching shm") != std::string::npos;
      ASSERT_EQ(peer.ReadLog().find("failed"), std::string::npos) << peer.ReadLog();
      ASSERT_EQ(peer.ReadLog().find("wrong"), std::string::npos) << peer.ReadLog();
    }
    ASSERT_TRUE(batching) << peer.ReadLog();
    std::this_thread::sleep_for(std::chrono::milliseconds(37 * (round + 1)));  // mid-loop
    peer.Signal(SIGKILL);
    peer.Wait(std::chrono::seconds(10));
  }
  // The daemon drops a dead client's mapping at its next sweep (every 500 ms).
  EXPECT_EQ(MemfdRefsAfter(d.proc.pid(), std::chrono::seconds(5)), 0)
      << "the daemon still maps or holds a dead client's segment";
  EXPECT_EQ(Scrape(d.metrics_port, "epd_kv_shm_segments_mapped"), 0);
  EXPECT_GT(Scrape(d.metrics_port, "epd_kv_shm_bytes_total{direction=\"get\"}"), 0);
  auto c = KvStoreClient::Create(d.target());
  auto got = c->BatchGet(Tier::kAuto, keys, false);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 64; ++i) EXPECT_TRUE((*got)[i].ok() && (*got)[i]->value == values[i]) << i;
  EXPECT_TRUE(c->shared_memory_active());
}

// The sharded client sends each daemon one batch of the keys it owns and merges them in order.
TEST(KvStoreBatchTest, ShardedClientSplitsABatchOverItsDaemons) {
  TempDir dir;
  Daemon a, b;
  StartDaemon(dir, "a", &a);
  StartDaemon(dir, "b", &b);
  auto sharded = ShardedKvClient::Create({a.target(), b.target()});
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  const std::vector<std::string> keys = Keys(0, 40);
  std::vector<std::string> values;
  std::vector<KvPut> puts;
  for (int i = 0; i < 40; ++i) values.push_back(Payload(i, 1000 + i));
  for (int i = 0; i < 40; ++i) puts.push_back({keys[i], values[i]});
  auto put = (*sharded)->BatchPut(Tier::kG3, puts);
  ASSERT_TRUE(put.ok()) << put.status();
  for (const auto& s : *put) EXPECT_TRUE(s.ok()) << s;
  auto got = (*sharded)->BatchGet(Tier::kAuto, keys, false);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE((*got)[i].ok()) << (*got)[i].status();
    EXPECT_TRUE((*got)[i]->value == values[i]) << i;
    // The owner holds it; the other daemon does not.
    auto& owner = (*sharded)->OwnerOf(keys[i]) == a.target() ? a : b;
    auto& other = &owner == &a ? b : a;
    EXPECT_TRUE(owner.client->Get(Tier::kG3, keys[i])->found);
    EXPECT_FALSE(other.client->Get(Tier::kG3, keys[i])->found);
  }
  for (Daemon* d : {&a, &b}) {
    EXPECT_EQ(Scrape(d->metrics_port, "epd_kv_batch_calls_total{op=\"get\"}"), 1);
    EXPECT_EQ(Scrape(d->metrics_port, "epd_kv_batch_calls_total{op=\"put\"}"), 1);
  }
}

// The same calls through KvStoreApi against the in-process KvStore and against a daemon's client:
// the same answers, and failures as the same status codes.
std::string Transcript(KvStoreApi& store) {
  std::string t;
  auto code = [](const absl::Status& s) { return absl::StatusCodeToString(s.code()); };
  const std::vector<std::string> keys = Keys(0, 4);
  const std::vector<std::string> values{Payload(1, kBlock), Payload(2, 10), Payload(3, 1),
                                        Payload(4, kBlock)};
  std::vector<KvPut> puts;
  for (int i = 0; i < 3; ++i) puts.push_back({keys[i], values[i]});
  puts.push_back({"short-key", values[3]});
  auto put = store.BatchPut(Tier::kG3, puts);
  absl::StrAppend(&t, "batchput ", code(put.status()));
  if (put.ok())
    for (const auto& s : *put) absl::StrAppend(&t, " ", code(s));
  absl::StrAppend(&t, "\nput g2 ", code(store.Put(Tier::kG2, "snap", values[1])));
  std::vector<BlockHash> chain;
  for (int i = 0; i < 4; ++i) chain.push_back(Key(i));
  auto look = store.Lookup("fp", chain);
  absl::StrAppend(&t, "\nlookup ", code(look.status()), " ", look.ok() ? look->cached_blocks : -1);
  auto get = store.Get(Tier::kG3, keys[1]);
  absl::StrAppend(&t, "\nget ", code(get.status()), " ", get.ok() && get->value == values[1]);
  auto bad = store.Get(Tier::kG3, "short-key");
  absl::StrAppend(&t, "\nget bad ", code(bad.status()));
  auto snap = store.Get(Tier::kG2, "snap");
  absl::StrAppend(&t, "\nget g2 ", snap.ok() && snap->found && snap->value == values[1]);
  auto batch = store.BatchGet(Tier::kAuto, keys, true);
  absl::StrAppend(&t, "\nbatchget ", code(batch.status()));
  if (batch.ok()) {
    for (size_t i = 0; i < batch->size(); ++i) {
      const auto& r = (*batch)[i];
      absl::StrAppend(&t, " ", code(r.status()), ":",
                      r.ok() ? (r->found ? (r->value == values[i] ? "same" : "DIFF")
                                         : std::string(MissReasonName(r->miss)))
                             : "-");
    }
  }
  auto pin = store.Pin(keys[0], true);
  absl::StrAppend(&t, "\npin ", code(pin.status()), " ", pin.ok() && *pin);
  auto pin_missing = store.Pin(keys[3], true);
  absl::StrAppend(&t, "\npin missing ", code(pin_missing.status()), " ",
                  pin_missing.ok() && *pin_missing);
  return t;
}

TEST(KvStoreBatchTest, TheInProcessStoreAndADaemonClientAnswerAlikeThroughOneInterface) {
  TempDir dir;
  Daemon d;
  StartDaemon(dir, "d", &d);
  common::FakeClock clock;
  prometheus::Registry registry;
  KvStoreConfig config;
  config.data_dir = dir.File("in-process");
  config.g1.capacity_bytes = 16 * kBlock;
  auto local = KvStore::Open(config, clock, registry);
  ASSERT_TRUE(local.ok()) << local.status();
  const std::string in_process = Transcript(**local);
  const std::string remote = Transcript(*d.client);
  EXPECT_EQ(in_process, remote);
  // And the transcript says what it should.
  EXPECT_NE(in_process.find("batchput OK OK OK OK INVALID_ARGUMENT"), std::string::npos)
      << in_process;
  EXPECT_NE(in_process.find("get bad INVALID_ARGUMENT"), std::string::npos) << in_process;
  EXPECT_NE(in_process.find("batchget OK OK:same OK:same OK:same OK:absent"), std::string::npos)
      << in_process;
  EXPECT_NE(in_process.find("pin missing OK 0"), std::string::npos) << in_process;
}

}  // namespace
}  // namespace epd::kvstore
