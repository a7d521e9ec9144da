#include "tests/testing/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

namespace epd::testing {

std::string BinaryPath(const std::string& name) {
  const char* dir = std::getenv("EPD_BINARY_DIR");
  return std::string(dir ? dir : EPD_DEFAULT_BINARY_DIR) + "/" + name;
}

std::string SourcePath(const std::string& relative) {
  const char* dir = std::getenv("EPD_SOURCE_DIR");
  return std::string(dir ? dir : EPD_DEFAULT_SOURCE_DIR) + "/" + relative;
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "epd-test-XXXXXX").string();
  char* p = mkdtemp(tmpl.data());
  path_ = p ? p : "";
}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

namespace {
// Whether `port` can be bound on 127.0.0.1 now.
bool Bindable(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}
}  // namespace

int PickFreePort() {
  // Below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default):
  // a port from that range can be taken between this pick and the program's bind by any
  // connect() or bind(0) of the tests running beside it, which are many; below it only another
  // pick can collide, one chance in thousands.
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  const int lo = 10000, hi = std::max(lo + 1000, low);
  thread_local std::mt19937 rng(static_cast<unsigned>(std::random_device{}() ^ getpid()));
  std::uniform_int_distribution<int> pick(lo, hi - 1);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = pick(rng);
    if (Bindable(port)) return port;
  }
  return -1;
}

std::optional<std::string> HttpGet(int port, const std::string& path, int* status) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(5);
  cli.set_read_timeout(10);
  auto res = cli.Get(path);
  if (!res) return std::nullopt;
  if (status) *status = res->status;
  return res->body;
}

int RunCommand(const std::string& cmd, std::string* out) {
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
    if (out) out->append(buf, n);
  }
  int st = pclose(f);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

std::string DescribeThreads(pid_t pid) {
  auto first_line = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    std::string line;
    std::getline(in, line);
    return line;
  };
  std::ostringstream out;
  const std::filesystem::path task = "/proc/" + std::to_string(pid) + "/task";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(task, ec)) {
    const std::string stat = first_line(entry.path() / "stat");
    // State is the field after the parenthesised name.
    const size_t close = stat.rfind(')');
    const char state =
        close != std::string::npos && close + 2 < stat.size() ? stat[close + 2] : '?';
    out << "  thread " << entry.path().filename().string() << " '"
        << first_line(entry.path() / "comm") << "' state " << state << " wchan "
        << first_line(entry.path() / "wchan") << " syscall " << first_line(entry.path() / "syscall")
        << "\n";
  }
  if (ec) out << "  (cannot list " << task.string() << ": " << ec.message() << ")\n";
  return out.str();
}

}  // namespace epd::testing
