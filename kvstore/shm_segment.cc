#include "kvstore/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace epd::kvstore {
namespace {

constexpr char kMemfdName[] = "epd-kv-segment";

absl::Status Errno(const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

std::string HostId() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!std::getline(boot, id) || id.empty()) return "";
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return "";
  return absl::StrCat(absl::StripAsciiWhitespace(id), "/", st.st_ino);
}

absl::StatusOr<std::unique_ptr<ClientSegment>> ClientSegment::Create(size_t bytes) {
  std::unique_ptr<ClientSegment> seg(new ClientSegment());
  seg->fd_ = memfd_create(kMemfdName, MFD_CLOEXEC);
  if (seg->fd_ < 0) return Errno("memfd_create");
  struct stat st;
  if (fstat(seg->fd_, &st) != 0) return Errno("fstat(memfd)");
  seg->inode_ = st.st_ino;
  if (auto s = seg->Reserve(bytes); !s.ok()) return s;
  return seg;
}

ClientSegment::~ClientSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

absl::Status ClientSegment::Reserve(size_t bytes) {
  if (bytes <= size_ && data_ != nullptr) return absl::OkStatus();
  // Round up to 1 MiB so that a growing workload does not remap on every call.
  const size_t want =
      (std::max<size_t>(bytes, 1) + (1u << 20) - 1) & ~static_cast<size_t>((1u << 20) - 1);
  if (data_ != nullptr) {
    munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }
  if (ftruncate(fd_, static_cast<off_t>(want)) != 0) return Errno("ftruncate(memfd)");
  void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) return Errno("mmap(memfd)");
  data_ = static_cast<uint8_t*>(p);
  size_ = want;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MappedPeerSegment>> MappedPeerSegment::Map(
    int pid, int fd, uint64_t inode, uint64_t size, bool writable, std::string* reason) {
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  char link[256];
  const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n < 0) {
    *reason = "open";
    return absl::FailedPreconditionError(
        absl::StrCat("shm: cannot read ", path, ": ", std::strerror(errno)));
  }
  link[n] = '\0';
  if (std::string_view(link).rfind(absl::StrCat("/memfd:", kMemfdName), 0) != 0) {
    *reason = "not_memfd";
    return absl::FailedPreconditionError(
        absl::StrCat("shm: ", path, " is '", link, "', not an epd memfd segment"));
  }
  const int local = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (local < 0) {
    *reason = "open";
    return absl::FailedPreconditionError(
        absl::StrCat("shm: cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(local, &st) != 0 || static_cast<uint64_t>(st.st_ino) != inode) {
    close(local);
    *reason = "inode";
    return absl::FailedPreconditionError(
        absl::StrCat("shm: ", path, " is not the segment announced (inode ", inode, ")"));
  }
  if (size == 0 || static_cast<uint64_t>(st.st_size) < size) {
    close(local);
    *reason = "size";
    return absl::FailedPreconditionError(
        absl::StrCat("shm: segment ", path, " holds ", st.st_size, " bytes, announced ", size));
  }
  // MAP_POPULATE: one page-table fill instead of a fault per page (the pages exist already).
  void* p = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                 MAP_SHARED | MAP_POPULATE, local, 0);
  close(local);  // the mapping keeps the memory until munmap
  if (p == MAP_FAILED) {
    *reason = "map";
    return absl::FailedPreconditionError(
        absl::StrCat("shm: cannot map ", path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<MappedPeerSegment> m(new MappedPeerSegment());
  m->data_ = static_cast<uint8_t*>(p);
  m->size_ = size;
  return m;
}

MappedPeerSegment::~MappedPeerSegment() {
  if (data_ != nullptr) munmap(data_, size_);
}

}  // namespace epd::kvstore
