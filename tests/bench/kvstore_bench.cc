// kvstore_bench: the kvstore data path against plain RocksDB, each figure the median of three runs
// inside one invocation (docs/kvstore.md "Benchmark"). With no arguments (~30 s):
//   1. a 64-block prefix (64 x 56,960 B) fetched as one BatchGet from a real epd-kvstore (G1 off:
//      every block a RocksDB read; same-host values through shared memory) / the same 64 blocks
//      read with plain RocksDB Gets of the same data in this process: the ratio (goal >= 0.7);
//      for context the same batch inline and the prefix as 64 Get RPCs;
//   2. G1-hot BatchGet throughput in GB/s (goal >= 2);
//   3. 1 MiB values put/get inline vs shared memory (kShm) vs UCX bulk (kUcx).
// The last line is "kvstore_bench ratio: <R>" with R the figure of 1 (the median over the three
// runs of plain time / daemon time; each run interleaves the two prefix by prefix).
// With --values N it runs only part 3 (N rounds, ~1 s each).
// With --per-block it runs the older per-block throughput comparison instead:
//   UCX_NET_DEVICES=lo build/kvstore_bench --per-block --blocks 1000 --threads 4 --repeat 3
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

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct RunningDaemon {
  epd::testing::Subprocess proc;
  std::string target;
  ~RunningDaemon() {
    proc.Signal(SIGKILL);
    proc.Wait(std::chrono::seconds(10));
  }
};

std::unique_ptr<RunningDaemon> StartDaemon(const std::string& daemon,
                                           const epd::testing::TempDir& dir, const std::string& tag,
                                           uint64_t g1_bytes, size_t block_bytes, bool bulk) {
  std::filesystem::remove_all(dir.File(tag));
  std::filesystem::remove(dir.File(tag + ".json"));
  auto d = std::make_unique<RunningDaemon>();
  d->proc = epd::testing::Subprocess::Start(
      {daemon, "--data-dir", dir.File(tag), "--grpc-port", "0", "--port-file",
       dir.File(tag + ".json"), "--g1-capacity-bytes", std::to_string(g1_bytes), "--block-bytes",
       std::to_string(block_bytes), "--bulk", bulk ? "ucx" : "off", "--log-level", "warn",
       "--drain-timeout-ms", "1000"},
      dir.File(tag + ".log"));
  auto port =
      epd::testing::WaitForPortFile(dir.File(tag + ".json"), "grpc", std::chrono::seconds(30));
  if (!port.has_value()) {
    std::cerr << "kvstore_bench: daemon did not start: " << d->proc.ReadLog() << "\n";
    std::exit(1);
  }
  d->target = absl::StrCat("127.0.0.1:", *port);
  return d;
}

// 1 MiB values put/get (G3) through one daemon by each transport, sequential, `rounds` rounds
// after a warm-up round; the modes alternate inside each round so they see the same load.
// Wrong bytes and failed calls are added to *errors_out.
constexpr int kBig = 24;  // 1 MiB values per round (part 3)
constexpr size_t kBigBytes = size_t{1} << 20;

struct ValueMode {
  const char* name;
  epd::kvstore::BulkTransport bulk;
  std::vector<double> puts, gets;
};

std::vector<ValueMode> RunValueBench(const std::string& daemon, const epd::testing::TempDir& dir,
                                     int rounds, int* errors_out, const std::string& only = "") {
  using epd::kvstore::Tier;
  constexpr size_t kBlockBytes = 64 * 890;
  int errors = 0;
  std::vector<std::string> big_keys, big_values;
  for (int i = 0; i < kBig; ++i) {
    const int32_t t = 1'000'000 + i;
    big_keys.emplace_back(epd::kvstore::AsBytes(epd::kvstore::ChainHash(
        epd::kvstore::kRootParent, std::span<const int32_t>(&t, 1), "bench")));
    big_values.push_back(Payload(static_cast<uint64_t>(t), kBigBytes));
  }
  std::vector<ValueMode> modes{{"inline", epd::kvstore::BulkTransport::kInline, {}, {}},
                               {"shm", epd::kvstore::BulkTransport::kShm, {}, {}},
                               {"ucx", epd::kvstore::BulkTransport::kUcx, {}, {}}};
  if (!only.empty()) {  // one mode alone (for profiling it)
    std::erase_if(modes, [&](const ValueMode& m) { return only != m.name; });
  }
  {
    auto d = StartDaemon(daemon, dir, "big", 0, kBlockBytes, true);
    std::vector<std::unique_ptr<epd::kvstore::KvStoreClient>> clients;
    for (ValueMode& m : modes) {
      epd::kvstore::KvClientOptions o;
      o.bulk = m.bulk;
      o.bulk_min_bytes = 0;
      clients.push_back(epd::kvstore::KvStoreClient::Create(d->target, o));
    }
    for (int r = 0; r <= rounds; ++r) {  // r == 0 warms up
      for (size_t m = 0; m < modes.size(); ++m) {
        auto& c = *clients[m];
        const double put_s = Seconds([&] {
          for (int i = 0; i < kBig; ++i)
            errors += c.Put(Tier::kG3, big_keys[i], big_values[i]).ok() ? 0 : 1;
        });
        const double get_s = Seconds([&] {
          for (int i = 0; i < kBig; ++i) {
            auto g = c.Get(Tier::kG3, big_keys[i]);
            errors += g.ok() && g->found && g->value == big_values[i] ? 0 : 1;
          }
        });
        if (r > 0) {
          modes[m].puts.push_back(put_s);
          modes[m].gets.push_back(get_s);
        }
      }
    }
  }

  *errors_out += errors;
  return modes;
}

void PrintValueTable(const std::vector<ValueMode>& modes) {
  std::printf("%-44s %10s %10s\n", "1 MiB values (24, sequential)", "put MB/s", "get MB/s");
  const double big_mb = static_cast<double>(kBig) * kBigBytes / 1e6;
  for (const ValueMode& m : modes) {
    std::printf("%-44s %10.1f %10.1f\n", m.name, big_mb / Median(m.puts), big_mb / Median(m.gets));
  }
  if (modes.size() < 3) return;
  std::printf(
      "1 MiB shm/inline: put %.2f, get %.2f; ucx/inline: put %.2f, get %.2f\n",
      Median(modes[0].puts) / Median(modes[1].puts), Median(modes[0].gets) / Median(modes[1].gets),
      Median(modes[0].puts) / Median(modes[2].puts), Median(modes[0].gets) / Median(modes[2].gets));
}

// The default run (see the header). Returns the process exit code.
int RunPrefixBench(const std::string& daemon, int prefixes) {
  constexpr int kBlocks = 64;
  constexpr size_t kBlockBytes = 64 * 890;
  constexpr int kRepeat = 3;
  using epd::kvstore::KvPut;
  using epd::kvstore::Tier;
  epd::testing::TempDir dir;
  // prefixes x 64 blocks, each prefix a chain of 64 distinct keys.
  std::vector<std::vector<std::string>> keys(prefixes), values(prefixes);
  for (int p = 0; p < prefixes; ++p) {
    for (int b = 0; b < kBlocks; ++b) {
      const int32_t t = p * kBlocks + b;
      keys[p].emplace_back(epd::kvstore::AsBytes(epd::kvstore::ChainHash(
          epd::kvstore::kRootParent, std::span<const int32_t>(&t, 1), "bench")));
      values[p].push_back(Payload(static_cast<uint64_t>(t) + 1, kBlockBytes));
    }
  }
  int errors = 0;
  auto put_all = [&](epd::kvstore::KvStoreClient& c) {
    for (int p = 0; p < prefixes; ++p) {
      std::vector<KvPut> puts;
      for (int b = 0; b < kBlocks; ++b) puts.push_back({keys[p][b], values[p][b]});
      auto r = c.BatchPut(Tier::kG3, puts);
      if (!r.ok()) {
        ++errors;
        continue;
      }
      for (const auto& s : *r) errors += s.ok() ? 0 : 1;
    }
  };
  // Prefix p as one BatchGet; returns seconds; values checked after the clock stopped.
  auto batch_get_one = [&](epd::kvstore::KvStoreClient& c, Tier tier, int p) {
    absl::StatusOr<std::vector<absl::StatusOr<epd::kvstore::GetResult>>> got =
        absl::UnknownError("not run");
    const double s = Seconds([&] { got = c.BatchGet(tier, keys[p], /*stop_at_first_miss=*/true); });
    if (!got.ok() || got->size() != static_cast<size_t>(kBlocks)) {
      ++errors;
      return s;
    }
    for (int b = 0; b < kBlocks; ++b) {
      const auto& item = (*got)[b];
      if (!item.ok() || !item->found || item->value != values[p][b]) ++errors;
    }
    return s;
  };
  auto batch_get_all = [&](epd::kvstore::KvStoreClient& c, Tier tier) {
    double s = 0;
    for (int p = 0; p < prefixes; ++p) s += batch_get_one(c, tier, p);
    return s;
  };
  auto per_block_get_one = [&](epd::kvstore::KvStoreClient& c, int p) {
    return Seconds([&] {
      for (int b = 0; b < kBlocks; ++b) {
        auto r = c.Get(Tier::kG3, keys[p][b]);
        if (!r.ok() || !r->found || r->value.size() != kBlockBytes) ++errors;
      }
    });
  };
  epd::kvstore::KvClientOptions shm_opts;  // default: shared memory on the same host
  epd::kvstore::KvClientOptions inline_opts;
  inline_opts.shared_memory = false;
  const double prefix_mb = static_cast<double>(kBlocks) * kBlockBytes / 1e6;
  const double total_gb = prefix_mb * prefixes / 1e3;

  // --- 1. G3: daemon batch vs plain RocksDB, interleaved prefix by prefix so that both see the
  // same load on a shared machine ---
  std::vector<double> d_shm, d_inline, d_single, plain;
  bool shm_active = false;
  {
    // Plain RocksDB with G3's options (WAL on, no fsync, no compression, verified reads).
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
    for (int p = 0; p < prefixes; ++p)
      for (int b = 0; b < kBlocks; ++b)
        if (!db->Put(rocksdb::WriteOptions(), keys[p][b], values[p][b]).ok()) ++errors;
    rocksdb::ReadOptions ro;
    ro.verify_checksums = true;
    auto plain_get_one = [&](int p) {
      std::vector<std::string> got(kBlocks);
      const double s = Seconds([&] {
        for (int b = 0; b < kBlocks; ++b)
          if (!db->Get(ro, keys[p][b], &got[b]).ok()) ++errors;
      });
      for (int b = 0; b < kBlocks; ++b) errors += got[b] == values[p][b] ? 0 : 1;
      return s;
    };

    auto d = StartDaemon(daemon, dir, "g3", 0, kBlockBytes, false);
    auto shm = epd::kvstore::KvStoreClient::Create(d->target, shm_opts);
    auto inl = epd::kvstore::KvStoreClient::Create(d->target, inline_opts);
    put_all(*shm);
    batch_get_all(*shm, Tier::kG3);  // warm: page cache, connections, segments
    batch_get_all(*inl, Tier::kG3);
    for (int p = 0; p < prefixes; ++p) plain_get_one(p);
    shm_active = shm->shared_memory_active();
    for (int r = 0; r < kRepeat; ++r) {
      double ds = 0, is = 0, ss = 0, ps = 0;
      for (int p = 0; p < prefixes; ++p) {
        ds += batch_get_one(*shm, Tier::kG3, p);
        ps += plain_get_one(p);
        is += batch_get_one(*inl, Tier::kG3, p);
        ss += per_block_get_one(*inl, p);
      }
      d_shm.push_back(ds);
      plain.push_back(ps);
      d_inline.push_back(is);
      d_single.push_back(ss);
    }
    db->Close();
  }

  // --- 2. G1 hot ---
  std::vector<double> hot_shm, hot_inline;
  {
    auto d =
        StartDaemon(daemon, dir, "g1", static_cast<uint64_t>(prefixes * kBlocks + 1) * kBlockBytes,
                    kBlockBytes, false);
    auto shm = epd::kvstore::KvStoreClient::Create(d->target, shm_opts);
    auto inl = epd::kvstore::KvStoreClient::Create(d->target, inline_opts);
    put_all(*shm);  // writes through to G1
    batch_get_all(*shm, Tier::kG1);
    batch_get_all(*inl, Tier::kG1);
    for (int r = 0; r < kRepeat; ++r) {
      hot_shm.push_back(batch_get_all(*shm, Tier::kG1));
      hot_inline.push_back(batch_get_all(*inl, Tier::kG1));
    }
  }

  // --- 3. 1 MiB values: inline vs shared memory vs UCX ---
  std::vector<ValueMode> modes = RunValueBench(daemon, dir, kRepeat, &errors);

  // R: the median over the three runs of (plain time / daemon time) of the same run.
  std::vector<double> run_ratios;
  for (int r = 0; r < kRepeat; ++r) run_ratios.push_back(plain[r] / d_shm[r]);
  const double ratio = Median(run_ratios);
  std::printf("kvstore_bench: %d prefixes x %d blocks x %zu B, 1 client thread, median of %d\n",
              prefixes, kBlocks, kBlockBytes, kRepeat);
  std::printf("%-44s %10s %10s\n", "64-block prefix get (G3 / RocksDB reads)", "ms/prefix", "GB/s");
  auto row = [&](const char* name, double s) {
    std::printf("%-44s %10.3f %10.2f\n", name, s * 1e3 / prefixes, total_gb / s);
  };
  row(shm_active ? "daemon BatchGet, shared memory" : "daemon BatchGet (shm NOT active)",
      Median(d_shm));
  row("daemon BatchGet, inline gRPC", Median(d_inline));
  row("daemon 64 x Get RPC, inline", Median(d_single));
  row("plain RocksDB 64 x Get", Median(plain));
  row("G1-hot BatchGet, shared memory", Median(hot_shm));
  row("G1-hot BatchGet, inline gRPC", Median(hot_inline));
  PrintValueTable(modes);
  std::printf("G1-hot get: %.2f GB/s (goal >= 2)\n", total_gb / Median(hot_shm));
  std::printf("batched prefix get daemon/plain: shm %.2f, inline %.2f, per-block RPCs %.2f\n",
              ratio, Median(plain) / Median(d_inline), Median(plain) / Median(d_single));
  if (errors > 0) {
    std::printf("ERRORS: %d operations failed or returned wrong bytes\n", errors);
    return 1;
  }
  std::printf("kvstore_bench ratio: %.2f\n", ratio);
  return 0;
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
  bool per_block = false;
  app.add_flag("--per-block", per_block,
               "Run the per-block throughput comparison (--blocks, --threads, ...) instead");
  int prefixes = 16;
  app.add_option("--prefixes", prefixes, "Default run: 64-block prefixes per pass (default 16)")
      ->check(CLI::PositiveNumber);
  int values_rounds = 0;
  app.add_option("--values", values_rounds,
                 "Run only the 1 MiB values table (part 3), this many rounds (median printed)")
      ->check(CLI::PositiveNumber);
  std::string values_mode;
  app.add_option("--values-mode", values_mode, "With --values: only this mode (inline|shm|ucx)")
      ->check(CLI::IsMember({"inline", "shm", "ucx"}));
  CLI11_PARSE(app, argc, argv);
  if (values_rounds > 0) {
    epd::testing::TempDir dir;
    int errors = 0;
    PrintValueTable(RunValueBench(daemon, dir, values_rounds, &errors, values_mode));
    if (errors > 0) {
      std::printf("ERRORS: %d operations failed or returned wrong bytes\n", errors);
      return 1;
    }
    return 0;
  }
  if (!per_block) return RunPrefixBench(daemon, prefixes);
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
