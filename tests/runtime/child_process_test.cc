// ChildProcess (runtime/child_process.h), the launcher's and the tests' process handle:
// move assignment over a running child kills and reaps it (it used to run its own destructor
// and assign into the destroyed log path: `double free` under `epd serve` restarts); a program
// that cannot start is an error naming the cause; no descriptor of the parent leaks into the
// child; and a child started with a parent-death signal dies with a parent that is SIGKILLed.
#include "runtime/child_process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

namespace epd::services {
namespace {

// True while `pid` exists and is not a zombie.
bool Alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
}

TEST(ChildProcessTest, MoveAssignmentOverARunningChildKillsAndReapsIt) {
  runtime::ChildProcess p = runtime::ChildProcess::Start({"/bin/sleep", "30"}, "/dev/null");
  ASSERT_GT(p.pid(), 0) << p.error();
  for (int i = 0; i < 5; ++i) {  // the restart loop of `epd serve`
    const pid_t old = p.pid();
    p = runtime::ChildProcess::Start({"/bin/sleep", "30"}, "/dev/null");
    ASSERT_GT(p.pid(), 0) << p.error();
    EXPECT_NE(p.pid(), old);
    EXPECT_FALSE(Alive(old));
    EXPECT_EQ(p.log_path(), "/dev/null");
    EXPECT_TRUE(p.running());
  }
  runtime::ChildProcess q = std::move(p);
  EXPECT_EQ(p.pid(), -1);
  EXPECT_TRUE(q.running());
  p = std::move(q);  // into an empty one
  EXPECT_TRUE(p.running());
  EXPECT_EQ(p.Stop(std::chrono::seconds(5)), 128 + SIGTERM);
  EXPECT_EQ(p.exit_status(), 128 + SIGTERM);
  EXPECT_FALSE(p.running());
}

TEST(ChildProcessTest, AProgramThatCannotStartIsAnErrorNamingIt) {
  runtime::ChildProcess p = runtime::ChildProcess::Start({"/nonexistent/epd-x"}, "");
  EXPECT_LE(p.pid(), 0);
  EXPECT_NE(p.error().find("/nonexistent/epd-x"), std::string::npos) << p.error();
  EXPECT_FALSE(p.running());
}

TEST(ChildProcessTest, NoDescriptorOfTheParentLeaksIntoTheChild) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);  // without O_CLOEXEC, as a library might leave one
  ASSERT_GE(dup2(fds[0], 57), 0);
  char tmpl[] = "/tmp/epd-child-XXXXXX";
  const int log_fd = mkstemp(tmpl);
  ASSERT_GE(log_fd, 0);
  close(log_fd);
  runtime::ChildProcess p = runtime::ChildProcess::Start({"/bin/sh", "-c", "ls /proc/self/fd"}, tmpl);
  ASSERT_EQ(p.Wait(std::chrono::seconds(10)), 0);
  const std::string fds_seen = p.ReadLog();
  EXPECT_EQ(fds_seen.find("57"), std::string::npos) << fds_seen;
  EXPECT_NE(fds_seen.find("2"), std::string::npos) << fds_seen;
  close(57);
  close(fds[0]);
  close(fds[1]);
  unlink(tmpl);
}

TEST(ChildProcessTest, AChildWithAParentDeathSignalDiesWithItsSigkilledParent) {
  int report[2];
  ASSERT_EQ(pipe(report), 0);
  const pid_t parent = fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {  // the launcher: starts a long child, reports its pid, waits to be killed
    runtime::SpawnOptions options;
    options.parent_death_signal = SIGKILL;
    runtime::ChildProcess child = runtime::ChildProcess::StartWith({"/bin/sleep", "60"}, "", options);
    const pid_t pid = child.pid();
    ssize_t n = write(report[1], &pid, sizeof(pid));
    (void)n;
    pause();
    _exit(0);
  }
  close(report[1]);
  pid_t child = -1;
  ASSERT_EQ(read(report[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  close(report[0]);
  ASSERT_GT(child, 0);
  EXPECT_TRUE(Alive(child));
  kill(parent, SIGKILL);
  int st;
  waitpid(parent, &st, 0);
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    gone = !Alive(child);
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_TRUE(gone) << "pid " << child << " outlived its SIGKILLed parent";
  if (!gone) kill(child, SIGKILL);
}

}  // namespace
}  // namespace epd::services
