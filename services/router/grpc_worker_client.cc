// WorkerClient over gRPC: WorkerControl.Submit streams, Cancel as a fire-and-forget RPC.
#include <atomic>
#include <map>
#include <mutex>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "common/cluster_secret.h"
#include "epd/v1/worker.grpc.pb.h"
#include "runtime/grpc_auth.h"
#include "services/router/dispatch.h"

namespace epd::services::router {
namespace {

absl::Status ToAbsl(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

class GrpcJobStream final : public JobStream {
 public:
  GrpcJobStream(std::shared_ptr<grpc::Channel> channel, const epd::v1::Job& job,
                std::string worker_id)
      : stub_(epd::v1::WorkerControl::NewStub(channel)),
        request_id_(job.request_id()),
        worker_id_(std::move(worker_id)) {
    if (job.deadline_unix_ms() > 0) {
      ctx_.set_deadline(std::chrono::system_clock::time_point(
          std::chrono::milliseconds(job.deadline_unix_ms())));
    }
    reader_ = stub_->Submit(&ctx_, job);
  }

  ~GrpcJobStream() override {
    if (!finished_) {
      ctx_.TryCancel();
      epd::v1::SubmitResponse sink;
      while (reader_->Read(&sink)) {
      }
      reader_->Finish().ok();
    }
  }

  bool Read(epd::v1::SubmitResponse* out) override { return reader_->Read(out); }

  absl::Status Finish() override {
    finished_ = true;
    return ToAbsl(reader_->Finish());
  }

  void Cancel() override {
    if (cancelled_.exchange(true)) return;
    ctx_.TryCancel();
    // Tell the worker too: a cancelled stream alone may not stop work it queued elsewhere.
    struct Call {
      grpc::ClientContext ctx;
      epd::v1::CancelRequest req;
      epd::v1::CancelResponse resp;
    };
    auto* call = new Call;
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    call->req.set_request_id(request_id_);
    stub_->async()->Cancel(&call->ctx, &call->req, &call->resp,
                           [call](grpc::Status) { delete call; });
  }

 private:
  std::unique_ptr<epd::v1::WorkerControl::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<epd::v1::SubmitResponse>> reader_;
  std::string request_id_;
  std::string worker_id_;
  std::atomic<bool> cancelled_{false};
  bool finished_ = false;
};

class GrpcWorkerClient final : public WorkerClient {
 public:
  std::unique_ptr<JobStream> Submit(const WorkerInfo& worker, const epd::v1::Job& job) override {
    return std::make_unique<GrpcJobStream>(Channel(worker.control_address), job, worker.id);
  }

  void Forget(const WorkerInfo& worker) override {
    std::lock_guard<std::mutex> lock(mu_);
    channels_.erase(worker.control_address);
  }

 private:
  std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& ch = channels_[address];
    if (!ch) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(64 << 20);
      args.SetMaxSendMessageSize(64 << 20);
      // Every Submit and Cancel proves the cluster secret (docs/security.md).
      ch = runtime::CreateClusterChannel(address, secret_, args);
    }
    return ch;
  }

  const std::string secret_ = common::ClusterSecretFromEnv();
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
};

}  // namespace

std::unique_ptr<WorkerClient> NewGrpcWorkerClient() {
  return std::make_unique<GrpcWorkerClient>();
}

}  // namespace epd::services::router
