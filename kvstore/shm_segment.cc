#include "kvstore/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

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
  seg->fd_ = memfd_create(kMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (seg->fd_ < 0) return Errno("memfd_create");
  // The daemon keeps its mapping across calls: the segment may grow but never shrink under it.
  if (fcntl(seg->fd_, F_ADD_SEALS, F_SEAL_SHRINK) != 0) return Errno("F_ADD_SEALS(memfd)");
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
  const int seals = fcntl(local, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    close(local);
    *reason = "not_sealed";
    return absl::FailedPreconditionError(
        absl::StrCat("shm: segment ", path, " is not sealed against shrinking (F_SEAL_SHRINK)"));
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
  m->writable_ = writable;
  return m;
}

MappedPeerSegment::~MappedPeerSegment() {
  if (data_ != nullptr) munmap(data_, size_);
}

namespace {

// Whether /proc/<pid>/fd/<fd> still names the memfd with `inode`.
bool StillNamed(int pid, int fd, uint64_t inode) {
  struct stat st;
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  return stat(path.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_ino) == inode;
}

}  // namespace

PeerSegmentCache::PeerSegmentCache(size_t max_entries, std::chrono::milliseconds sweep,
                                   std::function<void(size_t)> on_count)
    : max_entries_(std::max<size_t>(max_entries, 1)), sweep_(sweep), on_count_(std::move(on_count)) {
  sweeper_ = std::thread([this] {
    std::unique_lock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, sweep_, [this] { return stop_; });
      if (stop_) break;
      lock.unlock();
      Sweep();
      lock.lock();
    }
  });
}

PeerSegmentCache::~PeerSegmentCache() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  sweeper_.join();
}

void PeerSegmentCache::CountLocked() {
  if (on_count_) on_count_(entries_.size());
}

size_t PeerSegmentCache::size() const {
  std::lock_guard lock(mu_);
  return entries_.size();
}

void PeerSegmentCache::Sweep() {
  std::vector<std::shared_ptr<MappedPeerSegment>> dropped;  // unmapped outside the lock
  std::lock_guard lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (StillNamed(it->pid, it->fd, it->inode)) {
      ++it;
    } else {
      dropped.push_back(std::move(it->seg));
      it = entries_.erase(it);
    }
  }
  if (!dropped.empty()) CountLocked();
}

absl::StatusOr<std::shared_ptr<MappedPeerSegment>> PeerSegmentCache::Acquire(
    int pid, int fd, uint64_t inode, uint64_t size, bool writable, std::string* reason) {
  std::shared_ptr<MappedPeerSegment> stale;  // unmapped outside the lock
  {
    std::lock_guard lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->pid != pid || it->fd != fd || it->inode != inode) continue;
      if (it->seg->size() >= size && (it->seg->writable() || !writable) &&
          StillNamed(pid, fd, inode)) {
        entries_.splice(entries_.begin(), entries_, it);
        return entries_.front().seg;
      }
      stale = std::move(it->seg);  // grown, or mapped read-only: map it again below
      entries_.erase(it);
      CountLocked();
      break;
    }
  }
  stale.reset();
  auto mapped = MappedPeerSegment::Map(pid, fd, inode, size, writable, reason);
  if (!mapped.ok()) return mapped.status();
  std::shared_ptr<MappedPeerSegment> seg = *std::move(mapped);
  std::vector<std::shared_ptr<MappedPeerSegment>> dropped;
  std::lock_guard lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->pid == pid && it->fd == fd && it->inode == inode) {  // a concurrent call mapped it too
      dropped.push_back(std::move(it->seg));
      entries_.erase(it);
      break;
    }
  }
  entries_.push_front(Entry{pid, fd, inode, seg});
  while (entries_.size() > max_entries_) {
    dropped.push_back(std::move(entries_.back().seg));
    entries_.pop_back();
  }
  CountLocked();
  return seg;
}

}  // namespace epd::kvstore
