#pragma once

// Same-host value exchange for the kvstore (docs/kvstore.md "Shared memory"). A client owns a
// memfd segment (ClientSegment); for one BatchGet/BatchPut call it names the segment (its pid, fd,
// inode and size), the daemon maps it (MappedPeerSegment), copies values in (get) or out (put),
// and unmaps and closes it before answering. The daemon never keeps a client's memory past a
// call, so a client that dies leaks nothing: its memfd is freed with its last descriptor.
// Both ends must run under the same kernel and pid namespace (HostId()).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace epd::kvstore {

// "<boot id>/<pid namespace inode>": equal on two processes that can reach each other's
// /proc/<pid>/fd. Empty when it cannot be read (no shared memory then).
std::string HostId();

// A memfd mapped read-write in the owning (client) process. Not thread-safe: one call at a time.
class ClientSegment {
 public:
  static absl::StatusOr<std::unique_ptr<ClientSegment>> Create(size_t bytes);
  ~ClientSegment();
  ClientSegment(const ClientSegment&) = delete;
  ClientSegment& operator=(const ClientSegment&) = delete;

  // Grows the segment to at least `bytes` (contents are not kept).
  absl::Status Reserve(size_t bytes);
  uint8_t* data() { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  uint64_t inode() const { return inode_; }

 private:
  ClientSegment() = default;
  int fd_ = -1;
  uint64_t inode_ = 0;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// A client's segment mapped in the daemon for one call; unmapped by the destructor.
class MappedPeerSegment {
 public:
  // Opens /proc/<pid>/fd/<fd>, checks it is an epd memfd with `inode` and at least `size` bytes,
  // maps `size` bytes (read-write for gets, read-only for puts). On failure `reason` is one of
  // "open", "not_memfd", "inode", "size", "map" (a bounded metric label).
  static absl::StatusOr<std::unique_ptr<MappedPeerSegment>> Map(int pid, int fd, uint64_t inode,
                                                                uint64_t size, bool writable,
                                                                std::string* reason);
  ~MappedPeerSegment();
  MappedPeerSegment(const MappedPeerSegment&) = delete;
  MappedPeerSegment& operator=(const MappedPeerSegment&) = delete;
  uint8_t* data() { return data_; }
  size_t size() const { return size_; }

 private:
  MappedPeerSegment() = default;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace epd::kvstore
