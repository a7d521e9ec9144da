// transfer_bench: KV hand-off bandwidth of the transfer engine between two processes, over UCX
// TCP (listener) and shared memory (worker-address exchange), next to ucx_perftest on the same
// transport and message size in the same run, and the ratio.
//
//   transfer_bench [--modes tcp,shm] [--sizes-mib 1,4,16,64,256] [--iters 5]
//
// The engine figure is one hand-off of SIZE bytes in 8 segments, timed from Send to the sender's
// confirmation (manifest, claim, data, checksums on both sides, confirmation), median of --iters.
// ucx_perftest runs `-t tag_bw` and `-t ucp_am_bw` with the same size (one message of SIZE bytes
// per iteration) and UCX_TLS=tcp or sm,self; its "overall" MB/s (MiB/s) is reported.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_split.h"
#include "kvstore/transfer/manifest.h"
#include "kvstore/transfer/transfer_engine.h"
#include "kvstore/transfer/ucx_wire.h"
#include "prometheus/registry.h"
#include "spdlog/spdlog.h"
#include "tests/kvstore/transfer/transfer_testing.h"

extern char** environ;
namespace et = epd::transfer;

namespace {

constexpr int kSegments = 8;

et::UcxOptions Ucx(const std::string& mode) {
  et::UcxOptions uo;
  uo.mode = mode == "tcp" ? et::UcxOptions::Mode::kListener : et::UcxOptions::Mode::kWorkerAddress;
  uo.net_devices = "lo";
  return uo;
}

uint64_t g_chunk_mib = 16;

et::EngineOptions Engine() {
  et::EngineOptions eo;
  eo.config_fingerprint = "bench";
  eo.cluster_token = "bench";
  eo.chunk_bytes = g_chunk_mib << 20;
  return eo;
}

std::string RequestId(uint64_t mib, int i) {
  return "b-" + std::to_string(mib) + "-" + std::to_string(i);
}

// Child: receives iters+1 hand-offs per size, in order.
int RunReceiver(const std::string& mode, const std::vector<uint64_t>& sizes, int iters,
                const std::string& address_file) {
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
  for (uint64_t mib : sizes) {
    for (int i = 0; i <= iters; ++i) {
      auto m =
          et::testing::BulkManifest(RequestId(mib, i), "bench", kSegments, (mib << 20) / kSegments);
      // Receive buffers come pre-faulted, as from a worker's pool.
      auto buf = (*rx)->Allocate(et::TotalBytes(m));
      std::memset((*buf)->data(), 0, (*buf)->size());
      auto id = (*rx)->Receive(m, std::move(*buf), {});
      if (!id.ok() || !(*rx)->Wait(*id, absl::Seconds(120)).ok()) return 1;
      (*rx)->Forget(*id);
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

// ucx_perftest client+server on one size; returns MiB/s ("overall" bandwidth), or -1.
double Perftest(const std::string& mode, const std::string& test, uint64_t bytes, int iters,
                int port) {
  const std::string tls = mode == "tcp" ? "UCX_TLS=tcp" : "UCX_TLS=sm,self";
  const std::vector<std::string> env = {tls, "UCX_NET_DEVICES=lo"};
  const std::string slog = "/tmp/transfer_bench_pt_server.log";
  const std::string clog = "/tmp/transfer_bench_pt_client.log";
  pid_t server = Spawn({"ucx_perftest", "-p", std::to_string(port)}, slog, env);
  if (server < 0) return -1;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  pid_t client = Spawn({"ucx_perftest", "127.0.0.1", "-p", std::to_string(port), "-t", test, "-s",
                        std::to_string(bytes), "-n", std::to_string(iters), "-w", "2"},
                       clog, env);
  const int rc = client < 0 ? -1 : WaitPid(client, 120);
  WaitPid(server, 10);
  if (rc != 0) return -1;
  std::ifstream in(clog);
  std::string line;
  double mibs = -1;
  while (std::getline(in, line)) {
    if (line.rfind("Final:", 0) != 0) continue;
    std::vector<std::string> cols = absl::StrSplit(line, ' ', absl::SkipEmpty());
    // Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall
    if (cols.size() >= 7) mibs = std::stod(cols[6]);
  }
  return mibs;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"transfer_bench: KV hand-off bandwidth vs ucx_perftest"};
  std::string modes = "tcp,shm", sizes_arg = "1,4,16,64,256", role, address_file, mode;
  int iters = 5;
  app.add_option("--modes", modes);
  app.add_option("--sizes-mib", sizes_arg);
  app.add_option("--iters", iters);
  app.add_option("--chunk-mib", g_chunk_mib, "engine data chunk size");
  app.add_option("--role", role);  // internal: "recv" for the child
  app.add_option("--mode", mode);
  app.add_option("--address-file", address_file);
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);
  setenv("UCX_NET_DEVICES", "lo", 1);
  std::vector<uint64_t> sizes;
  for (auto s : absl::StrSplit(sizes_arg, ',')) sizes.push_back(std::stoull(std::string(s)));
  if (role == "recv") return RunReceiver(mode, sizes, iters, address_file);

  std::printf("%-4s %9s %12s %14s %14s %10s %10s\n", "tl", "size", "engine_GiB/s", "perf_tag_GiB/s",
              "perf_am_GiB/s", "eng/tag", "eng/am");
  int port = 20000 + getpid() % 20000;
  for (auto m : absl::StrSplit(modes, ',')) {
    const std::string md(m);
    const std::string addr_file = "/tmp/transfer_bench_addr_" + std::to_string(getpid());
    std::remove(addr_file.c_str());
    char self[4096] = {};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) return 2;
    pid_t child = Spawn({self, "--role", "recv", "--mode", md, "--sizes-mib", sizes_arg, "--iters",
                         std::to_string(iters), "--address-file", addr_file},
                        "/tmp/transfer_bench_recv.log", {});
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
      return 2;
    }
    auto peer = (*tx)->Connect(addr, absl::Seconds(10));
    if (!peer.ok()) {
      std::cerr << peer.status() << "\n";
      return 2;
    }
    auto kind = (*tx)->PeerTransport(*peer);
    for (uint64_t mib : sizes) {
      std::vector<double> secs;
      for (int i = 0; i <= iters; ++i) {
        auto man = et::testing::BulkManifest(RequestId(mib, i), "bench", kSegments,
                                             (mib << 20) / kSegments);
        auto buf = (*tx)->Allocate(et::TotalBytes(man));
        std::memset((*buf)->data(), i, (*buf)->size());
        const auto t0 = std::chrono::steady_clock::now();
        auto id = (*tx)->Send(*peer, man, std::move(*buf), {});
        if (!id.ok() || !(*tx)->Wait(*id, absl::Seconds(120)).ok()) {
          std::cerr << "transfer failed\n";
          return 1;
        }
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        (*tx)->Forget(*id);
        if (i > 0) secs.push_back(s);  // first one is the warm-up
      }
      std::sort(secs.begin(), secs.end());
      const double engine = static_cast<double>(mib << 20) / secs[secs.size() / 2] / (1 << 30);
      const double tag = Perftest(md, "tag_bw", mib << 20, std::max(iters, 3), port++) / 1024;
      const double am = Perftest(md, "ucp_am_bw", mib << 20, std::max(iters, 3), port++) / 1024;
      std::printf("%-4s %6lluMiB %12.2f %14.2f %14.2f %10.2f %10.2f%s\n", md.c_str(),
                  static_cast<unsigned long long>(mib), engine, tag, am,
                  tag > 0 ? engine / tag : 0.0, am > 0 ? engine / am : 0.0,
                  kind.ok()
                      ? (" (engine lanes: " + std::string(et::TransportLabel(*kind)) + ")").c_str()
                      : "");
      std::fflush(stdout);
    }
    tx->reset();
    WaitPid(child, 60);
    std::remove(addr_file.c_str());
  }
  return 0;
}
