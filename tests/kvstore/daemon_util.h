#pragma once

// A real epd-kvstore process for integration tests (kvstore_daemon_test, kvstore_bulk_test), and
// the SIGKILL-under-writers crash check both run: writers keep putting while the daemon is killed,
// then a restarted daemon must serve every acknowledged put and hold each other attempt whole or
// not at all.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvstore/kvstore_client.h"
#include "tests/kvstore/test_util.h"
#include "tests/testing/subprocess.h"

namespace epd::kvstore::testing {

struct Daemon {
  epd::testing::Subprocess proc;
  int grpc_port = 0;
  int metrics_port = 0;
  std::unique_ptr<KvStoreClient> client;  // inline gRPC client with default options
  std::string target() const { return absl::StrCat("127.0.0.1:", grpc_port); }
};

// Starts epd-kvstore on `data_dir` with ports 0, a port file and log named by `tag` inside `dir`,
// a 1 s drain, then `args`. Fails the test (fatally) when it does not publish its ports.
inline void StartDaemonWith(const epd::testing::TempDir& dir, const std::string& data_dir,
                            const std::string& tag, Daemon* d, std::vector<std::string> args) {
  const std::string port_file = dir.File(tag + ".ports.json");
  std::remove(port_file.c_str());
  std::vector<std::string> argv{epd::testing::BinaryPath("epd-kvstore"),
                                "--data-dir",
                                data_dir,
                                "--grpc-port",
                                "0",
                                "--metrics-port",
                                "0",
                                "--port-file",
                                port_file,
                                "--drain-timeout-ms",
                                "1000"};
  argv.insert(argv.end(), args.begin(), args.end());
  d->proc = epd::testing::Subprocess::Start(argv, dir.File(tag + ".log"));
  auto grpc = epd::testing::WaitForPortFile(port_file, "grpc", std::chrono::seconds(30));
  ASSERT_TRUE(grpc.has_value()) << d->proc.ReadLog();
  d->grpc_port = *grpc;
  d->metrics_port = *epd::testing::WaitForPortFile(port_file, "metrics", std::chrono::seconds(5));
  d->client = KvStoreClient::Create(d->target());
}

struct KilledWrites {
  std::vector<int> acked;      // puts the daemon acknowledged before it died
  std::vector<int> attempted;  // every put started, acknowledged or not
};

// Three writers (each with its own client from `make_client`) put Key(i) -> value(i) to G3 for
// i = 1000 + t, step 3, until a put fails; once `min_acked` puts are acknowledged (or ~10 s
// passed) the daemon gets SIGKILL. Returns after every writer stopped.
inline KilledWrites PutWhileKilling(
    Daemon& d, const std::function<std::unique_ptr<KvStoreClient>()>& make_client,
    const std::function<std::string(int)>& value, size_t min_acked) {
  std::mutex mu;
  KilledWrites out;
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int t = 0; t < 3; ++t) {
    writers.emplace_back([&, t] {
      auto client = make_client();
      for (int i = 1000 + t; !stop.load(); i += 3) {
        {
          std::lock_guard<std::mutex> lock(mu);
          out.attempted.push_back(i);
        }
        if (!client->Put(Tier::kG3, AsBytes(Key(i)), value(i)).ok()) break;
        std::lock_guard<std::mutex> lock(mu);
        out.acked.push_back(i);
      }
    });
  }
  for (int spins = 0; spins < 2000; ++spins) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (out.acked.size() >= min_acked) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  d.proc.Signal(SIGKILL);
  EXPECT_TRUE(d.proc.Wait(std::chrono::seconds(10)).has_value());
  stop = true;
  for (auto& w : writers) w.join();
  return out;
}

// After the restart: every acknowledged put is served bit-identical from G3; every other attempt
// is either wholly there or absent, never torn or corrupt.
inline void ExpectAckedServedAndAttemptsWholeOrAbsent(
    KvStoreClient& client, const KilledWrites& writes,
    const std::function<std::string(int)>& value) {
  for (int i : writes.acked) {
    auto g = client.Get(Tier::kG3, AsBytes(Key(i)));
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(g->found) << "acknowledged put " << i << " lost";
    EXPECT_TRUE(g->value == value(i)) << i;
  }
  for (int i : writes.attempted) {
    auto g = client.Get(Tier::kG3, AsBytes(Key(i)));
    ASSERT_TRUE(g.ok()) << g.status();
    if (g->found) {
      EXPECT_TRUE(g->value == value(i)) << i;
    } else {
      EXPECT_EQ(g->miss, MissReason::kAbsent) << i;
    }
  }
}

}  // namespace epd::kvstore::testing
