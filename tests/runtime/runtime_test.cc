#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "prometheus/counter.h"
#include "runtime/http_util.h"
#include "runtime/listen_thread.h"
#include "runtime/metrics_server.h"
#include "runtime/shutdown.h"
#include "tests/testing/subprocess.h"

namespace epd::services {
namespace {

TEST(MetricsServerTest, ServesRegistryAndHealth) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& fam = prometheus::BuildCounter()
                  .Name("epd_test_requests_total")
                  .Help("test counter")
                  .Register(*registry);
  fam.Add({{"pool", "decode"}}).Increment(3);
  runtime::MetricsServer server(registry, "test");
  auto port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  int status = 0;
  auto body = epd::testing::HttpGet(*port, "/metrics", &status);
  ASSERT_TRUE(body.has_value());
  EXPECT_EQ(status, 200);
  EXPECT_NE(body->find("epd_test_requests_total{pool=\"decode\"} 3"), std::string::npos) << *body;

  auto health = epd::testing::HttpGet(*port, "/health", &status);
  ASSERT_TRUE(health.has_value());
  EXPECT_EQ(status, 200);
  EXPECT_NE(health->find("\"status\":\"ok\""), std::string::npos);

  server.SetHealth([] { return runtime::HealthReport{false, R"({"reason":"draining"})"}; });
  health = epd::testing::HttpGet(*port, "/health", &status);
  EXPECT_EQ(status, 503);
  EXPECT_NE(health->find("draining"), std::string::npos);
  server.Stop();
  EXPECT_FALSE(epd::testing::HttpGet(*port, "/health").has_value());
}

TEST(MetricsServerTest, BusyPortIsAClearError) {
  auto registry = std::make_shared<prometheus::Registry>();
  runtime::MetricsServer a(registry, "a"), b(registry, "b");
  auto port = a.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok());
  auto again = b.Start("127.0.0.1", *port);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(std::to_string(*port)), std::string::npos);
}

TEST(ListenThreadTest, StopRightAfterStartEndsTheAcceptLoop) {
  // A SIGTERM during a router's startup stops its HTTP server before the accept loop may have
  // started. httplib ignores stop() then, so a plain stop + join hung forever (the router never
  // exited: ProcessRuntimeTest.SigtermDrainsToCleanExit under CI load). The loop runs on a
  // detached thread so a hang fails the test instead of blocking it.
  auto finished = std::make_shared<std::promise<int>>();
  auto result = finished->get_future();
  std::thread([finished] {
    int stopped = 0;
    for (int i = 0; i < 200; ++i) {
      httplib::Server server;
      runtime::ConfigureListener(server);
      if (server.bind_to_any_port("127.0.0.1") <= 0) break;
      runtime::ListenThread listener;
      listener.Start(&server);
      if (i % 2 == 1) std::this_thread::sleep_for(std::chrono::microseconds(50 * (i % 7)));
      listener.Stop();
      ++stopped;
    }
    finished->set_value(stopped);
  }).detach();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "runtime::ListenThread::Stop did not return";
  EXPECT_EQ(result.get(), 200);
}

TEST(ShutdownTest, RequestWakesWaiter) {
  runtime::InstallShutdownHandlers();
  std::thread t([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    runtime::RequestShutdown();
  });
  EXPECT_TRUE(runtime::WaitForShutdown(std::chrono::seconds(10)));
  t.join();
  EXPECT_TRUE(runtime::ShutdownRequested());
}

// The thread that waits on the handler's self-pipe, found as the other thread blocked in read()
// (this one reads its own syscall file with read()).
pid_t PipeWatcherThread() {
  const pid_t self = static_cast<pid_t>(syscall(SYS_gettid));
  for (int attempt = 0; attempt < 500; ++attempt) {
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
      const pid_t tid = static_cast<pid_t>(std::stol(e.path().filename()));
      std::ifstream in(e.path() / "syscall");
      long nr = -1;
      if (tid != self && in >> nr && nr == SYS_read) return tid;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return -1;
}

// A SIGTERM that the kernel hands to the watcher thread itself interrupts its read() (EINTR);
// the shutdown must still happen (the router once hung there: ProcessRuntimeTest's SIGTERM).
// In a fresh process (the shutdown state is once per process).
TEST(ShutdownTest, SignalOnTheWatcherThreadItselfIsNotLost) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        runtime::InstallShutdownHandlers();
        const pid_t watcher = PipeWatcherThread();
        if (watcher <= 0) _exit(2);
        syscall(SYS_tgkill, getpid(), watcher, SIGTERM);
        _exit(runtime::WaitForShutdown(std::chrono::seconds(10)) ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace epd::services

namespace epd::services {
namespace {

TEST(PortFileTest, ZeroTimeoutReadsAnExistingFileOnce) {
  epd::testing::TempDir dir;
  EXPECT_FALSE(runtime::WaitForPortFile(dir.File("ports.json"), "grpc", std::chrono::milliseconds(0)));
  std::ofstream(dir.File("ports.json")) << R"({"grpc": 4242, "metrics": 7})";
  EXPECT_EQ(runtime::WaitForPortFile(dir.File("ports.json"), "grpc", std::chrono::milliseconds(0)), 4242);
  EXPECT_FALSE(runtime::WaitForPortFile(dir.File("ports.json"), "http", std::chrono::milliseconds(0)));
}

}  // namespace
}  // namespace epd::services
