#pragma once

// Same-host value exchange for the kvstore (docs/kvstore.md "Shared memory"). A client owns a
// memfd segment (ClientSegment), sealed against shrinking; for each BatchGet/BatchPut call it
// names the segment (its pid, fd, inode and size), the daemon maps it (MappedPeerSegment, kept
// across calls in a PeerSegmentCache) and copies values in (get) or out (put). The daemon keeps
// a mapping only while the client's descriptor still names that memfd: a sweeper drops the
// mapping of a client that closed its segment or died within a second, so a dead client's memory
// is freed with it. Both ends must run under the same kernel and pid namespace (HostId()).
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

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
  // Opens /proc/<pid>/fd/<fd>, checks it is an epd memfd with `inode`, sealed against shrinking
  // (F_SEAL_SHRINK: no later truncate can fault the daemon) and holding at least `size` bytes,
  // maps `size` bytes (read-write for gets, read-only for puts). On failure `reason` is one of
  // "open", "not_memfd", "inode", "not_sealed", "size", "map" (a bounded metric label).
  static absl::StatusOr<std::unique_ptr<MappedPeerSegment>> Map(int pid, int fd, uint64_t inode,
                                                                uint64_t size, bool writable,
                                                                std::string* reason);
  ~MappedPeerSegment();
  MappedPeerSegment(const MappedPeerSegment&) = delete;
  MappedPeerSegment& operator=(const MappedPeerSegment&) = delete;
  uint8_t* data() { return data_; }
  size_t size() const { return size_; }
  bool writable() const { return writable_; }

 private:
  MappedPeerSegment() = default;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool writable_ = false;
};

// The daemon's client-segment mappings, kept across calls: mapping (populating) and unmapping a
// 4 MiB segment on every call was about a third of a batched get's daemon time. Keyed by (pid,
// fd, inode). A hit is re-checked with one stat of /proc/<pid>/fd/<fd>: the mapping keeps the
// memfd alive, so the same inode there is the same segment. A sweeper thread drops, every
// `sweep`, the entries whose descriptor no longer names their memfd (segment closed, client
// dead); beyond `max_entries` the least recently used goes. Thread-safe.
class PeerSegmentCache {
 public:
  // `on_count(n)` is called with the number of mapped segments whenever it changes.
  PeerSegmentCache(size_t max_entries, std::chrono::milliseconds sweep,
                   std::function<void(size_t)> on_count);
  ~PeerSegmentCache();
  PeerSegmentCache(const PeerSegmentCache&) = delete;
  PeerSegmentCache& operator=(const PeerSegmentCache&) = delete;

  // A mapping of at least `size` bytes (writable if asked), the cached one or a new one; errors
  // and `reason` as MappedPeerSegment::Map. The mapping stays valid while the caller holds it.
  absl::StatusOr<std::shared_ptr<MappedPeerSegment>> Acquire(int pid, int fd, uint64_t inode,
                                                             uint64_t size, bool writable,
                                                             std::string* reason);
  size_t size() const;
  // Runs one sweep now (tests).
  void Sweep();

 private:
  struct Entry {
    int pid;
    int fd;
    uint64_t inode;
    std::shared_ptr<MappedPeerSegment> seg;
  };
  void CountLocked();

  const size_t max_entries_;
  const std::chrono::milliseconds sweep_;
  const std::function<void(size_t)> on_count_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::list<Entry> entries_;  // most recently used first
  std::thread sweeper_;
};

}  // namespace epd::kvstore
