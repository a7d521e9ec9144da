// The main of every GoogleTest binary (epd_test, cmake/EpdWarnings.cmake), in place of
// gtest_main: it also catches SIGPIPE with a handler that does nothing. A test is a client of
// real servers, and one that hangs up while the test still writes (a TLS port answering a
// plaintext request, a server refusing an oversized body) must fail that write with EPIPE, not
// kill the test binary: Debian's cpp-httplib 0.11.4 sends without MSG_NOSIGNAL. A handler, not
// SIG_IGN, because an ignored signal stays ignored across exec and the processes a test starts
// (workers, shell pipelines) must keep the default.
//
// It also gives the binary a cluster secret ($EPD_CLUSTER_SECRET, random per run) when none is set,
// so the in-process servers and clients and the processes a test starts (which inherit it) are one
// cluster (docs/security.md); the tests that play a stranger use another secret on purpose.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <cstdio>
#include <random>

namespace {
void OnSigpipe(int) {}  // nothing: the write that raised it fails with EPIPE
}  // namespace

int main(int argc, char** argv) {
  struct sigaction sa {};
  sa.sa_handler = OnSigpipe;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGPIPE, &sa, nullptr);
  if (getenv("EPD_CLUSTER_SECRET") == nullptr && getenv("EPD_CLUSTER_SECRET_FILE") == nullptr &&
      getenv("EPD_CLUSTER_TOKEN") == nullptr) {
    std::random_device rd;
    char secret[33];
    for (int i = 0; i < 4; ++i) std::snprintf(secret + 8 * i, 9, "%08x", rd());
    setenv("EPD_CLUSTER_SECRET", secret, 1);
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
