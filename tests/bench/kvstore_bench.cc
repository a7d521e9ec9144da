// kvstore_bench: put/get throughput of global-KV blocks through the epd-kvstore daemon (G3
// RocksDB tier), with the bytes inline in gRPC and over the UCX bulk path, next to plain RocksDB
// put/get of the same values in the same run, and the ratios. Each figure is the median of
// --repeat runs. Not part of ctest. Example:
//   UCX_NET_DEVICES=lo build-kv/kvstore_bench --blocks 1000 --threads 4 --repeat 3
// (block = --block-tokens 64 x --bytes-per-token 890 B by default).
#include <signal.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvstore/chain_hash.h"
#include "kvstore/kvstore_client.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "tests/testing/subprocess.h"

namespace {

using epd::kvstore::BlockHash;

std::string Payload(uint64_t seed, size_t n) {
  std::string out(n, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out.data() + i, &x, 8);
  }
  return out;
}

// Runs fn(i) for i in [0, n) over `threads` threads; returns seconds.
double Timed(int n, int threads, const std::function<bool(int)>& fn, std::atomic<int>* errors) {
  const auto start = std::chrono::steady_clock::now();
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) {
        if (!fn(i)) ++*errors;
      }
    });
  }
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvstore_bench: daemon vs plain RocksDB put/get of global-KV blocks"};
  int blocks = 1000;
  int threads = 4;
  int block_tokens = 64;
  int bytes_per_token = 890;
  std::string daemon = (std::filesystem::path(argv[0]).parent_path() / "epd-kvstore").string();
  app.add_option("--blocks", blocks, "Blocks to put and get (default 1000)");
  app.add_option("--threads", threads, "Concurrent clients / RocksDB threads (default 4)");
  app.add_option("--block-tokens", block_tokens, "Tokens per block (default 64)");
  app.add_option("--bytes-per-token", bytes_per_token,
                 "Global KV bytes per token (default 890, the official config)");
  app.add_option("--daemon", daemon, "Path of epd-kvstore (default: next to this binary)");
  int repeat = 1;
  app.add_option("--repeat", repeat, "Runs per figure; the median is printed (default 1)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const size_t block_bytes = static_cast<size_t>(block_tokens) * bytes_per_token;

  std::vector<BlockHash> keys;
  std::vector<std::string> values;
  for (int i = 0; i < blocks; ++i) {
    const int32_t t = i;
    keys.push_back(epd::kvstore::ChainHash(epd::kvstore::kRootParent,
                                           std::span<const int32_t>(&t, 1), "bench"));
    values.push_back(Payload(i + 1, block_bytes));
  }
  epd::testing::TempDir dir;

  std::atomic<int> errors{0};
  // Puts then gets every block through one daemon; returns {put seconds, get seconds}.
  auto run_daemon = [&](const std::string& tag, uint64_t g1_bytes, epd::kvstore::Tier get_tier,
                        epd::kvstore::KvClientOptions options) -> std::pair<double, double> {
    std::filesystem::remove_all(dir.File(tag));
    std::filesystem::remove(dir.File(tag + ".json"));  // a stale port file of an earlier run
    auto proc = epd::testing::Subprocess::Start(
        {daemon, "--data-dir", dir.File(tag), "--grpc-port", "0", "--port-file",
         dir.File(tag + ".json"), "--g1-capacity-bytes", std::to_string(g1_bytes), "--block-bytes",
         std::to_string(block_bytes), "--log-level", "warn", "--drain-timeout-ms", "1000"},
        dir.File(tag + ".log"));
    auto port =
        epd::testing::WaitForPortFile(dir.File(tag + ".json"), "grpc", std::chrono::seconds(30));
    if (!port.has_value()) {
      std::cerr << "kvstore_bench: daemon did not start: " << proc.ReadLog() << "\n";
      std::exit(1);
    }
    std::vector<std::unique_ptr<epd::kvstore::KvStoreClient>> clients;
    for (int t = 0; t < threads; ++t) {
      clients.push_back(
          epd::kvstore::KvStoreClient::Create(absl::StrCat("127.0.0.1:", *port), options));
    }
    auto client = [&](int i) -> epd::kvstore::KvStoreClient& { return *clients[i % threads]; };
    const double put_s = Timed(
        blocks, threads,
        [&](int i) {
          return client(i)
              .Put(epd::kvstore::Tier::kG3, epd::kvstore::AsBytes(keys[i]), values[i])
              .ok();
        },
        &errors);
    const double get_s = Timed(
        blocks, threads,
        [&](int i) {
          auto g = client(i).Get(get_tier, epd::kvstore::AsBytes(keys[i]));
          return g.ok() && g->found && g->value == values[i];
        },
        &errors);
    proc.Signal(SIGKILL);
    proc.Wait(std::chrono::seconds(10));
    return {put_s, get_s};
  };
  epd::kvstore::KvClientOptions inline_options;
  epd::kvstore::KvClientOptions bulk_options;
  bulk_options.bulk = epd::kvstore::BulkTransport::kUcx;
  bulk_options.bulk_min_bytes = 0;  // every block over UCX
  std::vector<double> d_puts, d_gets, b_puts, b_gets, h_puts, h_gets, r_puts, r_gets;
  for (int rep = 0; rep < repeat; ++rep) {
    // G1 disabled: every get is a RocksDB read behind gRPC (bytes inline).
    const auto [d_put, d_get] = run_daemon("g3", 0, epd::kvstore::Tier::kG3, inline_options);
    // The same, with the bytes over the UCX bulk path (gRPC carries only the control messages).
    const auto [b_put, b_get] = run_daemon("bulk", 0, epd::kvstore::Tier::kG3, bulk_options);
    // G1 sized to hold every block: puts write through, gets are served from the host arena.
    const auto [h_put, h_get] = run_daemon("g1", static_cast<uint64_t>(blocks + 1) * block_bytes,
                                           epd::kvstore::Tier::kAuto, inline_options);

    // --- plain RocksDB, same options as G3 (WAL on, no fsync, no compression) ---
    std::filesystem::remove_all(dir.File("plain"));
    rocksdb::Options options;
    options.create_if_missing = true;
    options.compression = rocksdb::kNoCompression;
    options.write_buffer_size = 64ull << 20;
    options.IncreaseParallelism(2);
    rocksdb::DB* raw = nullptr;
    if (!rocksdb::DB::Open(options, dir.File("plain"), &raw).ok()) {
      std::cerr << "kvstore_bench: cannot open plain RocksDB\n";
      return 1;
    }
    std::unique_ptr<rocksdb::DB> db(raw);
    auto key_slice = [&](int i) {
      return rocksdb::Slice(reinterpret_cast<const char*>(keys[i].data()), keys[i].size());
    };
    const double r_put = Timed(
        blocks, threads,
        [&](int i) { return db->Put(rocksdb::WriteOptions(), key_slice(i), values[i]).ok(); },
        &errors);
    const double r_get = Timed(
        blocks, threads,
        [&](int i) {
          std::string v;
          return db->Get(rocksdb::ReadOptions(), key_slice(i), &v).ok() && v == values[i];
        },
        &errors);
    db->Close();
    d_puts.push_back(d_put);
    d_gets.push_back(d_get);
    b_puts.push_back(b_put);
    b_gets.push_back(b_get);
    h_puts.push_back(h_put);
    h_gets.push_back(h_get);
    r_puts.push_back(r_put);
    r_gets.push_back(r_get);
  }
  const double d_put = Median(d_puts), d_get = Median(d_gets), b_put = Median(b_puts),
               b_get = Median(b_gets), h_put = Median(h_puts), h_get = Median(h_gets),
               r_put = Median(r_puts), r_get = Median(r_gets);

  const double mb = static_cast<double>(block_bytes) * blocks / 1e6;
  std::printf(
      "kvstore_bench: %d blocks x %zu B (%d tokens x %d B/token), %d threads, median of %d\n",
      blocks, block_bytes, block_tokens, bytes_per_token, threads, repeat);
  std::printf("%-28s %12s %10s\n", "path", "blocks/s", "MB/s");
  std::printf("%-28s %12.0f %10.1f\n", "daemon put (gRPC -> G3)", blocks / d_put, mb / d_put);
  std::printf("%-28s %12.0f %10.1f\n", "daemon put (UCX bulk -> G3)", blocks / b_put, mb / b_put);
  std::printf("%-28s %12.0f %10.1f\n", "plain RocksDB put", blocks / r_put, mb / r_put);
  std::printf("%-28s %12.0f %10.1f\n", "daemon get (gRPC <- G3)", blocks / d_get, mb / d_get);
  std::printf("%-28s %12.0f %10.1f\n", "daemon get (UCX bulk <- G3)", blocks / b_get, mb / b_get);
  std::printf("%-28s %12.0f %10.1f\n", "plain RocksDB get", blocks / r_get, mb / r_get);
  std::printf("%-28s %12.0f %10.1f\n", "daemon put (G3 + G1 copy)", blocks / h_put, mb / h_put);
  std::printf("%-28s %12.0f %10.1f\n", "daemon get (G1 hot)", blocks / h_get, mb / h_get);
  std::printf("ratio daemon/plain: put %.2f, get %.2f (G1-hot get %.2f)\n", r_put / d_put,
              r_get / d_get, r_get / h_get);
  std::printf("ratio bulk/plain: put %.2f, get %.2f; bulk/inline: put %.2f, get %.2f\n",
              r_put / b_put, r_get / b_get, d_put / b_put, d_get / b_get);
  if (errors.load() > 0) {
    std::printf("ERRORS: %d operations failed or returned wrong bytes\n", errors.load());
    return 1;
  }
  return 0;
}
