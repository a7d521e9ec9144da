#include "services/cli/chaos.h"

#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "epd/v1/inference.grpc.pb.h"
#include "runtime/child_process.h"
#include "runtime/processes.h"
#include "runtime/shutdown.h"

namespace epd::services {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using Ids = std::vector<int32_t>;

constexpr const char* kPools[] = {"encoder", "prefill", "decode"};

std::string SelfDir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

struct Result {
  Ids ids;
  std::string finish;
  grpc::Status status;
  int cached = -1;
  double start_s = 0;  // since the campaign began
  double seconds = 0;
};

const Clock::time_point g_epoch = Clock::now();
double Since() { return std::chrono::duration<double>(Clock::now() - g_epoch).count(); }

Result Generate(const std::string& target, const std::string& request_id, const Ids& prompt,
                int max_tokens, int deadline_s) {
  auto stub =
      epd::v1::Inference::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
  epd::v1::GenerateRequest req;
  req.set_model("epd-nano");
  req.set_request_id(request_id);
  for (int32_t id : prompt) req.mutable_prompt_ids()->add_ids(id);
  req.mutable_sampling()->set_temperature(0.f);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  const auto start = Clock::now();
  auto reader = stub->Generate(&ctx, req);
  Result r;
  r.start_s = Since();
  epd::v1::GenerateResponse m;
  while (reader->Read(&m)) {
    r.ids.insert(r.ids.end(), m.token_ids().begin(), m.token_ids().end());
    if (!m.finish_reason().empty()) r.finish = m.finish_reason();
    if (m.has_usage()) r.cached = m.usage().cached_tokens();
  }
  r.status = reader->Finish();
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return r;
}

// The /metrics page on `port`; nullopt when it cannot be read.
std::optional<std::string> MetricsPage(const std::string& host, int port) {
  httplib::Client cli(host, port);
  cli.set_connection_timeout(2, 0);
  cli.set_read_timeout(5, 0);
  auto res = cli.Get("/metrics");
  if (!res || res->status != 200) return std::nullopt;
  return res->body;
}

// One series of a /metrics page; nullopt when it is missing.
std::optional<double> Series(const std::string& body, const std::string& series) {
  size_t pos = 0;
  while ((pos = body.find(series + " ", pos)) != std::string::npos) {
    if (pos == 0 || body[pos - 1] == '\n') return std::stod(body.substr(pos + series.size() + 1));
    ++pos;
  }
  return std::nullopt;
}

// One series of the /metrics page on `port`; nullopt when the page or the series is missing.
std::optional<double> Metric(const std::string& host, int port, const std::string& series) {
  auto page = MetricsPage(host, port);
  return page ? Series(*page, series) : std::nullopt;
}

// The last `n` lines of the file at `path` (all of it when shorter; empty when unreadable).
std::string LastLines(const std::string& path, size_t n) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(std::move(line));
    if (lines.size() > n) lines.pop_front();
  }
  std::string out;
  for (const auto& line : lines) out += line + "\n";
  return out;
}

std::optional<int> Published(const std::string& run_dir, const std::string& name,
                             const std::string& key) {
  return runtime::WaitForPortFile(run_dir + "/" + name + ".json", key, std::chrono::milliseconds(0));
}

// Resident memory (kB) and open descriptors of `pid`; nullopt when it is gone.
struct ProcSample {
  double t = 0;  // seconds since the load began
  pid_t pid = 0;
  int64_t rss_kb = 0;
  int64_t fds = 0;
  // From a worker's /metrics (-1 elsewhere or when unread): its KV pool's cached bytes and the
  // C heap's free bytes (freed, kept by the allocator) and bytes in use (worker_runtime.cc).
  int64_t pool_cached_kb = -1;
  int64_t heap_free_kb = -1;
  int64_t heap_in_use_kb = -1;
};
std::optional<ProcSample> SampleProcess(pid_t pid) {
  ProcSample s;
  s.pid = pid;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  if (!status) return std::nullopt;
  bool found = false;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) {
      s.rss_kb = std::atoll(line.c_str() + 6);
      found = true;
    }
  }
  if (!found) return std::nullopt;  // a zombie has no VmRSS
  DIR* fd = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (!fd) return std::nullopt;
  while (dirent* e = readdir(fd)) s.fds += e->d_name[0] != '.';
  closedir(fd);
  return s;
}

// The soak verdict of one process from its samples after the warm-up: the mean resident memory
// of the last quarter exceeds that of the first quarter by at most max(8 MiB, 5 %), the most
// descriptors of the last quarter exceed those of the first by at most 2, and the pid never
// changed (no restart).
nlohmann::json SoakVerdict(const std::vector<ProcSample>& v, bool* flat) {
  nlohmann::json j;
  j["samples"] = v.size();
  if (v.size() < 4) {
    j["flat"] = false;
    j["why"] = "fewer than 4 samples after the warm-up";
    *flat = false;
    return j;
  }
  const size_t q = v.size() / 4;
  double rss0 = 0, rss1 = 0;
  int64_t fds0 = 0, fds1 = 0, rss_max = 0;
  bool same_pid = true;
  for (size_t i = 0; i < v.size(); ++i) {
    same_pid &= v[i].pid == v[0].pid;
    rss_max = std::max(rss_max, v[i].rss_kb);
    if (i < q) rss0 += v[i].rss_kb, fds0 = std::max(fds0, v[i].fds);
    if (i >= v.size() - q) rss1 += v[i].rss_kb, fds1 = std::max(fds1, v[i].fds);
  }
  rss0 /= q;
  rss1 /= q;
  const double rss_limit = std::max(8192.0, 0.05 * rss0);
  const bool ok = same_pid && rss1 - rss0 <= rss_limit && fds1 - fds0 <= 2;
  j["rss_kb_first_quarter"] = static_cast<int64_t>(rss0);
  j["rss_kb_last_quarter"] = static_cast<int64_t>(rss1);
  j["rss_kb_max"] = rss_max;
  j["fds_first_quarter_max"] = fds0;
  j["fds_last_quarter_max"] = fds1;
  j["restarted"] = !same_pid;
  j["flat"] = ok;
  if (!ok) *flat = false;
  return j;
}

// Runs a shell command line; true on exit status 0. Its output goes to `log` (appended).
bool Sh(const std::string& cmd, const std::string& log) {
  const std::string line = "(" + cmd + ") >>'" + log + "' 2>&1";
  return std::system(line.c_str()) == 0;
}

// The network-cut fault's topology: one worker in its own network namespace, joined to the host
// by a veth pair; the host side's address lives on an interface of its own (one end of a second
// veth pair whose both ends stay on the host: always up, where containers have no `dummy` link
// type), so it stays up while the link is cut. Host: A1 on that interface, route A2/32 over the
// first pair; namespace: A2 on eth0, route A1/32.
// Every name carries a random suffix; Down() (also the destructor) removes it all.
class CutNetwork {
 public:
  // Empty when the fault can run here, else why not.
  static std::string Unavailable() {
    if (geteuid() != 0) return "needs root (ip netns)";
    if (std::system("ip netns list >/dev/null 2>&1") != 0) return "no usable `ip netns` (iproute2)";
    return "";
  }
  bool Up(const std::string& log) {
    log_ = log;
    std::random_device rd;
    char id[8];
    std::snprintf(id, sizeof(id), "%06x", rd() & 0xffffff);
    ns_ = std::string("epdch-") + id;
    host_if_ = std::string("epdch") + id + "h";
    host_if_peer_ = std::string("epdch") + id + "k";
    veth_ = std::string("epdch") + id + "v";
    peer_ = std::string("epdch") + id + "p";
    const std::string net =
        "10." + std::to_string(200 + rd() % 50) + "." + std::to_string(rd() % 256) + ".";
    host_addr_ = net + "1";
    ns_addr_ = net + "2";
    up_ = true;
    return Sh("ip link add " + host_if_ + " type veth peer name " + host_if_peer_ +
                  " && ip addr add " + host_addr_ + "/32 dev " + host_if_ + " && ip link set " +
                  host_if_peer_ + " up && ip link set " + host_if_ + " up && ip netns add " + ns_ +
                  " && ip link add " + veth_ + " type veth peer name " + peer_ +
                  " && ip link set " + peer_ + " netns " + ns_ + " && ip link set " + veth_ +
                  " up && ip route add " + ns_addr_ + "/32 dev " + veth_ + " src " + host_addr_ +
                  " && " + InNs("ip link set lo up") + " && " +
                  InNs("ip link set " + peer_ + " name eth0") + " && " +
                  InNs("ip addr add " + ns_addr_ + "/32 dev eth0") + " && " + RestoreCmd(),
              log_);
  }
  // Takes the namespace's link down (its routes go with it; the host side loses carrier).
  bool Cut() { return Sh(InNs("ip link set eth0 down"), log_); }
  bool Restore() { return Sh(RestoreCmd(), log_); }
  void Down() {
    if (!up_) return;
    up_ = false;
    Sh("ip netns del " + ns_ + "; ip link del " + veth_ + " 2>/dev/null; ip link del " + host_if_,
       log_);
  }
  ~CutNetwork() { Down(); }
  const std::string& ns() const { return ns_; }
  const std::string& host_if() const { return host_if_; }
  const std::string& host_addr() const { return host_addr_; }
  const std::string& ns_addr() const { return ns_addr_; }

 private:
  std::string InNs(const std::string& cmd) const { return "ip netns exec " + ns_ + " " + cmd; }
  std::string RestoreCmd() const {
    return InNs("ip link set eth0 up") + " && " +
           InNs("ip route replace " + host_addr_ + "/32 dev eth0");
  }
  bool up_ = false;
  std::string log_, ns_, host_if_, host_if_peer_, veth_, peer_, host_addr_, ns_addr_;
};

// The conversations: turn t's prompt is a system block, then per earlier turn its tool output
// and the no-fault answer, then this turn's tool output (an agent resending its context).
struct Workload {
  std::vector<std::vector<Ids>> prompts;   // [session][turn]
  std::vector<std::vector<Ids>> expected;  // no-fault outputs
};

Ids RandomIds(std::mt19937_64& rng, int n) {
  std::uniform_int_distribution<int32_t> d(10, 309);
  Ids out(n);
  for (auto& id : out) id = d(rng);
  return out;
}

}  // namespace

void AddChaosFlags(CLI::App& app, ChaosOptions* o) {
  app.add_option("--seconds", o->seconds, "Seconds of faults under load (default 120)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--seed", o->seed, "Seed of the prompts and the fault schedule (default 7)");
  app.add_option("--clients", o->clients, "Concurrent agent sessions (default 3)")
      ->check(CLI::Range(1, 64));
  app.add_option("--sessions", o->sessions, "Distinct conversations (default 4)")
      ->check(CLI::Range(1, 64));
  app.add_option("--turns", o->turns, "Turns per conversation (default 3)")
      ->check(CLI::Range(1, 32));
  app.add_option("--max-tokens", o->max_tokens, "Generated tokens per request (default 24)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--request-deadline-s", o->request_deadline_s,
                 "A request not finished after this many seconds is a hang (default 90)")
      ->check(CLI::Range(5, 3600));
  app.add_option("--faults", o->faults,
                 "Fault kinds: sigkill_worker,sigstop_worker,kill_kvstore,cut_network,kill_router "
                 "(all; cut_network needs root); "
                 "'none' for a steady load without faults (the soak)");
  app.add_option("--think-ms", o->think_ms, "Pause of each agent between requests (default 0)")
      ->check(CLI::Range(0, 600000));
  app.add_option("--sample-s", o->sample_s,
                 "Soak: sample every process's RSS and open fds every N s and require them flat "
                 "after the warm-up (default 0: off)")
      ->check(CLI::Range(0, 3600));
  app.add_option("--warmup-s", o->warmup_s, "Soak warm-up in seconds (default: --seconds / 5)");
  app.add_option("--samples-csv", o->samples_csv, "Soak: write every sample to this CSV file");
  app.add_option("--data-dir", o->data_dir, "Cluster data folder (default: a fresh /tmp folder)");
  app.add_option("--json", o->json_path, "Write the counts to this JSON file");
}

int RunChaos(const ChaosOptions& o) {
  runtime::InstallShutdownHandlers();
  const std::string bin = SelfDir();
  std::string data_dir = o.data_dir;
  bool remove_data = false;
  if (data_dir.empty()) {
    char tmpl[] = "/tmp/epd-chaos-XXXXXX";
    if (!mkdtemp(tmpl)) {
      std::cerr << "epd chaos: cannot create a temporary folder\n";
      return 2;
    }
    data_dir = tmpl;
    remove_data = true;
  }
  const std::string run_dir = data_dir + "/run";
  std::cout << "epd chaos: seed " << o.seed << ", " << o.seconds << " s of faults, data in "
            << data_dir << "\n"
            << std::flush;
  // The network cut needs one worker in its own namespace: epd-decode-1, with the rest of the
  // cluster on the host side's address (reachable from the namespace).
  const std::string kNetnsWorker = "epd-decode-1";
  auto has_kind = [&](const std::string& kind) {
    return ("," + o.faults + ",").find("," + kind + ",") != std::string::npos;
  };
  std::string cut_unavailable = has_kind("cut_network") ? CutNetwork::Unavailable() : "";
  CutNetwork net;
  bool cut = has_kind("cut_network") && cut_unavailable.empty();
  if (cut && !net.Up(data_dir + ".net.log")) {
    std::cerr << "epd chaos: cannot set up the network namespace; see " << data_dir << ".net.log\n";
    return 2;
  }
  if (!cut_unavailable.empty()) {
    std::cout << "epd chaos: cut_network left out: " << cut_unavailable << "\n" << std::flush;
  }
  const std::string host = cut ? net.host_addr() : "127.0.0.1";
  auto host_of = [&](const std::string& c) {
    return cut && c == kNetnsWorker ? net.ns_addr() : host;
  };
  // The router's ports: its first start binds free ones (port 0) and publishes them, and epd serve
  // restarts it on the same ones. Picking "free" ports here and passing them raced every other
  // process binding port 0 between the pick and the router's bind (the likely cause of a CI run
  // whose cluster did not come up within a second).
  std::string target;
  std::vector<std::string> serve_argv = {bin + "/epd",
                                         "serve",
                                         "--data-dir",
                                         data_dir,
                                         "--http-port",
                                         "0",
                                         "--grpc-port",
                                         "0",
                                         "--encoders",
                                         "2",
                                         "--prefills",
                                         "2",
                                         "--decodes",
                                         "2",
                                         "--max-restarts",
                                         "1000",
                                         "--restart-backoff-ms",
                                         "200",
                                         "--log-level",
                                         "info"};
  if (cut) {
    serve_argv.insert(serve_argv.end(), {"--host", host, "--worker-netns",
                                         kNetnsWorker + ":" + net.ns() + ":" + net.ns_addr()});
    // Host-side UCX on the host address's interface only (shared memory between host-side workers
    // stays): the namespace reaches that address, not the host's other interfaces.
    setenv("UCX_NET_DEVICES", net.host_if().c_str(), 1);
  }
  runtime::SpawnOptions spawn;
  spawn.parent_death_signal = SIGKILL;
  runtime::ChildProcess serve = runtime::ChildProcess::StartWith(serve_argv, data_dir + ".serve.log", spawn);
  const std::vector<std::string> workers = {"epd-encoder-0", "epd-encoder-1", "epd-prefill-0",
                                            "epd-prefill-1", "epd-decode-0",  "epd-decode-1"};
  std::vector<std::string> components = workers;
  components.insert(components.begin(), {"epd-kvstore", "epd-router"});

  auto router_metric = [&](const std::string& series) -> std::optional<double> {
    auto port = Published(run_dir, "epd-router", "metrics");
    return port ? Metric(host, *port, series) : std::nullopt;
  };
  // Every component runs under the pid it published and the router lists 2 workers per pool.
  auto healthy = [&] {
    for (const auto& c : components) {
      auto pid = Published(run_dir, c, "pid");
      if (!pid || kill(*pid, 0) != 0 || !Published(run_dir, c, "grpc")) return false;
    }
    for (const char* pool : kPools) {
      auto n = router_metric(std::string("epd_router_workers{pool=\"") + pool + "\"}");
      if (!n || *n != 2) return false;
    }
    return true;
  };
  auto wait_healthy = [&](std::chrono::seconds timeout) {
    const auto end = Clock::now() + timeout;
    while (Clock::now() < end && serve.running()) {
      if (healthy()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  };
  auto fail_start = [&](const char* what) {
    serve.Stop(std::chrono::seconds(30));
    std::cerr << "epd chaos: " << what << "; see " << data_dir << ".serve.log and " << data_dir
              << "/logs\n"
              << "epd chaos: the end of " << data_dir << ".serve.log:\n"
              << LastLines(data_dir + ".serve.log", 40) << std::flush;
    return 2;
  };
  if (!wait_healthy(std::chrono::seconds(300))) return fail_start("the cluster did not come up");
  target = host + ":" + std::to_string(*Published(run_dir, "epd-router", "grpc"));

  // 1. No-fault outputs of every conversation turn.
  std::mt19937_64 prompt_rng(o.seed);
  Workload w;
  w.prompts.resize(o.sessions);
  w.expected.resize(o.sessions);
  const Ids system = RandomIds(prompt_rng, 64);
  std::vector<std::vector<Ids>> tools(o.sessions);
  for (auto& s : tools) {
    for (int t = 0; t < o.turns; ++t) s.push_back(RandomIds(prompt_rng, o.tool_tokens));
  }
  for (int s = 0; s < o.sessions; ++s) {
    Ids context = system;
    for (int t = 0; t < o.turns; ++t) {
      context.insert(context.end(), tools[s][t].begin(), tools[s][t].end());
      Result r = Generate(target, "ref-" + std::to_string(s) + "-" + std::to_string(t), context,
                          o.max_tokens, o.request_deadline_s);
      if (!r.status.ok()) return fail_start("a no-fault request failed");
      w.prompts[s].push_back(context);
      w.expected[s].push_back(r.ids);
      context.insert(context.end(), r.ids.begin(), r.ids.end());
    }
  }
  // Idle resource levels of the fault-free workers (transfer registrations are long-lived).
  std::map<std::string, double> idle_max;
  const char* kResources[] = {"registrations", "allocations", "transfers"};
  for (const auto& c : workers) {
    auto port = Published(run_dir, c, "metrics");
    for (const char* res : kResources) {
      const std::string series = std::string("epd_transfer_outstanding{resource=\"") + res + "\"}";
      double v = port ? Metric(host_of(c), *port, series).value_or(0) : 0;
      const std::string pool = c.substr(4, c.rfind('-') - 4);
      idle_max[pool + "/" + res] = std::max(idle_max[pool + "/" + res], v);
    }
  }

  // 2. Load and faults.
  struct Done {
    std::string request_id;
    int session, turn;
    Result result;
  };
  std::mutex mu;
  std::vector<Done> done;
  std::atomic<bool> stop_load{false};
  const auto end = Clock::now() + std::chrono::seconds(o.seconds);
  std::vector<std::thread> clients;
  for (int c = 0; c < o.clients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 rng(o.seed * 1000 + c);
      for (int n = 0; !stop_load.load() && !runtime::ShutdownRequested(); ++n) {
        const int s = static_cast<int>(rng() % o.sessions);
        for (int t = 0; t < o.turns && !stop_load.load(); ++t) {
          const std::string id =
              "chaos-" + std::to_string(c) + "-" + std::to_string(n) + "-" + std::to_string(t);
          Result r = Generate(target, id, w.prompts[s][t], o.max_tokens, o.request_deadline_s);
          const bool failed = !r.status.ok();
          {
            std::lock_guard<std::mutex> lock(mu);
            done.push_back({id, s, t, std::move(r)});
          }
          // An agent backs off after an error instead of hammering a cluster that is recovering.
          if (failed) std::this_thread::sleep_for(std::chrono::milliseconds(250));
          if (o.think_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.think_ms));
        }
      }
    });
  }
  std::map<std::string, int> faults;
  int net_failures = 0;  // `ip` commands of the network cut that failed
  std::mt19937_64 fault_rng(o.seed ^ 0x9e3779b97f4a7c15ULL);
  std::uniform_real_distribution<double> gap(o.fault_min_s, o.fault_max_s);
  std::vector<std::string> kinds;
  std::vector<double> weights;
  const std::map<std::string, double> kWeights = {{"sigkill_worker", 4},
                                                  {"sigstop_worker", 3},
                                                  {"kill_kvstore", 2},
                                                  {"cut_network", 2},
                                                  {"kill_router", 1}};
  for (const auto& [kind, weight] : kWeights) {
    if (!has_kind(kind) || (kind == "cut_network" && !cut)) continue;
    kinds.push_back(kind);
    weights.push_back(weight);
  }
  const bool no_faults = o.faults == "none";
  if (kinds.empty() && !no_faults) {
    std::cerr << "epd chaos: --faults names no known fault kind\n";
    stop_load = true;
    for (auto& t : clients) t.join();
    serve.Stop(std::chrono::seconds(30));
    return 2;
  }
  // Soak sampler: every process of the cluster (and `epd serve`) from /proc.
  std::map<std::string, std::vector<ProcSample>> samples;
  std::thread sampler;
  const auto load_start = Clock::now();
  const int warmup_s = o.warmup_s >= 0 ? o.warmup_s : o.seconds / 5;
  if (o.sample_s > 0) {
    sampler = std::thread([&] {
      while (!stop_load.load() && !runtime::ShutdownRequested()) {
        const double t = std::chrono::duration<double>(Clock::now() - load_start).count();
        std::vector<std::pair<std::string, pid_t>> procs = {{"epd-serve", serve.pid()}};
        for (const auto& c : components) {
          if (auto pid = Published(run_dir, c, "pid")) procs.emplace_back(c, *pid);
        }
        for (const auto& [name, pid] : procs) {
          if (auto smp = SampleProcess(pid)) {
            smp->t = t;
            const bool worker = name.find("-encoder-") != std::string::npos ||
                                name.find("-prefill-") != std::string::npos ||
                                name.find("-decode-") != std::string::npos;
            const auto port = worker ? Published(run_dir, name, "metrics") : std::nullopt;
            if (auto page = port ? MetricsPage(host_of(name), *port) : std::nullopt) {
              auto kb = [&](const std::string& series) -> int64_t {
                auto v = Series(*page, series);
                return v ? static_cast<int64_t>(*v / 1024) : -1;
              };
              smp->pool_cached_kb = kb("epd_kv_pool_bytes{state=\"cached\"}");
              smp->heap_free_kb = kb("epd_malloc_bytes{state=\"free\"}");
              smp->heap_in_use_kb = kb("epd_malloc_bytes{state=\"in_use\"}");
            }
            std::lock_guard<std::mutex> lock(mu);
            samples[name].push_back(*smp);
          }
        }
        for (int i = 0; i < o.sample_s * 10 && !stop_load.load(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
    });
  }
  std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
  while (no_faults && Clock::now() < end && !runtime::ShutdownRequested() && serve.running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  while (!no_faults && Clock::now() < end && !runtime::ShutdownRequested() && serve.running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(gap(fault_rng) * 1000)));
    if (Clock::now() >= end) break;
    const std::string kind = kinds[pick(fault_rng)];
    const std::string victim = kind == "kill_kvstore"  ? "epd-kvstore"
                               : kind == "kill_router" ? "epd-router"
                               : kind == "cut_network" ? kNetnsWorker
                                                       : workers[fault_rng() % workers.size()];
    if (kind == "cut_network") {
      // The link goes down whether or not the worker runs now; back up after 1..5 s (longer
      // than the router's 3 s heartbeat expiry sometimes: both a stall and an expiry happen).
      ++faults[kind];
      const int ms = 1000 + static_cast<int>(fault_rng() % 4000);
      std::cout << "epd chaos: t=" << Since() << " s cut_network " << victim << " (" << ms
                << " ms)\n"
                << std::flush;
      if (!net.Cut()) ++net_failures;
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      if (!net.Restore()) {
        std::cerr << "epd chaos: cannot restore the link; see " << data_dir << ".net.log\n";
        ++net_failures;
      }
      continue;
    }
    auto pid = Published(run_dir, victim, "pid");
    if (!pid || kill(*pid, 0) != 0) {
      ++faults["skipped_down"];
      continue;
    }
    ++faults[kind];
    std::cout << "epd chaos: t=" << Since() << " s " << kind << " " << victim << " (pid " << *pid
              << ")\n"
              << std::flush;
    if (kind == "sigstop_worker") {
      kill(*pid, SIGSTOP);
      std::this_thread::sleep_for(std::chrono::milliseconds(500 + fault_rng() % 2500));
      kill(*pid, SIGCONT);
    } else {
      kill(*pid, SIGKILL);
    }
  }
  stop_load = true;
  for (auto& t : clients) t.join();
  if (sampler.joinable()) sampler.join();
  const bool recovered = wait_healthy(std::chrono::seconds(180));

  // 3. Checks.
  std::map<std::string, int> migrated_at;  // request id -> tokens streamed before it moved
  {
    std::ifstream in(data_dir + "/logs/epd-router.log");
    const std::regex re("request (\\S+): .*migrating with (\\d+) streamed");
    std::string line;
    std::smatch m;
    while (std::getline(in, line)) {
      if (std::regex_search(line, m, re)) migrated_at.emplace(m[1], std::stoi(m[2]));
    }
  }
  int ok = 0, clean_failures = 0, hangs = 0, wrong = 0, continuations = 0;
  std::map<std::string, int> failure_codes;
  for (const auto& d : done) {
    const Result& r = d.result;
    if (r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        r.seconds > o.request_deadline_s + 5) {
      ++hangs;
      std::cerr << "epd chaos: request " << d.request_id << " hung (" << r.seconds << " s)\n";
      continue;
    }
    if (!r.status.ok()) {
      ++clean_failures;
      ++failure_codes[std::to_string(r.status.error_code())];
      if (clean_failures <= 20) {
        std::cout << "epd chaos: request " << d.request_id << " (t=" << r.start_s << ".."
                  << r.start_s + r.seconds << " s) failed: " << r.status.error_message() << "\n";
      }
      continue;
    }
    ++ok;
    const Ids& want = w.expected[d.session][d.turn];
    if (r.ids == want) continue;
    auto mig = migrated_at.find(d.request_id);
    bool equal = false;
    std::string check_note;
    if (mig != migrated_at.end() && recovered) {
      const size_t k = static_cast<size_t>(mig->second);
      if (k <= r.ids.size() && std::equal(r.ids.begin(), r.ids.begin() + k, want.begin(),
                                          want.begin() + std::min(k, want.size()))) {
        Ids context = w.prompts[d.session][d.turn];
        context.insert(context.end(), r.ids.begin(), r.ids.begin() + k);
        // The fresh request runs on a cluster that just recovered: a clean failure of it (e.g. a
        // worker the registry still lists but that is going away) is retried, and named if it
        // persists, so it is never mistaken for a continuation that differs.
        Result fresh;
        for (int attempt = 0; attempt < 5; ++attempt) {
          if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
          fresh = Generate(target, d.request_id + "-check-" + std::to_string(attempt), context,
                           o.max_tokens - static_cast<int>(k), o.request_deadline_s);
          if (fresh.status.ok()) break;
        }
        equal = fresh.status.ok() && Ids(r.ids.begin() + k, r.ids.end()) == fresh.ids;
        if (!fresh.status.ok()) {
          check_note =
              " (its continuation check request failed: " + fresh.status.error_message() + ")";
        } else if (!equal) {
          check_note = " (migrated with " + std::to_string(k) + " streamed token(s))";
        }
      }
    }
    if (equal) {
      ++continuations;
    } else {
      ++wrong;
      size_t diverge = 0;
      while (diverge < r.ids.size() && diverge < want.size() && r.ids[diverge] == want[diverge]) {
        ++diverge;
      }
      std::cerr << "epd chaos: request " << d.request_id << " (t=" << r.start_s << ".."
                << r.start_s + r.seconds << " s, cached " << r.cached << ", prompt "
                << w.prompts[d.session][d.turn].size() << ") differs from the no-fault output at "
                << "token " << diverge
                << (mig != migrated_at.end() ? " and from its migration continuation" : "")
                << check_note << "\n";
    }
  }
  // Leaks: once idle, no worker holds a job or more transfer resources than a fault-free one did
  // at rest; the kvstore answers no put; the router runs nothing.
  int leaks = 0;
  std::vector<std::string> leak_notes;
  if (recovered) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    for (const auto& c : workers) {
      auto port = Published(run_dir, c, "metrics");
      const std::string pool = c.substr(4, c.rfind('-') - 4);
      if (!port) continue;
      if (Metric(host_of(c), *port, "epd_queue_depth{pool=\"" + pool + "\"}").value_or(0) != 0) {
        ++leaks, leak_notes.push_back(c + " queue_depth");
      }
      for (const char* res : kResources) {
        const double v = Metric(host_of(c), *port,
                                std::string("epd_transfer_outstanding{resource=\"") + res + "\"}")
                             .value_or(0);
        if (v > idle_max[pool + "/" + res]) ++leaks, leak_notes.push_back(c + " " + res);
      }
    }
    if (auto kv = Published(run_dir, "epd-kvstore", "metrics")) {
      if (Metric(host, *kv, "epd_kv_puts_in_flight").value_or(0) != 0) {
        ++leaks, leak_notes.push_back("kvstore puts_in_flight");
      }
    }
    if (router_metric("epd_router_inflight_requests").value_or(1) != 0) {
      ++leaks, leak_notes.push_back("router inflight");
    }
  }
  // The live processes are exactly the published ones, and the registry lists them.
  std::set<pid_t> published;
  for (const auto& c : components) {
    if (auto pid = Published(run_dir, c, "pid")) published.insert(*pid);
  }
  const std::set<pid_t> live = runtime::ProcessesNaming(data_dir + "/", serve.pid());
  const bool registry_exact = recovered && live == published;
  const double migrations_ok =
      router_metric("epd_request_migrations_total{outcome=\"ok\"}").value_or(0);
  const double migrations_failed =
      router_metric("epd_request_migrations_total{outcome=\"failed\"}").value_or(0);

  // 4. Stop: nothing of the cluster may remain.
  serve.Signal(SIGINT);
  const auto serve_rc = serve.Wait(std::chrono::seconds(120));
  if (!serve_rc) serve.Stop(std::chrono::seconds(1));
  std::set<pid_t> orphans;
  for (int i = 0; i < 100; ++i) {
    orphans = runtime::ProcessesNaming(data_dir + "/", -1);
    if (orphans.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  net.Down();

  nlohmann::json j = {{"seed", o.seed},
                      {"seconds", o.seconds},
                      {"requests", done.size()},
                      {"ok", ok},
                      {"equal_no_fault", ok - continuations - wrong},
                      {"migration_continuations", continuations},
                      {"clean_failures", clean_failures},
                      {"failure_codes", failure_codes},
                      {"hangs", hangs},
                      {"wrong_outputs", wrong},
                      {"leaks", leaks},
                      {"leak_notes", leak_notes},
                      {"faults", faults},
                      {"migrations_ok", migrations_ok},
                      {"migrations_failed", migrations_failed},
                      {"recovered", recovered},
                      {"registry_exact", registry_exact},
                      {"serve_exit", serve_rc.value_or(-1)},
                      {"orphans", orphans.size()}};
  if (!cut_unavailable.empty()) j["cut_network_unavailable"] = cut_unavailable;
  if (cut) j["cut_network_failures"] = net_failures;
  bool soak_flat = true;
  if (o.sample_s > 0) {
    nlohmann::json soak;
    std::ofstream csv;
    if (!o.samples_csv.empty()) {
      csv.open(o.samples_csv);
      csv << "t_s,process,pid,rss_kb,fds,pool_cached_kb,heap_free_kb,heap_in_use_kb\n";
    }
    for (const auto& [name, v] : samples) {
      std::vector<ProcSample> after;
      for (const ProcSample& smp : v) {
        if (csv) {
          csv << smp.t << "," << name << "," << smp.pid << "," << smp.rss_kb << "," << smp.fds
              << "," << smp.pool_cached_kb << "," << smp.heap_free_kb << "," << smp.heap_in_use_kb
              << "\n";
        }
        if (smp.t >= warmup_s) after.push_back(smp);
      }
      soak[name] = SoakVerdict(after, &soak_flat);
    }
    if (samples.empty()) soak_flat = false;
    j["soak"] = soak;
    j["soak_warmup_s"] = warmup_s;
    j["soak_flat"] = soak_flat;
  }
  std::cout << "epd chaos: " << j.dump(1) << "\n";
  if (!o.json_path.empty()) std::ofstream(o.json_path) << j.dump(2) << "\n";
  const bool pass = recovered && hangs == 0 && wrong == 0 && leaks == 0 && registry_exact &&
                    net_failures == 0 && orphans.empty() && serve_rc.value_or(-1) == 0 && ok > 0 &&
                    soak_flat;
  std::cout << "epd chaos: " << (pass ? "PASS" : "FAIL") << "\n";
  if (pass && remove_data) {
    std::error_code ec;
    fs::remove_all(data_dir, ec);
    fs::remove(data_dir + ".serve.log", ec);
    fs::remove(data_dir + ".net.log", ec);
  }
  return pass ? 0 : 1;
}

}  // namespace epd::services
