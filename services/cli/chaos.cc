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

namespace {

// The kinds of resource a worker's transfer engine holds (epd_transfer_outstanding{resource}).
constexpr const char* kResources[] = {"registrations", "allocations", "transfers"};

// The pool of a worker's name: "epd-decode-1" -> "decode".
std::string PoolOf(const std::string& worker) { return worker.substr(4, worker.rfind('-') - 4); }

// The campaign's flags, its data folder, the network cut and the `epd serve` cluster: what the
// steps of RunChaos share.
struct Campaign {
  explicit Campaign(const ChaosOptions& options) : o(options) {}

  const ChaosOptions& o;
  // The network cut needs one worker in its own namespace: epd-decode-1, with the rest of the
  // cluster on the host side's address (reachable from the namespace).
  const std::string kNetnsWorker = "epd-decode-1";
  std::string bin;
  std::string data_dir;
  bool remove_data = false;
  std::string run_dir;
  std::string cut_unavailable;
  CutNetwork net;
  bool cut = false;
  std::string host;
  runtime::ChildProcess serve;
  std::vector<std::string> workers;
  std::vector<std::string> components;
  std::string target;

  bool HasKind(const std::string& kind) const {
    return ("," + o.faults + ",").find("," + kind + ",") != std::string::npos;
  }
  std::string HostOf(const std::string& c) const {
    return cut && c == kNetnsWorker ? net.ns_addr() : host;
  }
  std::optional<double> RouterMetric(const std::string& series) const {
    auto port = Published(run_dir, "epd-router", "metrics");
    return port ? Metric(host, *port, series) : std::nullopt;
  }
  // Every component runs under the pid it published and the router lists 2 workers per pool.
  bool Healthy() const {
    for (const auto& c : components) {
      auto pid = Published(run_dir, c, "pid");
      if (!pid || kill(*pid, 0) != 0 || !Published(run_dir, c, "grpc")) return false;
    }
    for (const char* pool : kPools) {
      auto n = RouterMetric(std::string("epd_router_workers{pool=\"") + pool + "\"}");
      if (!n || *n != 2) return false;
    }
    return true;
  }
  bool WaitHealthy(std::chrono::seconds timeout) {
    const auto end = Clock::now() + timeout;
    while (Clock::now() < end && serve.running()) {
      if (Healthy()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }
  int FailStart(const char* what) {
    serve.Stop(std::chrono::seconds(30));
    std::cerr << "epd chaos: " << what << "; see " << data_dir << ".serve.log and " << data_dir
              << "/logs\n"
              << "epd chaos: the end of " << data_dir << ".serve.log:\n"
              << LastLines(data_dir + ".serve.log", 40) << std::flush;
    return 2;
  }
};

// --data-dir, else a fresh /tmp folder (removed after a pass); false when it cannot be made.
bool MakeDataDir(Campaign& run) {
  run.data_dir = run.o.data_dir;
  if (run.data_dir.empty()) {
    char tmpl[] = "/tmp/epd-chaos-XXXXXX";
    if (!mkdtemp(tmpl)) {
      std::cerr << "epd chaos: cannot create a temporary folder\n";
      return false;
    }
    run.data_dir = tmpl;
    run.remove_data = true;
  }
  run.run_dir = run.data_dir + "/run";
  return true;
}

// The network cut's namespace when the fault is asked for and can run here (else a note why
// not); the address the cluster binds. False when the namespace cannot be set up.
bool SetUpNetwork(Campaign& run) {
  run.cut_unavailable = run.HasKind("cut_network") ? CutNetwork::Unavailable() : "";
  run.cut = run.HasKind("cut_network") && run.cut_unavailable.empty();
  if (run.cut && !run.net.Up(run.data_dir + ".net.log")) {
    std::cerr << "epd chaos: cannot set up the network namespace; see " << run.data_dir
              << ".net.log\n";
    return false;
  }
  if (!run.cut_unavailable.empty()) {
    std::cout << "epd chaos: cut_network left out: " << run.cut_unavailable << "\n" << std::flush;
  }
  run.host = run.cut ? run.net.host_addr() : "127.0.0.1";
  return true;
}

// Starts `epd serve` with 2 workers per pool. The router's ports: its first start binds free ones
// (port 0) and publishes them, and epd serve restarts it on the same ones. Picking "free" ports
// here and passing them raced every other process binding port 0 between the pick and the
// router's bind (the likely cause of a CI run whose cluster did not come up within a second).
void StartServe(Campaign& run) {
  std::vector<std::string> serve_argv = {
      run.bin + "/epd", "serve", "--data-dir",     run.data_dir, "--http-port",          "0",
      "--grpc-port",    "0",     "--encoders",     "2",          "--prefills",           "2",
      "--decodes",      "2",     "--max-restarts", "1000",       "--restart-backoff-ms", "200",
      "--log-level",    "info"};
  if (run.cut) {
    serve_argv.insert(serve_argv.end(),
                      {"--host", run.host, "--worker-netns",
                       run.kNetnsWorker + ":" + run.net.ns() + ":" + run.net.ns_addr()});
    // Host-side UCX on the host address's interface only (shared memory between host-side workers
    // stays): the namespace reaches that address, not the host's other interfaces.
    setenv("UCX_NET_DEVICES", run.net.host_if().c_str(), 1);
  }
  runtime::SpawnOptions spawn;
  spawn.parent_death_signal = SIGKILL;
  run.serve = runtime::ChildProcess::StartWith(serve_argv, run.data_dir + ".serve.log", spawn);
  run.workers = {"epd-encoder-0", "epd-encoder-1", "epd-prefill-0",
                 "epd-prefill-1", "epd-decode-0",  "epd-decode-1"};
  run.components = run.workers;
  run.components.insert(run.components.begin(), {"epd-kvstore", "epd-router"});
}

// 1. The no-fault outputs of every conversation turn; false when a request failed.
bool RecordNoFaultOutputs(const Campaign& run, Workload* w) {
  const ChaosOptions& o = run.o;
  std::mt19937_64 prompt_rng(o.seed);
  w->prompts.resize(o.sessions);
  w->expected.resize(o.sessions);
  const Ids system = RandomIds(prompt_rng, 64);
  std::vector<std::vector<Ids>> tools(o.sessions);
  for (auto& s : tools) {
    for (int t = 0; t < o.turns; ++t) s.push_back(RandomIds(prompt_rng, o.tool_tokens));
  }
  for (int s = 0; s < o.sessions; ++s) {
    Ids context = system;
    for (int t = 0; t < o.turns; ++t) {
      context.insert(context.end(), tools[s][t].begin(), tools[s][t].end());
      Result r = Generate(run.target, "ref-" + std::to_string(s) + "-" + std::to_string(t), context,
                          o.max_tokens, o.request_deadline_s);
      if (!r.status.ok()) return false;
      w->prompts[s].push_back(context);
      w->expected[s].push_back(r.ids);
      context.insert(context.end(), r.ids.begin(), r.ids.end());
    }
  }
  return true;
}

// Idle resource levels of the fault-free workers (transfer registrations are long-lived), per
// "pool/resource".
std::map<std::string, double> IdleResourceLevels(const Campaign& run) {
  std::map<std::string, double> idle_max;
  for (const auto& c : run.workers) {
    auto port = Published(run.run_dir, c, "metrics");
    for (const char* res : kResources) {
      const std::string series = std::string("epd_transfer_outstanding{resource=\"") + res + "\"}";
      double v = port ? Metric(run.HostOf(c), *port, series).value_or(0) : 0;
      const std::string pool = PoolOf(c);
      idle_max[pool + "/" + res] = std::max(idle_max[pool + "/" + res], v);
    }
  }
  return idle_max;
}

// One request of the load and its result.
struct Done {
  std::string request_id;
  int session, turn;
  Result result;
};

// The agent load and the soak sampler: their threads and what they collect (under mu).
struct Load {
  std::mutex mu;
  std::vector<Done> done;
  std::map<std::string, std::vector<ProcSample>> samples;
  std::atomic<bool> stop{false};
  std::vector<std::thread> clients;
  std::thread sampler;

  // Stops the load and joins its threads.
  void Stop() {
    stop = true;
    for (auto& t : clients) t.join();
    if (sampler.joinable()) sampler.join();
  }
};

// 2. The agents: each resends a random conversation turn by turn until the load stops.
void StartClients(const Campaign& run, const Workload& w, Load* load) {
  for (int c = 0; c < run.o.clients; ++c) {
    load->clients.emplace_back([&run, &w, load, c] {
      const ChaosOptions& o = run.o;
      std::mt19937_64 rng(o.seed * 1000 + c);
      for (int n = 0; !load->stop.load() && !runtime::ShutdownRequested(); ++n) {
        const int s = static_cast<int>(rng() % o.sessions);
        for (int t = 0; t < o.turns && !load->stop.load(); ++t) {
          const std::string id =
              "chaos-" + std::to_string(c) + "-" + std::to_string(n) + "-" + std::to_string(t);
          Result r = Generate(run.target, id, w.prompts[s][t], o.max_tokens, o.request_deadline_s);
          const bool failed = !r.status.ok();
          {
            std::lock_guard<std::mutex> lock(load->mu);
            load->done.push_back({id, s, t, std::move(r)});
          }
          // An agent backs off after an error instead of hammering a cluster that is recovering.
          if (failed) std::this_thread::sleep_for(std::chrono::milliseconds(250));
          if (o.think_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.think_ms));
        }
      }
    });
  }
}

// The fault kinds asked for that can run here, with their weights.
struct FaultPlan {
  std::vector<std::string> kinds;
  std::vector<double> weights;
};

FaultPlan PlanFaults(const Campaign& run) {
  FaultPlan plan;
  const std::map<std::string, double> kWeights = {{"sigkill_worker", 4},
                                                  {"sigstop_worker", 3},
                                                  {"kill_kvstore", 2},
                                                  {"cut_network", 2},
                                                  {"kill_router", 1}};
  for (const auto& [kind, weight] : kWeights) {
    if (!run.HasKind(kind) || (kind == "cut_network" && !run.cut)) continue;
    plan.kinds.push_back(kind);
    plan.weights.push_back(weight);
  }
  return plan;
}

// One soak sample of `pid` (named `name`) at `t` s; a worker's also from its /metrics.
std::optional<ProcSample> SampleComponent(const Campaign& run, const std::string& name, pid_t pid,
                                          double t) {
  auto smp = SampleProcess(pid);
  if (!smp) return smp;
  smp->t = t;
  const bool worker = name.find("-encoder-") != std::string::npos ||
                      name.find("-prefill-") != std::string::npos ||
                      name.find("-decode-") != std::string::npos;
  const auto port = worker ? Published(run.run_dir, name, "metrics") : std::nullopt;
  if (auto page = port ? MetricsPage(run.HostOf(name), *port) : std::nullopt) {
    auto kb = [&](const std::string& series) -> int64_t {
      auto v = Series(*page, series);
      return v ? static_cast<int64_t>(*v / 1024) : -1;
    };
    smp->pool_cached_kb = kb("epd_kv_pool_bytes{state=\"cached\"}");
    smp->heap_free_kb = kb("epd_malloc_bytes{state=\"free\"}");
    smp->heap_in_use_kb = kb("epd_malloc_bytes{state=\"in_use\"}");
  }
  return smp;
}

// Soak sampler: every process of the cluster (and `epd serve`) from /proc, every --sample-s.
void StartSampler(const Campaign& run, Clock::time_point load_start, Load* load) {
  load->sampler = std::thread([&run, load_start, load] {
    while (!load->stop.load() && !runtime::ShutdownRequested()) {
      const double t = std::chrono::duration<double>(Clock::now() - load_start).count();
      std::vector<std::pair<std::string, pid_t>> procs = {{"epd-serve", run.serve.pid()}};
      for (const auto& c : run.components) {
        if (auto pid = Published(run.run_dir, c, "pid")) procs.emplace_back(c, *pid);
      }
      for (const auto& [name, pid] : procs) {
        if (auto smp = SampleComponent(run, name, pid, t)) {
          std::lock_guard<std::mutex> lock(load->mu);
          load->samples[name].push_back(*smp);
        }
      }
      for (int i = 0; i < run.o.sample_s * 10 && !load->stop.load(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  });
}

// The faults done, per kind (and "skipped_down"), and the network cut's failed `ip` commands.
struct FaultTally {
  std::map<std::string, int> faults;
  int net_failures = 0;
};

// One cut_network fault: the link goes down whether or not the worker runs now; back up after
// 1..5 s (longer than the router's 3 s heartbeat expiry sometimes: both a stall and an expiry
// happen).
void CutNetworkFault(Campaign& run, std::mt19937_64& fault_rng, FaultTally* tally) {
  ++tally->faults["cut_network"];
  const int ms = 1000 + static_cast<int>(fault_rng() % 4000);
  std::cout << "epd chaos: t=" << Since() << " s cut_network " << run.kNetnsWorker << " (" << ms
            << " ms)\n"
            << std::flush;
  if (!run.net.Cut()) ++tally->net_failures;
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  if (!run.net.Restore()) {
    std::cerr << "epd chaos: cannot restore the link; see " << run.data_dir << ".net.log\n";
    ++tally->net_failures;
  }
}

// Until `end` (or shutdown, or `epd serve` exiting): with no fault kinds (the soak) it only
// waits; else at seeded random moments a drawn fault on a drawn victim.
FaultTally InjectFaults(Campaign& run, const FaultPlan& plan, Clock::time_point end) {
  FaultTally tally;
  const bool no_faults = run.o.faults == "none";
  std::mt19937_64 fault_rng(run.o.seed ^ 0x9e3779b97f4a7c15ULL);
  std::uniform_real_distribution<double> gap(run.o.fault_min_s, run.o.fault_max_s);
  std::discrete_distribution<size_t> pick(plan.weights.begin(), plan.weights.end());
  while (no_faults && Clock::now() < end && !runtime::ShutdownRequested() && run.serve.running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  while (!no_faults && Clock::now() < end && !runtime::ShutdownRequested() && run.serve.running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(gap(fault_rng) * 1000)));
    if (Clock::now() >= end) break;
    const std::string kind = plan.kinds[pick(fault_rng)];
    if (kind == "cut_network") {
      CutNetworkFault(run, fault_rng, &tally);
      continue;
    }
    const std::string victim = kind == "kill_kvstore" ? "epd-kvstore"
                               : kind == "kill_router"
                                   ? "epd-router"
                                   : run.workers[fault_rng() % run.workers.size()];
    auto pid = Published(run.run_dir, victim, "pid");
    if (!pid || kill(*pid, 0) != 0) {
      ++tally.faults["skipped_down"];
      continue;
    }
    ++tally.faults[kind];
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
  return tally;
}

// Request id -> tokens streamed before the router migrated it (from the router's log).
std::map<std::string, int> MigratedAt(const std::string& data_dir) {
  std::map<std::string, int> migrated_at;
  std::ifstream in(data_dir + "/logs/epd-router.log");
  const std::regex re("request (\\S+): .*migrating with (\\d+) streamed");
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_search(line, m, re)) migrated_at.emplace(m[1], std::stoi(m[2]));
  }
  return migrated_at;
}

// Whether `d`'s output, which differs from the no-fault one, is the continuation of its
// migration after `streamed` tokens: a fresh greedy request of prompt + those tokens. The fresh
// request runs on a cluster that just recovered: a clean failure of it (e.g. a worker the registry
// still lists but that is going away) is retried, and named in *note if it persists, so it is
// never mistaken for a continuation that differs.
bool IsContinuation(const Campaign& run, const Workload& w, const Done& d, size_t streamed,
                    std::string* note) {
  const Result& r = d.result;
  Ids context = w.prompts[d.session][d.turn];
  context.insert(context.end(), r.ids.begin(), r.ids.begin() + streamed);
  Result fresh;
  for (int attempt = 0; attempt < 5; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    fresh = Generate(run.target, d.request_id + "-check-" + std::to_string(attempt), context,
                     run.o.max_tokens - static_cast<int>(streamed), run.o.request_deadline_s);
    if (fresh.status.ok()) break;
  }
  const bool equal = fresh.status.ok() && Ids(r.ids.begin() + streamed, r.ids.end()) == fresh.ids;
  if (!fresh.status.ok()) {
    *note = " (its continuation check request failed: " + fresh.status.error_message() + ")";
  } else if (!equal) {
    *note = " (migrated with " + std::to_string(streamed) + " streamed token(s))";
  }
  return equal;
}

// What the completed requests came to.
struct OutputCounts {
  int ok = 0, clean_failures = 0, hangs = 0, wrong = 0, continuations = 0;
  std::map<std::string, int> failure_codes;
};

// A request that completed: equal to its no-fault output, the continuation of its migration
// (checked once the cluster recovered), or wrong (named on stderr).
void CheckCompleted(const Campaign& run, const Workload& w, const Done& d,
                    const std::map<std::string, int>& migrated_at, bool recovered,
                    OutputCounts* n) {
  const Result& r = d.result;
  const Ids& want = w.expected[d.session][d.turn];
  if (r.ids == want) return;
  auto mig = migrated_at.find(d.request_id);
  bool equal = false;
  std::string check_note;
  if (mig != migrated_at.end() && recovered) {
    const size_t streamed = static_cast<size_t>(mig->second);
    if (streamed <= r.ids.size() &&
        std::equal(r.ids.begin(), r.ids.begin() + streamed, want.begin(),
                   want.begin() + std::min(streamed, want.size()))) {
      equal = IsContinuation(run, w, d, streamed, &check_note);
    }
  }
  if (equal) {
    ++n->continuations;
    return;
  }
  ++n->wrong;
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

// 3. Every request of the load: a hang, a clean failure, or a completed one (CheckCompleted).
OutputCounts CheckOutputs(const Campaign& run, const Workload& w, const std::vector<Done>& done,
                          bool recovered) {
  const std::map<std::string, int> migrated_at = MigratedAt(run.data_dir);
  OutputCounts n;
  for (const auto& d : done) {
    const Result& r = d.result;
    if (r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        r.seconds > run.o.request_deadline_s + 5) {
      ++n.hangs;
      std::cerr << "epd chaos: request " << d.request_id << " hung (" << r.seconds << " s)\n";
      continue;
    }
    if (!r.status.ok()) {
      ++n.clean_failures;
      ++n.failure_codes[std::to_string(r.status.error_code())];
      if (n.clean_failures <= 20) {
        std::cout << "epd chaos: request " << d.request_id << " (t=" << r.start_s << ".."
                  << r.start_s + r.seconds << " s) failed: " << r.status.error_message() << "\n";
      }
      continue;
    }
    ++n.ok;
    CheckCompleted(run, w, d, migrated_at, recovered, &n);
  }
  return n;
}

// Leaks of a recovered cluster: once idle, no worker holds a job or more transfer resources than
// a fault-free one did at rest; the kvstore answers no put; the router runs nothing. Each leak
// is named in *notes.
int CountLeaks(const Campaign& run, const std::map<std::string, double>& idle_max,
               std::vector<std::string>* notes) {
  int leaks = 0;
  std::this_thread::sleep_for(std::chrono::seconds(2));
  for (const auto& c : run.workers) {
    auto port = Published(run.run_dir, c, "metrics");
    const std::string pool = PoolOf(c);
    if (!port) continue;
    if (Metric(run.HostOf(c), *port, "epd_queue_depth{pool=\"" + pool + "\"}").value_or(0) != 0) {
      ++leaks, notes->push_back(c + " queue_depth");
    }
    for (const char* res : kResources) {
      const double v = Metric(run.HostOf(c), *port,
                              std::string("epd_transfer_outstanding{resource=\"") + res + "\"}")
                           .value_or(0);
      if (v > idle_max.at(pool + "/" + res)) ++leaks, notes->push_back(c + " " + res);
    }
  }
  if (auto kv = Published(run.run_dir, "epd-kvstore", "metrics")) {
    if (Metric(run.host, *kv, "epd_kv_puts_in_flight").value_or(0) != 0) {
      ++leaks, notes->push_back("kvstore puts_in_flight");
    }
  }
  if (run.RouterMetric("epd_router_inflight_requests").value_or(1) != 0) {
    ++leaks, notes->push_back("router inflight");
  }
  return leaks;
}

// The live processes are exactly the published ones (and the registry lists them).
bool RegistryExact(const Campaign& run) {
  std::set<pid_t> published;
  for (const auto& c : run.components) {
    if (auto pid = Published(run.run_dir, c, "pid")) published.insert(*pid);
  }
  const std::set<pid_t> live = runtime::ProcessesNaming(run.data_dir + "/", run.serve.pid());
  return live == published;
}

// 4. Stops `epd serve` (Ctrl-C) and takes the network cut down; the processes of the cluster
// that remain (none, unless something leaked).
std::set<pid_t> StopCluster(Campaign& run, std::optional<int>* serve_rc) {
  run.serve.Signal(SIGINT);
  *serve_rc = run.serve.Wait(std::chrono::seconds(120));
  if (!*serve_rc) run.serve.Stop(std::chrono::seconds(1));
  std::set<pid_t> orphans;
  for (int i = 0; i < 100; ++i) {
    orphans = runtime::ProcessesNaming(run.data_dir + "/", -1);
    if (orphans.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  run.net.Down();
  return orphans;
}

// What the campaign found, for the report and the verdict.
struct Findings {
  size_t requests = 0;
  OutputCounts outputs;
  int leaks = 0;
  std::vector<std::string> leak_notes;
  FaultTally tally;
  double migrations_ok = 0;
  double migrations_failed = 0;
  bool recovered = false;
  bool registry_exact = false;
  std::optional<int> serve_rc;
  std::set<pid_t> orphans;
};

nlohmann::json ReportJson(const Campaign& run, const Findings& f) {
  const auto& [requests, outputs, leaks, leak_notes, tally, migrations_ok, migrations_failed,
               recovered, registry_exact, serve_rc, orphans] = f;
  const auto& [ok, clean_failures, hangs, wrong, continuations, failure_codes] = outputs;
  nlohmann::json j = {{"seed", run.o.seed},
                      {"seconds", run.o.seconds},
                      {"requests", requests},
                      {"ok", ok},
                      {"equal_no_fault", ok - continuations - wrong},
                      {"migration_continuations", continuations},
                      {"clean_failures", clean_failures},
                      {"failure_codes", failure_codes},
                      {"hangs", hangs},
                      {"wrong_outputs", wrong},
                      {"leaks", leaks},
                      {"leak_notes", leak_notes},
                      {"faults", tally.faults},
                      {"migrations_ok", migrations_ok},
                      {"migrations_failed", migrations_failed},
                      {"recovered", recovered},
                      {"registry_exact", registry_exact},
                      {"serve_exit", serve_rc.value_or(-1)},
                      {"orphans", orphans.size()}};
  if (!run.cut_unavailable.empty()) j["cut_network_unavailable"] = run.cut_unavailable;
  if (run.cut) j["cut_network_failures"] = tally.net_failures;
  return j;
}

// The soak's verdict per process (samples after the warm-up, all of them to --samples-csv) into
// j; false when a process was not flat or nothing was sampled.
bool AddSoak(const ChaosOptions& o, const std::map<std::string, std::vector<ProcSample>>& samples,
             int warmup_s, nlohmann::json* j) {
  bool soak_flat = true;
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
        csv << smp.t << "," << name << "," << smp.pid << "," << smp.rss_kb << "," << smp.fds << ","
            << smp.pool_cached_kb << "," << smp.heap_free_kb << "," << smp.heap_in_use_kb << "\n";
      }
      if (smp.t >= warmup_s) after.push_back(smp);
    }
    soak[name] = SoakVerdict(after, &soak_flat);
  }
  if (samples.empty()) soak_flat = false;
  (*j)["soak"] = soak;
  (*j)["soak_warmup_s"] = warmup_s;
  (*j)["soak_flat"] = soak_flat;
  return soak_flat;
}

bool Passed(const Findings& f, bool soak_flat) {
  const OutputCounts& n = f.outputs;
  return f.recovered && n.hangs == 0 && n.wrong == 0 && f.leaks == 0 && f.registry_exact &&
         f.tally.net_failures == 0 && f.orphans.empty() && f.serve_rc.value_or(-1) == 0 &&
         n.ok > 0 && soak_flat;
}

}  // namespace

int RunChaos(const ChaosOptions& o) {
  runtime::InstallShutdownHandlers();
  Campaign run(o);
  run.bin = SelfDir();
  if (!MakeDataDir(run)) return 2;
  std::cout << "epd chaos: seed " << o.seed << ", " << o.seconds << " s of faults, data in "
            << run.data_dir << "\n"
            << std::flush;
  if (!SetUpNetwork(run)) return 2;
  StartServe(run);
  if (!run.WaitHealthy(std::chrono::seconds(300))) {
    return run.FailStart("the cluster did not come up");
  }
  run.target = run.host + ":" + std::to_string(*Published(run.run_dir, "epd-router", "grpc"));

  // 1. No-fault outputs of every conversation turn.
  Workload w;
  if (!RecordNoFaultOutputs(run, &w)) return run.FailStart("a no-fault request failed");
  const std::map<std::string, double> idle_max = IdleResourceLevels(run);

  // 2. Load and faults.
  Load load;
  const auto end = Clock::now() + std::chrono::seconds(o.seconds);
  StartClients(run, w, &load);
  const FaultPlan plan = PlanFaults(run);
  if (plan.kinds.empty() && o.faults != "none") {
    std::cerr << "epd chaos: --faults names no known fault kind\n";
    load.Stop();
    run.serve.Stop(std::chrono::seconds(30));
    return 2;
  }
  const auto load_start = Clock::now();
  const int warmup_s = o.warmup_s >= 0 ? o.warmup_s : o.seconds / 5;
  if (o.sample_s > 0) StartSampler(run, load_start, &load);
  Findings f;
  f.tally = InjectFaults(run, plan, end);
  load.Stop();
  f.recovered = run.WaitHealthy(std::chrono::seconds(180));

  // 3. Checks.
  f.requests = load.done.size();
  f.outputs = CheckOutputs(run, w, load.done, f.recovered);
  if (f.recovered) f.leaks = CountLeaks(run, idle_max, &f.leak_notes);
  const bool registry_exact = RegistryExact(run);
  f.registry_exact = f.recovered && registry_exact;
  f.migrations_ok = run.RouterMetric("epd_request_migrations_total{outcome=\"ok\"}").value_or(0);
  f.migrations_failed =
      run.RouterMetric("epd_request_migrations_total{outcome=\"failed\"}").value_or(0);

  // 4. Stop: nothing of the cluster may remain.
  f.orphans = StopCluster(run, &f.serve_rc);

  nlohmann::json j = ReportJson(run, f);
  const bool soak_flat = o.sample_s > 0 ? AddSoak(o, load.samples, warmup_s, &j) : true;
  std::cout << "epd chaos: " << j.dump(1) << "\n";
  if (!o.json_path.empty()) std::ofstream(o.json_path) << j.dump(2) << "\n";
  const bool pass = Passed(f, soak_flat);
  std::cout << "epd chaos: " << (pass ? "PASS" : "FAIL") << "\n";
  if (pass && run.remove_data) {
    std::error_code ec;
    fs::remove_all(run.data_dir, ec);
    fs::remove(run.data_dir + ".serve.log", ec);
    fs::remove(run.data_dir + ".net.log", ec);
  }
  return pass ? 0 : 1;
}

}  // namespace epd::services
