// transfer_bench: KV hand-off bandwidth and latency of the transfer engine between two processes,
// over UCX TCP (listener) and shared memory (worker-address exchange), next to ucx_perftest on the
// same transport and message size in the same invocation.
//
//   transfer_bench                      (the issue-14 figures: 16 and 256 MiB, tcp and shm, 3
//   rounds) transfer_bench [--modes tcp,shm] [--sizes-mib 16,256] [--rounds 3] [--iters 3]
//                  [--latency-mib 1] [--lat-iters 15] [--chunk-mib 4] [--pool-mib 256]
//                  [--spin-us -1] [--inline-hash-kib 1024]
//
// Both engines are configured as the workers' hand-off engines are (a pool of registered buffers,
// kHandoffPoolBytes; small transfers hashed inline, kHandoffInlineHashBytes; the progress
// threads' default spin for this host), unless --pool-mib / --inline-hash-kib / --spin-us say
// otherwise.
//
// Bandwidth: each round times --iters hand-offs of SIZE bytes in 8 segments, each from Send to the
// sender's confirmation (offer, claim, data, checksums on both sides, seal, confirmation), and
// takes their median; then runs `ucx_perftest -t tag_bw -s SIZE` (UCX_TLS=tcp or sm,self) and
// reads its "overall" MB/s (MiB/s). The figure per (transport, size) is the median of the rounds;
// ratio = engine / tag_bw. Latency: the median time of one --latency-mib hand-off against
// `ucx_perftest -t tag_lat` at that size, whose reported latency is half a round trip (the round
// trip is quoted). Then the two ways a worker hand-off can fill its transfer from segments it
// holds (1 MiB and 16 MiB, median of --lat-iters, timed from the first copy to the sender's
// confirmation): copy each segment into the buffer and let the engine hash while the data moves,
// or hash each segment while copying it and send the checksums in the offer
// (`checksums_in_manifest`, what the kvstore bulk path does; worker hand-offs keep the engine's
// hashing, docs/transfer.md says why). The last line is
// `transfer_bench ratio: <min over the bandwidth ratios>`.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_split.h"
#include "transfer/manifest.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx_wire.h"
#include "prometheus/registry.h"
#include "spdlog/spdlog.h"
#include "tests/transfer/transfer_testing.h"

extern char** environ;
namespace et = epd::transfer;

namespace {

constexpr int kSegments = 8;

int64_t g_spin_us = -1;  // UcxOptions::spin in us; -1: its default (EffectiveSpin)
// EngineOptions::pool_bytes in MiB; default: the workers' hand-off engines' pool.
uint64_t g_pool_mib = et::kHandoffPoolBytes >> 20;
// EngineOptions::inline_hash_bytes in KiB; default: the workers' hand-off engines'.
uint64_t g_inline_hash_kib = et::kHandoffInlineHashBytes >> 10;

et::UcxOptions Ucx(const std::string& mode) {
  et::UcxOptions uo;
  uo.mode = mode == "tcp" ? et::UcxOptions::Mode::kListener : et::UcxOptions::Mode::kWorkerAddress;
  uo.net_devices = "lo";
  if (g_spin_us >= 0) uo.spin = absl::Microseconds(g_spin_us);
  return uo;
}

uint64_t g_chunk_mib = 4;

et::EngineOptions Engine() {
  et::EngineOptions eo;
  eo.config_fingerprint = "bench";
  eo.cluster_token = "bench";
  eo.chunk_bytes = g_chunk_mib << 20;
  eo.pool_bytes = g_pool_mib << 20;
  eo.inline_hash_bytes = g_inline_hash_kib << 10;
  return eo;
}

// The hand-offs one mode runs, in order: (MiB, count).
using Plan = std::vector<std::pair<uint64_t, int>>;

std::string PlanString(const Plan& plan) {
  std::string out;
  for (const auto& [mib, n] : plan)
    out += (out.empty() ? "" : ",") + std::to_string(mib) + ":" + std::to_string(n);
  return out;
}

Plan ParsePlan(const std::string& s) {
  Plan plan;
  for (auto item : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(item, ':');
    if (kv.size() == 2) plan.emplace_back(std::stoull(kv[0]), std::stoi(kv[1]));
  }
  return plan;
}

std::string RequestId(int seq) { return "b-" + std::to_string(seq); }

// Child: receives the plan's hand-offs, in order.
int RunReceiver(const std::string& mode, const Plan& plan, const std::string& address_file) {
  prometheus::Registry registry;
  auto rx = et::MakeUcxTransport(Ucx(mode), Engine(), registry, epd::common::SystemClock::Get());
  if (!rx.ok()) {
    std::cerr << rx.status() << "\n";
    return 2;
  }
  {
    std::ofstream out(address_file + ".tmp");
    out << (*rx)->LocalAddress();
  }
  std::rename((address_file + ".tmp").c_str(), address_file.c_str());
  // Like a worker's pool: each receive is posted before its offer comes (two ahead), into a
  // buffer that is recycled (already faulted in) once its hand-off has been taken.
  std::vector<uint64_t> order;
  for (const auto& [mib, count] : plan)
    for (int i = 0; i < count; ++i) order.push_back(mib);
  std::vector<std::unique_ptr<et::TransferBuffer>> spare;
  auto post = [&](size_t seq) -> absl::StatusOr<et::TransferId> {
    const uint64_t mib = order[seq];
    auto m = et::testing::BulkManifest(RequestId(static_cast<int>(seq)), "bench", kSegments,
                                       (mib << 20) / kSegments);
    std::unique_ptr<et::TransferBuffer> buf;
    for (auto it = spare.begin(); it != spare.end(); ++it) {
      if ((*it)->size() == et::TotalBytes(m)) {
        buf = std::move(*it);
        spare.erase(it);
        break;
      }
    }
    if (!buf) {
      auto fresh = (*rx)->Allocate(et::TotalBytes(m));
      if (!fresh.ok()) return fresh.status();
      buf = std::move(*fresh);
      std::memset(buf->data(), 0, buf->size());
    }
    return (*rx)->Receive(m, std::move(buf), {});
  };
  std::deque<et::TransferId> posted;
  size_t next = 0;
  for (; next < order.size() && next < 2; ++next) {
    auto id = post(next);
    if (!id.ok()) return 1;
    posted.push_back(*id);
  }
  while (!posted.empty()) {
    const et::TransferId id = posted.front();
    posted.pop_front();
    if (!(*rx)->Wait(id, absl::Seconds(120)).ok()) return 1;
    auto got = (*rx)->TakeReceived(id);
    if (!got.ok()) return 1;
    spare.clear();  // at most the one just taken is kept: sizes change between phases
    spare.push_back(std::move(got->buffer));
    (*rx)->Forget(id);
    if (next < order.size()) {
      auto nid = post(next++);
      if (!nid.ok()) return 1;
      posted.push_back(*nid);
    }
  }
  return 0;
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log,
            const std::vector<std::string>& env_extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  env.insert(env.end(), env_extra.begin(), env_extra.end());
  std::vector<char*> a, e;
  for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  for (auto& s : env) e.push_back(const_cast<char*>(s.c_str()));
  e.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  if (posix_spawnp(&pid, a[0], &fa, nullptr, a.data(), e.data()) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

int WaitPid(pid_t pid, int timeout_s) {
  for (int i = 0; i < timeout_s * 100; ++i) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

// ucx_perftest client+server on one size; returns column `col` of its "Final:" line, or -1.
// Final: iters lat_typical lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall
// (bw in MB/s = MiB/s, latencies in usec).
double Perftest(const std::string& mode, const std::string& test, uint64_t bytes, int iters,
                int port, int col) {
  const std::string tls = mode == "tcp" ? "UCX_TLS=tcp" : "UCX_TLS=sm,self";
  const std::vector<std::string> env = {tls, "UCX_NET_DEVICES=lo"};
  const std::string tag = std::to_string(getpid());
  const std::string slog = "/tmp/transfer_bench_pt_server_" + tag + ".log";
  const std::string clog = "/tmp/transfer_bench_pt_client_" + tag + ".log";
  pid_t server = Spawn({"ucx_perftest", "-p", std::to_string(port)}, slog, env);
  if (server < 0) return -1;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  pid_t client = Spawn({"ucx_perftest", "127.0.0.1", "-p", std::to_string(port), "-t", test, "-s",
                        std::to_string(bytes), "-n", std::to_string(iters), "-w", "2"},
                       clog, env);
  const int rc = client < 0 ? -1 : WaitPid(client, 120);
  WaitPid(server, 10);
  double value = -1;
  if (rc == 0) {
    std::ifstream in(clog);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("Final:", 0) != 0) continue;
      std::vector<std::string> cols = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (static_cast<int>(cols.size()) > col) value = std::stod(cols[col]);
    }
  }
  std::remove(slog.c_str());
  std::remove(clog.c_str());
  return value;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

std::string Join(const std::vector<double>& v, double scale) {
  std::string out;
  char buf[32];
  for (double x : v) {
    std::snprintf(buf, sizeof(buf), "%s%.2f", out.empty() ? "" : " ", x * scale);
    out += buf;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"transfer_bench: KV hand-off bandwidth and latency vs ucx_perftest"};
  std::string modes = "tcp,shm", sizes_arg = "16,256", role, address_file, mode, plan_arg;
  int rounds = 3, iters = 3, lat_iters = 15;
  uint64_t latency_mib = 1;
  app.add_option("--modes", modes, "transports: tcp (UCX listener), shm (worker address)");
  app.add_option("--sizes-mib", sizes_arg, "bandwidth sizes");
  app.add_option("--rounds", rounds, "rounds per size; the figure is their median");
  app.add_option("--iters", iters, "engine hand-offs per round (their median)");
  app.add_option("--latency-mib", latency_mib, "hand-off size for the latency figure (0: skip)");
  app.add_option("--lat-iters", lat_iters, "hand-offs timed for the latency figure");
  app.add_option("--chunk-mib", g_chunk_mib, "engine data chunk size");
  app.add_option("--pool-mib", g_pool_mib,
                 "engine buffer pool in MiB (EngineOptions::pool_bytes; default: the workers')");
  app.add_option("--inline-hash-kib", g_inline_hash_kib,
                 "hash transfers up to this in Send() / on the wire thread (EngineOptions::"
                 "inline_hash_bytes; default: the workers')");
  app.add_option("--spin-us", g_spin_us,
                 "UCX progress thread spin in us (UcxOptions::spin; -1: its default on this host)");
  app.add_option("--role", role);  // internal: "recv" for the child
  app.add_option("--mode", mode);
  app.add_option("--plan", plan_arg);
  app.add_option("--address-file", address_file);
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::err);
  setenv("UCX_NET_DEVICES", "lo", 1);
  if (role == "recv") return RunReceiver(mode, ParsePlan(plan_arg), address_file);
  if (rounds < 1 || iters < 1 || lat_iters < 1 || g_chunk_mib == 0) {
    std::cerr << "--rounds, --iters, --lat-iters and --chunk-mib must be >= 1\n";
    return 2;
  }
  std::vector<uint64_t> sizes;
  for (auto s : absl::StrSplit(sizes_arg, ',', absl::SkipEmpty()))
    sizes.push_back(std::stoull(std::string(s)));
  Plan plan;
  for (uint64_t mib : sizes) plan.emplace_back(mib, 1 + rounds * iters);  // 1 warm-up
  if (latency_mib > 0) plan.emplace_back(latency_mib, 2 + lat_iters);     // 2 warm-up
  if (lat_iters > 0) {  // hand-offs from segments: plain and checksums-in-offer, alternated
    plan.emplace_back(1, 2 * (2 + lat_iters));
    plan.emplace_back(16, 2 * (2 + lat_iters));
  }

  std::printf("%-4s %8s %13s %13s %7s   %s\n", "tl", "size", "engine_GiB/s", "tag_bw_GiB/s",
              "ratio", "rounds: engine | tag_bw (GiB/s)");
  double min_ratio = 1e9;
  std::vector<std::string> latency_lines;
  int port = 20000 + getpid() % 20000;
  for (auto m : absl::StrSplit(modes, ',', absl::SkipEmpty())) {
    const std::string md(m);
    if (md != "tcp" && md != "shm") {
      std::cerr << "unknown mode " << md << " (want tcp or shm)\n";
      return 2;
    }
    const std::string addr_file = "/tmp/transfer_bench_addr_" + std::to_string(getpid());
    std::remove(addr_file.c_str());
    char self[4096] = {};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) return 2;
    const std::string recv_log = "/tmp/transfer_bench_recv_" + std::to_string(getpid()) + ".log";
    pid_t child =
        Spawn({self, "--role", "recv", "--mode", md, "--plan", PlanString(plan), "--chunk-mib",
               std::to_string(g_chunk_mib), "--pool-mib", std::to_string(g_pool_mib),
               "--inline-hash-kib", std::to_string(g_inline_hash_kib), "--spin-us",
               std::to_string(g_spin_us), "--address-file", addr_file},
              recv_log, {});
    std::string addr;
    for (int i = 0; i < 2000 && addr.empty(); ++i) {
      std::ifstream in(addr_file);
      std::getline(in, addr);
      if (addr.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    prometheus::Registry registry;
    auto tx = et::MakeUcxTransport(Ucx(md), Engine(), registry, epd::common::SystemClock::Get());
    if (!tx.ok() || addr.empty()) {
      std::cerr << "setup failed\n";
      if (child > 0) WaitPid(child, 1);
      return 2;
    }
    auto peer = (*tx)->Connect(addr, absl::Seconds(10));
    if (!peer.ok()) {
      std::cerr << peer.status() << "\n";
      WaitPid(child, 1);
      return 2;
    }
    int seq = 0;
    // Sends `buf` under `man` and waits for the sender's confirmation: seconds since t0, or -1.
    auto send_and_wait = [&](const epd::v1::Manifest& man, std::unique_ptr<et::TransferBuffer> buf,
                             const et::TransferOptions& opts,
                             std::chrono::steady_clock::time_point t0) -> double {
      auto id = (*tx)->Send(*peer, man, std::move(buf), opts);
      if (!id.ok()) return -1;
      absl::Status st = (*tx)->Wait(*id, absl::Seconds(120));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (*tx)->Forget(*id);
      return st.ok() ? s : -1;
    };
    // A worker hand-off from segments the sender holds: copies them into a transfer buffer, plain
    // (the engine hashes) or hashing each as it goes (checksums in the offer); seconds from the
    // first copy to the sender's confirmation, or -1.
    std::vector<std::vector<uint8_t>> held;
    auto from_segments = [&](uint64_t mib, bool in_offer) -> double {
      const uint64_t seg = (mib << 20) / kSegments;
      held.resize(kSegments);
      for (auto& h : held) h.assign(seg, static_cast<uint8_t>(seq));
      auto man = et::testing::BulkManifest(RequestId(seq), "bench", kSegments, seg);
      ++seq;
      const auto t0 = std::chrono::steady_clock::now();
      auto buf = (*tx)->Allocate(et::TotalBytes(man));
      if (!buf.ok()) return -1;
      for (int i = 0; i < kSegments; ++i) {
        uint8_t* dst = (*buf)->data() + i * seg;
        if (in_offer) {
          man.mutable_segments(i)->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
          man.mutable_segments(i)->set_checksum(et::CopyAndChecksum(held[i], dst));
        } else {
          std::memcpy(dst, held[i].data(), seg);
        }
      }
      et::TransferOptions opts;
      opts.checksums_in_manifest = in_offer;
      return send_and_wait(man, std::move(*buf), opts, t0);
    };
    // One hand-off of `mib` MiB; its seconds from Send to the sender's confirmation, or -1.
    auto handoff = [&](uint64_t mib) -> double {
      auto man =
          et::testing::BulkManifest(RequestId(seq), "bench", kSegments, (mib << 20) / kSegments);
      auto buf = (*tx)->Allocate(et::TotalBytes(man));
      std::memset((*buf)->data(), seq & 0xff, (*buf)->size());
      ++seq;
      return send_and_wait(man, std::move(*buf), {}, std::chrono::steady_clock::now());
    };
    auto kind = (*tx)->PeerTransport(*peer);
    for (uint64_t mib : sizes) {
      if (handoff(mib) < 0) {  // warm-up
        std::cerr << "transfer failed\n";
        return 1;
      }
      std::vector<double> engine, tag;
      for (int r = 0; r < rounds; ++r) {
        std::vector<double> secs;
        for (int i = 0; i < iters; ++i) {
          const double s = handoff(mib);
          if (s < 0) {
            std::cerr << "transfer failed\n";
            return 1;
          }
          secs.push_back(s);
        }
        engine.push_back(static_cast<double>(mib << 20) / Median(secs) / (1 << 30));
        const double pt = Perftest(md, "tag_bw", mib << 20, std::max(iters, 3), port++, 6);
        tag.push_back(pt > 0 ? pt / 1024 : 0);
      }
      const double e = Median(engine), t = Median(tag);
      const double ratio = t > 0 ? e / t : 0;
      min_ratio = std::min(min_ratio, ratio);
      std::printf("%-4s %5lluMiB %13.2f %13.2f %7.2f   %s | %s%s\n", md.c_str(),
                  static_cast<unsigned long long>(mib), e, t, ratio, Join(engine, 1).c_str(),
                  Join(tag, 1).c_str(),
                  kind.ok()
                      ? (" (engine lanes: " + std::string(et::TransportLabel(*kind)) + ")").c_str()
                      : "");
      std::fflush(stdout);
    }
    if (latency_mib > 0) {
      std::vector<double> secs;
      for (int i = 0; i < 2 + lat_iters; ++i) {
        const double s = handoff(latency_mib);
        if (s < 0) {
          std::cerr << "transfer failed\n";
          return 1;
        }
        if (i >= 2) secs.push_back(s);
      }
      const double engine_us = Median(secs) * 1e6;
      // tag_lat reports half a round trip (usec, "typical" = median).
      const double half =
          Perftest(md, "tag_lat", latency_mib << 20, std::max(lat_iters, 10), port++, 2);
      const double rtt_us = half > 0 ? 2 * half : 0;
      char line[256];
      std::snprintf(line, sizeof(line),
                    "latency %-4s %lluMiB: engine hand-off %.0f us (median of %d), perftest "
                    "tag_lat round trip %.0f us, round trip / hand-off %.2f",
                    md.c_str(), static_cast<unsigned long long>(latency_mib), engine_us, lat_iters,
                    rtt_us, engine_us > 0 ? rtt_us / engine_us : 0.0);
      latency_lines.push_back(line);
    }
    for (uint64_t mib : {uint64_t{1}, uint64_t{16}}) {
      if (lat_iters <= 0) break;
      std::vector<double> plain, in_offer;
      for (int i = 0; i < 2 + lat_iters; ++i) {  // alternated; 2 warm-up pairs
        const double a = from_segments(mib, false), b = from_segments(mib, true);
        if (a < 0 || b < 0) {
          std::cerr << "transfer failed\n";
          return 1;
        }
        if (i >= 2) {
          plain.push_back(a);
          in_offer.push_back(b);
        }
      }
      char line[256];
      std::snprintf(line, sizeof(line),
                    "hand-off from segments %-4s %2lluMiB: copy + engine hashing %.0f us, "
                    "copy-and-hash + checksums in the offer %.0f us (medians of %d; %.2fx)",
                    md.c_str(), static_cast<unsigned long long>(mib), Median(plain) * 1e6,
                    Median(in_offer) * 1e6, lat_iters, Median(plain) / Median(in_offer));
      latency_lines.push_back(line);
    }
    tx->reset();
    if (WaitPid(child, 60) == 0) std::remove(recv_log.c_str());  // kept when the receiver failed
    std::remove(addr_file.c_str());
  }
  for (const std::string& l : latency_lines) std::printf("%s\n", l.c_str());
  std::printf("transfer_bench ratio: %.2f\n", min_ratio < 1e9 ? min_ratio : 0.0);
  return 0;
}
