#pragma once

// The OpenAI-compatible HTTP front end: POST /v1/chat/completions and /v1/completions (SSE
// streaming and not), GET /v1/models, /health (readiness: 503 without a decode worker) and
// /metrics. Errors use the OpenAI shape {"error":{"message","type","param","code"}}.
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"
#include "services/router/admission.h"
#include "services/router/router_core.h"
#include "runtime/listen_thread.h"

namespace httplib {
class Server;
}

namespace epd::services::router {

struct HttpOptions {
  std::string api_key;  // Default: none. When set, /v1/* requires "Authorization: Bearer <key>"
  int threads = 512;    // Default: 512 connection threads (each running stream holds one)
  AdmissionQueue* admission = nullptr;  // Default: none (unbounded). Not owned; outlives server
  std::string tls_cert_file;  // Default: none (plain HTTP). With tls_key_file: HTTPS (PEM files)
  std::string tls_key_file;
};

// The /health body shared by HTTP and gRPC: pools, fingerprint, recent registration refusals.
// Sets *serving when a decode worker of the served model is live.
std::string RouterHealthJson(RouterCore& core, bool* serving);

// OpenAI request JSON to a GenerateSpec; ApiError (400) naming the offending param. `chat`
// selects /v1/chat/completions vs /v1/completions. *stream and *include_usage are outputs.
absl::StatusOr<GenerateSpec> ParseOpenAiRequest(const nlohmann::json& body, bool chat,
                                                bool* stream, bool* include_usage);

// The constraint (SamplingParams.constraint, grammar/grammar.h) for a forced tool
// call: `tools` is the OpenAI tools array; `only` names the one function allowed ("" = any, the
// tool_choice "required" case); `parallel` allows several calls. ApiError naming `param`.
absl::StatusOr<std::string> ToolCallConstraint(const nlohmann::json& tools, const std::string& only,
                                               bool parallel, const std::string& param);

// Thread-safe: Start/Stop from one thread; requests are served on the server's pool.
class OpenAiHttpServer {
 public:
  OpenAiHttpServer(RouterCore& core, std::shared_ptr<prometheus::Registry> metrics,
                   HttpOptions options);
  ~OpenAiHttpServer();
  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  // Binds host:port (0 = any) and serves on a background thread; returns the bound port.
  absl::StatusOr<int> Start(const std::string& host, int port);
  // Stops accepting and closes connections; running streams end when their writes fail.
  void Stop();

 private:
  void Routes();

  RouterCore& core_;
  std::shared_ptr<prometheus::Registry> metrics_;
  HttpOptions options_;
  std::unique_ptr<httplib::Server> server_;
  runtime::ListenThread listener_;
};

}  // namespace epd::services::router
