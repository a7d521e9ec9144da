#pragma once

// The CUDA backend (kernels/backend.h on one GPU). CUDA-free header: host code includes it
// without nvcc. Only kernels/ (and the device factory, kernels/device) include it.
//
// Memory: Allocate gives device memory (cudaMalloc; freed by the Buffer); op arguments are device
// pointers (a Buffer's data()). Packed QuantWeights must hold their codes in this backend's
// buffers; decoded ones (values/scales host vectors) are copied to device scratch per call.
// Streams: ids 0..kCudaStreams-1 are CUDA streams; every op is queued on stream 0; Upload and
// Download run on the buffer's stream, ordered after the queued ops, and return when done, except
// an Upload of at most 64 KiB into a stream-0 buffer: it is staged in pinned memory and queued on
// stream 0, and returns at once (the host bytes are free; every later op, and a Download from any
// stream, sees them), so the small uploads of a decode step do not drain the GPU's queue.
// Errors: bad arguments give InvalidArgument naming the op (checked before any launch, like the
// CPU backend); a CUDA error gives Internal naming the op and the CUDA error; an error raised
// while a kernel runs surfaces at the next call. An error that leaves the device unusable gives
// Unavailable, and so does every later call (CudaDeviceLost, below).
// Graphs (Backend::BeginCapture): a capture records stream 0 into a CUDA graph (relaxed capture
// mode: Allocate's cudaMalloc may run meanwhile), and LaunchGraph launches it on stream 0. While
// it lasts, Upload, Download and Synchronize on the capturing thread are refused, and the
// Upload, Download, Copy, Synchronize and kernel ops (the KV pool's CopyBlocks, DigestBlocks and
// BlocksEqual) of other threads wait for it to end, so that none of their work lands in the graph;
// an op that would wait for the device (the scratch growing, a GroupedLinearQuant weight table not
// made before, a decoded weight) fails the capture. Run a step op by op before capturing it. A
// graph's kernels keep the scratch and weight-table pointers they were captured with: a block the
// backend lets go of (the scratch outgrown, the tables reset) is kept until no graph is alive.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace epd::kernels {

inline constexpr int kCudaStreams = 4;

// The backend on CUDA device `device`. FailedPrecondition naming "cuda:<device>" and the cause
// when there is no usable GPU (no driver, no device); NotFound when `device` is not one of the
// present devices.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

// OK while `backend`'s device works (and for a backend that is not a CUDA backend). Once a CUDA
// error has left the device's context unusable (a kernel's illegal address or other fault, an
// uncorrectable ECC error: after one, every CUDA call of the process fails), the first such
// error, naming the op that met it; every later call of the backend then fails at once with it.
// Only a new process can use the GPU again: a worker exits (worker_runtime.cc) so that its
// supervisor restarts it and the router replays its requests.
absl::Status CudaDeviceLost(const Backend& backend);

// Where a CUDA backend's time goes, for benchmarks (tests/bench/cuda_model_bench.cc). While
// profiling is on, each op called outside a capture is bracketed by two events on stream 0 and
// waited for, and its device time (between the events) and host time (the call, the wait
// included) are added to its name's entry; a graph launch is one "LaunchGraph" entry. The waits
// serialize host and device, so the sum exceeds a step's time; the shares are the point.
//
// Why it is in the production backend although only a benchmark and a test call it (issue 48): it
// is a diagnostic, the way an operator profiles a GPU build (cuda_model_bench's PROFILE lines),
// and it costs nothing while off (one relaxed atomic load per op in Run, no event, no wait). It
// cannot live outside the backend without exposing its internals: the timing brackets each op's
// launches on the backend's own stream 0 (a cudaStream_t this CUDA-free header does not show),
// inside the one Run every op goes through, after the wait for another thread's capture and never
// during one; a wrapper Backend would time the call, not the device work, and would need the
// stream and the capture state.
struct CudaOpTime {
  std::string op;
  int64_t calls = 0;
  double device_ms = 0;
  double host_ms = 0;
};
// Turns profiling on (clearing the table) or off. InvalidArgument when `backend` is not a CUDA
// backend.
absl::Status SetCudaOpProfiling(Backend& backend, bool on);
// The table, most device time first. InvalidArgument when `backend` is not a CUDA backend.
absl::StatusOr<std::vector<CudaOpTime>> CudaOpProfile(Backend& backend);

}  // namespace epd::kernels
