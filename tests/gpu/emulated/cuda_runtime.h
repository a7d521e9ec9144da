#pragma once
// A host emulation of the part of CUDA that kernels/cuda uses, so that the CUDA backend (its
// kernels' indexing, shared memory, barriers and arithmetic, and the host code around them) can
// run against the CPU reference on a machine without a GPU (tests/gpu/emulated). It stands in
// for <cuda_runtime.h> and <cuda_runtime_api.h> when a .cu file, rewritten by to_host.cmake, and
// cuda_backend.cc are compiled as host C++.
//
// What it models:
// - A launch runs its blocks one after another. A block's threads are fibers (Boost.Context) on
//   the launching thread, each run in turn up to its next __syncthreads() or its end, so a barrier
//   is passed only when every live thread of the block has reached it (a thread that returned no
//   longer counts). __shared__ variables become function statics (the running block's); dynamic
//   shared memory is a buffer of 0xff bytes (an unwritten float reads as NaN) of exactly the
//   launch's size, and device memory past an allocation's end is poisoned under ASan, so the
//   sanitizer pass catches a kernel reading or writing out of bounds.
// - Warp exchanges (__shfl_sync, __shfl_xor_sync, __ballot_sync, __syncthreads_or) go through
// per-thread slots
//   between two block-wide barriers: right for code where every thread of the block makes the same
//   exchanges, which is how kernels/cuda uses them.
// - Devices: one, or EPD_EMU_DEVICE_COUNT, each current per host thread (cudaSetDevice).
// - Device memory is host memory. Every stream runs its work at once, in the calling thread,
//   under one lock (one launch at a time); events are no-ops. A stream being captured records its
//   launches, copies and sets into a graph instead; launching the graph replays them in order.
// - A launch with more than 48 KiB of dynamic shared memory fails unless its kernel opted in
//   (cudaFuncSetAttribute), up to 227 KiB (an H200's opt-in).
// - Failures a test injects (the host cannot fault as a device does): a lost context, whose error
//   every later call returns (emu::LoseContext, or a file a process is told to watch:
//   EPD_EMU_LOSE_CONTEXT_FILE, which also hides the device from a process that starts while it
//   exists), one failed call (emu::FailNextCall) and one failed graph launch
//   (emu::FailNextGraphLaunch); a failed call's error is
//   the calling thread's last error (cudaGetLastError), as the runtime keeps it.
// What it does not model: warp scheduling and warp-synchronous code beyond the above, atomics,
// the order of work across streams, the static shared memory (not seen here), other limits,
// the device's transcendental functions (the host's libm stands in) and the device's fp32
// arithmetic itself (host arithmetic without contraction, as nvcc's -fmad=false). No packaged
// library emulates CUDA on the host (HIP-CPU is not in Debian), so this is our own.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <boost/context/fiber.hpp>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorECCUncorrectable = 214,
  cudaErrorNvlinkUncorrectable = 220,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchTimeout = 702,
  cudaErrorAssert = 710,
  cudaErrorHardwareStackError = 714,
  cudaErrorIllegalInstruction = 715,
  cudaErrorMisalignedAddress = 716,
  cudaErrorInvalidAddressSpace = 717,
  cudaErrorInvalidPc = 718,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureInvalidated = 901,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost,
  cudaMemcpyHostToDevice,
  cudaMemcpyDeviceToHost,
  cudaMemcpyDeviceToDevice,
  cudaMemcpyDefault
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeRelaxed };
constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDisableTiming = 2;
constexpr unsigned cudaHostAllocDefault = 0;

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlockOptin;
  int multiProcessorCount;
  int major;
  int minor;
};

namespace emu {

namespace bctx = boost::context;
inline constexpr size_t kStack = 128 * 1024;
inline constexpr size_t kMaxSmem = 227 * 1024;
inline constexpr size_t kDeviceBytes = size_t{16} << 30;  // what cudaMemGetInfo reports

struct Graph {
  std::vector<std::function<void()>> ops;
};
struct Stream {
  Graph* capture = nullptr;  // non-null while captured
};
struct Event {};

struct Fiber {
  std::unique_ptr<char[]> stack;
  bctx::fiber self, back;
  dim3 tid;
  bool done = false;
};
// Hands each fiber its own reused stack (no allocation per block).
struct ReusedStack {
  char* base;
  bctx::stack_context allocate() {
    bctx::stack_context sc;
    sc.size = kStack;
    sc.sp = base + kStack;
    return sc;
  }
  void deallocate(bctx::stack_context&) noexcept {}
};

// The running block (one at a time, under g_mu).
inline std::recursive_mutex g_mu;
inline dim3 tl_thread, tl_block, g_block_dim, g_grid_dim;
// The running launch's dynamic shared memory, exactly its size (under ASan an overrun is caught).
inline std::unique_ptr<unsigned char[]> g_smem;
inline Fiber* g_cur = nullptr;
inline std::function<void()> g_body;
inline std::vector<Fiber> g_fibers;
inline std::vector<uint64_t> g_slots;  // warp exchanges, one per thread
// The calling thread's last error, as the runtime keeps one per host thread.
inline thread_local cudaError_t g_last_error = cudaSuccess;
// Failures tests inject (the device cannot fault here): a lost context's error, which every later
// call of every thread returns, as the runtime does after a kernel's illegal address
// (LoseContext; until RestoreContext, which a real process cannot do), and one failure of the
// next call (FailNextCall).
inline std::atomic<cudaError_t> g_lost{cudaSuccess}, g_fail_next{cudaSuccess};
inline void LoseContext(cudaError_t e) {
  g_lost = e;
  g_last_error = e;
}
inline void RestoreContext() {
  g_lost = cudaSuccess;
  g_last_error = cudaSuccess;
}
inline void FailNextCall(cudaError_t e) { g_fail_next = e; }
// The devices: EPD_EMU_DEVICE_COUNT of them (1 to 16; default 1), all backed by the host's memory,
// so that a launcher's spreading of workers over GPUs runs here (tests/gpu/emulated_serve_test.cc).
// The current device is the calling thread's, as in the runtime.
inline int DeviceCount() {
  static const int n = [] {
    const char* v = std::getenv("EPD_EMU_DEVICE_COUNT");
    const int k = v != nullptr ? std::atoi(v) : 1;
    return std::clamp(k, 1, 16);
  }();
  return n;
}
inline bool ValidDevice(int d) { return d >= 0 && d < DeviceCount(); }
inline thread_local int tl_device = 0;
// One failure of the next cudaGraphLaunch alone (nothing of the graph runs), whatever calls come
// before it.
inline std::atomic<cudaError_t> g_fail_next_graph_launch{cudaSuccess};
inline void FailNextGraphLaunch(cudaError_t e) { g_fail_next_graph_launch = e; }
// A process run on the emulated device (epd-decode-emulated, tests/gpu/CMakeLists.txt) finds its
// device gone while the file named by EPD_EMU_LOSE_CONTEXT_FILE exists, as a GPU that fell off
// the bus: a running process loses its context at its first kernel or graph launch after the file
// appeared, as a kernel's illegal address would, and a process that starts meanwhile finds no
// device (cudaGetDeviceCount). How a test makes real worker processes meet a lost device at a
// moment it chooses, and get it back (tests/gpu/emulated_worker_e2e_test.cc,
// tests/gpu/emulated_serve_test.cc).
inline bool DeviceGoneByFile() {
  static const char* const path = std::getenv("EPD_EMU_LOSE_CONTEXT_FILE");
  return path != nullptr && ::access(path, F_OK) == 0;
}
inline void LoseContextIfTriggered() {
  if (g_lost == cudaSuccess && DeviceGoneByFile()) LoseContext(cudaErrorIllegalAddress);
}
// The injected failure of a call (cudaSuccess: none); it becomes the last error, as the runtime
// keeps a failed call's error for cudaGetLastError.
inline cudaError_t Injected() {
  const cudaError_t lost = g_lost;
  cudaError_t e = lost;
  if (e == cudaSuccess && g_fail_next.load() != cudaSuccess) e = g_fail_next.exchange(cudaSuccess);
  if (e != cudaSuccess) g_last_error = e;
  return e;
}

inline void Sync() { g_cur->back = std::move(g_cur->back).resume(); }
inline unsigned LinearTid() {
  return tl_thread.x + g_block_dim.x * (tl_thread.y + g_block_dim.y * tl_thread.z);
}
template <class T>
T* DynSmem() {
  return reinterpret_cast<T*>(g_smem.get());
}

// Runs `op` now, or records it when `s` is being captured.
inline void Enqueue(Stream* s, std::function<void()> op) {
  if (s != nullptr && s->capture != nullptr) {
    s->capture->ops.push_back(std::move(op));
    return;
  }
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  op();
}

inline void RunBlocks(dim3 grid, dim3 block, size_t smem) {
  const unsigned nt = block.x * block.y * block.z;
  g_grid_dim = grid;
  g_block_dim = block;
  if (g_fibers.size() < nt) g_fibers.resize(nt);
  g_slots.assign(nt, 0);
  g_smem.reset(new unsigned char[smem > 0 ? smem : 1]);
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::memset(g_smem.get(), 0xff, smem);
        tl_block = dim3(bx, by, bz);
        for (unsigned t = 0; t < nt; ++t) {
          Fiber& f = g_fibers[t];
          if (!f.stack) f.stack.reset(new char[kStack]);
          f.tid = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          f.done = false;
          f.self = bctx::fiber(std::allocator_arg, ReusedStack{f.stack.get()},
                               [&f](bctx::fiber&& sched) {
                                 f.back = std::move(sched);
                                 g_body();
                                 f.done = true;
                                 return std::move(f.back);
                               });
        }
        for (bool live = true; live;) {
          live = false;
          for (unsigned t = 0; t < nt; ++t) {
            Fiber& f = g_fibers[t];
            if (f.done) continue;
            g_cur = &f;
            tl_thread = f.tid;
            f.self = std::move(f.self).resume();
            live = live || !f.done;
          }
        }
      }
    }
  }
}

// Each kernel's cudaFuncAttributeMaxDynamicSharedMemorySize: above 48 KiB of dynamic shared
// memory a launch fails unless its kernel opted in (the device also counts the static part,
// which the emulation cannot see).
inline std::mutex g_attr_mu;
inline std::map<const void*, size_t> g_max_dynamic_smem;
inline size_t MaxDynamicSmem(const void* kernel) {
  std::lock_guard<std::mutex> lock(g_attr_mu);
  const auto it = g_max_dynamic_smem.find(kernel);
  return it == g_max_dynamic_smem.end() ? size_t{48} << 10 : it->second;
}

// `kernel<<<grid, block, smem, stream>>>(args...)` after to_host.cmake.
template <class K>
auto Launch(K* kernel, dim3 grid, dim3 block, size_t smem = 0, Stream* stream = nullptr) {
  return [=](auto... args) {
    const unsigned nt = block.x * block.y * block.z;
    LoseContextIfTriggered();
    if (Injected() != cudaSuccess) return;
    if (nt == 0 || nt > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        smem > MaxDynamicSmem(reinterpret_cast<const void*>(kernel))) {
      g_last_error = cudaErrorInvalidValue;
      return;
    }
    Enqueue(stream, [=] {
      g_body = [&] { kernel(args...); };
      RunBlocks(grid, block, smem);
    });
  };
}

template <class T>
T Exchange(T v, unsigned src_tid) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  g_slots[LinearTid()] = bits;
  Sync();
  T r;
  std::memcpy(&r, &g_slots[src_tid], sizeof(T));
  Sync();
  return r;
}

}  // namespace emu

using cudaStream_t = emu::Stream*;
using cudaEvent_t = emu::Event*;
using cudaGraph_t = emu::Graph*;
using cudaGraphExec_t = emu::Graph*;
using cudaGraphNode_t = void*;

#define threadIdx emu::tl_thread
#define blockIdx emu::tl_block
#define blockDim emu::g_block_dim
#define gridDim emu::g_grid_dim
#define __syncthreads() emu::Sync()

// ---- Device functions ----
template <class T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
  const unsigned tid = emu::LinearTid();
  return emu::Exchange(v, tid / width * width + static_cast<unsigned>(src_lane % width));
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  const unsigned tid = emu::LinearTid();
  return emu::Exchange(v, tid / width * width + ((tid % width) ^ static_cast<unsigned>(lane_mask)));
}
inline unsigned __ballot_sync(unsigned, int pred) {
  const unsigned tid = emu::LinearTid(), base = tid / 32 * 32;
  emu::g_slots[tid] = pred != 0;
  emu::Sync();
  unsigned bits = 0;
  for (unsigned l = 0; l < 32 && base + l < emu::g_slots.size(); ++l) {
    if (emu::g_slots[base + l] != 0) bits |= 1u << l;
  }
  emu::Sync();
  return bits;
}
inline int __syncthreads_or(int pred) {
  const unsigned tid = emu::LinearTid();
  emu::g_slots[tid] = pred != 0;
  emu::Sync();
  int any = 0;
  for (uint64_t v : emu::g_slots) any |= v != 0;
  emu::Sync();
  return any;
}
inline int __popc(unsigned v) { return std::popcount(v); }
inline int __popcll(unsigned long long v) { return std::popcount(v); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float fminf(float a, float b) { return std::fmin(a, b); }
inline float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

// ---- Runtime API ----
inline cudaError_t cudaGetLastError() {
  if (const cudaError_t lost = emu::g_lost; lost != cudaSuccess) return lost;  // it stays
  const cudaError_t e = emu::g_last_error;
  emu::g_last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return emu::g_last_error; }
inline const char* cudaGetErrorString(cudaError_t e) {
  if (e == cudaErrorNoDevice) return "no CUDA-capable device is detected";
  return e == cudaSuccess ? "no error" : "emulated CUDA error";
}
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    default:
      return "cudaErrorEmulated";
  }
}
// Only the field the backend reads.
struct cudaFuncAttributes {
  int maxDynamicSharedSizeBytes = 0;
};
template <class F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, F* kernel) {
  attr->maxDynamicSharedSizeBytes =
      static_cast<int>(emu::MaxDynamicSmem(reinterpret_cast<const void*>(kernel)));
  return cudaSuccess;
}
template <class F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute, int v) {
  if (v < 0 || static_cast<size_t>(v) > emu::kMaxSmem) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(emu::g_attr_mu);
  emu::g_max_dynamic_smem[reinterpret_cast<const void*>(kernel)] = static_cast<size_t>(v);
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  if (emu::DeviceGoneByFile()) {
    *n = 0;
    emu::g_last_error = cudaErrorNoDevice;
    return cudaErrorNoDevice;
  }
  *n = emu::DeviceCount();
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
  if (cudaError_t e = emu::Injected(); e != cudaSuccess) return e;
  if (!emu::ValidDevice(d)) return cudaErrorInvalidDevice;
  emu::tl_device = d;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = emu::tl_device;
  return cudaSuccess;
}
// Nothing to destroy: the devices' memory is the host's, and a test process keeps using it.
inline cudaError_t cudaDeviceReset() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (!emu::ValidDevice(d)) return cudaErrorInvalidDevice;
  *p = cudaDeviceProp{};
  std::strcpy(p->name, "emulated CUDA device");
  p->totalGlobalMem = emu::kDeviceBytes;
  p->sharedMemPerBlockOptin = emu::kMaxSmem;
  p->multiProcessorCount = 132;
  p->major = 9;
  p->minor = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int d) {
  if (!emu::ValidDevice(d)) return cudaErrorInvalidDevice;
  *v = attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? static_cast<int>(emu::kMaxSmem) : 132;
  return cudaSuccess;
}
inline cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *free_bytes = emu::kDeviceBytes;
  *total = emu::kDeviceBytes;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

inline cudaError_t cudaMalloc(void** p, size_t n) {
  if (cudaError_t e = emu::Injected(); e != cudaSuccess) return e;
  const size_t rounded = (n + 255) / 256 * 256 + 256;  // aligned_alloc takes whole alignments
  *p = std::aligned_alloc(256, rounded);
  if (*p == nullptr) return emu::g_last_error = cudaErrorMemoryAllocation;
#if defined(__SANITIZE_ADDRESS__)
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(*p) + n, rounded - n);  // an overrun is caught
#endif
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** p, size_t n) {
  return cudaMalloc(reinterpret_cast<void**>(p), n);
}
inline cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaHostAlloc(void** p, size_t n, unsigned) { return cudaMalloc(p, n); }
inline cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  if (cudaError_t e = emu::Injected(); e != cudaSuccess) return e;
  std::lock_guard<std::recursive_mutex> lock(emu::g_mu);
  if (n > 0) std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind,
                                   cudaStream_t s = nullptr) {
  if (cudaError_t e = emu::Injected(); e != cudaSuccess) return e;
  emu::Enqueue(s, [=] {
    if (n > 0) std::memmove(dst, src, n);
  });
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  std::lock_guard<std::recursive_mutex> lock(emu::g_mu);
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s = nullptr) {
  emu::Enqueue(s, [=] { std::memset(p, v, n); });
  return cudaSuccess;
}

namespace emu {
// A stream's, event's or graph's handle: a host object.
template <class T>
cudaError_t Create(T** handle) {
  *handle = new T;
  return cudaSuccess;
}
template <class T>
cudaError_t Destroy(T* handle) {
  delete handle;
  return cudaSuccess;
}
}  // namespace emu

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { return emu::Create(s); }
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) { return emu::Destroy(s); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (cudaError_t e = emu::Injected(); e != cudaSuccess) return e;
  return s != nullptr && s->capture != nullptr ? cudaErrorStreamCaptureInvalidated : cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return emu::Create(e); }
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { return emu::Destroy(e); }
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) { return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = 0.f;  // no device clock
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned = 0) {
  return cudaSuccess;
}

inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (s == nullptr || s->capture != nullptr) return cudaErrorInvalidValue;
  s->capture = new emu::Graph;
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  if (s == nullptr || s->capture == nullptr) return cudaErrorInvalidValue;
  *g = s->capture;
  s->capture = nullptr;
  return cudaSuccess;
}
inline cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t* nodes, size_t* n) {
  if (nodes != nullptr) return cudaErrorInvalidValue;
  *n = g->ops.size();
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t g,
                                        unsigned long long = 0) {
  *exec = new emu::Graph(*g);
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  emu::LoseContextIfTriggered();
  if (cudaError_t e = emu::Injected(); e != cudaSuccess) return e;
  if (const cudaError_t e = emu::g_fail_next_graph_launch.exchange(cudaSuccess); e != cudaSuccess) {
    emu::g_last_error = e;
    return e;
  }
  for (const auto& op : exec->ops) emu::Enqueue(s, op);
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t g) { return emu::Destroy(g); }
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t g) { return emu::Destroy(g); }
