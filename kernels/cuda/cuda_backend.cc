// CudaBackend: the argument checks, memory, streams and scratch of the CUDA backend; the kernels
// are in the .cu files of this folder (launch.h). Every check mirrors the CPU backend's
// (kernels/cpu/cpu_backend.cc), so both refuse the same calls.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/launch.h"

namespace epd::kernels {
namespace {

using absl::InvalidArgumentError;
using absl::OkStatus;
using absl::Status;

#define EPD_CUDA_RETURN_IF_ERROR(op, expr)                                  \
  do {                                                                      \
    if (cudaError_t rc_ = (expr); rc_ != cudaSuccess) return Cuda(op, rc_); \
  } while (0)

// Whether `rc` leaves the device's context unusable: every later CUDA call of the process
// returns the same error, and only a new process can use the GPU again (driver_types.h: "the
// process must be terminated and relaunched"). A kernel's fault surfaces so, at the next call.
bool LosesTheContext(cudaError_t rc) {
  switch (rc) {
    case cudaErrorECCUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorNvlinkUncorrectable:
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
#endif
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
    case cudaErrorContained:
    case cudaErrorTensorMemoryLeak:
#endif
      return true;
    default:
      return false;
  }
}

// What a CudaBackend shares with its graphs, under `mu`: the capture under way, and the device
// blocks (an outgrown scratch block, weight tables) the backend has let go of while graphs whose
// kernels may read them are alive. Shared, so that a graph destroyed after its backend (which
// backend.h forbids) still frees only itself.
struct GraphState {
  int device = 0;
  cudaStream_t stream = nullptr;  // stream 0, where graphs launch; null once the backend is gone
  std::mutex mu;
  std::condition_variable cv;  // `capturing` or `outside` changed
  bool capturing = false;
  std::thread::id capture_thread;
  Status first_error;   // the first error an op gave on the capturing thread
  int64_t outside = 0;  // calls of other threads that reach stream 0, running (EnterStream0)
  int64_t live = 0;     // graphs alive
  std::vector<void*> retired;

  // Frees the retired blocks when no graph is alive and no capture is under way, once stream 0's
  // work (a launch that may read them) is done. `mu` held; the device current.
  void FreeRetiredLocked() {
    if (live > 0 || capturing || stream == nullptr || retired.empty()) return;
    cudaStreamSynchronize(stream);
    for (void* p : retired) cudaFree(p);
    retired.clear();
  }
};

// A captured CUDA graph and its executable form. Its kernels hold the pointers they were given,
// the backend's scratch and weight tables among them: GraphState keeps those while it is alive.
class CudaGraph final : public Graph {
 public:
  CudaGraph(std::shared_ptr<GraphState> state, cudaGraph_t graph, cudaGraphExec_t exec, int64_t ops)
      : state_(std::move(state)), graph_(graph), exec_(exec), ops_(ops) {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->live;
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  // A launch still in flight is not waited for: the driver frees an executable graph that is
  // running once it completes (cuGraphExecDestroy). No stream is synchronized here, so a graph
  // may be destroyed during another capture.
  ~CudaGraph() override {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(state_->device);
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      --state_->live;
      state_->FreeRetiredLocked();
    }
    cudaSetDevice(prev);
  }

  int64_t ops() const override { return ops_; }
  bool Of(const GraphState* state) const { return state_.get() == state; }
  cudaGraphExec_t exec() const { return exec_; }

 private:
  std::shared_ptr<GraphState> state_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  int64_t ops_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device), graphs_(std::make_shared<GraphState>()) {
    graphs_->device = device;
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    {
      std::lock_guard<std::mutex> lock(graphs_->mu);
      if (graphs_->capturing) {  // a capture that never ended: discard it
        cudaGraph_t g = nullptr;
        if (cudaStreamEndCapture(streams_[0], &g) == cudaSuccess && g != nullptr)
          cudaGraphDestroy(g);
        cudaGetLastError();
        graphs_->capturing = false;
      }
      if (streams_[0] != nullptr) cudaStreamSynchronize(streams_[0]);
      for (void* p : graphs_->retired) cudaFree(p);
      graphs_->retired.clear();
      graphs_->stream = nullptr;
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    for (cudaEvent_t e : staging_done_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (prof_start_ != nullptr) cudaEventDestroy(prof_start_);
    if (prof_stop_ != nullptr) cudaEventDestroy(prof_stop_);
    if (staging_ != nullptr) cudaFreeHost(staging_);
    for (auto& [key, p] : group_tables_) cudaFree(p);
    for (cudaStream_t s : streams_) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  Status Init() {
    EPD_CUDA_RETURN_IF_ERROR("init", cudaSetDevice(device_));
    for (cudaStream_t& s : streams_) {
      EPD_CUDA_RETURN_IF_ERROR("init", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    }
    std::lock_guard<std::mutex> lock(graphs_->mu);
    graphs_->stream = streams_[0];
    return OkStatus();
  }

  std::string_view Name() const override { return "cuda"; }

  // ---- Memory ----
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  int64_t free_memory_bytes() const override {
    size_t free = 0, total = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
      cudaGetLastError();  // not the next launch's error
      return -1;
    }
    return static_cast<int64_t>(free);
  }
  absl::StatusOr<Buffer> Allocate(int64_t bytes, Stream stream) override {
    if (bytes < 0) return Bad("Allocate", absl::StrCat("negative size ", bytes));
    if (stream.id < 0 || stream.id >= kCudaStreams)
      return Bad("Allocate", absl::StrCat("stream ", stream.id, " (the backend has streams 0..",
                                          kCudaStreams - 1, ")"));
    if (bytes == 0) return Buffer(nullptr, 0, MemoryKind::kDevice, stream, nullptr);
    RETURN_IF_ERROR(Enter("Allocate"));
    void* p = nullptr;
    if (cudaError_t rc = cudaMalloc(&p, static_cast<size_t>(bytes)); rc != cudaSuccess) {
      cudaGetLastError();
      if (rc == cudaErrorMemoryAllocation) {
        return Note(absl::ResourceExhaustedError(
            absl::StrCat("cuda backend: Allocate: out of device memory for ", bytes,
                         " bytes on cuda:", device_)));
      }
      return Cuda("Allocate", rc);
    }
    const int device = device_;
    return Buffer(p, bytes, MemoryKind::kDevice, stream, [device](void* q) {
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(device);
      cudaFree(q);  // synchronizes: no queued op still reads q
      cudaSetDevice(prev);
    });
  }
  Status Upload(const void* host, int64_t bytes, Buffer& dst, int64_t dst_offset) override {
    Stream0Hold hold;
    if (Status st = EnterStream0("Upload", kHoldsNoHostData, hold); !st.ok()) return st;
    if (bytes < 0 || dst_offset < 0 || dst_offset + bytes > dst.bytes()) {
      return Bad("Upload", absl::StrCat(bytes, " bytes at offset ", dst_offset,
                                        " do not fit a buffer of ", dst.bytes()));
    }
    if (dst.kind() != MemoryKind::kDevice) return Bad("Upload", "the buffer is not device memory");
    if (bytes == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("Upload"));
    cudaStream_t s = StreamOf(dst);
    if (s == streams_[0] && bytes <= kStagingSlotBytes) {
      auto staged = UploadStaged(host, bytes, dst.as<uint8_t>() + dst_offset);
      if (!staged.ok()) return staged.status();
      if (*staged) return OkStatus();  // else no pinned memory: the synchronous copy below
    }
    if (Status st = OrderAfter("Upload", s, streams_[0]); !st.ok()) return st;
    EPD_CUDA_RETURN_IF_ERROR(
        "Upload", cudaMemcpyAsync(dst.as<uint8_t>() + dst_offset, host, static_cast<size_t>(bytes),
                                  cudaMemcpyHostToDevice, s));
    EPD_CUDA_RETURN_IF_ERROR("Upload", cudaStreamSynchronize(s));
    return OkStatus();
  }
  Status Download(const Buffer& src, int64_t src_offset, int64_t bytes, void* host) override {
    Stream0Hold hold;
    if (Status st = EnterStream0("Download", kHoldsNoHostData, hold); !st.ok()) return st;
    if (bytes < 0 || src_offset < 0 || src_offset + bytes > src.bytes()) {
      return Bad("Download", absl::StrCat(bytes, " bytes at offset ", src_offset,
                                          " are not inside a buffer of ", src.bytes()));
    }
    if (src.kind() != MemoryKind::kDevice)
      return Bad("Download", "the buffer is not device memory");
    if (bytes == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("Download"));
    cudaStream_t s = StreamOf(src);
    if (Status st = OrderAfter("Download", s, streams_[0]); !st.ok()) return st;
    EPD_CUDA_RETURN_IF_ERROR(
        "Download", cudaMemcpyAsync(host, src.as<uint8_t>() + src_offset,
                                    static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, s));
    EPD_CUDA_RETURN_IF_ERROR("Download", cudaStreamSynchronize(s));
    return OkStatus();
  }
  Status Synchronize(Stream stream) override {
    Stream0Hold hold;
    if (Status st =
            EnterStream0("Synchronize", "during a graph capture (nothing recorded runs)", hold);
        !st.ok())
      return st;
    if (stream.id < 0 || stream.id >= kCudaStreams)
      return Bad("Synchronize", absl::StrCat("stream ", stream.id));
    RETURN_IF_ERROR(Enter("Synchronize"));
    EPD_CUDA_RETURN_IF_ERROR("Synchronize", cudaStreamSynchronize(streams_[stream.id]));
    return OkStatus();
  }
  Status Copy(void* dst, const void* src, int64_t bytes) override {
    Stream0Hold hold;
    if (Status st = EnterStream0("Copy", /*refusal=*/nullptr, hold); !st.ok()) return st;
    if (bytes < 0) return Bad("Copy", "negative size");
    if (bytes == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("Copy"));
    EPD_CUDA_RETURN_IF_ERROR("Copy", cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                                     cudaMemcpyDeviceToDevice, streams_[0]));
    return OkStatus();
  }

  // ---- Graphs ----
  // A capture records stream 0 (relaxed mode: the caller's scratch may cudaMalloc meanwhile).
  // What must not land in the graph is kept out: Upload, Download and Synchronize on the
  // capturing thread are refused, and those of other threads (and their Copy and kernel ops) wait
  // for the capture to end (EnterStream0); an op that would wait for the device (scratch growing,
  // a new weight table, a decoded weight) is refused.
  bool supports_graphs() const override { return true; }
  Status BeginCapture() override {
    RETURN_IF_ERROR(Enter("BeginCapture"));
    cudaError_t rc = cudaSuccess;
    {
      std::unique_lock<std::mutex> lock(graphs_->mu);
      graphs_->cv.wait(lock, [&] { return graphs_->capturing || graphs_->outside == 0; });
      if (!graphs_->capturing) {
        rc = cudaStreamBeginCapture(streams_[0], cudaStreamCaptureModeRelaxed);
        if (rc == cudaSuccess) {
          graphs_->capturing = true;
          graphs_->capture_thread = std::this_thread::get_id();
          graphs_->first_error = OkStatus();
          return OkStatus();
        }
      }
    }
    if (rc != cudaSuccess) {
      cudaGetLastError();
      return Cuda("BeginCapture", rc);
    }
    return Refuse("BeginCapture", "a capture is under way");
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture() override {
    bool mine = false;
    Status st;  // the first error an op gave while recording
    {
      std::lock_guard<std::mutex> lock(graphs_->mu);
      mine = graphs_->capturing && graphs_->capture_thread == std::this_thread::get_id();
      st = graphs_->first_error;
    }
    if (!mine) return Refuse("EndCapture", "no capture under way on this thread");
    cudaSetDevice(device_);
    cudaGraph_t graph = nullptr;
    cudaError_t rc = cudaStreamEndCapture(streams_[0], &graph);
    {
      std::lock_guard<std::mutex> lock(graphs_->mu);
      graphs_->capturing = false;
      graphs_->first_error = OkStatus();
    }
    graphs_->cv.notify_all();
    if (rc != cudaSuccess || graph == nullptr) {
      cudaGetLastError();  // the invalidated capture's error
      if (st.ok())
        st = Cuda("EndCapture", rc != cudaSuccess ? rc : cudaErrorStreamCaptureInvalidated);
    }
    cudaGraphExec_t exec = nullptr;
    size_t nodes = 0;
    if (st.ok()) {
      rc = cudaGraphGetNodes(graph, nullptr, &nodes);
      if (rc == cudaSuccess) rc = cudaGraphInstantiate(&exec, graph, 0);
      if (rc != cudaSuccess) {
        cudaGetLastError();
        st = Cuda("EndCapture", rc);
      }
    }
    if (!st.ok()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      std::lock_guard<std::mutex> lock(graphs_->mu);
      graphs_->FreeRetiredLocked();
      return st;
    }
    return std::unique_ptr<Graph>(
        std::make_unique<CudaGraph>(graphs_, graph, exec, static_cast<int64_t>(nodes)));
  }
  Status LaunchGraph(Graph& graph) override {
    if (Capturing()) return Refuse("LaunchGraph", "during a graph capture");
    auto* g = dynamic_cast<CudaGraph*>(&graph);
    if (g == nullptr || !g->Of(graphs_.get()))
      return Bad("LaunchGraph", "not a graph of this backend");
    return Run("LaunchGraph", [&] { return cudaGraphLaunch(g->exec(), streams_[0]); });
  }

  // ---- Linears ----
  Status LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) override {
    if (rows < 0) return Bad("LinearQuant", "shape");
    if (std::string why = QuantWeightProblem(w); !why.empty()) return Bad("LinearQuant", why);
    if (w.packed() &&
        (w.codes.kind() != MemoryKind::kDevice || w.scale_codes.kind() != MemoryKind::kDevice))
      return Bad("LinearQuant", "packed weight codes are not in device memory");
    if (rows > kMaxGemmRows)
      return Bad("LinearQuant", absl::StrCat(rows, " rows > ", kMaxGemmRows));
    if (rows == 0 || w.out == 0) return OkStatus();
    if (!w.packed() && Capturing())  // its host values are copied in, then waited for
      return Refuse("LinearQuant", "a decoded weight (host values) during a graph capture");
    RETURN_IF_ERROR(Enter("LinearQuant"));
    const int64_t k = w.in, nb = (k + 31) / 32;
    const size_t q_bytes = Align(rows * k * 4), s_bytes = Align(rows * nb * 4);
    const size_t wv_bytes = w.packed() ? 0 : Align(w.out * w.in * 4);
    const size_t ws_bytes = w.packed() ? 0 : Align(static_cast<int64_t>(w.scales.size()) * 4);
    cuda::GemmWeight gw;
    gw.out = w.out;
    gw.in = w.in;
    const size_t t_bytes = Align(cuda::GemmQuantTermsBytes(rows, gw));
    auto scratch = Scratch("LinearQuant", q_bytes + s_bytes + wv_bytes + ws_bytes + t_bytes);
    if (!scratch.ok()) return scratch.status();
    auto* q = reinterpret_cast<float*>(*scratch);
    auto* s = reinterpret_cast<float*>(*scratch + q_bytes);
    float* terms =
        t_bytes == 0 ? nullptr
                     : reinterpret_cast<float*>(*scratch + q_bytes + s_bytes + wv_bytes + ws_bytes);
    const uint8_t* scale_codes = nullptr;
    float* values = nullptr;  // decoded weights: their copy in scratch, then their scales'
    float* scale_values = nullptr;
    if (w.packed()) {
      gw.kind = w.format == WeightFormat::kFp8E4M3 ? cuda::WeightKind::kFp8Packed
                                                   : cuda::WeightKind::kFp4Packed;
      gw.data = w.codes.data();
      scale_codes = w.scale_codes.as<uint8_t>();
    } else {
      values = reinterpret_cast<float*>(*scratch + q_bytes + s_bytes);
      gw.kind = cuda::WeightKind::kF32;
      gw.data = values;
      scale_values = reinterpret_cast<float*>(*scratch + q_bytes + s_bytes + wv_bytes);
    }
    // One Run: the profile times the whole op, and another thread's call waits for a capture.
    RETURN_IF_ERROR(Run("LinearQuant", [&]() -> cudaError_t {
      if (!w.packed()) {
        // Decoded weights live in host vectors: copy them to scratch (stream-ordered).
        cudaError_t rc = cudaMemcpyAsync(values, w.values.data(), w.values.size() * 4,
                                         cudaMemcpyHostToDevice, streams_[0]);
        if (rc == cudaSuccess && !w.scales.empty())
          rc = cudaMemcpyAsync(scale_values, w.scales.data(), w.scales.size() * 4,
                               cudaMemcpyHostToDevice, streams_[0]);
        if (rc != cudaSuccess) return rc;
      }
      if (cudaError_t rc = cuda::QuantizeFp8Rows(x, rows, k, q, s, streams_[0]); rc != cudaSuccess)
        return rc;
      return cuda::GemmQuant(q, s, rows, gw, scale_codes, scale_values, w.block_rows, w.block_cols,
                             w.scale_cols(), y, terms, streams_[0]);
    }));
    if (!w.packed()) {
      // The host vectors must outlive the copies: wait (decoded weights are a test/tool form).
      EPD_CUDA_RETURN_IF_ERROR("LinearQuant", cudaStreamSynchronize(streams_[0]));
    }
    return OkStatus();
  }
  Status LinearBf16(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                    float* y) override {
    if (rows < 0 || out < 0 || in < 0) return Bad("LinearBf16", "negative shape");
    return Plain("LinearBf16", x, rows, w, out, in, true, y);
  }
  Status LinearF32(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                   float* y) override {
    if (rows < 0 || out < 0 || in < 0) return Bad("LinearF32", "negative shape");
    return Plain("LinearF32", x, rows, w, out, in, false, y);
  }

  // ---- Norms, RoPE, rounding ----
  Status RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                 float* y) override {
    if (rows < 0 || dim <= 0) return Bad("RmsNorm", "shape");
    return Run("RmsNorm", [&] { return cuda::RmsNorm(x, w, rows, dim, eps, y, streams_[0]); });
  }
  Status RopeTables(const float* freqs, int n_pairs, const int64_t* positions, int64_t rows,
                    float* cos, float* sin) override {
    if (rows < 0 || n_pairs < 0) return Bad("RopeTables", "negative shape");
    return Run("RopeTables", [&] {
      return cuda::RopeTables(freqs, n_pairs, positions, rows, cos, sin, streams_[0]);
    });
  }
  Status Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
              const float* cos, const float* sin, bool inverse) override {
    if (rows < 0 || heads < 0 || offset < 0 || offset + 2 * n_pairs > stride)
      return Bad("Rope", "the rotated pairs do not fit the row stride");
    return Run("Rope", [&] {
      return cuda::Rope(x, rows, heads, stride, offset, n_pairs, cos, sin, inverse, streams_[0]);
    });
  }
  Status RoundBf16(float* x, int64_t n) override {
    return Run("RoundBf16", [&] { return cuda::ScaleRoundBf16(x, n, 1.f, false, streams_[0]); });
  }
  Status ScaleRoundBf16(float* x, int64_t n, float scale) override {
    return Run("ScaleRoundBf16",
               [&] { return cuda::ScaleRoundBf16(x, n, scale, true, streams_[0]); });
  }
  Status Add(float* x, const float* y, int64_t n) override {
    return Run("Add", [&] { return cuda::Add(x, y, n, streams_[0]); });
  }

  // ---- Attention ----
  Status SparseAttention(const SparseAttentionArgs& args) override {
    if (args.rows < 0 || args.heads < 0 || args.head_dim <= 0 || args.list_len < 0)
      return Bad("SparseAttention", "shape");
    if (args.head_dim > 16384)
      return Bad("SparseAttention", absl::StrCat("head_dim ", args.head_dim, " > 16384"));
    cuda::AttentionArgs a;
    a.q = args.q;
    a.kv = args.kv;
    a.sink = args.sink;
    a.idx = args.idx;
    a.kv_ext = args.kv_ext;
    a.kv_ext_start = args.kv_ext_start;
    a.rows = args.rows;
    a.heads = args.heads;
    a.head_dim = args.head_dim;
    a.list_len = args.list_len;
    a.scale = args.scale;
    a.out = args.out;
    return Run("SparseAttention", [&] { return cuda::SparseAttention(a, streams_[0]); });
  }
  Status CompressPool(const float* kv, const float* score, int64_t groups, int ratio, int64_t hd,
                      float* out) override {
    if (ratio < 1 || ratio > 8) return Bad("CompressPool", absl::StrCat("ratio ", ratio));
    if (groups < 0 || hd < 0) return Bad("CompressPool", "negative shape");
    return Run("CompressPool",
               [&] { return cuda::CompressPool(kv, score, groups, ratio, hd, out, streams_[0]); });
  }
  Status IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                       int64_t dim, float* score) override {
    if (heads < 0 || n < 0 || dim < 0) return Bad("IndexerScores", "negative shape");
    return Run("IndexerScores",
               [&] { return cuda::IndexerScores(q, w, heads, keys, n, dim, score, streams_[0]); });
  }
  Status MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                    int64_t mask_cols) override {
    return Run("MaskScores",
               [&] { return cuda::MaskScores(score, n, valid, mask, mask_cols, streams_[0]); });
  }
  Status StableTopK(const float* v, int64_t n, int64_t k, int32_t* out) override {
    if (n < 0 || k < 0) return Bad("StableTopK", "negative size");
    if (n > kMaxTopK) return Bad("StableTopK", absl::StrCat(n, " values > ", kMaxTopK));
    if (n == 0 || k == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("StableTopK"));
    const size_t bytes = cuda::TopKScratchBytes(n);
    auto scratch = Scratch("StableTopK", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("StableTopK",
               [&] { return cuda::StableTopK(v, n, k, out, *scratch, bytes, streams_[0]); });
  }
  Status CandidateMask(const float* score, int64_t n, int64_t bs, int64_t visible,
                       int64_t keep_blocks, uint8_t* mask) override {
    if (bs <= 0 || n < 0) return Bad("CandidateMask", "block size must be > 0");
    if (n == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("CandidateMask"));
    const size_t bytes = cuda::CandidateMaskScratchBytes(n, bs);
    auto scratch = Scratch("CandidateMask", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("CandidateMask", [&] {
      return cuda::CandidateMask(score, n, bs, visible, keep_blocks, mask, *scratch, bytes,
                                 streams_[0]);
    });
  }
  Status SelectTopK(const float* score, int64_t n, int64_t k, int64_t visible, int64_t offset,
                    int32_t* out) override {
    if (k < 0 || k > n) return Bad("SelectTopK", absl::StrCat("k ", k, " not in [0, ", n, "]"));
    if (n > kMaxTopK) return Bad("SelectTopK", absl::StrCat(n, " values > ", kMaxTopK));
    if (k == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("SelectTopK"));
    const size_t bytes = cuda::TopKScratchBytes(n);
    auto scratch = Scratch("SelectTopK", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("SelectTopK", [&] {
      return cuda::SelectTopK(score, n, k, visible, offset, out, *scratch, bytes, streams_[0]);
    });
  }

  Status IndexerScoresRows(const float* q, const float* w, int heads, const float* keys, int64_t n,
                           int64_t dim, int64_t rows, const int64_t* valid, float* score) override {
    if (heads < 0 || n < 0 || dim < 0 || rows < 0)
      return Bad("IndexerScoresRows", "negative shape");
    if (rows > kMaxGridY)
      return Bad("IndexerScoresRows", absl::StrCat(rows, " rows > ", kMaxGridY));
    return Run("IndexerScoresRows", [&] {
      return cuda::IndexerScoresRows(q, w, heads, keys, n, dim, rows, valid, score, streams_[0]);
    });
  }
  Status IndexerScoresPaged(const float* q, const float* w, int heads, RowCodec codec,
                            const uint8_t* const* const* tables, const int64_t* rows_per_page,
                            const int64_t* valid, int64_t n, int64_t dim, int64_t rows,
                            float* score) override {
    if (heads < 0 || n < 0 || dim < 0 || rows < 0)
      return Bad("IndexerScoresPaged", "negative shape");
    if (std::string why = RowCodecProblem(codec, dim); !why.empty())
      return Bad("IndexerScoresPaged", why);
    if (rows > kMaxGridY)
      return Bad("IndexerScoresPaged", absl::StrCat(rows, " rows > ", kMaxGridY));
    return Run("IndexerScoresPaged", [&] {
      return cuda::IndexerScoresPaged(q, w, heads, codec, tables, rows_per_page, valid, n, dim,
                                      rows, score, streams_[0]);
    });
  }
  Status CandidateMaskRows(const float* score, int64_t rows, int64_t n, int64_t bs,
                           const int64_t* visible, const int64_t* cols, int64_t keep_blocks,
                           uint8_t* mask) override {
    if (bs <= 0 || n < 0 || rows < 0) return Bad("CandidateMaskRows", "block size must be > 0");
    if (rows > kMaxGridY)
      return Bad("CandidateMaskRows", absl::StrCat(rows, " rows > ", kMaxGridY));
    if (rows * n > kMaxTopK)
      return Bad("CandidateMaskRows", absl::StrCat(rows, " x ", n, " scores > ", kMaxTopK));
    if (n == 0 || rows == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("CandidateMaskRows"));
    const size_t bytes = cuda::CandidateMaskRowsScratchBytes(rows, n, bs);
    auto scratch = Scratch("CandidateMaskRows", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("CandidateMaskRows", [&] {
      return cuda::CandidateMaskRows(score, rows, n, bs, visible, cols, keep_blocks, mask, *scratch,
                                     bytes, streams_[0]);
    });
  }
  Status SelectTopKRows(const float* score, int64_t rows, int64_t n, int64_t k,
                        const int64_t* visible, int64_t offset, const uint8_t* mask,
                        int64_t mask_cols, int32_t* out) override {
    if (rows < 0 || n < 0) return Bad("SelectTopKRows", "negative shape");
    if (k < 0 || k > n) return Bad("SelectTopKRows", absl::StrCat("k ", k, " not in [0, ", n, "]"));
    if (rows * n > kMaxTopK)
      return Bad("SelectTopKRows", absl::StrCat(rows, " x ", n, " scores > ", kMaxTopK));
    if (k == 0 || rows == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("SelectTopKRows"));
    const size_t bytes = cuda::SelectTopKRowsScratchBytes(rows, n, k);
    auto scratch = Scratch("SelectTopKRows", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("SelectTopKRows", [&] {
      return cuda::SelectTopKRows(score, rows, n, k, visible, offset, mask, mask_cols, out,
                                  *scratch, bytes, streams_[0]);
    });
  }

  // ---- mHC ----
  Status HcMixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                 const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                 float norm_eps, float* pre, float* post, float* comb) override {
    return Mixes(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, pre, post,
                 comb, /*vector_exp=*/true);
  }
  Status HcMixesSingleToken(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                            const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                            float norm_eps, float* pre, float* post, float* comb) override {
    return Mixes(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, pre, post,
                 comb, /*vector_exp=*/false);
  }
  // HcMixes and HcMixesSingleToken: the sigmoids with torch's vectorized exp or glibc's.
  Status Mixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
               const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
               float norm_eps, float* pre, float* post, float* comb, bool vector_exp) {
    if (rows < 0 || hc <= 0 || dim <= 0) return Bad("HcMixes", "shape");
    if (rows > kMaxGemmRows) return Bad("HcMixes", absl::StrCat(rows, " rows > ", kMaxGemmRows));
    if (rows == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("HcMixes"));
    const int64_t nm = (2 + hc) * hc;
    auto scratch = Scratch("HcMixes", Align(rows * nm * 4));
    if (!scratch.ok()) return scratch.status();
    auto* m = reinterpret_cast<float*>(*scratch);
    cuda::GemmWeight gw;
    gw.kind = cuda::WeightKind::kF32;
    gw.data = fn;
    gw.out = nm;
    gw.in = hc * dim;
    return Run("HcMixes", [&] {
      if (cudaError_t rc = cuda::GemmPlain(h, rows, gw, false, m, streams_[0]); rc != cudaSuccess)
        return rc;
      return cuda::HcMixesFinish(rows, h, hc, dim, m, scale, base, sinkhorn_iters, hc_eps, norm_eps,
                                 pre, post, comb, vector_exp, streams_[0]);
    });
  }
  Status HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
               float* y) override {
    if (rows < 0 || hc <= 0 || dim <= 0) return Bad("HcPre", "shape");
    return Run("HcPre", [&] { return cuda::HcPre(rows, h, hc, dim, pre, y, streams_[0]); });
  }
  Status HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                const float* post, const float* comb, float* out) override {
    if (rows < 0 || hc <= 0 || dim <= 0) return Bad("HcPost", "shape");
    if (rows == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("HcPost"));
    auto scratch = Scratch("HcPost", Align(rows * hc * dim * 4));
    if (!scratch.ok()) return scratch.status();
    return Run("HcPost", [&] {
      return cuda::HcPost(rows, y, res, hc, dim, post, comb, reinterpret_cast<float*>(*scratch),
                          out, streams_[0]);
    });
  }
  Status HcMean(int64_t rows, const float* h, int hc, int64_t dim, float* y,
                int64_t y_stride) override {
    if (rows < 0 || hc <= 0 || dim < 0) return Bad("HcMean", "shape");
    return Run("HcMean", [&] { return cuda::HcMean(rows, h, hc, dim, y, y_stride, streams_[0]); });
  }

  // ---- MoE ----
  Status MoeRoute(const float* z, int64_t rows, int n_experts, const float* bias, int top_k,
                  float route_scale, int32_t* experts, float* weights, int32_t* ranked) override {
    const int64_t E = n_experts, K = top_k;
    if (K < 1 || K > E) return Bad("MoeRoute", absl::StrCat("top_k ", K, " of ", E, " experts"));
    if (rows <= 0) return OkStatus();
    RETURN_IF_ERROR(Enter("MoeRoute"));
    auto scratch = Scratch("MoeRoute", cuda::MoeRouteScratchBytes(rows, n_experts, top_k));
    if (!scratch.ok()) return scratch.status();
    return Run("MoeRoute", [&] {
      return cuda::MoeRoute(z, rows, n_experts, bias, top_k, route_scale, experts, weights, ranked,
                            *scratch, streams_[0]);
    });
  }
  Status MoeGroup(const int32_t* experts, const float* weights, int64_t rows, int n_experts,
                  int top_k, int n_shared, int64_t* starts, int64_t* src_rows, int64_t* slot_rows,
                  float* entry_weights) override {
    const int64_t E = n_experts, K = top_k, NS = n_shared;
    if (rows < 0 || K < 1 || K > E || NS < 0)
      return Bad("MoeGroup", absl::StrCat("top_k ", K, " of ", E, " experts, ", NS, " shared"));
    return Run("MoeGroup", [&] {
      return cuda::MoeGroup(experts, weights, rows, n_experts, top_k, n_shared, starts, src_rows,
                            slot_rows, entry_weights, streams_[0]);
    });
  }
  // The starts live in device memory: unlike the CPU backend, this does not check them (they
  // are MoeGroup's output); a decoded (host-value) weight group reads them back and runs one
  // LinearQuant per group (tests and tools only).
  Status GroupedLinearQuant(const float* x, int64_t rows, const int64_t* starts,
                            const QuantWeight* const* ws, int n_groups, float* y) override {
    if (rows < 0 || n_groups < 0) return Bad("GroupedLinearQuant", "negative shape");
    if (std::string why = WeightGroupProblem(ws, n_groups); !why.empty())
      return Bad("GroupedLinearQuant", why);
    if (n_groups == 0) return OkStatus();  // no group covers a row
    const QuantWeight& w0 = *ws[0];
    if (!w0.packed()) return GroupByGroup(x, rows, starts, ws, n_groups, y);
    for (int g = 0; g < n_groups; ++g) {
      if (ws[g]->codes.kind() != MemoryKind::kDevice ||
          ws[g]->scale_codes.kind() != MemoryKind::kDevice)
        return Bad("GroupedLinearQuant",
                   absl::StrCat("weight ", g, ": packed codes are not in device memory"));
    }
    if (cuda::GroupedGemmGridRows(rows, n_groups) > 65535) {
      return Bad("GroupedLinearQuant",
                 absl::StrCat(rows, " rows in ", n_groups, " groups exceed the grid"));
    }
    if (rows == 0 || w0.out == 0) return OkStatus();
    RETURN_IF_ERROR(Enter("GroupedLinearQuant"));
    auto table = GroupTable(ws, n_groups);
    if (!table.ok()) return table.status();
    const int64_t k = w0.in, nb = (k + 31) / 32;
    const size_t q_bytes = Align(rows * k * 4), s_bytes = Align(rows * nb * 4);
    auto scratch = Scratch("GroupedLinearQuant", q_bytes + s_bytes);
    if (!scratch.ok()) return scratch.status();
    auto* q = reinterpret_cast<float*>(*scratch);
    auto* sc = reinterpret_cast<float*>(*scratch + q_bytes);
    cuda::GemmWeight gw;
    gw.kind = w0.format == WeightFormat::kFp8E4M3 ? cuda::WeightKind::kFp8Packed
                                                  : cuda::WeightKind::kFp4Packed;
    gw.out = w0.out;
    gw.in = w0.in;
    return Run("GroupedLinearQuant", [&] {
      if (cudaError_t rc = cuda::QuantizeFp8Rows(x, rows, k, q, sc, streams_[0]); rc != cudaSuccess)
        return rc;
      return cuda::GroupedGemmQuant(q, sc, rows, starts, n_groups, *table, gw, w0.block_rows,
                                    w0.block_cols, w0.scale_cols(), y, streams_[0]);
    });
  }
  Status SwiGlu(const float* g, const float* u, int64_t rows, int64_t inter, float lim,
                const float* row_weights, float* h) override {
    return Run("SwiGlu",
               [&] { return cuda::SwiGlu(g, u, rows, inter, lim, row_weights, h, streams_[0]); });
  }
  Status CopyRows(const float* src, const int64_t* src_rows, float* dst, const int64_t* dst_rows,
                  int64_t n, int64_t dim) override {
    if (n < 0 || dim < 0) return Bad("CopyRows", "negative shape");
    return Run("CopyRows",
               [&] { return cuda::CopyRows(src, src_rows, dst, dst_rows, n, dim, streams_[0]); });
  }
  Status SumSlots(const float* ys, int64_t rows, int64_t slots, int64_t dim, float* out) override {
    return Run("SumSlots", [&] { return cuda::SumSlots(ys, rows, slots, dim, out, streams_[0]); });
  }

  // ---- Engram ----
  Status Fp8RowLookup(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                      const int64_t* ids, int64_t n, float* out) override {
    if (dim % 32 != 0) return Bad("Fp8RowLookup", "dim must be a multiple of 32");
    return Run("Fp8RowLookup", [&] {
      return cuda::Fp8RowLookup(table, table_scale, dim, ids, n, out, streams_[0]);
    });
  }
  Status EngramGate(float* h, const float* e, int64_t rows, int hc, int64_t D,
                    const float* q_weight, const float* k_weight, float norm_eps) override {
    return Engram("EngramGate", h, e, rows, hc, D, q_weight, k_weight, norm_eps, true);
  }
  Status EngramGateSingleToken(float* h, const float* e, int64_t rows, int hc, int64_t D,
                               const float* q_weight, const float* k_weight,
                               float norm_eps) override {
    return Engram("EngramGateSingleToken", h, e, rows, hc, D, q_weight, k_weight, norm_eps, false);
  }
  // EngramGate and EngramGateSingleToken: the gate's sigmoid with torch's vectorized exp or
  // glibc's.
  Status Engram(const char* op, float* h, const float* e, int64_t rows, int hc, int64_t D,
                const float* q_weight, const float* k_weight, float norm_eps, bool vector_exp) {
    const float inv_sqrt_d = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
    return Run(op, [&] {
      return cuda::EngramGate(h, e, rows, hc, D, q_weight, k_weight, norm_eps, inv_sqrt_d,
                              vector_exp, streams_[0]);
    });
  }
  Status Embed(PlainWeight table, int64_t dim, const int32_t* ids, int64_t rows, int hc,
               float* h) override {
    if (std::string why = PlainWeightProblem(table); !why.empty()) return Bad("Embed", why);
    return Run("Embed", [&] {
      return cuda::Embed(table.data, table.dtype == PlainDtype::kBf16, dim, ids, rows, hc, h,
                         streams_[0]);
    });
  }

  // ---- Paged packed rows ----
  Status PackRows(RowCodec codec, const float* x, int64_t n, int64_t dim, uint8_t* const* pages,
                  int64_t rows_per_page, const int32_t* rows, int64_t first) override {
    if (Status s = PagedProblem("PackRows", codec, n, dim, rows_per_page, rows, first, false);
        !s.ok())
      return s;
    return Run("PackRows", [&] {
      return cuda::PackRows(codec, x, n, dim, pages, rows_per_page, rows, first, streams_[0]);
    });
  }
  Status UnpackRows(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    if (Status s = PagedProblem("UnpackRows", codec, n, dim, rows_per_page, rows, first, true);
        !s.ok())
      return s;
    return Run("UnpackRows", [&] {
      return cuda::UnpackRows(codec, pages, rows_per_page, dim, rows, first, n, out, streams_[0]);
    });
  }

  Status GatherRows(RowCodec codec, const uint8_t* const* const* tables,
                    const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    if (std::string why = RowCodecProblem(codec, dim); !why.empty()) return Bad("GatherRows", why);
    if (per_table <= 0 || n < 0) return Bad("GatherRows", "non-positive rows per table");
    return Run("GatherRows", [&] {
      return cuda::GatherRows(codec, tables, rows_per_page, per_table, dim, rows, first, n, out,
                              streams_[0]);
    });
  }

  Status TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base, bool per_slot,
                   int32_t* list, int64_t list_len, int64_t offset) override {
    if (rows < 0 || k < 0 || offset < 0 || offset + k > list_len)
      return Bad("TopKSlots", absl::StrCat(k, " slots at ", offset, " in lists of ", list_len));
    return Run("TopKSlots", [&] {
      return cuda::TopKSlots(topk, rows, k, base, per_slot, list, list_len, offset, streams_[0]);
    });
  }

  Status DigestBlocks(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                      uint64_t* out) override {
    if (n < 0) return Bad("DigestBlocks", "negative block count");
    if (n >= (int64_t{1} << 31)) return Bad("DigestBlocks", absl::StrCat(n, " blocks >= 2^31"));
    return Run("DigestBlocks",
               [&] { return cuda::DigestBlocks(blocks, bytes, n, out, streams_[0]); });
  }
  Status BlocksEqual(const uint8_t* const* a, const uint8_t* const* b, const int64_t* bytes,
                     int64_t n, int32_t* equal) override {
    if (n < 0) return Bad("BlocksEqual", "negative block count");
    if (n >= (int64_t{1} << 31)) return Bad("BlocksEqual", absl::StrCat(n, " pairs >= 2^31"));
    return Run("BlocksEqual",
               [&] { return cuda::BlocksEqual(a, b, bytes, n, equal, streams_[0]); });
  }
  Status CopyBlocks(uint8_t* const* dst, const uint8_t* const* src, const int64_t* bytes,
                    int64_t n) override {
    if (n < 0) return Bad("CopyBlocks", "negative block count");
    if (n >= (int64_t{1} << 31)) return Bad("CopyBlocks", absl::StrCat(n, " blocks >= 2^31"));
    return Run("CopyBlocks", [&] { return cuda::CopyBlocks(dst, src, bytes, n, streams_[0]); });
  }

  Status QuantDequant(Qdq kind, float* x, int64_t rows, int64_t dim) override {
    const int k = kind == Qdq::kFp8Window ? 0 : (kind == Qdq::kFp4Index ? 1 : 2);
    return Run("QuantDequant", [&] { return cuda::QuantDequant(k, x, rows, dim, streams_[0]); });
  }

  Status Argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    if (n <= 0) return Bad("Argmax", "empty rows");
    return Run("Argmax", [&] { return cuda::Argmax(x, rows, n, out, streams_[0]); });
  }

  Status PenalizeLogits(float* x, int64_t total, const int64_t* at, const int32_t* counts,
                        int64_t entries, float repetition, float frequency,
                        float presence) override {
    if (entries < 0 || total < 0) return Bad("PenalizeLogits", "negative sizes");
    if (!(repetition > 0.f)) return Bad("PenalizeLogits", "the repetition penalty must be > 0");
    return Run("PenalizeLogits", [&] {
      return cuda::PenalizeLogits(x, total, at, counts, entries, repetition, frequency, presence,
                                  streams_[0]);
    });
  }

  // The uniforms are device memory: unlike the CPU backend, no check of their range.
  Status SampleLogits(const float* x, int64_t rows, int64_t n, const SampleParams& p,
                      const double* u, int32_t* out, float* probs) override {
    if (rows < 0) return Bad("SampleLogits", "negative rows");
    if (n <= 0) return Bad("SampleLogits", "empty rows");
    if (const char* why = sampling::ParamsProblem(p); why != nullptr) return Bad("SampleLogits", why);
    if (rows * n >= (int64_t{1} << 31)) return Bad("SampleLogits", "more than 2^31 logits");
    if (rows == 0) return OkStatus();
    const bool sort = (p.top_k > 0 && p.top_k < n) || p.top_p < 1.f;
    const size_t bytes = cuda::SampleLogitsScratchBytes(rows, n, sort);
    auto scratch = Scratch("SampleLogits", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("SampleLogits", [&] {
      return cuda::SampleLogits(x, rows, n, p.temperature, p.top_k, p.top_p, p.min_p, u, out, probs,
                                *scratch, bytes, streams_[0]);
    });
  }

  // The drafts and uniforms are device memory: unlike the CPU backend, no check of their range
  // (a draft outside [0, n) is rejected).
  Status VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k, int64_t n,
                      const double* u, int32_t* out, int32_t* chosen) override {
    if (k < 0) return Bad("VerifyDrafts", "negative draft count");
    if (n <= 0) return Bad("VerifyDrafts", "empty rows");
    if ((k + 1) * n >= (int64_t{1} << 31)) return Bad("VerifyDrafts", "more than 2^31 entries");
    const size_t bytes = cuda::VerifyDraftsScratchBytes(n);
    auto scratch = Scratch("VerifyDrafts", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("VerifyDrafts", [&] {
      return cuda::VerifyDrafts(p, q, drafts, k, n, u, out, chosen, *scratch, bytes, streams_[0]);
    });
  }

  // The chosen tokens are device memory: unlike the CPU backend, no check of their range (an
  // out-of-range one gets logprob NaN).
  Status TopLogprobs(const float* x, int64_t rows, int64_t n, const int32_t* chosen, int64_t top,
                     float* chosen_lp, int32_t* top_ids, float* top_lp) override {
    if (rows < 0) return Bad("TopLogprobs", "negative rows");
    if (n <= 0) return Bad("TopLogprobs", "empty rows");
    if (top < 0 || top > n)
      return Bad("TopLogprobs", absl::StrCat("top ", top, " is outside [0, ", n, "]"));
    if (rows * n >= (int64_t{1} << 31)) return Bad("TopLogprobs", "more than 2^31 logits");
    if (rows == 0) return OkStatus();
    const size_t bytes = cuda::TopLogprobsScratchBytes(rows, n);
    auto scratch = Scratch("TopLogprobs", bytes);
    if (!scratch.ok()) return scratch.status();
    return Run("TopLogprobs", [&] {
      return cuda::TopLogprobs(x, rows, n, chosen, top, chosen_lp, top_ids, top_lp, *scratch, bytes,
                               streams_[0]);
    });
  }

 private:
  // Every error this backend gives is made by Bad, Cuda, Refuse or Note: the first one made on the
  // capturing thread during a capture is the one EndCapture gives. Never called with graphs_->mu
  // held.
  Status Note(Status st) {
    std::lock_guard<std::mutex> lock(graphs_->mu);
    if (!st.ok() && graphs_->capturing && graphs_->capture_thread == std::this_thread::get_id() &&
        graphs_->first_error.ok())
      graphs_->first_error = st;
    return st;
  }
  Status Bad(const char* op, const std::string& why) {
    return Note(InvalidArgumentError(absl::StrCat("cuda backend: ", op, ": ", why)));
  }
  // A failed CUDA call: Internal naming the op and the error. The runtime also keeps the error
  // as the thread's last error, which the next launch's check (cudaGetLastError) would report as
  // that launch's: it is cleared here. An error that loses the context (LosesTheContext) is
  // Unavailable, the device's fault and not the request's (a router retries such a failure
  // elsewhere), and is kept: every later call fails with it (Enter), and CudaDeviceLost reports
  // it, so that the process can restart.
  Status Cuda(const char* op, cudaError_t rc) {
    if (rc == cudaSuccess) return OkStatus();
    cudaGetLastError();
    const std::string what = absl::StrCat("cuda backend: ", op, ": ", cudaGetErrorName(rc), ": ",
                                          cudaGetErrorString(rc));
    if (!LosesTheContext(rc)) return Note(absl::InternalError(what));
    {
      std::lock_guard<std::mutex> lock(lost_mu_);
      if (lost_.ok()) {
        lost_ = absl::UnavailableError(
            absl::StrCat("cuda:", device_, " is lost since ", what,
                         " (the device's context is unusable: restart the process)"));
        is_lost_.store(true, std::memory_order_release);
      }
    }
    return Note(absl::UnavailableError(what));
  }
  // Every call that reaches the device starts here: once the context is lost it fails at once,
  // naming the first error; else it makes the backend's device the thread's current one.
  Status Enter(const char* op) {
    if (Status lost = Lost(); !lost.ok())
      return Note(absl::UnavailableError(absl::StrCat("cuda backend: ", op, ": ", lost.message())));
    return Cuda(op, cudaSetDevice(device_));
  }
  Status Refuse(const char* op, const std::string& why) {
    return Note(absl::FailedPreconditionError(absl::StrCat("cuda backend: ", op, ": ", why)));
  }

  bool Capturing() {
    std::lock_guard<std::mutex> lock(graphs_->mu);
    return graphs_->capturing;
  }

  // Upload, Download, Synchronize, Copy and the kernel ops (Run) reach stream 0: they queue work
  // on it, wait for it, or order another stream after it. On the capturing thread during a
  // capture, such a call is refused (`refusal`, the reason) or, with a null refusal (Copy, a
  // kernel op), recorded. On any other thread it waits until no capture is under way, and `hold`
  // keeps a capture from beginning until the call returns, so that none of its work lands in a
  // graph.
  struct Stream0Hold {
    GraphState* state = nullptr;
    Stream0Hold() = default;
    Stream0Hold(const Stream0Hold&) = delete;
    Stream0Hold& operator=(const Stream0Hold&) = delete;
    ~Stream0Hold() {
      if (state == nullptr) return;
      std::lock_guard<std::mutex> lock(state->mu);
      if (--state->outside == 0) state->cv.notify_all();
    }
  };
  static constexpr const char* kHoldsNoHostData =
      "during a graph capture (a graph holds no host data)";
  Status EnterStream0(const char* op, const char* refusal, Stream0Hold& hold) {
    std::unique_lock<std::mutex> lock(graphs_->mu);
    if (graphs_->capturing && graphs_->capture_thread == std::this_thread::get_id()) {
      lock.unlock();
      return refusal == nullptr ? OkStatus() : Refuse(op, refusal);
    }
    graphs_->cv.wait(lock, [&] { return !graphs_->capturing; });
    ++graphs_->outside;
    hold.state = graphs_.get();
    return OkStatus();
  }

  // Device blocks the backend lets go of (an outgrown scratch block, weight tables): kept while a
  // graph is alive (its kernels may read them; GraphState frees them when none is), else freed
  // once the work queued on stream 0 is done. Not during a capture.
  Status Release(const char* op, const std::vector<void*>& blocks) {
    {
      std::lock_guard<std::mutex> lock(graphs_->mu);
      if (graphs_->live > 0) {
        graphs_->retired.insert(graphs_->retired.end(), blocks.begin(), blocks.end());
        return OkStatus();
      }
    }
    EPD_CUDA_RETURN_IF_ERROR(op, cudaStreamSynchronize(streams_[0]));
    cudaError_t rc = cudaSuccess;
    for (void* p : blocks) {
      if (cudaError_t f = cudaFree(p); rc == cudaSuccess) rc = f;
    }
    return Cuda(op, rc);
  }

  // The checks the CPU reference makes that need no device read (a listed row's value and its
  // page are device memory). A negative row: UnpackRows skips it as the CPU does; PackRows
  // refuses it in a range, and its kernel skips a listed one (never writing outside the pages)
  // where the CPU would refuse the call.
  Status PagedProblem(const char* op, RowCodec codec, int64_t n, int64_t dim, int64_t rows_per_page,
                      const int32_t* rows, int64_t first, bool skip_negative) {
    if (std::string why = RowCodecProblem(codec, dim); !why.empty()) return Bad(op, why);
    if (n < 0 || rows_per_page <= 0) return Bad(op, "negative rows or non-positive page size");
    if (!skip_negative && rows == nullptr && first < 0 && n > 0) {
      return Bad(op, absl::StrCat("negative row ", first));
    }
    return OkStatus();
  }
  static constexpr int64_t kMaxGridY = 65535;            // a kernel's grid.y (one row per y)
  static constexpr int64_t kMaxTopK = int64_t{1} << 30;  // CUB's int item count, 32-bit indices
  static constexpr int64_t kMaxGemmRows = int64_t{65535} * 16;  // grid.y limit x the row tile

  static size_t Align(int64_t bytes) { return (static_cast<size_t>(bytes) + 255) / 256 * 256; }

  // Every kernel op launches here. One from a thread other than the capturing one waits for a
  // capture to end, and keeps the next from beginning until it is queued, as the memory calls do
  // (EnterStream0): relaxed stream capture would take its launch into the graph (run at each
  // launch of it, and not now). backend.h lets the KV pool's CopyBlocks, DigestBlocks and
  // BlocksEqual come from any thread.
  template <typename F>
  Status Run(const char* op, F&& launch) {
    RETURN_IF_ERROR(Enter(op));
    Stream0Hold hold;
    RETURN_IF_ERROR(EnterStream0(op, /*refusal=*/nullptr, hold));
    if (profiling_.load(std::memory_order_relaxed) && !Capturing()) return RunTimed(op, launch);
    return Cuda(op, launch());  // a launch's status, as any call's
  }

  // Run with the op's time added to the profile (SetCudaOpProfiling).
  template <typename F>
  Status RunTimed(const char* op, F&& launch) {
    std::lock_guard<std::mutex> lock(profile_mu_);
    if (prof_start_ == nullptr) {
      EPD_CUDA_RETURN_IF_ERROR(op, cudaEventCreate(&prof_start_));
      EPD_CUDA_RETURN_IF_ERROR(op, cudaEventCreate(&prof_stop_));
    }
    const auto t0 = std::chrono::steady_clock::now();
    EPD_CUDA_RETURN_IF_ERROR(op, cudaEventRecord(prof_start_, streams_[0]));
    if (Status s = Cuda(op, launch()); !s.ok()) return s;
    EPD_CUDA_RETURN_IF_ERROR(op, cudaEventRecord(prof_stop_, streams_[0]));
    EPD_CUDA_RETURN_IF_ERROR(op, cudaEventSynchronize(prof_stop_));
    float ms = 0;
    EPD_CUDA_RETURN_IF_ERROR(op, cudaEventElapsedTime(&ms, prof_start_, prof_stop_));
    CudaOpTime& t = profile_[op];
    t.op = op;
    ++t.calls;
    t.device_ms += ms;
    t.host_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return OkStatus();
  }

 public:
  // OK while the device works; after, the first error that lost its context (Cuda).
  Status Lost() const {
    if (!is_lost_.load(std::memory_order_acquire)) return OkStatus();
    std::lock_guard<std::mutex> lock(lost_mu_);
    return lost_;
  }
  void SetProfiling(bool on) {
    std::lock_guard<std::mutex> lock(profile_mu_);
    profile_.clear();
    profiling_.store(on);
  }
  std::vector<CudaOpTime> Profile() {
    std::lock_guard<std::mutex> lock(profile_mu_);
    std::vector<CudaOpTime> out;
    for (const auto& [name, t] : profile_) out.push_back(t);
    std::sort(out.begin(), out.end(),
              [](const CudaOpTime& a, const CudaOpTime& b) { return a.device_ms > b.device_ms; });
    return out;
  }

 private:
  Status Plain(const char* op, const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
               bool round, float* y) {
    if (rows > kMaxGemmRows) return Bad(op, absl::StrCat(rows, " rows > ", kMaxGemmRows));
    if (std::string why = PlainWeightProblem(w); !why.empty()) return Bad(op, why);
    cuda::GemmWeight gw;
    gw.kind = w.dtype == PlainDtype::kBf16 ? cuda::WeightKind::kBf16 : cuda::WeightKind::kF32;
    gw.data = w.data;
    gw.out = out;
    gw.in = in;
    return Run(op, [&] { return cuda::GemmPlain(x, rows, gw, round, y, streams_[0]); });
  }

  // GroupedLinearQuant of decoded weights: the starts come back to the host, then one
  // LinearQuant per group.
  Status GroupByGroup(const float* x, int64_t rows, const int64_t* starts,
                      const QuantWeight* const* ws, int n_groups, float* y) {
    std::vector<int64_t> at(static_cast<size_t>(n_groups) + 1);
    {
      // Refused on a capturing thread; another thread's capture waits for the download.
      Stream0Hold hold;
      if (Status st = EnterStream0(
              "GroupedLinearQuant",
              "decoded weights (their starts come back to the host) during a graph capture", hold);
          !st.ok())
        return st;
      RETURN_IF_ERROR(Enter("GroupedLinearQuant"));
      EPD_CUDA_RETURN_IF_ERROR("GroupedLinearQuant",
                               cudaMemcpyAsync(at.data(), starts, at.size() * sizeof(int64_t),
                                               cudaMemcpyDeviceToHost, streams_[0]));
      EPD_CUDA_RETURN_IF_ERROR("GroupedLinearQuant", cudaStreamSynchronize(streams_[0]));
    }
    if (std::string why = StartsProblem(at.data(), n_groups, rows); !why.empty())
      return Bad("GroupedLinearQuant", why);
    for (int g = 0; g < n_groups; ++g) {
      const int64_t n = at[g + 1] - at[g];
      const QuantWeight& w = *ws[g];
      if (Status st = LinearQuant(x + at[g] * w.in, n, w, y + at[g] * w.out); !st.ok()) return st;
    }
    return OkStatus();
  }

  // The device array of a group's packed weights (codes and scale pointers), made once per
  // distinct group and kept: the key is the pointers themselves, so a table is right for any
  // weights at those addresses. A steady state uploads nothing.
  absl::StatusOr<const cuda::GroupWeight*> GroupTable(const QuantWeight* const* ws, int n) {
    std::vector<const void*> key(2 * static_cast<size_t>(n));
    std::vector<cuda::GroupWeight> host(static_cast<size_t>(n));
    for (int g = 0; g < n; ++g) {
      host[g].codes = ws[g]->codes.data();
      host[g].scale_codes = ws[g]->scale_codes.as<uint8_t>();
      key[2 * g] = host[g].codes;
      key[2 * g + 1] = host[g].scale_codes;
    }
    if (auto it = group_tables_.find(key); it != group_tables_.end())
      return static_cast<const cuda::GroupWeight*>(it->second);
    // A new table is written and waited for: refused on a capturing thread, and another
    // thread's capture waits for it.
    Stream0Hold hold;
    if (Status st = EnterStream0(
            "GroupedLinearQuant",
            "a weight table not made before would be made during a graph capture", hold);
        !st.ok())
      return st;
    if (group_tables_.size() >= kMaxGroupTables) {
      // Weights came and went (tests that load many models): start over.
      std::vector<void*> old;
      for (auto& [k, p] : group_tables_) old.push_back(p);
      if (Status st = Release("GroupedLinearQuant", old); !st.ok()) return st;
      group_tables_.clear();
    }
    void* p = nullptr;
    const size_t bytes = host.size() * sizeof(cuda::GroupWeight);
    if (cudaError_t rc = cudaMalloc(&p, bytes); rc != cudaSuccess) {
      if (rc != cudaErrorMemoryAllocation) return Cuda("GroupedLinearQuant", rc);
      cudaGetLastError();
      return Note(absl::ResourceExhaustedError(
          absl::StrCat("cuda backend: GroupedLinearQuant: no device memory for a weight table of ",
                       bytes, " bytes on cuda:", device_)));
    }
    // On stream 0 and waited for, so the table is complete before any kernel reads it. (A plain
    // cudaMemcpy from pageable memory runs on the legacy stream, which stream 0 does not wait
    // for, and may return before its copy has landed.)
    cudaError_t rc = cudaMemcpyAsync(p, host.data(), bytes, cudaMemcpyHostToDevice, streams_[0]);
    if (rc == cudaSuccess) rc = cudaStreamSynchronize(streams_[0]);
    if (rc != cudaSuccess) {
      cudaFree(p);
      return Cuda("GroupedLinearQuant", rc);
    }
    auto* table = static_cast<const cuda::GroupWeight*>(p);
    group_tables_.emplace(std::move(key), p);
    return table;
  }

  cudaStream_t StreamOf(const Buffer& b) const {
    const int64_t id = b.stream().id;
    return streams_[id >= 0 && id < kCudaStreams ? id : 0];
  }

  // `waiter` runs its next work after everything queued on `signaler` so far.
  Status OrderAfter(const char* op, cudaStream_t waiter, cudaStream_t signaler) {
    if (waiter == signaler) return OkStatus();
    cudaEvent_t ev = nullptr;
    EPD_CUDA_RETURN_IF_ERROR(op, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t rc = cudaEventRecord(ev, signaler);
    if (rc == cudaSuccess) rc = cudaStreamWaitEvent(waiter, ev, 0);
    cudaEventDestroy(ev);  // released once the wait is done
    return Cuda(op, rc);
  }

  // A small upload into a stream-0 buffer without waiting for the device: the host bytes are
  // copied into the next slot of a pinned staging ring and the slot's copy is queued on stream
  // 0, so the caller's memory is free on return and every later op of stream 0 sees the bytes
  // (a Download from another stream orders itself after stream 0). A slot is reused once the
  // event recorded after its copy has fired (kStagingSlots uploads later: in practice long
  // done). A decode step's uploads (ids, positions, index lists, page tables) then no longer
  // drain the GPU's queue each. False when the ring cannot be had (no pinned memory): the
  // caller copies synchronously.
  absl::StatusOr<bool> UploadStaged(const void* host, int64_t bytes, uint8_t* dst) {
    std::lock_guard<std::mutex> lock(staging_mu_);  // Upload may come from other threads
    if (staging_failed_) return false;
    if (staging_ == nullptr) {
      void* p = nullptr;
      const size_t ring = kStagingSlots * static_cast<size_t>(kStagingSlotBytes);
      if (cudaHostAlloc(&p, ring, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        staging_failed_ = true;
        return false;
      }
      staging_ = static_cast<uint8_t*>(p);
      for (cudaEvent_t& e : staging_done_) {
        EPD_CUDA_RETURN_IF_ERROR("Upload",
                                 cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
    }
    const size_t slot = staging_next_;
    staging_next_ = (staging_next_ + 1) % kStagingSlots;
    if (staging_used_[slot]) {
      EPD_CUDA_RETURN_IF_ERROR("Upload", cudaEventSynchronize(staging_done_[slot]));
    }
    uint8_t* stage = staging_ + slot * kStagingSlotBytes;
    std::memcpy(stage, host, static_cast<size_t>(bytes));
    EPD_CUDA_RETURN_IF_ERROR("Upload", cudaMemcpyAsync(dst, stage, static_cast<size_t>(bytes),
                                                       cudaMemcpyHostToDevice, streams_[0]));
    EPD_CUDA_RETURN_IF_ERROR("Upload", cudaEventRecord(staging_done_[slot], streams_[0]));
    staging_used_[slot] = true;
    return true;
  }

  // Device scratch of at least `bytes` for the op being queued on stream 0. Grown in stream
  // order (the old block is released after every op queued before: Release), never shrunk; not
  // during a capture.
  absl::StatusOr<uint8_t*> Scratch(const char* op, size_t bytes) {
    if (bytes <= scratch_bytes_) return scratch_;
    if (Capturing()) return Refuse(op, "scratch would grow during a graph capture");
    // The block must be on this backend's device, whichever device the calling thread was on.
    RETURN_IF_ERROR(Enter(op));
    const size_t grow = std::max(bytes, scratch_bytes_ * 2);
    if (scratch_ != nullptr) {
      if (Status st = Release(op, {scratch_}); !st.ok()) return st;
      scratch_ = nullptr;
      scratch_bytes_ = 0;
    }
    void* p = nullptr;
    if (cudaError_t rc = cudaMalloc(&p, grow); rc != cudaSuccess) {
      // cudaMalloc also returns an earlier launch's fault: only this error is a lack of memory.
      if (rc != cudaErrorMemoryAllocation) return Cuda(op, rc);
      cudaGetLastError();
      return Note(
          absl::ResourceExhaustedError(absl::StrCat("cuda backend: ", op, ": no device memory for ",
                                                    grow, " bytes of scratch on cuda:", device_)));
    }
    scratch_ = static_cast<uint8_t*>(p);
    scratch_bytes_ = grow;
    return scratch_;
  }

  int device_;
  std::atomic<bool> is_lost_{false};  // lost_ is set
  mutable std::mutex lost_mu_;
  Status lost_;                         // the first error that lost the device's context (Cuda)
  std::shared_ptr<GraphState> graphs_;  // the capture, and what live graphs keep
  std::array<cudaStream_t, kCudaStreams> streams_{};
  uint8_t* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  static constexpr size_t kMaxGroupTables = 4096;
  // UploadStaged's pinned ring: kStagingSlots slots of kStagingSlotBytes (4 MiB of pinned host
  // memory, taken on the first small upload).
  static constexpr int64_t kStagingSlotBytes = int64_t{64} << 10;
  static constexpr size_t kStagingSlots = 64;
  std::mutex staging_mu_;
  uint8_t* staging_ = nullptr;
  bool staging_failed_ = false;
  size_t staging_next_ = 0;
  std::array<cudaEvent_t, kStagingSlots> staging_done_{};
  std::array<bool, kStagingSlots> staging_used_{};
  std::map<std::vector<const void*>, void*> group_tables_;  // GroupTable
  // SetCudaOpProfiling's state.
  std::atomic<bool> profiling_{false};
  std::mutex profile_mu_;
  cudaEvent_t prof_start_ = nullptr, prof_stop_ = nullptr;
  std::map<std::string, CudaOpTime> profile_;
};

absl::StatusOr<CudaBackend*> Profiled(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr) {
    return InvalidArgumentError(
        absl::StrCat("op profiling needs a CUDA backend, not ", std::string(backend.Name())));
  }
  return cuda;
}

}  // namespace

Status SetCudaOpProfiling(Backend& backend, bool on) {
  absl::StatusOr<CudaBackend*> cuda = Profiled(backend);
  if (!cuda.ok()) return cuda.status();
  (*cuda)->SetProfiling(on);
  return OkStatus();
}

absl::StatusOr<std::vector<CudaOpTime>> CudaOpProfile(Backend& backend) {
  absl::StatusOr<CudaBackend*> cuda = Profiled(backend);
  if (!cuda.ok()) return cuda.status();
  return (*cuda)->Profile();
}

Status CudaDeviceLost(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda == nullptr ? OkStatus() : cuda->Lost();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  std::string why;
  const int count = cuda::DeviceCount(&why);
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", device, " is not available: no CUDA device (", why, ")"));
  }
  if (device < 0 || device >= count) {
    return absl::NotFoundError(absl::StrCat("cuda:", device, " does not exist: this machine has ",
                                            count, " CUDA device(s), cuda:0..cuda:", count - 1));
  }
  auto backend = std::make_unique<CudaBackend>(device);
  if (Status s = backend->Init(); !s.ok()) return s;
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace epd::kernels
