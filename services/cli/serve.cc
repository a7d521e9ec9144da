#include "services/cli/serve.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cluster_secret.h"
#include "kernels/device/device.h"
#include "runtime/child_process.h"
#include "runtime/shutdown.h"

namespace epd::services {
namespace {

namespace fs = std::filesystem;

std::string SelfDir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

// The trained demo model (models/epd-nano, tools/train/): next to the build folder of the binary,
// else in the source tree the binary was built from. Empty when neither exists (then `epd serve`
// generates the random nano model, as `epd gen-model` does).
std::string DemoModelDir(const std::string& bin) {
  std::vector<std::string> candidates = {bin + "/../models/epd-nano"};
#ifdef EPD_DEMO_MODEL_DIR
  candidates.push_back(EPD_DEMO_MODEL_DIR);
#endif
  for (const std::string& c : candidates) {
    std::error_code ec;
    if (fs::exists(c + "/config.json", ec) && fs::exists(c + "/model.safetensors", ec)) {
      return fs::weakly_canonical(c, ec).string();
    }
  }
  return "";
}

// One process the launcher owns, and its restart state.
struct Component {
  std::string name;               // e.g. "epd-decode-0"
  std::string pool;               // a worker's pool ("decode"); empty for the kvstore and router
  std::vector<std::string> argv;  // full command line
  std::string log_path;
  std::string port_file;
  std::string port_key = "grpc";  // the port-file key that says the process is up
  runtime::ChildProcess proc;
  int restarts = 0;
  bool down = false;  // exited (or failed to come up) and waiting for its restart
  bool parked = false;  // a worker past its restart budget, waiting a window before the next try
  bool starting = false;  // restarted, not yet up (the supervisor polls it)
  std::chrono::steady_clock::time_point start_deadline;
  std::chrono::steady_clock::time_point up_since;
  std::chrono::steady_clock::time_point restart_at;
  std::chrono::milliseconds backoff{0};
  std::deque<std::chrono::steady_clock::time_point> recent_restarts;  // within the window
};

// How long a process may take to publish its port file once started.
constexpr std::chrono::minutes kStartTimeout{2};

// Starts `c`'s process (its old port file removed): false when it could not be started.
bool SpawnComponent(Component& c) {
  std::error_code ec;
  fs::remove(c.port_file, ec);
  runtime::SpawnOptions spawn;
  // Children die with the launcher even when it is SIGKILLed (they stay in its process group,
  // so a group-wide SIGTERM from a terminal or a service manager reaches them too).
  spawn.parent_death_signal = SIGKILL;
  c.proc = runtime::ChildProcess::StartWith(c.argv, c.log_path, spawn);
  if (c.proc.pid() <= 0) {
    std::cerr << "epd serve: cannot start " << c.name << ": " << c.proc.error() << "\n";
    return false;
  }
  c.start_deadline = std::chrono::steady_clock::now() + kStartTimeout;
  return true;
}

enum class StartState { kUp, kPending, kFailed };

// Where a spawned `c` stands: up once its port file names `c.port_key`; failed when it exited
// first or did not come up by its deadline (then it is stopped).
StartState PollStart(Component& c) {
  if (runtime::WaitForPortFile(c.port_file, c.port_key, std::chrono::milliseconds(0))) {
    c.up_since = std::chrono::steady_clock::now();
    return StartState::kUp;
  }
  if (!c.proc.running()) {
    std::cerr << "epd serve: " << c.name << " exited while starting (status "
              << c.proc.exit_status().value_or(-1) << "); see " << c.log_path << "\n";
    return StartState::kFailed;
  }
  if (std::chrono::steady_clock::now() > c.start_deadline) {
    std::cerr << "epd serve: " << c.name << " did not come up; see " << c.log_path << "\n";
    c.proc.Stop(std::chrono::seconds(2));
    return StartState::kFailed;
  }
  return StartState::kPending;
}

// Starts `c` and waits until it is up (the first start, in order: each process needs the ones
// before it): false when it could not be started, exited while starting, did not come up within
// kStartTimeout, or shutdown was asked.
bool StartComponent(Component& c) {
  if (!SpawnComponent(c)) return false;
  for (;;) {
    switch (PollStart(c)) {
      case StartState::kUp:
        return true;
      case StartState::kFailed:
        return false;
      case StartState::kPending:
        break;
    }
    if (runtime::ShutdownRequested()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// `prog` found on $PATH (children are exec'd without a path search), or `prog` itself.
std::string FindInPath(const std::string& prog) {
  const char* path = getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/sbin:/usr/bin:/sbin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string p = dir + "/" + prog;
    if (!dir.empty() && access(p.c_str(), X_OK) == 0) return p;
  }
  return prog;
}

// Replaces the value after `flag` in argv (a restarted kvstore or router must come back on the
// ports the others already use).
void SetFlag(std::vector<std::string>& argv, const std::string& flag, const std::string& value) {
  for (size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == flag) {
      argv[i + 1] = value;
      return;
    }
  }
  argv.insert(argv.end(), {flag, value});
}

// Rewrites the Prometheus file_sd target list (deploy/prometheus/prometheus.yml reads it) so a
// Prometheus server scrapes every running component, whatever ports they picked.
void WriteScrapeTargets(const std::string& path,
                        const std::vector<std::unique_ptr<Component>>& comps) {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& c : comps) {
    auto port = runtime::WaitForPortFile(c->port_file, "metrics", std::chrono::milliseconds(0));
    if (!port) continue;
    std::string pool = c->name.substr(4);  // "epd-decode-0" -> "decode-0"
    pool = pool.substr(0, pool.find('-'));
    groups.push_back({{"targets", {"127.0.0.1:" + std::to_string(*port)}},
                      {"labels", {{"component", c->name}, {"pool", pool}}}});
  }
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << groups.dump(2) << "\n";
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace

absl::Status ApplyServeConfigFile(const CLI::App& app, ServeOptions* o) {
  if (o->config_file.empty()) return absl::OkStatus();
  std::ifstream in(o->config_file);
  if (!in) return absl::NotFoundError("cannot read --config " + o->config_file);
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("--config " + o->config_file + " is not a JSON object");
  }
  auto set_str = [&](const char* key, const char* flag, std::string* dst) {
    if (j.contains(key) && app.count(flag) == 0) *dst = j[key].get<std::string>();
  };
  auto set_int = [&](const char* key, const char* flag, int* dst) {
    if (j.contains(key) && app.count(flag) == 0) *dst = j[key].get<int>();
  };
  try {
    set_str("model", "--model", &o->model_dir);
    set_str("data_dir", "--data-dir", &o->data_dir);
    set_int("http_port", "--http-port", &o->http_port);
    set_int("grpc_port", "--grpc-port", &o->grpc_port);
    set_int("encoders", "--encoders", &o->encoders);
    set_int("prefills", "--prefills", &o->prefills);
    set_int("decodes", "--decodes", &o->decodes);
    set_int("context_length", "--context-length", &o->context_length);
    set_int("dspark_k", "--dspark-k", &o->dspark_k);
    set_int("swa_ttl_minutes", "--swa-ttl-minutes", &o->swa_ttl_minutes);
    set_int("global_ttl_hours", "--global-ttl-hours", &o->global_ttl_hours);
    set_str("api_key", "--api-key", &o->api_key);
    set_str("api_key_file", "--api-key-file", &o->api_key_file);
    set_str("dspark", "--dspark", &o->dspark);
    set_str("device", "--device", &o->device);
    set_str("step_graphs", "--step-graphs", &o->step_graphs);
    set_str("tls_cert", "--tls-cert", &o->tls_cert);
    set_str("tls_key", "--tls-key", &o->tls_key);
    if (o->dspark_k < -1 || o->dspark_k > kMaxDSparkK) {
      return absl::InvalidArgumentError(absl::StrCat("--config ", o->config_file,
                                                     ": dspark_k must be -1 (the k policy) or 0..",
                                                     kMaxDSparkK));
    }
    if (o->dspark != "on" && o->dspark != "off") {
      return absl::InvalidArgumentError("--config " + o->config_file +
                                        ": dspark must be \"on\" or \"off\"");
    }
    if (o->step_graphs != "on" && o->step_graphs != "off") {
      return absl::InvalidArgumentError("--config " + o->config_file +
                                        ": step_graphs must be \"on\" or \"off\"");
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError("--config " + o->config_file + ": " + e.what());
  }
  return absl::OkStatus();
}

void AddServeFlags(CLI::App& app, ServeOptions* o) {
  app.add_option("--model", o->model_dir,
                 "Model directory (default: the trained demo model models/epd-nano; without it "
                 "the random nano model is generated)");
  app.add_option("--data-dir", o->data_dir, "Data folder: store, logs, generated model (./data)");
  app.add_option("--http-port", o->http_port,
                 "OpenAI HTTP port (default 8000; 0: a free one, printed when ready)");
  app.add_option("--grpc-port", o->grpc_port,
                 "gRPC port (default 50051; 0: a free one, printed when ready)");
  app.add_option("--encoders", o->encoders, "Encoder workers (default 1)")->check(CLI::Range(1, 64));
  app.add_option("--prefills", o->prefills, "Prefill workers (default 1)")->check(CLI::Range(1, 64));
  app.add_option("--decodes", o->decodes, "Decode workers (default 1)")->check(CLI::Range(1, 64));
  app.add_option("--swa-ttl-minutes", o->swa_ttl_minutes, "SWA pool TTL in minutes (default 10)");
  app.add_option("--global-ttl-hours", o->global_ttl_hours, "Global KV TTL in hours (default 72)");
  app.add_option("--api-key", o->api_key,
                 "Require this Bearer key on the HTTP API (visible in this process's command "
                 "line: prefer --api-key-file or $EPD_API_KEY)");
  app.add_option("--api-key-file", o->api_key_file,
                 "Require the Bearer key held in this file on the HTTP API (default: "
                 "$EPD_API_KEY; never passed on a child's command line)");
  app.add_option("--cluster-secret-file", o->cluster_secret_file,
                 "The cluster secret every internal plane authenticates with (default: "
                 "$EPD_CLUSTER_SECRET_FILE, $EPD_CLUSTER_SECRET, else a fresh random one; "
                 "passed to the children through their environment; docs/security.md)");
  app.add_option("--config", o->config_file, "JSON file with the same keys (flags win)");
  app.add_option("--log-level", o->log_level, "Log level of the children (info)");
  app.add_option("--dspark", o->dspark, "DSpark speculative decoding on|off (default on)")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--dspark-k", o->dspark_k,
                 "DSpark drafts verified per decode step: -1 = the k policy (default), 0.." +
                     std::to_string(kMaxDSparkK) + " = fixed (passed to every decode worker)")
      ->check(CLI::Range(-1, kMaxDSparkK));
  app.add_option("--device", o->device,
                 "The workers' backend: cpu, cuda (the workers spread over every visible GPU, "
                 "round-robin in start order) or cuda:N (every worker on GPU N) (default cpu; "
                 "docs/serve.md)");
  app.add_option("--step-graphs", o->step_graphs,
                 "Decode step graphs on|off (default on; passed to every decode worker): a "
                 "batched decode step's row-independent parts launched as CUDA graphs "
                 "(docs/cuda.md); off runs every op one by one, with the same output")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--kv-pool-bytes", o->kv_pool_bytes,
                 "KV pool bytes of each decode worker (default: 90% of a GPU's free memory "
                 "after the weights, a quarter of the host memory on the CPU, split among the "
                 "decode workers that share that GPU or host)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--tls-cert", o->tls_cert, "PEM certificate: HTTPS and gRPC TLS on the router");
  app.add_option("--tls-key", o->tls_key, "PEM private key of --tls-cert");
  app.add_option("--max-restarts", o->max_restarts,
                 "Restarts of one process within --restart-window-s before epd serve parks it "
                 "for a window (a worker) or gives up (the kvstore, the router) (default 5)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--restart-window-s", o->restart_window_s,
                 "Window of the restart budget, seconds (default 60)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--restart-backoff-ms", o->restart_backoff_ms,
                 "First restart delay; doubles up to 16x while a process keeps failing (500)")
      ->check(CLI::Range(0, 600000));
  app.add_option("--migration-limit", o->migration_limit,
                 "Router: times a request moves to another decode worker when its worker dies "
                 "mid-generation (default 1; 0 = never)")
      ->check(CLI::Range(0, 100));
  app.add_option("--context-length", o->context_length,
                 "Router: prompt + completion tokens per request (default 32768, room for "
                 "`epd bench` defaults)")
      ->check(CLI::Range(256, 1 << 20));
  app.add_option("--host", o->host,
                 "Address every process binds and advertises (default 127.0.0.1)");
  app.add_option("--worker-binary", o->worker_binaries,
                 "POOL=PATH: run the POOL (encoder, prefill, decode) workers from PATH instead of "
                 "epd-POOL beside epd (a bare name: beside epd); repeat or separate by commas "
                 "for several pools (so PATH holds no comma)")
      ->delimiter(',');
  app.add_option("--worker-netns", o->worker_netns,
                 "NAME:NETNS:ADDR: run worker NAME in network namespace NETNS, advertising ADDR "
                 "(root; used by `epd chaos` for its network cut)");
}

namespace {

// The options (the ports filled in once the router took them), the workers' devices, binaries
// and network namespace, and the components started so far: what the steps of RunServe share.
struct Launcher {
  explicit Launcher(ServeOptions& options) : o(options) {}

  ServeOptions& o;
  std::string bin;
  kernels::DeviceSpec device;
  std::vector<kernels::DeviceSpec> devices;
  std::string netns_name, netns, netns_addr;         // --worker-netns
  std::map<std::string, std::string> worker_binary;  // pool -> binary
  std::vector<std::unique_ptr<Component>> comps;     // in start order
  bool tls = false;
  std::string kv_addr;
  std::string router_addr;
  int started_workers = 0;
  std::map<size_t, std::string> on_device;  // devices[i] -> its workers, for the ready message

  // A component with the flags every process gets (port file, metrics port, log level, host).
  Component* Add(std::string name, std::vector<std::string> argv) {
    auto c = std::make_unique<Component>();
    c->name = name;
    c->argv = std::move(argv);
    c->log_path = o.data_dir + "/logs/" + name + ".log";
    c->port_file = o.data_dir + "/run/" + name + ".json";
    c->argv.insert(c->argv.end(), {"--port-file", c->port_file, "--metrics-port", "0",
                                   "--log-level", o.log_level, "--host", o.host});
    comps.push_back(std::move(c));
    return comps.back().get();
  }
  void StopAll() {
    // Stop in reverse start order: workers drain first, the store last.
    for (auto it = comps.rbegin(); it != comps.rend(); ++it) (*it)->proc.Signal(SIGTERM);
    for (auto it = comps.rbegin(); it != comps.rend(); ++it) (*it)->proc.Stop();
  }
};

// The device first: with --device cuda and no usable GPU (or a model that cannot run there)
// nothing is started. The workers' devices (docs/serve.md, Devices): `cuda` spreads them over
// every GPU this process sees, round-robin in start order (encoders, prefills, decodes); `cuda:N`
// puts every worker on N. Each device used is checked here, and this process keeps no context on
// it. False (said on stderr) when one cannot serve.
bool ChooseDevices(Launcher& launch) {
  const ServeOptions& o = launch.o;
  auto device = kernels::ParseDeviceSpec(o.device);
  if (!device.ok()) {
    std::cerr << "epd serve: " << device.status().message() << "\n";
    return false;
  }
  launch.device = *device;
  launch.devices = {*device};
  if (device->kind == kernels::DeviceSpec::Kind::kCuda && o.device == "cuda") {
    const int gpus = std::min(kernels::CudaDeviceCount(), o.encoders + o.prefills + o.decodes);
    for (int i = 1; i < gpus; ++i) launch.devices.push_back({kernels::DeviceSpec::Kind::kCuda, i});
  }
  for (const kernels::DeviceSpec& d : launch.devices) {
    if (auto s = kernels::CheckModelCanRunOn(d); !s.ok()) {
      std::cerr << "epd serve: --device " << o.device << ": " << s.message() << "\n";
      return false;
    }
  }
  return true;
}

// The data folder's logs/ and run/; false (said on stderr) when they cannot be made.
bool MakeDataDirs(const ServeOptions& o) {
  std::error_code ec;
  fs::create_directories(o.data_dir + "/logs", ec);
  fs::create_directories(o.data_dir + "/run", ec);
  if (ec) {
    std::cerr << "epd serve: cannot create " << o.data_dir << ": " << ec.message() << "\n";
    return false;
  }
  return true;
}

// --model, else the trained demo model, else the random nano model generated into the data
// folder (once); false when generating it failed.
bool ChooseModel(ServeOptions& o, const std::string& bin) {
  if (o.model_dir.empty()) o.model_dir = DemoModelDir(bin);
  if (!o.model_dir.empty()) {
    std::cout << "epd serve: model " << o.model_dir << "\n";
    return true;
  }
  o.model_dir = o.data_dir + "/models/nano";
  if (fs::exists(o.model_dir + "/config.json")) return true;
  std::cout << "epd serve: generating the nano demo model into " << o.model_dir << "\n";
  runtime::ChildProcess gen = runtime::ChildProcess::Start(
      {bin + "/epd", "gen-model", "--preset", "nano", "--out", o.model_dir},
      o.data_dir + "/logs/gen-model.log");
  auto rc = gen.Wait(std::chrono::minutes(10));
  if (!rc || *rc != 0) {
    std::cerr << "epd serve: gen-model failed; see " << o.data_dir << "/logs/gen-model.log\n";
    return false;
  }
  return true;
}

// --worker-netns NAME:NETNS:ADDR into launch.netns_*; false (said on stderr) when malformed.
bool ParseWorkerNetns(Launcher& launch) {
  if (launch.o.worker_netns.empty()) return true;
  std::vector<std::string> parts;
  std::stringstream in(launch.o.worker_netns);
  for (std::string p; std::getline(in, p, ':');) parts.push_back(p);
  if (parts.size() != 3 || parts[0].rfind("epd-", 0) != 0 || parts[1].empty() || parts[2].empty()) {
    std::cerr << "epd serve: --worker-netns '" << launch.o.worker_netns
              << "' is not NAME:NETNS:ADDR (e.g. epd-decode-1:ns0:10.0.0.2)\n";
    return false;
  }
  launch.netns_name = parts[0], launch.netns = parts[1], launch.netns_addr = parts[2];
  return true;
}

// Each pool's worker binary: epd-POOL beside epd, or --worker-binary POOL=PATH; false (said on
// stderr) when a --worker-binary is malformed, not executable or names a pool twice.
bool ChooseWorkerBinaries(Launcher& launch) {
  for (const char* kind : {"encoder", "prefill", "decode"}) {
    launch.worker_binary[kind] = launch.bin + "/epd-" + kind;
  }
  std::set<std::string> given;
  for (const std::string& spec : launch.o.worker_binaries) {
    const size_t eq = spec.find('=');
    const std::string kind = spec.substr(0, eq);
    std::string path = eq == std::string::npos ? "" : spec.substr(eq + 1);
    if (eq == std::string::npos || !launch.worker_binary.contains(kind) || path.empty()) {
      std::cerr << "epd serve: --worker-binary '" << spec
                << "' is not POOL=PATH with POOL encoder, prefill or decode\n";
      return false;
    }
    if (path.find('/') == std::string::npos) path = launch.bin + "/" + path;
    std::error_code fs_ec;
    if (!fs::is_regular_file(path, fs_ec) || access(path.c_str(), X_OK) != 0) {
      std::cerr << "epd serve: --worker-binary " << kind << "=" << path
                << ": not an executable file\n";
      return false;
    }
    if (!given.insert(kind).second) {
      std::cerr << "epd serve: --worker-binary names the " << kind << " pool twice\n";
      return false;
    }
    launch.worker_binary[kind] = path;
  }
  return true;
}

// 1. kvstore. A restarted store reopens its RocksDB and must listen where the others look.
bool StartKvstore(Launcher& launch) {
  const ServeOptions& o = launch.o;
  Component* kv = launch.Add(
      "epd-kvstore", {launch.bin + "/epd-kvstore", "--data-dir", o.data_dir + "/kvstore",
                      "--grpc-port", "0", "--swa-ttl-minutes", std::to_string(o.swa_ttl_minutes),
                      "--global-ttl-hours", std::to_string(o.global_ttl_hours)});
  if (!StartComponent(*kv)) return false;
  const int kv_port = *runtime::WaitForPortFile(kv->port_file, "grpc", std::chrono::seconds(1));
  SetFlag(kv->argv, "--grpc-port", std::to_string(kv_port));
  launch.kv_addr = o.host + ":" + std::to_string(kv_port);
  return true;
}

// 2. router. Workers re-register with a restarted router (it answers their heartbeat with
// "unknown").
bool StartRouter(Launcher& launch) {
  ServeOptions& o = launch.o;
  std::vector<std::string> router_argv = {launch.bin + "/epd-router",
                                          "--http-port",
                                          std::to_string(o.http_port),
                                          "--grpc-port",
                                          std::to_string(o.grpc_port),
                                          "--model",
                                          o.model_dir,
                                          "--kvstore",
                                          launch.kv_addr,
                                          "--migration-limit",
                                          std::to_string(o.migration_limit),
                                          "--context-length",
                                          std::to_string(o.context_length)};
  // The key reaches the router through its environment ($EPD_API_KEY, set by RunServe), never
  // its command line (docs/security.md).
  launch.tls = !o.tls_cert.empty() || !o.tls_key.empty();
  if (launch.tls) {
    // The public ports speak TLS; the workers register on a plaintext port of their own.
    router_argv.insert(router_argv.end(), {"--tls-cert", o.tls_cert, "--tls-key", o.tls_key,
                                           "--worker-grpc-port", "0"});
  }
  Component* router = launch.Add("epd-router", router_argv);
  if (launch.tls) router->port_key = "worker_grpc";
  if (!StartComponent(*router)) return false;
  // A restarted router listens where the clients and the workers look.
  std::vector<std::string> router_keys = {"http", "grpc"};
  if (launch.tls) router_keys.push_back("worker_grpc");
  for (const std::string& key : router_keys) {
    const int port = *runtime::WaitForPortFile(router->port_file, key, std::chrono::seconds(1));
    std::string flag = "--" + key + "-port";
    std::replace(flag.begin(), flag.end(), '_', '-');
    SetFlag(router->argv, flag, std::to_string(port));
    // Port 0 asked for free ones: say the ones the router took.
    if (key == "http") o.http_port = port;
    if (key == "grpc") o.grpc_port = port;
  }
  launch.router_addr =
      o.host + ":" +
      std::to_string(*runtime::WaitForPortFile(
          router->port_file, launch.tls ? "worker_grpc" : "grpc", std::chrono::seconds(1)));
  return true;
}

// The command line of worker `name` of pool `kind` on device `dev`, whose decode workers there
// number `share`.
std::vector<std::string> WorkerArgv(const Launcher& launch, const std::string& kind,
                                    const std::string& name, const std::string& dev, int share) {
  const ServeOptions& o = launch.o;
  const std::string& binary = launch.worker_binary.at(kind);
  std::vector<std::string> argv = {
      binary,    "--router",  launch.router_addr, "--kvstore", launch.kv_addr,
      "--model", o.model_dir, "--dspark",         o.dspark,    "--device",
      dev};
  if (kind == "decode" && o.kv_pool_bytes > 0)
    argv.insert(argv.end(), {"--kv-pool-bytes", std::to_string(o.kv_pool_bytes)});
  if (kind == "decode" && o.kv_pool_bytes <= 0 && share > 1)
    argv.insert(argv.end(), {"--kv-pool-share", std::to_string(share)});
  if (kind == "decode") argv.insert(argv.end(), {"--step-graphs", o.step_graphs});
  if (kind == "decode" && o.dspark_k >= 0)
    argv.insert(argv.end(), {"--dspark-k", std::to_string(o.dspark_k)});
  if (name == launch.netns_name) {
    // Its own network: only eth0 (a veth) reaches the others, so UCX runs over TCP on it
    // (no shared memory, which would bypass the network).
    argv.insert(argv.begin(), {FindInPath("ip"), "netns", "exec", launch.netns, "env",
                               "UCX_TLS=tcp", "UCX_NET_DEVICES=eth0"});
    argv.insert(argv.end(), {"--advertise-address", launch.netns_addr});
  }
  return argv;
}

// 3. The `n` workers of pool `kind`, each started and registered in turn; false when one could
// not be. A pool whose binary this build lacks stays empty.
bool StartPool(Launcher& launch, const std::string& kind, int n) {
  const std::string& binary = launch.worker_binary.at(kind);
  if (!fs::exists(binary)) {
    std::cerr << "epd serve: " << binary << " is not available in this build; the " << kind
              << " pool stays empty\n";
    return true;
  }
  // Decode workers that share a memory split its default KV pool (docs/serve.md, Devices):
  // the number of this pool's workers on each device (the host counts as one).
  const int first = launch.started_workers;
  auto device_of = [&](int i) { return static_cast<size_t>(first + i) % launch.devices.size(); };
  std::vector<int> per_device(launch.devices.size(), 0);
  for (int i = 0; i < n; ++i) ++per_device[device_of(i)];
  for (int i = 0; i < n; ++i) {
    const std::string name = "epd-" + kind + "-" + std::to_string(i);
    const size_t dev_index = device_of(i);
    ++launch.started_workers;
    const std::string dev = launch.devices[dev_index].ToString();
    launch.on_device[dev_index] += " " + name;
    Component* w = launch.Add(name, WorkerArgv(launch, kind, name, dev, per_device[dev_index]));
    w->pool = kind;
    if (name == launch.netns_name) SetFlag(w->argv, "--host", "0.0.0.0");
    // The first start waits until it registered with the router (its gRPC port opens
    // earlier), so "ready" means a request is routed, not answered 503 no_workers. A restart
    // waits for the gRPC port only: the router may be restarting too, and the supervisor loop
    // must not block on it.
    w->port_key = "registered";
    if (!StartComponent(*w)) return false;
    w->port_key = "grpc";
  }
  return true;
}

void PrintReady(const Launcher& launch, const std::string& targets_path) {
  const ServeOptions& o = launch.o;
  std::cout << "epd serve: ready\n"
            << "  OpenAI API  " << (launch.tls ? "https://" : "http://") << o.host << ":"
            << o.http_port << "/v1\n"
            << "  gRPC        " << o.host << ":" << o.grpc_port << " (epd.v1.Inference"
            << (launch.tls ? ", TLS)\n" : ")\n") << "  logs        " << o.data_dir << "/logs\n"
            << "  scrape list " << targets_path << " (deploy/prometheus/prometheus.yml)\n";
  if (launch.device.kind == kernels::DeviceSpec::Kind::kCuda) {
    for (const auto& [dev_index, names] : launch.on_device) {
      const std::string dev = launch.devices[dev_index].ToString();
      std::cout << "  " << dev << (dev.size() < 12 ? std::string(12 - dev.size(), ' ') : " ")
                << names.substr(1) << "\n";
    }
  }
  std::cout << "Press Ctrl-C to stop.\n" << std::flush;
}

// Supervise: a process that exits is restarted after a backoff (doubling from
// --restart-backoff-ms up to 16x, reset once it stayed up a whole window); more than
// --max-restarts restarts of one process within --restart-window-s park it for a window (a
// worker, or the kvstore: a cache the workers serve without) or stop everything (the router). A restarted process is polled on each
// pass until it is up (PollStart), so one slow start delays no other restart.
class Supervisor {
 public:
  using Clock = std::chrono::steady_clock;

  Supervisor(const ServeOptions& o, std::vector<std::unique_ptr<Component>>& comps,
             const std::string& targets_path)
      : o_(o),
        comps_(comps),
        targets_path_(targets_path),
        window_(std::chrono::seconds(o.restart_window_s)),
        backoff_min_(std::chrono::milliseconds(o.restart_backoff_ms)) {}

  // Passes every 100 ms until shutdown is asked; the exit code (1 when the router ran out of
  // restarts).
  int Run() {
    while (!runtime::WaitForShutdown(std::chrono::milliseconds(100))) {
      const auto now = Clock::now();
      for (auto& c : comps_) {
        const Step step = Supervise(*c, now);
        if (step == Step::kGiveUp) return 1;
        if (step == Step::kStopPass) break;
      }
    }
    return 0;
  }

 private:
  // After one component: on to the next, the pass stops (a shutdown wins over a restart), or
  // everything stops.
  enum class Step { kNext, kStopPass, kGiveUp };

  Step Supervise(Component& c, Clock::time_point now) {
    if (c.starting) {
      PollRestart(c);
      return Step::kNext;
    }
    if (!c.down) {
      if (!c.proc.running()) NoteExit(c, now);
      return Step::kNext;
    }
    if (now < c.restart_at) return Step::kNext;
    while (!c.recent_restarts.empty() && now - c.recent_restarts.front() > window_) {
      c.recent_restarts.pop_front();
    }
    // (A worker back from a park always gets its one try, even with --max-restarts 0.)
    if (!c.parked && static_cast<int>(c.recent_restarts.size()) >= o_.max_restarts) {
      if (c.pool.empty() && c.name != "epd-kvstore") {
        // Nothing serves without the router. (The kvstore is a cache: the workers serve without
        // it, so it is parked like a worker.)
        std::cerr << "epd serve: " << c.name << " was restarted " << o_.max_restarts
                  << " times within " << o_.restart_window_s << " s; giving up and stopping. See "
                  << c.log_path << "\n";
        return Step::kGiveUp;
      }
      Park(c, now);
      return Step::kNext;
    }
    if (c.parked) {
      std::cerr << "epd serve: " << c.name << " was parked for " << o_.restart_window_s
                << " s; trying it again\n";
      c.parked = false;
    }
    c.recent_restarts.push_back(now);
    ++c.restarts;
    // A shutdown (e.g. the whole process group got SIGTERM) wins over a restart.
    if (runtime::ShutdownRequested()) return Step::kStopPass;
    if (SpawnComponent(c)) {
      c.starting = true;  // polled from the next pass on
    } else {
      RetryLater(c);
    }
    return Step::kNext;
  }

  // A restarted `c`, polled until it is up (or its start failed: tried again later).
  void PollRestart(Component& c) {
    const StartState state = PollStart(c);
    if (state == StartState::kPending) return;
    c.starting = false;
    if (state == StartState::kUp) {
      c.down = false;
      std::cerr << "epd serve: " << c.name << " restarted (restart " << c.restarts << ", pid "
                << c.proc.pid() << ")\n";
      WriteScrapeTargets(targets_path_, comps_);
    } else {
      RetryLater(c);
    }
  }

  // `c` exited: down, with its restart after a backoff (reset when it stayed up a window).
  void NoteExit(Component& c, Clock::time_point now) {
    c.down = true;
    c.backoff = now - c.up_since >= window_
                    ? backoff_min_
                    : std::clamp(c.backoff * 2, backoff_min_, backoff_min_ * 16);
    c.restart_at = now + c.backoff;
    std::cerr << "epd serve: " << c.name << " (pid " << c.proc.pid() << ") exited with status "
              << c.proc.exit_status().value_or(-1) << "; restarting in " << c.backoff.count()
              << " ms\n";
  }

  // A worker that cannot run here now (its GPU lost, a bad model file) is parked for a window:
  // the rest of the cluster keeps serving, its pool without it, and it is tried again with a
  // fresh budget (an operator may have mended the cause).
  void Park(Component& c, Clock::time_point now) {
    const int running =
        static_cast<int>(std::count_if(comps_.begin(), comps_.end(), [&](const auto& other) {
          return other->pool == c.pool && !other->down;
        }));
    std::cerr << "epd serve: " << c.name << " was restarted " << o_.max_restarts << " times within "
              << o_.restart_window_s << " s; parking it for " << o_.restart_window_s << " s (";
    if (c.pool.empty()) {
      std::cerr << "serving without the KV store meanwhile: no prefix reuse";
    } else {
      std::cerr << running << " " << c.pool << " worker(s) still running";
    }
    std::cerr << "). See " << c.log_path << "\n";
    c.parked = true;
    c.recent_restarts.clear();
    c.restart_at = now + window_;
  }

  // A start that failed: the next try after a doubled backoff.
  void RetryLater(Component& c) {
    c.backoff = std::clamp(c.backoff * 2, backoff_min_, backoff_min_ * 16);
    c.restart_at = Clock::now() + c.backoff;
  }

  const ServeOptions& o_;
  std::vector<std::unique_ptr<Component>>& comps_;
  const std::string& targets_path_;
  const std::chrono::seconds window_;
  const std::chrono::milliseconds backoff_min_;
};

}  // namespace

int RunServe(ServeOptions o) {
  Launcher launch(o);
  if (!ChooseDevices(launch)) return 1;
  runtime::InstallShutdownHandlers();
  launch.bin = SelfDir();
  // Everything runs on one host: keep UCX on loopback (shared memory is negotiated between
  // workers) unless the operator chose devices.
  if (o.host == "127.0.0.1" || o.host == "localhost") setenv("UCX_NET_DEVICES", "lo", 0);
  // Every file and socket the launcher and its children make is the owner's only.
  umask(077);
  // The cluster secret every internal plane authenticates with (docs/security.md): the
  // operator's, or a fresh one. The children inherit it through the environment (readable by
  // this user only, /proc/PID/environ is 0400), never argv (which every local user can read).
  {
    auto secret = common::LoadClusterSecret(o.cluster_secret_file);
    auto set = [](const char* name) {
      const char* v = std::getenv(name);
      return v != nullptr && *v != '\0';
    };
    const bool given = !o.cluster_secret_file.empty() || set("EPD_CLUSTER_SECRET") ||
                       set("EPD_CLUSTER_SECRET_FILE") || set("EPD_CLUSTER_TOKEN");
    if (!secret.ok() && given) {
      std::cerr << "epd serve: " << secret.status().message() << "\n";
      return 1;
    }
    setenv("EPD_CLUSTER_SECRET", (secret.ok() ? *secret : common::NewClusterSecret()).c_str(), 1);
    unsetenv("EPD_CLUSTER_SECRET_FILE");
    unsetenv("EPD_CLUSTER_TOKEN");
  }
  // The API key: from --api-key-file, --api-key or $EPD_API_KEY; to the router by environment.
  if (!o.api_key_file.empty()) {
    std::ifstream in(o.api_key_file, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    o.api_key = ss.str();
    while (!o.api_key.empty() && (o.api_key.back() == '\n' || o.api_key.back() == '\r'))
      o.api_key.pop_back();
    if (!in || o.api_key.empty()) {
      std::cerr << "epd serve: --api-key-file " << o.api_key_file << ": cannot read a key\n";
      return 1;
    }
  }
  if (!o.api_key.empty()) {
    setenv("EPD_API_KEY", o.api_key.c_str(), 1);
  } else if (const char* k = std::getenv("EPD_API_KEY"); k != nullptr) {
    o.api_key = k;
  }
  if (!MakeDataDirs(o) || !ChooseModel(o, launch.bin) || !ParseWorkerNetns(launch) ||
      !ChooseWorkerBinaries(launch)) {
    return 1;
  }
  if (!StartKvstore(launch) || !StartRouter(launch)) {
    launch.StopAll();
    return 1;
  }
  const bool ok = StartPool(launch, "encoder", o.encoders) &&
                  StartPool(launch, "prefill", o.prefills) &&
                  StartPool(launch, "decode", o.decodes);
  const std::string targets_path = o.data_dir + "/run/prometheus_targets.json";
  WriteScrapeTargets(targets_path, launch.comps);
  if (ok) PrintReady(launch, targets_path);
  const int exit_code = ok ? Supervisor(o, launch.comps, targets_path).Run() : 1;
  std::cout << "epd serve: stopping\n" << std::flush;
  launch.StopAll();
  return exit_code;
}

}  // namespace epd::services
