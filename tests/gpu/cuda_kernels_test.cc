// CUDA backend checks. They run on a GPU machine and skip, saying so, everywhere else.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_device.h"
#if defined(EPD_CUDA_EMULATED)
#include <cuda_runtime.h>  // the emulation's (tests/gpu/emulated): its injected failures
#endif

namespace {

#define SKIP_WITHOUT_GPU()                                          \
  do {                                                              \
    std::string why;                                                \
    if (epd::kernels::cuda::DeviceCount(&why) == 0) {               \
      GTEST_SKIP() << "skipped: no GPU (" << why << ")";            \
    }                                                               \
  } while (0)

// Small uploads into stream-0 buffers are staged in a pinned ring and return before the device
// has copied them (kernels/cuda/cuda_backend.h). Each is still seen, in order, by every later op
// and by a Download from any stream, after the ring has wrapped several times and with the
// caller's host array overwritten at once; large uploads and other streams' buffers copy
// synchronously with the same result.
TEST(CudaKernelsTest, StagedUploadsAreSeenInOrderByLaterOps) {
  SKIP_WITHOUT_GPU();
  auto be = epd::kernels::MakeCudaBackend(0);
  ASSERT_TRUE(be.ok()) << be.status();
  epd::kernels::Backend& b = **be;
  const int64_t n = 1024, rounds = 300;  // 300 uploads: the 64-slot ring wraps four times
  auto acc = b.Allocate(n * 4);
  auto one = b.Allocate(n * 4);
  auto big = b.Allocate(int64_t{1} << 20);                         // > a staging slot
  auto side = b.Allocate(n * 4, epd::kernels::Stream{1});          // another stream's buffer
  ASSERT_TRUE(acc.ok() && one.ok() && big.ok() && side.ok());
  std::vector<float> host(n, 0.f), expect(n, 0.f);
  ASSERT_TRUE(b.Upload(host.data(), n * 4, *acc).ok());
  for (int64_t r = 0; r < rounds; ++r) {
    for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>((r * 7 + i) % 13);
    ASSERT_TRUE(b.Upload(host.data(), n * 4, *one).ok());
    for (int64_t i = 0; i < n; ++i) expect[i] += host[i];
    std::fill(host.begin(), host.end(), -1.f);  // the staged copy no longer needs it
    ASSERT_TRUE(b.Add(acc->as<float>(), one->as<float>(), n).ok());
  }
  std::vector<float> got(n);
  ASSERT_TRUE(b.Download(*acc, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, expect);
  // A Download from another stream sees the last staged upload.
  for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(i);
  ASSERT_TRUE(b.Upload(host.data(), n * 4, *one).ok());
  ASSERT_TRUE(b.Copy(side->as<float>(), one->as<float>(), n * 4).ok());
  ASSERT_TRUE(b.Download(*side, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, host);
  // The synchronous paths: a 1 MiB upload and one into a stream-1 buffer.
  std::vector<uint8_t> mb(size_t{1} << 20), back(mb.size());
  for (size_t i = 0; i < mb.size(); ++i) mb[i] = static_cast<uint8_t>(i * 31);
  ASSERT_TRUE(b.Upload(mb.data(), static_cast<int64_t>(mb.size()), *big).ok());
  ASSERT_TRUE(b.Download(*big, 0, static_cast<int64_t>(back.size()), back.data()).ok());
  EXPECT_EQ(back, mb);
  ASSERT_TRUE(b.Upload(expect.data(), n * 4, *side).ok());
  ASSERT_TRUE(b.Download(*side, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, expect);
}

// SetCudaOpProfiling / CudaOpProfile (kernels/cuda/cuda_backend.h): each op called while profiling
// is on counts once under its name, with non-negative times; switching it on again clears the
// table; a backend that is not CUDA is refused, naming it.
TEST(CudaKernelsTest, OpProfileCountsEachOpCalled) {
  SKIP_WITHOUT_GPU();
  auto be = epd::kernels::MakeCudaBackend(0);
  ASSERT_TRUE(be.ok()) << be.status();
  epd::kernels::Backend& b = **be;
  const int64_t n = 4096;
  auto x = b.Allocate(n * 4), y = b.Allocate(n * 4);
  ASSERT_TRUE(x.ok() && y.ok());
  ASSERT_TRUE(b.Add(x->as<float>(), y->as<float>(), n).ok());  // before: not counted
  ASSERT_TRUE(epd::kernels::SetCudaOpProfiling(b, true).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(b.Add(x->as<float>(), y->as<float>(), n).ok());
  ASSERT_TRUE(b.Copy(y->as<float>(), x->as<float>(), n * 4).ok());
  // An op of several launches (quantize, GEMM) is one entry too: the whole op is timed.
  epd::kernels::QuantWeight w;
  w.out = 8;
  w.in = 64;
  w.values.assign(w.out * w.in, 0.5f);
  w.scales.assign(w.scale_rows() * w.scale_cols(), 1.f);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(b.LinearQuant(x->as<float>(), 2, w, y->as<float>()).ok());
  auto table = epd::kernels::CudaOpProfile(b);
  ASSERT_TRUE(table.ok()) << table.status();
  std::map<std::string, int64_t> calls;
  for (const auto& t : *table) {
    calls[t.op] = t.calls;
    EXPECT_GE(t.device_ms, 0) << t.op;
    EXPECT_GE(t.host_ms, 0) << t.op;
  }
  EXPECT_EQ(calls["Add"], 3);
  EXPECT_EQ(calls["LinearQuant"], 2);
  ASSERT_TRUE(epd::kernels::SetCudaOpProfiling(b, true).ok());
  EXPECT_TRUE(epd::kernels::CudaOpProfile(b)->empty());
  ASSERT_TRUE(epd::kernels::SetCudaOpProfiling(b, false).ok());
  ASSERT_TRUE(b.Add(x->as<float>(), y->as<float>(), n).ok());
  EXPECT_TRUE(epd::kernels::CudaOpProfile(b)->empty());
  auto cpu = epd::kernels::MakeCpuBackend();
  const absl::Status refused = epd::kernels::SetCudaOpProfiling(*cpu, true);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("cpu"), std::string::npos) << refused;
}

// While one thread records a graph (stream capture of stream 0, relaxed mode), another may run
// the KV pool's block ops (backend.h allows CopyBlocks, DigestBlocks and BlocksEqual from any
// thread). Such an op must not land in the graph, where it would not run now and would run again
// at every launch: it waits for the capture to end, then runs once, and the graph holds only the
// capturing thread's ops.
TEST(CudaKernelsTest, AnotherThreadsOpDuringACaptureRunsOnceOutsideTheGraph) {
  SKIP_WITHOUT_GPU();
  auto be = epd::kernels::MakeCudaBackend(0);
  ASSERT_TRUE(be.ok()) << be.status();
  epd::kernels::Backend& b = **be;
  const int64_t n = 256;
  auto x = b.Allocate(n * 4), y = b.Allocate(n * 4), z = b.Allocate(n * 4);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  const std::vector<float> ones(n, 1.f);
  for (auto* buf : {&*x, &*y, &*z}) ASSERT_TRUE(b.Upload(ones.data(), n * 4, *buf, 0).ok());
  ASSERT_TRUE(b.Synchronize(epd::kernels::Stream{}).ok());

  ASSERT_TRUE(b.BeginCapture().ok());
  ASSERT_TRUE(b.Add(x->as<float>(), y->as<float>(), n).ok());  // recorded: x += y
  std::atomic<bool> done{false};
  absl::Status other_status;
  std::thread other([&] {
    other_status = b.Add(z->as<float>(), y->as<float>(), n);  // z += y, not to be recorded
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(done.load()) << "the other thread's op did not wait for the capture to end";
  auto graph = b.EndCapture();
  other.join();
  ASSERT_TRUE(graph.ok()) << graph.status();
  ASSERT_TRUE(other_status.ok()) << other_status;
  EXPECT_EQ((*graph)->ops(), 1);
  std::vector<float> got(n);
  ASSERT_TRUE(b.Download(*x, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, ones) << "the recorded op ran before its graph was launched";
  ASSERT_TRUE(b.Download(*z, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, std::vector<float>(n, 2.f)) << "the other thread's op did not run once";
  ASSERT_TRUE(b.LaunchGraph(**graph).ok());
  ASSERT_TRUE(b.LaunchGraph(**graph).ok());
  ASSERT_TRUE(b.Download(*x, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, std::vector<float>(n, 3.f));
  ASSERT_TRUE(b.Download(*z, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, std::vector<float>(n, 2.f)) << "the other thread's op ran with the graph";
}

#if defined(EPD_CUDA_EMULATED)
// Errors the device gives, injected into the emulation (a real GPU faults only by a kernel's bad
// access, which would leave the test process unable to use it).
// - One failed call fails its op alone: its error is not charged to the next op (the runtime keeps
//   a failed call's error as the thread's last error, which the next launch's check reads).
// - An error that loses the device's context (an illegal address: every later CUDA call of the
//   process fails) is Unavailable and kept: CudaDeviceLost reports it, naming the op that met it,
//   and every later op fails at once naming it, even where the runtime would answer again (here,
//   restored), since only a new process can use the GPU; a worker exits on it to be restarted.
TEST(CudaKernelsTest, ALostContextFailsEveryLaterOpAndIsReported) {
  auto be = epd::kernels::MakeCudaBackend(0);
  ASSERT_TRUE(be.ok()) << be.status();
  epd::kernels::Backend& b = **be;
  const int64_t n = 64;
  auto x = b.Allocate(n * 4), y = b.Allocate(n * 4);
  ASSERT_TRUE(x.ok() && y.ok());
  const std::vector<float> ones(n, 1.f);
  ASSERT_TRUE(b.Upload(ones.data(), n * 4, *x, 0).ok());
  ASSERT_TRUE(b.Upload(ones.data(), n * 4, *y, 0).ok());
  ASSERT_TRUE(b.Add(x->as<float>(), y->as<float>(), n).ok());
  EXPECT_TRUE(epd::kernels::CudaDeviceLost(b).ok());

  emu::FailNextCall(cudaErrorInvalidValue);
  const absl::Status failed = b.RoundBf16(x->as<float>(), n);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_NE(failed.message().find("RoundBf16: cudaErrorInvalidValue"), std::string::npos) << failed;
  EXPECT_TRUE(b.Add(x->as<float>(), y->as<float>(), n).ok()) << "charged with the last error";
  EXPECT_TRUE(epd::kernels::CudaDeviceLost(b).ok());
  std::vector<float> got(n);
  ASSERT_TRUE(b.Download(*x, 0, n * 4, got.data()).ok());
  EXPECT_EQ(got, std::vector<float>(n, 3.f));  // both Adds ran, the failed op did nothing

  emu::LoseContext(cudaErrorIllegalAddress);
  const absl::Status first = b.Add(x->as<float>(), y->as<float>(), n);
  EXPECT_EQ(first.code(), absl::StatusCode::kUnavailable) << first;
  EXPECT_NE(first.message().find("Add: cudaErrorIllegalAddress"), std::string::npos) << first;
  const absl::Status lost = epd::kernels::CudaDeviceLost(b);
  EXPECT_NE(lost.message().find("cuda:0 is lost since cuda backend: Add: cudaErrorIllegalAddress"),
            std::string::npos)
      << lost;
  emu::RestoreContext();
  for (const absl::Status& later :
       {b.RoundBf16(x->as<float>(), n), b.Download(*x, 0, n * 4, got.data()),
        b.Upload(ones.data(), n * 4, *x, 0), b.Allocate(n * 4).status(),
        b.Synchronize(epd::kernels::Stream{})}) {
    EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable) << later;
    EXPECT_NE(later.message().find(lost.message()), std::string::npos) << later;
  }
  EXPECT_EQ(epd::kernels::CudaDeviceLost(b), lost);  // the first error, kept
}
#endif

}  // namespace
