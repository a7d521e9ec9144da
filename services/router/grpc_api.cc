#include "services/router/grpc_api.h"

#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "common/cluster_secret.h"
#include "epd/v1/inference.grpc.pb.h"
#include "epd/v1/worker.grpc.pb.h"
#include "services/router/openai_http.h"
#include "services/router/request_validator.h"
#include "services/router/utf8.h"
#include "runtime/grpc_auth.h"

namespace epd::services::router {
namespace {

// The OpenAI param and code travel as the trailing metadata epd-error-param / epd-error-code (and
// in the message), so a gRPC client sees the same error as an HTTP one.
grpc::Status ToGrpc(const absl::Status& s, grpc::ServerContext* ctx = nullptr) {
  if (ctx != nullptr) {
    if (const std::string p = ErrorParam(s); !p.empty())
      ctx->AddTrailingMetadata("epd-error-param", p);
    if (const std::string c = ErrorCode(s); !c.empty())
      ctx->AddTrailingMetadata("epd-error-code", c);
  }
  std::string msg(s.message());
  if (const std::string p = ErrorParam(s); !p.empty()) msg = absl::StrCat(msg, " (param: ", p, ")");
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), msg);
}

std::optional<PoolKind> FromProto(epd::v1::Pool p) {
  switch (p) {
    case epd::v1::POOL_ENCODER:
      return PoolKind::kEncoder;
    case epd::v1::POOL_PREFILL:
      return PoolKind::kPrefill;
    case epd::v1::POOL_DECODE:
      return PoolKind::kDecode;
    default:
      return std::nullopt;
  }
}

WorkerLoad LoadFromProto(const epd::v1::LoadFigures& l) {
  return WorkerLoad{l.queue_depth(), l.free_kv_blocks(), l.batch_size(), l.running_requests()};
}

absl::StatusOr<GenerateSpec> SpecFromProto(const epd::v1::GenerateRequest& req) {
  GenerateSpec spec;
  spec.model = req.model();
  spec.sampling = req.sampling();
  if (spec.sampling.top_p() == 0) spec.sampling.set_top_p(1);
  if (spec.sampling.repetition_penalty() == 0) spec.sampling.set_repetition_penalty(1);
  if (spec.sampling.top_k() == -1) spec.sampling.set_top_k(0);  // -1 = off, as over HTTP
  // Value ranges, limits, model, roles and the context length are checked by ValidateSpec /
  // ValidateLength in RouterCore::Prepare, the validation the HTTP front end shares.
  switch (req.input_case()) {
    case epd::v1::GenerateRequest::kPrompt:
      spec.prompt_text = req.prompt();
      break;
    case epd::v1::GenerateRequest::kPromptIds:
      spec.prompt_ids.emplace(req.prompt_ids().ids().begin(), req.prompt_ids().ids().end());
      break;
    case epd::v1::GenerateRequest::kChat: {
      const auto& c = req.chat();
      ChatRenderInput chat;
      chat.thinking = c.thinking();
      chat.reasoning_effort = c.reasoning_effort();
      if (auto s = ValidateToolChoice(c.tool_choice()); !s.ok()) return s;
      if (!c.tools_json().empty() && c.tool_choice() != "none") {
        auto tools = nlohmann::json::parse(c.tools_json(), nullptr, false);
        if (!tools.is_array()) {
          return ApiError(absl::StatusCode::kInvalidArgument, "tools_json must be a JSON array",
                          "tools_json", "invalid_value");
        }
        chat.tools_json = c.tools_json();
        spec.parse_tools = !tools.empty();
        if (c.tool_choice() == "required") {  // forced by the decode worker's grammar mask
          auto constraint = ToolCallConstraint(tools, "", /*parallel=*/true, "tool_choice");
          if (!constraint.ok()) return constraint.status();
          spec.sampling.set_constraint(*constraint);
          spec.constraint_param = "tools_json";
        }
      }
      for (int i = 0; i < c.messages_size(); ++i) {
        const auto& m = c.messages(i);
        ChatMessage msg{m.role(), m.content(), m.reasoning_content(), {}, m.tool_call_id(), ""};
        if (!m.tool_calls_json().empty()) {
          auto calls = nlohmann::json::parse(m.tool_calls_json(), nullptr, false);
          if (!calls.is_array()) {
            return ApiError(absl::StatusCode::kInvalidArgument,
                            absl::StrCat("messages[", i, "].tool_calls_json must be a JSON array"),
                            absl::StrCat("messages[", i, "].tool_calls_json"), "invalid_value");
          }
          for (const auto& tc : calls) {
            if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object()) continue;
            const auto& f = tc["function"];
            const auto str = [](const nlohmann::json& o, const char* k) {
              return o.contains(k) && o[k].is_string() ? o[k].get<std::string>() : std::string();
            };
            ToolCall call{str(tc, "id"), str(f, "name"), "{}"};
            if (f.contains("arguments")) {
              call.arguments_json =
                  f["arguments"].is_string() ? f["arguments"].get<std::string>() : f["arguments"].dump();
            }
            msg.tool_calls.push_back(std::move(call));
          }
        }
        chat.messages.push_back(std::move(msg));
      }
      spec.chat = std::move(chat);
      break;
    }
    default:
      return ApiError(absl::StatusCode::kInvalidArgument,
                      "one of prompt, prompt_ids or chat is required", "input",
                      "missing_required_parameter");
  }
  return spec;
}

class InferenceImpl final : public epd::v1::Inference::Service {
 public:
  InferenceImpl(RouterCore& core, std::string api_key, AdmissionQueue* admission)
      : core_(core), api_key_(std::move(api_key)), admission_(admission) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const epd::v1::GenerateRequest* req,
                        grpc::ServerWriter<epd::v1::GenerateResponse>* writer) override {
    if (auto s = Authorize(ctx); !s.ok()) return s;
    auto spec = SpecFromProto(*req);
    if (!spec.ok()) return Reject(ctx, spec.status());
    // The router owns request identity: the internal id is always its own (unique, unguessable);
    // the client's request_id is only a label echoed in the responses, so two requests with
    // the same one do not share hand-offs, cancels or output (docs/security.md).
    spec->request_id = NewId();
    const std::string label = req->request_id().empty() ? spec->request_id : req->request_id();
    auto prepared = core_.Prepare(std::move(*spec));
    if (!prepared.ok()) return Reject(ctx, prepared.status());
    std::optional<AdmissionQueue::Ticket> ticket;
    if (admission_) {
      auto admitted = admission_->Admit("grpc");
      if (!admitted.ok()) {
        ctx->AddTrailingMetadata("retry-after",
                                 std::to_string(admission_->options().retry_after_s));
        return Reject(ctx, admitted.status());
      }
      ticket.emplace(std::move(*admitted));
    }

    class Writer final : public StreamObserver {
     public:
      Writer(grpc::ServerContext* ctx, grpc::ServerWriter<epd::v1::GenerateResponse>* w,
             std::string id)
          : ctx_(ctx), w_(w), id_(std::move(id)) {}
      bool OnDelta(const Delta& d) override {
        if (ctx_->IsCancelled()) return false;
        epd::v1::GenerateResponse r;
        r.set_request_id(id_);
        r.set_index(d.index);
        r.mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.end());
        r.set_text(d.content);
        r.set_reasoning_text(d.reasoning);
        for (const TokenLogprobs& t : d.logprobs) {  // chosen, then the asked top entries
          auto* c = r.add_top_logprobs();
          c->set_token_id(t.token);
          c->set_logprob(t.logprob);
          for (const auto& [id, lp] : t.top) {
            auto* e = r.add_top_logprobs();
            e->set_token_id(id);
            e->set_logprob(lp);
          }
        }
        return w_->Write(r);
      }

     private:
      grpc::ServerContext* ctx_;
      grpc::ServerWriter<epd::v1::GenerateResponse>* w_;
      std::string id_;
    } observer(ctx, writer, label);

    auto out = core_.Run(*prepared, &observer);
    if (!out.ok()) return ToGrpc(out.status(), ctx);
    // One closing message per choice (index order); the last one carries the usage.
    for (size_t i = 0; i < out->choices.size(); ++i) {
      const Choice& ch = out->choices[i];
      epd::v1::GenerateResponse last;
      last.set_request_id(label);
      last.set_index(static_cast<int32_t>(i));
      last.set_finish_reason(ch.finish_reason);
      if (i + 1 == out->choices.size()) {
        auto* u = last.mutable_usage();
        u->set_prompt_tokens(out->prompt_tokens);
        u->set_cached_tokens(out->cached_tokens);
        u->set_completion_tokens(out->completion_tokens);
        u->set_total_tokens(out->prompt_tokens + out->completion_tokens);
        u->set_reasoning_tokens(out->reasoning_tokens);
      }
      if (!ch.parsed.tool_calls.empty()) {
        nlohmann::json arr = nlohmann::json::array();
        for (const auto& c : ch.parsed.tool_calls) {
          arr.push_back({{"id", c.id},
                         {"type", "function"},
                         {"function", {{"name", c.name}, {"arguments", c.arguments_json}}}});
        }
        // Invalid UTF-8 in generated names/arguments becomes U+FFFD (no throw in the handler).
        last.set_tool_calls_json(
            arr.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
      }
      writer->Write(last);
    }
    return grpc::Status::OK;
  }

  grpc::Status ListModels(grpc::ServerContext* ctx, const epd::v1::ListModelsRequest*,
                          epd::v1::ListModelsResponse* resp) override {
    if (auto s = Authorize(ctx); !s.ok()) return s;
    auto* m = resp->add_models();
    m->set_id(core_.options().model);
    m->set_context_length(core_.options().context_length);
    m->set_config_fingerprint(core_.registry().Fingerprint());
    return grpc::Status::OK;
  }

  grpc::Status Health(grpc::ServerContext*, const epd::v1::HealthRequest*,
                      epd::v1::HealthResponse* resp) override {
    bool serving = false;
    resp->set_detail(RouterHealthJson(core_, &serving));
    resp->set_serving(serving);
    return grpc::Status::OK;
  }

 private:
  grpc::Status Authorize(grpc::ServerContext* ctx) {
    if (api_key_.empty()) return grpc::Status::OK;
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it != md.end() && std::string(it->second.data(), it->second.size()) ==
                              "Bearer " + api_key_) {
      return grpc::Status::OK;
    }
    return Reject(ctx, ApiError(absl::StatusCode::kUnauthenticated, "Incorrect API key provided",
                                "", "invalid_api_key"));
  }

  grpc::Status Reject(grpc::ServerContext* ctx, const absl::Status& s) {
    core_.CountRejected(s);
    return ToGrpc(s, ctx);
  }

  static std::string NewId() { return absl::StrCat("gen-", common::ToHex(common::RandomBytes(16))); }

  RouterCore& core_;
  std::string api_key_;
  AdmissionQueue* admission_;
};

class RegistryImpl final : public epd::v1::WorkerRegistry::Service {
 public:
  // Only holders of the cluster secret may register or heartbeat (docs/security.md): a stranger
  // registering under a worker's id would receive users' prompts.
  explicit RegistryImpl(RouterCore& core) : core_(core), auth_(common::ClusterSecretFromEnv()) {}

  grpc::Status Register(grpc::ServerContext* ctx, const epd::v1::RegisterRequest* req,
                        epd::v1::RegisterResponse* resp) override {
    if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.WorkerRegistry/Register"); !a.ok()) return a;
    const auto pool = FromProto(req->pool());
    Registry& reg = core_.registry();
    resp->set_heartbeat_interval_ms(reg.options().heartbeat_interval_ms);
    resp->set_heartbeat_miss_limit(reg.options().heartbeat_miss_limit);
    if (!pool) {
      resp->set_accepted(false);
      resp->set_reason("pool must be encoder, prefill or decode");
      return grpc::Status::OK;
    }
    WorkerInfo w;
    w.id = req->worker_id();
    w.pool = *pool;
    w.control_address = req->control_address();
    w.transfer_address = req->transfer_address();
    w.fingerprint = req->config_fingerprint();
    w.model = req->model();
    absl::Status s = reg.Register(w);
    resp->set_accepted(s.ok());
    resp->set_reason(std::string(s.message()));
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const epd::v1::HeartbeatRequest* req,
                         epd::v1::HeartbeatResponse* resp) override {
    if (grpc::Status a = auth_.Check(*ctx, "/epd.v1.WorkerRegistry/Heartbeat"); !a.ok()) return a;
    resp->set_known(core_.registry().Heartbeat(req->worker_id(), req->config_fingerprint(),
                                               LoadFromProto(req->load()), req->draining()));
    return grpc::Status::OK;
  }

 private:
  RouterCore& core_;
  runtime::ClusterAuthChecker auth_;
};

}  // namespace

RouterGrpcServer::RouterGrpcServer(RouterCore& core, std::string api_key,
                                   AdmissionQueue* admission)
    : core_(core), api_key_(std::move(api_key)), admission_(admission) {}

RouterGrpcServer::~RouterGrpcServer() { Stop(); }

absl::Status RouterGrpcServer::SetTls(const GrpcTlsOptions& tls) {
  worker_port_ = tls.worker_port;
  if (tls.cert_file.empty() && tls.key_file.empty()) return absl::OkStatus();
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and a key file");
  }
  auto read = [](const std::string& path, std::string* out) -> absl::Status {
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read TLS file ", path));
    std::ostringstream ss;
    ss << in.rdbuf();
    *out = ss.str();
    if (out->find("-----BEGIN") == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("TLS file ", path, " is not PEM"));
    }
    return absl::OkStatus();
  };
  if (auto s = read(tls.cert_file, &tls_cert_pem_); !s.ok()) return s;
  return read(tls.key_file, &tls_key_pem_);
}

absl::StatusOr<int> RouterGrpcServer::Start(const std::string& host, int port) {
  inference_ = std::make_unique<InferenceImpl>(core_, api_key_, admission_);
  registry_ = std::make_unique<RegistryImpl>(core_);
  grpc::ServerBuilder builder;
  int bound = 0;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!tls_cert_pem_.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({tls_key_pem_, tls_cert_pem_});
    creds = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort(absl::StrCat(host, ":", port), creds, &bound);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterService(inference_.get());
  builder.RegisterService(registry_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || bound == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot bind gRPC on ", host, ":", port,
                                               tls_cert_pem_.empty() ? "" : " (TLS key/cert?)"));
  }
  if (worker_port_ >= 0) {
    worker_registry_ = std::make_unique<RegistryImpl>(core_);
    grpc::ServerBuilder wb;
    wb.AddListeningPort(absl::StrCat(host, ":", worker_port_), grpc::InsecureServerCredentials(),
                        &worker_bound_);
    wb.RegisterService(worker_registry_.get());
    worker_server_ = wb.BuildAndStart();
    if (!worker_server_ || worker_bound_ == 0) {
      Stop();
      return absl::UnavailableError(
          absl::StrCat("cannot bind the worker gRPC port on ", host, ":", worker_port_));
    }
  }
  return bound;
}

void RouterGrpcServer::Stop() {
  for (auto* s : {&worker_server_, &server_}) {
    if (!*s) continue;
    (*s)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    (*s)->Wait();
    s->reset();
  }
}

}  // namespace epd::services::router
