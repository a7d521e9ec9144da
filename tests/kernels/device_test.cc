// `--device` parsing and the backend factory (kernels/device). Without a GPU (CI) a cuda device
// is refused with FailedPrecondition naming it; the CPU backend always opens.
#include "kernels/device/device.h"

#include <gtest/gtest.h>

namespace epd::kernels {
namespace {

TEST(DeviceTest, ParsesCpuCudaAndCudaN) {
  auto cpu = ParseDeviceSpec("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cpu->kind, DeviceSpec::Kind::kCpu);
  EXPECT_EQ(cpu->ToString(), "cpu");
  auto cuda = ParseDeviceSpec("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(cuda->ToString(), "cuda:0");
  auto cuda3 = ParseDeviceSpec("cuda:3");
  ASSERT_TRUE(cuda3.ok());
  EXPECT_EQ(cuda3->kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(cuda3->index, 3);
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:1x", "CPU", "cuda:99999999999"}) {
    auto s = ParseDeviceSpec(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.status().message().find(std::string("--device ") + bad), std::string::npos)
        << s.status();
  }
}

TEST(DeviceTest, CpuOpensAndRunsTheModel) {
  auto b = MakeBackend(DeviceSpec{});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), "cpu");
  EXPECT_TRUE(CheckModelCanRunOn(DeviceSpec{}).ok());
  EXPECT_TRUE(DeviceLost(**b).ok());  // the host is never lost
}

TEST(DeviceTest, CudaOpensOnAGpuAndIsRefusedNamingTheDeviceWithoutOne) {
  const DeviceSpec spec{DeviceSpec::Kind::kCuda, 0};
  // The check first: it releases the process's context on the device (cudaDeviceReset), which
  // would leave a backend made before it with dead streams.
  const absl::Status model = CheckModelCanRunOn(spec);
  auto b = MakeBackend(spec);
  EXPECT_TRUE(WeightsInBackend(spec));
  EXPECT_FALSE(WeightsInBackend(DeviceSpec{}));
  if (b.ok()) {  // a GPU: the model runs there (tests/gpu/cuda_model_test)
    EXPECT_GE(CudaDeviceCount(), 1);
    EXPECT_EQ((*b)->Name(), "cuda");
    EXPECT_EQ((*b)->memory_kind(), MemoryKind::kDevice);
    EXPECT_TRUE(model.ok()) << model;
    GTEST_SKIP() << "a GPU is present: the no-GPU refusal is not testable here";
  }
  EXPECT_EQ(model.code(), absl::StatusCode::kFailedPrecondition) << model;
  EXPECT_EQ(CudaDeviceCount(), 0);  // what `epd serve --device cuda` spreads its workers over
  EXPECT_NE(model.message().find("cuda:0"), std::string::npos) << model;
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  EXPECT_NE(b.status().message().find("cuda:0 is not available"), std::string::npos) << b.status();
  if (CudaBackendBuilt()) {
    EXPECT_NE(b.status().message().find("no CUDA device"), std::string::npos) << b.status();
  } else {
    EXPECT_NE(b.status().message().find("no CUDA backend"), std::string::npos) << b.status();
  }
  EXPECT_EQ(model.message(), b.status().message());
}

}  // namespace
}  // namespace epd::kernels
