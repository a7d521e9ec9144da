#include "runtime/processes.h"

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace epd::runtime {

std::set<pid_t> ProcessesNaming(const std::string& needle, pid_t except) {
  std::set<pid_t> out;
  DIR* proc = opendir("/proc");
  if (!proc) return out;
  while (dirent* e = readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(atoi(e->d_name));
    if (pid <= 0 || pid == except || pid == getpid()) continue;
    std::ifstream cmd("/proc/" + std::string(e->d_name) + "/cmdline");
    std::stringstream ss;
    ss << cmd.rdbuf();
    if (ss.str().find(needle) == std::string::npos) continue;
    std::ifstream stat("/proc/" + std::string(e->d_name) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z') continue;
    out.insert(pid);
  }
  closedir(proc);
  return out;
}

}  // namespace epd::runtime
