// tests/testing/test_main.cc, the main of every test binary: a write to a peer that hung up fails
// with EPIPE instead of killing the test, and a process the test starts still dies of SIGPIPE
// (the handler is reset by exec; SIG_IGN would have been inherited).
#include <errno.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

TEST(TestMainTest, AWriteToAPeerThatHungUpFailsWithEpipe) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  close(fds[1]);
  const char byte = 'x';
  errno = 0;
  EXPECT_EQ(write(fds[0], &byte, 1), -1);  // without the handler: SIGPIPE ends the binary here
  EXPECT_EQ(errno, EPIPE);
  close(fds[0]);
}

TEST(TestMainTest, AStartedProcessKeepsTheDefaultSigpipe) {
  // A shell whose stdout is a pipe nobody reads: `yes` dies of SIGPIPE (the default) rather than
  // looping on EPIPE or exiting with an error.
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execl("/bin/sh", "sh", "-c", "exec yes", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  close(fds[0]);  // the reader goes: yes's next write raises SIGPIPE
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGPIPE);
}

}  // namespace
