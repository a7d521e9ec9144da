#pragma once

// `epd serve` as a test fixture: starts it on free ports (port 0: its router binds them and
// publishes them, so nothing can take them between a pick and the bind) with a temporary data
// folder, reads the
// pid and ports each child published (data/run/<name>.json), waits for a child to come back
// under a new pid, and lists the processes of the cluster that are still alive (every child's
// command line names the data folder). Header-only; link epd::testing.
//
// Ownership: owns the temp dir and the `epd serve` process (the destructor SIGKILLs it, and its
// children die with it: PR_SET_PDEATHSIG). Used from the test thread.

#include <signal.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/processes.h"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/subprocess.h"

namespace epd::testing {

class ServeCluster {
 public:
  // `args` are added to `epd serve --data-dir ... --http-port 0 --grpc-port 0 ...`; `binary` is
  // the launcher (epd, or epd-emulated: tests/gpu/CMakeLists.txt), `env` added to its environment
  // (its children inherit it).
  explicit ServeCluster(std::vector<std::string> args = {}, const std::string& binary = "epd",
                        const std::map<std::string, std::string>& env = {}) {
    std::vector<std::string> argv = {BinaryPath(binary),     "serve", "--data-dir",  data_dir(),
                                     "--http-port",          "0",     "--grpc-port", "0",
                                     "--restart-backoff-ms", "100"};
    argv.insert(argv.end(), args.begin(), args.end());
    serve_ = Subprocess::Start(argv, dir_.File("serve.log"), env);
  }

  // Waits for "epd serve: ready" (the first start generates the nano model), then reads the
  // router's ports (a restarted router comes back on them).
  bool WaitReady(std::chrono::seconds timeout = std::chrono::seconds(300)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end && serve_.running()) {
      if (serve_.ReadLog().find("epd serve: ready") != std::string::npos) {
        http_port_ = Published("epd-router", "http").value_or(0);
        grpc_port_ = Published("epd-router", "grpc").value_or(0);
        return http_port_ > 0 && grpc_port_ > 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  std::string data_dir() const { return dir_.File("data"); }
  // The router's ports; 0 until WaitReady returned true.
  int http_port() const { return http_port_; }
  int grpc_port() const { return grpc_port_; }
  Subprocess& serve() { return serve_; }

  // A value the child `name` (e.g. "epd-decode-1") published now; nullopt while it is down.
  std::optional<int> Published(const std::string& name, const std::string& key) const {
    return WaitForPortFile(data_dir() + "/run/" + name + ".json", key,
                           std::chrono::milliseconds(0));
  }
  pid_t Pid(const std::string& name) const { return Published(name, "pid").value_or(-1); }

  // Waits until `name` runs under a pid other than `old_pid` and published `key` ("registered"
  // for workers, "grpc" for the router and the kvstore).
  bool WaitBack(const std::string& name, pid_t old_pid, const std::string& key,
                std::chrono::seconds timeout = std::chrono::seconds(120)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      const pid_t pid = Pid(name);
      if (pid > 0 && pid != old_pid && Published(name, key) && kill(pid, 0) == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // One series of the router's /metrics.
  std::optional<double> RouterMetric(const std::string& series) const {
    auto port = Published("epd-router", "metrics");
    return port ? ScrapeMetric(*port, series) : std::nullopt;
  }

  // Waits until the router lists exactly `n[i]` live workers of the encoder, prefill and decode
  // pools.
  bool WaitWorkers(std::array<int, 3> n,
                   std::chrono::seconds timeout = std::chrono::seconds(60)) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    static const char* kPools[] = {"encoder", "prefill", "decode"};
    while (std::chrono::steady_clock::now() < end) {
      bool all = true;
      for (int i = 0; i < 3; ++i) {
        auto v = RouterMetric(std::string("epd_router_workers{pool=\"") + kPools[i] + "\"}");
        all = all && v && static_cast<int>(*v) == n[i];
      }
      if (all) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  // Live (not zombie) processes other than `epd serve` whose command line names the data
  // folder: the cluster's children.
  std::vector<pid_t> ClusterPids() const {
    const std::set<pid_t> pids = runtime::ProcessesNaming(data_dir() + "/", serve_.pid());
    return {pids.begin(), pids.end()};
  }

  std::string Logs() const {
    std::string out = "--- epd serve\n" + serve_.ReadLog();
    std::string listing;
    RunCommand("tail -n 30 " + data_dir() + "/logs/*.log 2>&1", &listing);
    return out + listing;
  }

  // Waits until no process of the cluster is left.
  bool WaitNoChildren(std::chrono::seconds timeout = std::chrono::seconds(30)) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      if (ClusterPids().empty()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

 private:
  TempDir dir_;
  int http_port_ = 0, grpc_port_ = 0;
  Subprocess serve_;
};

}  // namespace epd::testing
