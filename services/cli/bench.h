#pragma once

// `epd bench`: a multi-turn agent workload against any OpenAI-compatible endpoint.
//
// N sessions run concurrently, one thread each. Every turn resends the whole conversation so far
// plus a new user message carrying a synthetic tool output (terminal log, source file or web
// page text, deterministic for a given --seed), streams the answer over SSE and records the
// client-side time to first token and the gaps between token-carrying chunks. At the end it
// prints the figures (and writes them with --json), including the prefix-cache ratio from
// `usage.prompt_tokens_details.cached_tokens` and the SWA replay counts from the router's
// /metrics. Every loop is bounded by --turns and by --duration-s. docs/bench.md has the details.
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/config.h"

namespace CLI {
class App;
}

namespace epd::services {

struct BenchOptions {
  std::string url = "http://127.0.0.1:8000";  // Default: `epd serve`'s endpoint
  std::string model = "epd-nano";             // Default: the demo model's served name
  std::string api_key;                        // Default: $EPD_API_KEY, else none
  int sessions = 4;                           // Default: 4 concurrent agent sessions
  int turns = 4;                              // Default: 4 turns per session
  int tool_tokens = 1024;   // Default: ~1024 tokens of tool output per turn (4 chars/token)
  int max_tokens = 64;      // Default: 64 generated tokens per turn
  uint64_t seed = 1;        // Default: 1 (same seed, same prompts)
  double duration_s = 600;  // Default: 10 minutes; no new turn starts after it
  double timeout_s = 300;   // Default: 300 s per request (connect + read)
  std::string metrics_url;  // Default: none (replay counts print "n/a"); comma-separated list
  // The served model's config.json: with a kvstore's /metrics in metrics_url, the persisted bytes
  // per prompt token are set against a V4-style policy on the same blocks. Default: none (n/a)
  std::string model_config;
  int block_tokens = 64;  // Default: 64 (the kvstore block of epd serve's workers)
  std::string json_path;  // Default: none (no JSON file)
  std::string system_prompt =
      "You are a coding agent. Read the tool output and decide the next "
      "step.";  // Default: a short agent instruction

  [[nodiscard]] absl::Status Validate() const;
};

void AddBenchFlags(CLI::App& app, BenchOptions* options);

// p50/p90/p99 of one latency series, in milliseconds (nullopt: no sample).
struct Percentiles {
  std::optional<double> p50, p90, p99;
  size_t count = 0;
};

struct BenchResults {
  int64_t requests = 0;    // requests sent (ok + errors + incomplete)
  int64_t ok = 0;          // streams that ended with [DONE] and no error event
  int64_t errors = 0;      // HTTP errors, connection failures, SSE error events, missing [DONE]
  int64_t incomplete = 0;  // streams abandoned at --duration-s (not counted as errors)
  double wall_s = 0;
  Percentiles ttft_ms, itl_ms, e2e_ms;
  int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
  double output_tokens_per_s = 0;
  double requests_per_s = 0;
  std::optional<double> cached_token_ratio;  // cached / prompt; nullopt when prompt == 0
  // epd_swa_replay_total increase during the run by stage ("encoder", "decoder"); a stage is
  // absent when --metrics-url was not given, could not be read, or has no such series.
  std::map<std::string, double> swa_replays;
  bool metrics_read = false;
  // Increase of the kvstores' epd_kv_put_bytes_total{tier="g3"|"g2"} and
  // epd_kv_puts_total{tier="g3"} (blocks) during the run; nullopt without a kvstore in
  // --metrics-url.
  std::optional<double> persisted_g3_bytes, persisted_g2_bytes, persisted_g3_blocks;
  std::optional<double> persisted_bytes_per_token;  // (G3 + G2) / prompt tokens
  // A V4-style policy on the same stored blocks (V4StyleBytesPerBlock) / prompt tokens, and
  // ours / that; nullopt without --model-config or persisted figures.
  std::optional<double> v4_bytes_per_token, persisted_vs_v4;
  std::vector<std::string> error_samples;  // the first few error messages, for the report
};

// Runs the workload. Progress goes to `progress` (a bar when `progress_is_tty`, else a line every
// few seconds). Returns an error only for a bad configuration; request failures are counted.
absl::StatusOr<BenchResults> RunBench(const BenchOptions& options, std::ostream& progress,
                                      bool progress_is_tty);

// The human-readable summary and the --json document.
std::string FormatBenchResults(const BenchOptions& options, const BenchResults& results);
nlohmann::json BenchResultsJson(const BenchOptions& options, const BenchResults& results);

// `epd bench` end to end: validate, run, print, write --json. Returns the exit code: 0 when
// every request succeeded, 1 when some failed or the JSON file could not be written, 2 for bad
// flags or an unreachable endpoint.
int RunBenchCommand(const BenchOptions& options);

// ---- Pieces exposed for tests ----

// Nearest-rank percentile of `values` (q in [0, 1]); nullopt when empty.
std::optional<double> Percentile(std::vector<double> values, double q);

// Bytes a V4-style persistence policy writes per stored block of `block_tokens` tokens: every
// main layer keeps its own compressed KV (no CED: no layer reads another's; entry bytes / ratio
// per token for each layer with a compress ratio, plus index-key bytes / ratio for the index
// sources) for the block's tokens, and every main layer's SWA window (window x slot bytes) is
// persisted at the block's end.
double V4StyleBytesPerBlock(const model::ModelConfig& config, int block_tokens);

// Deterministic synthetic tool output of about `tokens` tokens (4 ASCII characters each): the
// kind (terminal, file, web page) rotates with `turn`; the text depends only on the arguments.
std::string SyntheticToolOutput(uint64_t seed, int session, int turn, int tokens);

// scheme://host[:port][/prefix] split into its parts (http or https; no scheme means http).
struct ParsedUrl {
  std::string scheme = "http";
  std::string host;
  int port = 80;     // 443 for https unless given
  std::string path;  // without a trailing '/', may be empty
};
absl::StatusOr<ParsedUrl> ParseHttpUrl(const std::string& url);

// One sample of the Prometheus text exposition format.
struct PromSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};
// Parses the sample lines (comments skipped); a malformed line is an error naming it.
absl::StatusOr<std::vector<PromSample>> ParsePrometheusText(const std::string& text);

}  // namespace epd::services
