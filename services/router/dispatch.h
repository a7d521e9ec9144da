#pragma once

// How the router reaches workers: one Submit stream per stage of a request (proto
// WorkerControl), behind an interface so router logic is tested with in-process fakes.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "epd/v1/worker.pb.h"
#include "services/router/registry.h"

namespace epd::services::router {

// One stage's Submit stream. Read/Finish from one thread; Cancel from any thread, any time,
// any number of times.
class JobStream {
 public:
  virtual ~JobStream() = default;
  // Blocks for the next message; false at the end of the stream (then call Finish once).
  virtual bool Read(epd::v1::SubmitResponse* out) = 0;
  // The stream's final status: Unavailable when the worker could not be reached or died.
  virtual absl::Status Finish() = 0;
  // Aborts the stream and tells the worker to drop the request (WorkerControl.Cancel).
  virtual void Cancel() = 0;
};

// Thread-safe.
class WorkerClient {
 public:
  virtual ~WorkerClient() = default;
  virtual std::unique_ptr<JobStream> Submit(const WorkerInfo& worker,
                                            const epd::v1::Job& job) = 0;
  // Drops any cached connection to a worker that failed.
  virtual void Forget(const WorkerInfo& worker) {}
};

// The gRPC implementation: one channel per control address, cached.
std::unique_ptr<WorkerClient> NewGrpcWorkerClient();

}  // namespace epd::services::router
