#include "services/cli/bench.h"

#include <httplib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace epd::services {
namespace {

using json = nlohmann::json;
using SteadyClock = std::chrono::steady_clock;

constexpr int kCharsPerToken = 4;  // the usual BPE ratio for English text and code
constexpr size_t kErrorSamples = 5;

double MsSince(SteadyClock::time_point from, SteadyClock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// SplitMix64: a tiny portable generator (std distributions differ between standard libraries,
// and the prompts must be the same everywhere for a given seed).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t Below(size_t n) { return static_cast<size_t>(Next() % n); }
  template <size_t N>
  const char* Pick(const char* const (&items)[N]) {
    return items[Below(N)];
  }

 private:
  uint64_t state_;
};

constexpr const char* kWords[] = {
    "the",      "server", "request", "cache",      "latency", "token",    "model",  "decoder",
    "encoder",  "window", "memory",  "throughput", "agent",   "context",  "prefix", "store",
    "returns",  "reads",  "writes",  "after",      "before",  "each",     "every",  "batch",
    "queue",    "worker", "router",  "response",   "stream",  "network",  "disk",   "page",
    "function", "error",  "value",   "table",      "results", "measured", "under",  "load"};
constexpr const char* kDirs[] = {"src", "lib", "core", "net", "io", "util", "test", "api"};
constexpr const char* kExts[] = {".cc", ".h", ".py", ".rs", ".go", ".ts"};
constexpr const char* kTypes[] = {"int", "size_t", "double", "bool", "std::string", "auto"};

void AppendTerminal(Rng& rng, std::string& out) {
  switch (rng.Below(4)) {
    case 0:
      absl::StrAppend(&out, "[", rng.Below(100), "%] Building CXX object ", rng.Pick(kDirs), "/",
                      rng.Pick(kWords), "_", rng.Below(1000), rng.Pick(kExts), ".o\n");
      break;
    case 1:
      absl::StrAppend(&out, rng.Pick(kDirs), "/", rng.Pick(kWords), rng.Pick(kExts), ":",
                      rng.Below(2000), ":", rng.Below(80), ": warning: unused variable '",
                      rng.Pick(kWords), "_", rng.Below(100), "' [-Wunused-variable]\n");
      break;
    case 2:
      absl::StrAppend(&out, "[ RUN      ] ", rng.Pick(kWords), "Test.", rng.Pick(kWords),
                      rng.Below(50), "\n[       OK ] (", rng.Below(500), " ms)\n");
      break;
    default:
      absl::StrAppend(&out, "-rw-r--r-- 1 agent agent ", rng.Below(100000), " Nov ",
                      1 + rng.Below(30), " ", rng.Pick(kWords), "_", rng.Below(100),
                      rng.Pick(kExts), "\n");
  }
}

void AppendFile(Rng& rng, std::string& out) {
  const char* type = rng.Pick(kTypes);
  absl::StrAppend(&out, type, " ", rng.Pick(kWords), "_", rng.Pick(kWords), "(", rng.Pick(kTypes),
                  " ", rng.Pick(kWords), ") {\n  if (", rng.Pick(kWords), " > ", rng.Below(1000),
                  ") return ", rng.Pick(kWords), ";\n  // ", rng.Pick(kWords), " ",
                  rng.Pick(kWords), " ", rng.Pick(kWords), "\n  return {};\n}\n\n");
}

void AppendWeb(Rng& rng, std::string& out) {
  const size_t words = 8 + rng.Below(12);
  for (size_t i = 0; i < words; ++i) {
    std::string w = rng.Pick(kWords);
    if (i == 0) w[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(w[0])));
    absl::StrAppend(&out, w, i + 1 == words ? ".\n" : " ");
  }
}

// The body of one SSE stream, parsed as it arrives.
struct StreamOutcome {
  int status = 0;
  bool done = false;
  bool aborted = false;  // abandoned at the hard deadline
  std::string error;
  std::string content;
  std::vector<SteadyClock::time_point> token_chunks;  // arrival of chunks carrying text
  SteadyClock::time_point end;
  std::optional<json> usage;
};

bool CarriesText(const json& delta) {
  for (const char* key : {"content", "reasoning_content"}) {
    auto it = delta.find(key);
    if (it != delta.end() && it->is_string() && !it->get_ref<const std::string&>().empty()) {
      return true;
    }
  }
  auto tc = delta.find("tool_calls");
  return tc != delta.end() && tc->is_array() && !tc->empty();
}

// Handles one `data:` payload (an event after an error is ignored).
void HandleEvent(const std::string& payload, SteadyClock::time_point now, StreamOutcome& out) {
  if (payload == "[DONE]") {
    out.done = true;
    return;
  }
  json ev = json::parse(payload, nullptr, /*allow_exceptions=*/false);
  if (ev.is_discarded() || !ev.is_object()) {
    if (out.error.empty())
      out.error = "an SSE event is not a JSON object: " + payload.substr(0, 80);
    return;
  }
  if (auto e = ev.find("error"); e != ev.end()) {
    if (out.error.empty()) {
      out.error = "SSE error event: " +
                  (e->is_object() && e->contains("message") ? (*e)["message"].dump() : e->dump());
    }
    return;
  }
  if (auto u = ev.find("usage"); u != ev.end() && u->is_object()) out.usage = *u;
  auto choices = ev.find("choices");
  if (choices == ev.end() || !choices->is_array() || choices->empty()) return;
  const json& c = (*choices)[0];
  auto delta = c.find("delta");
  if (delta == c.end() || !delta->is_object()) return;
  if (CarriesText(*delta)) out.token_chunks.push_back(now);
  if (auto t = delta->find("content"); t != delta->end() && t->is_string()) {
    out.content += t->get<std::string>();
  }
}

struct RequestRecord {
  bool ok = false;
  bool incomplete = false;
  std::string error;
  double ttft_ms = 0;
  double e2e_ms = 0;
  std::vector<double> itl_ms;
  int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
  std::string answer;
};

// cpp-httplib's "scheme://host:port" form, so https works where the library has TLS.
std::string ClientAddress(const ParsedUrl& u) {
  return absl::StrCat(u.scheme, "://", u.host, ":", u.port);
}

httplib::Headers AuthHeaders(const BenchOptions& o) {
  httplib::Headers h;
  if (!o.api_key.empty()) h.emplace("Authorization", "Bearer " + o.api_key);
  return h;
}

int64_t JsonInt(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<int64_t>() : 0;
}

RequestRecord SendTurn(httplib::Client& cli, const BenchOptions& o, const std::string& path,
                       const json& messages, SteadyClock::time_point hard_deadline) {
  json body = {{"model", o.model},
               {"messages", messages},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"max_tokens", o.max_tokens},
               {"temperature", 0}};
  StreamOutcome out;
  std::string buffer, raw;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.headers = AuthHeaders(o);
  req.set_header("Accept", "text/event-stream");
  req.set_header("Content-Type", "application/json");
  req.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    const auto now = SteadyClock::now();
    if (raw.size() < 4096) raw.append(data, std::min(len, 4096 - raw.size()));
    for (size_t i = 0; i < len; ++i) {
      if (data[i] != '\r') buffer.push_back(data[i]);
    }
    size_t pos;
    while ((pos = buffer.find("\n\n")) != std::string::npos) {
      std::string event = buffer.substr(0, pos);
      buffer.erase(0, pos + 2);
      // An event may hold several lines; the data lines are joined with '\n' (SSE spec).
      std::string payload;
      std::istringstream lines(event);
      for (std::string line; std::getline(lines, line);) {
        if (line.rfind("data:", 0) != 0) continue;
        std::string d = line.substr(5);
        if (!d.empty() && d[0] == ' ') d.erase(0, 1);
        if (!payload.empty()) payload += '\n';
        payload += d;
      }
      if (!payload.empty()) HandleEvent(payload, now, out);
    }
    if (now > hard_deadline) {
      out.aborted = true;
      return false;
    }
    return true;
  };
  const auto start = SteadyClock::now();
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = cli.send(req, res, err);
  out.end = SteadyClock::now();
  out.status = res.status;

  RequestRecord r;
  r.e2e_ms = MsSince(start, out.end);
  if (out.aborted) {
    r.incomplete = true;
    return r;
  }
  if (out.status <= 0) {
    r.error = "request failed: " + httplib::to_string(err);
  } else if (out.status != 200) {
    r.error = absl::StrCat("HTTP ", out.status, ": ", raw.substr(0, 300));
  } else if (!out.error.empty()) {
    r.error = out.error;
  } else if (!out.done) {
    r.error = "the stream ended without [DONE]";
    if (!sent) absl::StrAppend(&r.error, " (", httplib::to_string(err), ")");
  }
  if (!r.error.empty()) return r;
  r.ok = true;
  if (!out.token_chunks.empty()) {
    r.ttft_ms = MsSince(start, out.token_chunks.front());
    for (size_t i = 1; i < out.token_chunks.size(); ++i) {
      r.itl_ms.push_back(MsSince(out.token_chunks[i - 1], out.token_chunks[i]));
    }
  } else {
    r.ttft_ms = r.e2e_ms;  // an empty answer: the first (and only) response is the end
  }
  if (out.usage) {
    r.prompt_tokens = JsonInt(*out.usage, "prompt_tokens");
    r.completion_tokens = JsonInt(*out.usage, "completion_tokens");
    if (auto d = out.usage->find("prompt_tokens_details");
        d != out.usage->end() && d->is_object()) {
      r.cached_tokens = JsonInt(*d, "cached_tokens");
    }
  } else {
    r.completion_tokens = static_cast<int64_t>(out.token_chunks.size());
  }
  r.answer = std::move(out.content);
  return r;
}

// Sums the counters the report uses from one /metrics endpoint: epd_swa_replay_total by stage
// ("replay/<stage>"), the kvstore's epd_kv_put_bytes_total and epd_kv_puts_total by tier
// ("put_bytes/<tier>", "puts/<tier>").
std::optional<std::map<std::string, double>> ReadReplaysOne(const std::string& metrics_url,
                                                            double timeout_s, std::string* why) {
  auto url = ParseHttpUrl(metrics_url);
  if (!url.ok()) {
    *why = std::string(url.status().message());
    return std::nullopt;
  }
  httplib::Client cli(ClientAddress(*url));
  cli.set_connection_timeout(static_cast<time_t>(std::ceil(timeout_s)), 0);
  cli.set_read_timeout(static_cast<time_t>(std::ceil(timeout_s)), 0);
  auto res = cli.Get(url->path.empty() ? "/metrics" : url->path.c_str());
  if (!res) {
    *why = "cannot read " + metrics_url + ": " + httplib::to_string(res.error());
    return std::nullopt;
  }
  if (res->status != 200) {
    *why = absl::StrCat("GET ", metrics_url, " answered HTTP ", res->status);
    return std::nullopt;
  }
  auto samples = ParsePrometheusText(res->body);
  if (!samples.ok()) {
    *why = std::string(samples.status().message());
    return std::nullopt;
  }
  std::map<std::string, double> counters;
  auto label = [](const PromSample& s, const char* name) {
    auto it = s.labels.find(name);
    return it == s.labels.end() ? std::string() : it->second;
  };
  for (const auto& s : *samples) {
    if (s.name == "epd_swa_replay_total") {
      counters["replay/" + label(s, "stage")] += s.value;
    } else if (s.name == "epd_kv_put_bytes_total") {
      counters["put_bytes/" + label(s, "tier")] += s.value;
    } else if (s.name == "epd_kv_puts_total") {
      counters["puts/" + label(s, "tier")] += s.value;
    }
  }
  return counters;
}

// The same over a comma-separated list of endpoints (the encoder and prefill workers count the
// replays of their own stage), summed; nullopt when any cannot be read.
std::optional<std::map<std::string, double>> ReadReplays(const std::string& metrics_urls,
                                                         double timeout_s, std::string* why) {
  std::map<std::string, double> total;
  for (absl::string_view url : absl::StrSplit(metrics_urls, ',', absl::SkipWhitespace())) {
    auto one = ReadReplaysOne(std::string(absl::StripAsciiWhitespace(url)), timeout_s, why);
    if (!one) return std::nullopt;
    for (const auto& [stage, value] : *one) total[stage] += value;
  }
  return total;
}

json PercentilesJson(const Percentiles& p) {
  auto v = [](const std::optional<double>& x) { return x ? json(*x) : json(nullptr); };
  return {{"p50", v(p.p50)}, {"p90", v(p.p90)}, {"p99", v(p.p99)}, {"count", p.count}};
}

Percentiles Summarize(const std::vector<double>& values) {
  Percentiles p;
  p.count = values.size();
  p.p50 = Percentile(values, 0.50);
  p.p90 = Percentile(values, 0.90);
  p.p99 = Percentile(values, 0.99);
  return p;
}

std::string Fmt(const std::optional<double>& v, int precision = 1) {
  if (!v) return "n/a";
  std::ostringstream s;
  s << std::fixed << std::setprecision(precision) << *v;
  return s.str();
}

// The progress display: a bar redrawn in place on a TTY, a plain line every 5 s otherwise.
class Progress {
 public:
  Progress(std::ostream& out, bool tty, int64_t total)
      : out_(out), tty_(tty), total_(total), start_(SteadyClock::now()) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Progress() { Stop(); }
  void Count(bool error) {
    done_.fetch_add(1);
    if (error) errors_.fetch_add(1);
  }
  void Stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    Draw(/*final=*/true);
  }

 private:
  void Loop() {
    const auto period = tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(5000);
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, period, [this] { return stop_; })) {
      lock.unlock();
      Draw(false);
      lock.lock();
    }
  }
  void Draw(bool final) {
    const int64_t done = done_.load();
    const double elapsed = std::chrono::duration<double>(SteadyClock::now() - start_).count();
    std::ostringstream line;
    line << done << "/" << total_ << " requests, " << errors_.load() << " errors, " << std::fixed
         << std::setprecision(1) << elapsed << " s";
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : kWidth;
      out_ << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] "
           << line.str() << "\x1b[K";
      if (final) out_ << "\n";
    } else if (!final) {
      out_ << "epd bench: " << line.str() << "\n";
    }
    out_.flush();
  }

  std::ostream& out_;
  const bool tty_;
  const int64_t total_;
  const SteadyClock::time_point start_;
  std::atomic<int64_t> done_{0}, errors_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

absl::Status BenchOptions::Validate() const {
  if (sessions < 1 || sessions > 4096) {
    return absl::InvalidArgumentError("--sessions must be in [1, 4096]");
  }
  if (turns < 1 || turns > 100000)
    return absl::InvalidArgumentError("--turns must be in [1, 100000]");
  if (tool_tokens < 0 || tool_tokens > (1 << 22)) {
    return absl::InvalidArgumentError("--tool-tokens must be in [0, 4194304]");
  }
  if (max_tokens < 1 || max_tokens > (1 << 20)) {
    return absl::InvalidArgumentError("--max-tokens must be in [1, 1048576]");
  }
  if (!(duration_s > 0)) return absl::InvalidArgumentError("--duration-s must be > 0");
  if (!(timeout_s > 0)) return absl::InvalidArgumentError("--timeout-s must be > 0");
  if (model.empty()) return absl::InvalidArgumentError("--model must not be empty");
  if (block_tokens < 1) return absl::InvalidArgumentError("--block-tokens must be >= 1");
  if (auto u = ParseHttpUrl(url); !u.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--url: ", u.status().message()));
  }
  for (absl::string_view m : absl::StrSplit(metrics_url, ',', absl::SkipWhitespace())) {
    if (auto u = ParseHttpUrl(std::string(absl::StripAsciiWhitespace(m))); !u.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics-url: ", u.status().message()));
    }
  }
  return absl::OkStatus();
}

void AddBenchFlags(CLI::App& app, BenchOptions* o) {
  app.add_option("--url", o->url, "Base URL of the OpenAI-compatible endpoint")
      ->capture_default_str();
  app.add_option("--model", o->model, "Model name sent in each request")->capture_default_str();
  app.add_option("--api-key", o->api_key, "Bearer token (default: $EPD_API_KEY)")
      ->envname("EPD_API_KEY");
  app.add_option("--sessions", o->sessions, "Concurrent agent sessions")->capture_default_str();
  app.add_option("--turns", o->turns, "Turns per session")->capture_default_str();
  app.add_option("--tool-tokens", o->tool_tokens,
                 "Approximate tokens of synthetic tool output added per turn (4 chars/token)")
      ->capture_default_str();
  app.add_option("--max-tokens", o->max_tokens, "max_tokens of each request")
      ->capture_default_str();
  app.add_option("--seed", o->seed, "Seed of the synthetic tool outputs")->capture_default_str();
  app.add_option("--duration-s", o->duration_s,
                 "Stop starting turns after this many seconds; streams still running then are "
                 "abandoned and counted as incomplete")
      ->capture_default_str();
  app.add_option("--timeout-s", o->timeout_s, "Connect/read timeout of one request")
      ->capture_default_str();
  app.add_option("--metrics-url", o->metrics_url,
                 "/metrics URLs (comma-separated: router, encoder and prefill workers, kvstores) "
                 "whose epd_swa_replay_total is summed by stage and epd_kv_put_bytes_total by "
                 "tier (persisted bytes)");
  app.add_option("--model-config", o->model_config,
                 "The served model's config.json, for the V4-style persisted-bytes figure");
  app.add_option("--block-tokens", o->block_tokens, "Tokens per kvstore block")
      ->capture_default_str();
  app.add_option("--json", o->json_path, "Write the results as JSON to this file");
  app.add_option("--system-prompt", o->system_prompt, "System message of every session");
}

double V4StyleBytesPerBlock(const model::ModelConfig& c, int block_tokens) {
  const model::KvLayout k = model::ComputeKvLayout(c);
  double per_token = 0;
  for (int l = 0; l < c.n_layers && l < static_cast<int>(c.compress_ratios.size()); ++l) {
    const int ratio = c.compress_ratios[l];
    if (ratio <= 0) continue;
    double entry = static_cast<double>(k.main_entry_bytes);
    if (std::find(c.index_source_layers.begin(), c.index_source_layers.end(), l) !=
        c.index_source_layers.end()) {
      entry += static_cast<double>(k.index_key_bytes);
    }
    per_token += entry / ratio;
  }
  return per_token * block_tokens +
         static_cast<double>(c.n_layers) * static_cast<double>(k.swa_bytes_per_layer);
}

std::optional<double> Percentile(std::vector<double> values, double q) {
  if (values.empty()) return std::nullopt;
  std::sort(values.begin(), values.end());
  q = std::clamp(q, 0.0, 1.0);
  const double rank = std::ceil(q * static_cast<double>(values.size()));
  const size_t idx = rank < 1 ? 0 : std::min(values.size() - 1, static_cast<size_t>(rank) - 1);
  return values[idx];
}

std::string SyntheticToolOutput(uint64_t seed, int session, int turn, int tokens) {
  Rng rng(seed * 0x100000001b3ull ^ (static_cast<uint64_t>(session) << 32) ^
          static_cast<uint64_t>(turn));
  const size_t want = static_cast<size_t>(std::max(tokens, 0)) * kCharsPerToken;
  std::string out;
  const int kind = turn % 3;
  switch (kind) {
    case 0:
      absl::StrAppend(&out, "[tool: bash] $ make -j8 && ctest\n");
      break;
    case 1:
      absl::StrAppend(&out, "[tool: read_file] ", rng.Pick(kDirs), "/", rng.Pick(kWords),
                      rng.Pick(kExts), "\n");
      break;
    default:
      absl::StrAppend(&out, "[tool: fetch] https://docs.example.org/", rng.Pick(kWords), "\n");
  }
  while (out.size() < want) {
    if (kind == 0) AppendTerminal(rng, out);
    if (kind == 1) AppendFile(rng, out);
    if (kind == 2) AppendWeb(rng, out);
  }
  out.resize(want);
  return out;
}

absl::StatusOr<ParsedUrl> ParseHttpUrl(const std::string& url) {
  std::string rest = url;
  ParsedUrl p;
  if (rest.rfind("https://", 0) == 0) {
    p.scheme = "https";
    p.port = 443;
    rest.erase(0, 8);
  } else if (rest.rfind("http://", 0) == 0) {
    rest.erase(0, 7);
  } else if (rest.find("://") != std::string::npos) {
    return absl::InvalidArgumentError("'" + url +
                                      "': only http:// and https:// URLs are supported");
  }
  const size_t slash = rest.find('/');
  std::string hostport = rest.substr(0, slash);
  if (slash != std::string::npos) p.path = rest.substr(slash);
  while (!p.path.empty() && p.path.back() == '/') p.path.pop_back();
  const size_t colon = hostport.rfind(':');
  if (colon != std::string::npos && hostport.find(']') == std::string::npos) {
    int port = 0;
    if (!absl::SimpleAtoi(hostport.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError("'" + url + "': bad port");
    }
    p.port = port;
    hostport.resize(colon);
  }
  if (hostport.empty()) return absl::InvalidArgumentError("'" + url + "': no host");
  p.host = hostport;
  return p;
}

absl::StatusOr<std::vector<PromSample>> ParsePrometheusText(const std::string& text) {
  std::vector<PromSample> out;
  std::istringstream in(text);
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    auto bad = [&](const char* why) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics line ", line_no, ": ", why, ": ", line.substr(0, 120)));
    };
    PromSample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    if (s.name.empty()) return bad("no metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (true) {
        while (i < line.size() && (line[i] == ' ' || line[i] == ',')) ++i;
        if (i >= line.size()) return bad("unterminated label set");
        if (line[i] == '}') {
          ++i;
          break;
        }
        const size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          return bad("label without =\"value\"");
        }
        std::string key = line.substr(i, eq - i);
        std::string value;
        i = eq + 2;
        bool closed = false;
        while (i < line.size()) {
          const char c = line[i++];
          if (c == '\\' && i < line.size()) {
            const char e = line[i++];
            value.push_back(e == 'n' ? '\n' : e);
          } else if (c == '"') {
            closed = true;
            break;
          } else {
            value.push_back(c);
          }
        }
        if (!closed) return bad("unterminated label value");
        s.labels[std::move(key)] = std::move(value);
      }
    }
    while (i < line.size() && line[i] == ' ') ++i;
    const size_t end = line.find(' ', i);
    const std::string v = line.substr(i, end == std::string::npos ? std::string::npos : end - i);
    if (v == "+Inf") {
      s.value = HUGE_VAL;
    } else if (v == "-Inf") {
      s.value = -HUGE_VAL;
    } else if (v == "NaN") {
      s.value = NAN;
    } else if (!absl::SimpleAtod(v, &s.value)) {
      return bad("bad sample value");
    }
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<BenchResults> RunBench(const BenchOptions& o, std::ostream& progress_out,
                                      bool progress_is_tty) {
  if (auto s = o.Validate(); !s.ok()) return s;
  auto url = ParseHttpUrl(o.url);
  if (!url.ok()) return url.status();
  std::string path = url->path;
  if (path.size() < 3 || path.compare(path.size() - 3, 3, "/v1") != 0) path += "/v1";
  path += "/chat/completions";

  BenchResults results;
  std::optional<std::map<std::string, double>> replays_before;
  std::string metrics_why;
  if (!o.metrics_url.empty())
    replays_before = ReadReplays(o.metrics_url, o.timeout_s, &metrics_why);

  const auto start = SteadyClock::now();
  const auto soft_deadline = start + std::chrono::duration_cast<SteadyClock::duration>(
                                         std::chrono::duration<double>(o.duration_s));
  // Streams still running a little after the soft deadline are abandoned so the run ends.
  const auto hard_deadline = soft_deadline + std::chrono::seconds(1) +
                             std::chrono::duration_cast<SteadyClock::duration>(
                                 std::chrono::duration<double>(o.duration_s * 0.1));

  std::mutex mu;
  std::vector<RequestRecord> records;
  records.reserve(static_cast<size_t>(o.sessions) * static_cast<size_t>(o.turns));
  Progress progress(progress_out, progress_is_tty, static_cast<int64_t>(o.sessions) * o.turns);
  std::vector<std::thread> threads;
  threads.reserve(o.sessions);
  for (int session = 0; session < o.sessions; ++session) {
    threads.emplace_back([&, session] {
      httplib::Client cli(ClientAddress(*url));
      const time_t t = static_cast<time_t>(std::ceil(o.timeout_s));
      cli.set_connection_timeout(t, 0);
      cli.set_read_timeout(t, 0);
      cli.set_write_timeout(t, 0);
      cli.set_keep_alive(true);
      json messages = json::array();
      messages.push_back({{"role", "system"}, {"content", o.system_prompt}});
      messages.push_back(
          {{"role", "user"},
           {"content", absl::StrCat("Session ", session,
                                    ": the test suite fails after the last change. Find the "
                                    "cause and fix it; I will paste each tool's output.")}});
      for (int turn = 0; turn < o.turns && SteadyClock::now() < soft_deadline; ++turn) {
        // Turn 0 carries the task plus the first tool output in one user message.
        std::string tool = SyntheticToolOutput(o.seed, session, turn, o.tool_tokens);
        if (turn == 0) {
          messages.back()["content"] =
              messages.back()["content"].get<std::string>() + "\n\n" + tool;
        } else {
          messages.push_back({{"role", "user"}, {"content", std::move(tool)}});
        }
        RequestRecord r = SendTurn(cli, o, path, messages, hard_deadline);
        if (r.ok) messages.push_back({{"role", "assistant"}, {"content", r.answer}});
        progress.Count(!r.ok && !r.incomplete);
        std::lock_guard<std::mutex> lock(mu);
        records.push_back(std::move(r));
      }
    });
  }
  for (auto& th : threads) th.join();
  progress.Stop();
  const auto end = SteadyClock::now();
  results.wall_s = std::chrono::duration<double>(end - start).count();

  std::vector<double> ttft, itl, e2e;
  for (const auto& r : records) {
    ++results.requests;
    if (r.incomplete) {
      ++results.incomplete;
      continue;
    }
    if (!r.ok) {
      ++results.errors;
      if (results.error_samples.size() < kErrorSamples) results.error_samples.push_back(r.error);
      continue;
    }
    ++results.ok;
    ttft.push_back(r.ttft_ms);
    e2e.push_back(r.e2e_ms);
    itl.insert(itl.end(), r.itl_ms.begin(), r.itl_ms.end());
    results.prompt_tokens += r.prompt_tokens;
    results.cached_tokens += r.cached_tokens;
    results.completion_tokens += r.completion_tokens;
  }
  results.ttft_ms = Summarize(ttft);
  results.itl_ms = Summarize(itl);
  results.e2e_ms = Summarize(e2e);
  if (results.wall_s > 0) {
    results.output_tokens_per_s = static_cast<double>(results.completion_tokens) / results.wall_s;
    results.requests_per_s = static_cast<double>(results.ok) / results.wall_s;
  }
  if (results.prompt_tokens > 0) {
    results.cached_token_ratio =
        static_cast<double>(results.cached_tokens) / static_cast<double>(results.prompt_tokens);
  }
  if (!o.metrics_url.empty()) {
    auto after = ReadReplays(o.metrics_url, o.timeout_s, &metrics_why);
    if (after) {
      results.metrics_read = true;
      auto delta = [&](const std::string& key) -> std::optional<double> {
        auto it = after->find(key);
        if (it == after->end()) return std::nullopt;
        double before = 0;
        if (replays_before) {
          auto b = replays_before->find(key);
          if (b != replays_before->end()) before = b->second;
        }
        return it->second - before;
      };
      for (const auto& [key, value] : *after) {
        if (key.rfind("replay/", 0) == 0) results.swa_replays[key.substr(7)] = *delta(key);
      }
      results.persisted_g3_bytes = delta("put_bytes/g3");
      results.persisted_g2_bytes = delta("put_bytes/g2");
      results.persisted_g3_blocks = delta("puts/g3");
      if (results.persisted_g3_bytes && results.persisted_g2_bytes && results.prompt_tokens > 0) {
        const double tokens = static_cast<double>(results.prompt_tokens);
        results.persisted_bytes_per_token =
            (*results.persisted_g3_bytes + *results.persisted_g2_bytes) / tokens;
        if (!o.model_config.empty() && results.persisted_g3_blocks) {
          auto config = model::LoadModelConfig(o.model_config);
          if (config.ok()) {
            results.v4_bytes_per_token = *results.persisted_g3_blocks *
                                         V4StyleBytesPerBlock(*config, o.block_tokens) / tokens;
            if (*results.v4_bytes_per_token > 0) {
              results.persisted_vs_v4 =
                  *results.persisted_bytes_per_token / *results.v4_bytes_per_token;
            }
          } else {
            progress_out << "epd bench: --model-config: " << config.status().message() << "\n";
          }
        }
      }
    } else {
      progress_out << "epd bench: replay counts unavailable: " << metrics_why << "\n";
    }
  }
  return results;
}

std::string FormatBenchResults(const BenchOptions& o, const BenchResults& r) {
  std::ostringstream s;
  s << std::fixed;
  s << "epd bench: " << o.sessions << " sessions x " << o.turns << " turns, ~" << o.tool_tokens
    << " tool tokens/turn, max_tokens " << o.max_tokens << ", " << o.url << "\n";
  s << "  requests        " << r.requests << " (" << r.ok << " ok, " << r.errors << " errors, "
    << r.incomplete << " incomplete) in " << std::setprecision(2) << r.wall_s << " s\n";
  auto row = [&](const char* name, const Percentiles& p) {
    s << "  " << name << "p50 " << Fmt(p.p50) << "  p90 " << Fmt(p.p90) << "  p99 " << Fmt(p.p99)
      << "  (" << p.count << " samples)\n";
  };
  row("TTFT ms         ", r.ttft_ms);
  row("ITL ms          ", r.itl_ms);
  row("end-to-end ms   ", r.e2e_ms);
  s << "  output tokens/s " << std::setprecision(1) << r.output_tokens_per_s << "\n";
  s << "  requests/s      " << std::setprecision(2) << r.requests_per_s << "\n";
  s << "  tokens          prompt " << r.prompt_tokens << ", cached " << r.cached_tokens
    << ", completion " << r.completion_tokens << "\n";
  s << "  cached ratio    " << Fmt(r.cached_token_ratio, 3) << "\n";
  auto replay = [&](const char* stage) {
    auto it = r.swa_replays.find(stage);
    return it == r.swa_replays.end() ? std::string("n/a") : Fmt(it->second, 0);
  };
  s << "  SWA replays     encoder " << replay("encoder") << ", decoder " << replay("decoder")
    << "  (epd_swa_replay_total during the run)\n";
  s << "  persisted       " << Fmt(r.persisted_bytes_per_token, 1) << " B/prompt token (G3 "
    << Fmt(r.persisted_g3_bytes, 0) << " B in " << Fmt(r.persisted_g3_blocks, 0) << " blocks + G2 "
    << Fmt(r.persisted_g2_bytes, 0) << " B, from the kvstore's /metrics)\n";
  s << "  V4-style policy " << Fmt(r.v4_bytes_per_token, 1)
    << " B/prompt token (same blocks, every layer's SWA per block, no CED); ours / V4-style "
    << Fmt(r.persisted_vs_v4, 3) << "\n";
  for (const auto& e : r.error_samples) s << "  error: " << e << "\n";
  return s.str();
}

json BenchResultsJson(const BenchOptions& o, const BenchResults& r) {
  auto opt = [](const std::optional<double>& x) { return x ? json(*x) : json(nullptr); };
  json replays = json::object();
  for (const char* stage : {"encoder", "decoder"}) {
    auto it = r.swa_replays.find(stage);
    replays[stage] = it == r.swa_replays.end() ? json(nullptr) : json(it->second);
  }
  return {{"config",
           {{"url", o.url},
            {"model", o.model},
            {"sessions", o.sessions},
            {"turns", o.turns},
            {"tool_tokens", o.tool_tokens},
            {"max_tokens", o.max_tokens},
            {"seed", o.seed},
            {"model_config", o.model_config},
            {"block_tokens", o.block_tokens},
            {"duration_s", o.duration_s}}},
          {"requests", r.requests},
          {"ok", r.ok},
          {"errors", r.errors},
          {"incomplete", r.incomplete},
          {"wall_s", r.wall_s},
          {"ttft_ms", PercentilesJson(r.ttft_ms)},
          {"itl_ms", PercentilesJson(r.itl_ms)},
          {"e2e_ms", PercentilesJson(r.e2e_ms)},
          {"prompt_tokens", r.prompt_tokens},
          {"cached_tokens", r.cached_tokens},
          {"completion_tokens", r.completion_tokens},
          {"output_tokens_per_s", r.output_tokens_per_s},
          {"requests_per_s", r.requests_per_s},
          {"cached_token_ratio", opt(r.cached_token_ratio)},
          {"swa_replays", replays},
          {"persisted",
           {{"g3_bytes", opt(r.persisted_g3_bytes)},
            {"g2_bytes", opt(r.persisted_g2_bytes)},
            {"g3_blocks", opt(r.persisted_g3_blocks)},
            {"bytes_per_prompt_token", opt(r.persisted_bytes_per_token)},
            {"v4_style_bytes_per_prompt_token", opt(r.v4_bytes_per_token)},
            {"ours_vs_v4_style", opt(r.persisted_vs_v4)}}},
          {"error_samples", r.error_samples}};
}

int RunBenchCommand(const BenchOptions& o) {
  if (auto s = o.Validate(); !s.ok()) {
    std::cerr << "epd bench: " << s.message() << "\n";
    return 2;
  }
  // Probe the endpoint once so a wrong URL, key or model name is one clear line, not N errors.
  auto url = ParseHttpUrl(o.url);
  std::string models_path = url->path;
  if (models_path.size() < 3 || models_path.compare(models_path.size() - 3, 3, "/v1") != 0) {
    models_path += "/v1";
  }
  models_path += "/models";
  {
    httplib::Client cli(ClientAddress(*url));
    cli.set_connection_timeout(static_cast<time_t>(std::ceil(std::min(o.timeout_s, 10.0))), 0);
    cli.set_read_timeout(static_cast<time_t>(std::ceil(std::min(o.timeout_s, 10.0))), 0);
    auto res = cli.Get(models_path.c_str(), AuthHeaders(o));
    if (!res) {
      std::cerr << "epd bench: cannot reach " << o.url << ": " << httplib::to_string(res.error())
                << "\n";
      return 2;
    }
    if (res->status == 401) {
      std::cerr << "epd bench: " << o.url << " refused the API key (HTTP 401); pass --api-key or "
                << "set EPD_API_KEY\n";
      return 2;
    }
    if (res->status == 200) {
      json models = json::parse(res->body, nullptr, false);
      if (models.is_object() && models.contains("data") && models["data"].is_array()) {
        std::vector<std::string> ids;
        for (const auto& m : models["data"]) {
          if (m.is_object() && m.contains("id") && m["id"].is_string()) ids.push_back(m["id"]);
        }
        if (!ids.empty() && std::find(ids.begin(), ids.end(), o.model) == ids.end()) {
          std::cerr << "epd bench: " << o.url << " does not serve model '" << o.model
                    << "'; it serves:";
          for (const auto& id : ids) std::cerr << " " << id;
          std::cerr << " (pass --model)\n";
          return 2;
        }
      }
    }
  }
  auto results = RunBench(o, std::cerr, isatty(STDERR_FILENO) == 1);
  if (!results.ok()) {
    std::cerr << "epd bench: " << results.status().message() << "\n";
    return 2;
  }
  std::cout << FormatBenchResults(o, *results);
  int rc = results->errors > 0 ? 1 : 0;
  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    f << BenchResultsJson(o, *results).dump(2) << "\n";
    f.close();
    if (!f) {
      std::cerr << "epd bench: cannot write " << o.json_path << "\n";
      rc = 1;
    }
  }
  return rc;
}

}  // namespace epd::services
