#pragma once

// A forward call's scratch in the backend's memory (host memory on the CPU backend, device memory
// on CUDA), and the copies at the edges of the forward: token ids and index lists built on the
// host go up, routing and top-k results the host needs come down, and so do the rows the KV pool
// (host slabs today, docs/cuda.md) keeps. Every op of the forward gets pointers into a Scratch or
// into the weights, never into a host vector (the tests' CPU backend with check_operands,
// tests/testing/test_cpu_backend.h, checks it).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace epd::model {

// Backend buffers kept for the Scratch of later calls. A call's arrays have the same few sizes
// layer after layer and step after step, and a device allocation (cudaMalloc, cudaFree)
// synchronizes the device, so a decode step in its steady state should allocate nothing. Buffers
// are kept by size class (powers of two, at least 4 KiB) up to `max_cached_bytes`; a buffer
// given back beyond that is freed. Thread-safe; must not outlive its backend.
class ScratchPool {
 public:
  ScratchPool(kernels::Backend& backend, int64_t max_cached_bytes)
      : backend_(backend), max_cached_(max_cached_bytes) {}
  ScratchPool(const ScratchPool&) = delete;
  ScratchPool& operator=(const ScratchPool&) = delete;

  // A buffer of at least `bytes`: its bytes() is the size class, or exactly `bytes` when that class
  // is over the cap (such a buffer is freed when given back).
  absl::StatusOr<kernels::Buffer> Take(int64_t bytes);
  void Give(kernels::Buffer buffer);

  int64_t cached_bytes() const;
  // Backend allocations made so far (a steady state makes none).
  int64_t allocations() const;

 private:
  kernels::Backend& backend_;
  const int64_t max_cached_;
  mutable std::mutex mu_;
  std::map<int64_t, std::vector<kernels::Buffer>> free_;  // by size class
  int64_t cached_ = 0;
  int64_t allocations_ = 0;
};

// One call's arrays (not thread-safe: one per call and thread).
class Scratch {
 public:
  // `pool` (optional): where the arrays come from and go back to when the scratch ends.
  // `parent`: an enclosing call's scratch, whose arrays Upload/Download also reach.
  explicit Scratch(kernels::Backend& backend, ScratchPool* pool = nullptr,
                   Scratch* parent = nullptr)
      : backend_(backend), pool_(pool), parent_(parent) {}
  ~Scratch() {
    if (pool_ == nullptr) return;
    for (auto& [start, buffer] : buffers_) pool_->Give(std::move(buffer));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // n elements, uninitialized.
  template <typename T>
  absl::StatusOr<T*> Alloc(int64_t n) {
    if (n < 0) return absl::InvalidArgumentError(absl::StrCat("scratch: negative size ", n));
    const int64_t bytes = std::max<int64_t>(1, n) * static_cast<int64_t>(sizeof(T));
    auto p = AllocBytes(bytes);
    if (!p.ok()) return p.status();
    return static_cast<T*>(*p);
  }
  // n elements with the host values `host` (n of them).
  template <typename T>
  absl::StatusOr<T*> Copy(const T* host, int64_t n) {
    auto p = Alloc<T>(n);
    if (!p.ok()) return p.status();
    if (absl::Status s = Upload(*p, host, n); !s.ok()) return s;
    return *p;
  }
  template <typename T>
  absl::StatusOr<T*> Copy(const std::vector<T>& host) {
    return Copy(host.data(), static_cast<int64_t>(host.size()));
  }
  // A packed array: parts of the given bytes one after another, each rounded up to a multiple of
  // 16 and at least 16, so every part starts 16-byte aligned and an empty one still has an
  // address inside the array. `at` are the parts' byte offsets, `bytes` the array's size.
  // CopyAll and UploadPacked pack this way; a caller that allocates a packed array itself (to keep
  // its address, as a decode step's graph set does) lays it out with Packing of the same sizes.
  template <size_t N>
  struct Packing {
    std::array<int64_t, N> at{};
    int64_t bytes = 0;
  };
  template <size_t N>
  static constexpr Packing<N> PackingOf(const std::array<int64_t, N>& part_bytes) {
    Packing<N> p;
    for (size_t i = 0; i < N; ++i) {
      p.at[i] = p.bytes;
      p.bytes += std::max<int64_t>(16, (part_bytes[i] + 15) / 16 * 16);
    }
    return p;
  }
  // Several host arrays in one allocation and one Upload (packed as PackingOf lays them out): a
  // device backend makes one host-to-device copy for all of them. Returns their addresses in
  // order.
  template <typename... T>
  absl::StatusOr<std::tuple<T*...>> CopyAll(const std::vector<T>&... host) {
    return CopyAllOf(std::index_sequence_for<T...>{}, host...);
  }
  // The same host arrays packed the same way, in one Upload into `dst`: an array of this scratch
  // laid out as `layout`, which these arrays' sizes must give (else Internal, uploading nothing:
  // a part would land in another's place or past the array).
  template <size_t N, typename... T>
  absl::Status UploadPacked(void* dst, const Packing<N>& layout, const std::vector<T>&... host) {
    static_assert(N == sizeof...(T), "one part of the layout per host array");
    const auto [blob, packing] = Pack(std::index_sequence_for<T...>{}, host...);
    if (packing.at != layout.at || packing.bytes != layout.bytes) {
      return absl::InternalError(absl::StrCat("scratch: a packed upload of ", packing.bytes,
                                              " bytes does not fit the array's layout (",
                                              layout.bytes, " bytes)"));
    }
    return Upload(static_cast<uint8_t*>(dst), blob.data(), packing.bytes);
  }
  // n elements, each `value`.
  template <typename T>
  absl::StatusOr<T*> Filled(int64_t n, T value) {
    return Copy(std::vector<T>(static_cast<size_t>(std::max<int64_t>(0, n)), value));
  }

  // Host -> the n elements at dst (inside one of this scratch's arrays).
  template <typename T>
  absl::Status Upload(T* dst, const T* host, int64_t n) {
    if (n == 0) return absl::OkStatus();
    int64_t offset = 0;
    kernels::Buffer* b = Find(dst, n * static_cast<int64_t>(sizeof(T)), &offset);
    if (b == nullptr) return absl::InternalError("scratch: upload target is not scratch memory");
    return backend_.Upload(host, n * static_cast<int64_t>(sizeof(T)), *b, offset);
  }
  // The n elements at src (inside one of this scratch's arrays) -> host.
  template <typename T>
  absl::Status Download(const T* src, int64_t n, T* host) {
    if (n == 0) return absl::OkStatus();
    int64_t offset = 0;
    kernels::Buffer* b = Find(src, n * static_cast<int64_t>(sizeof(T)), &offset);
    if (b == nullptr) return absl::InternalError("scratch: download source is not scratch memory");
    return backend_.Download(*b, offset, n * static_cast<int64_t>(sizeof(T)), host);
  }
  template <typename T>
  absl::Status DownloadTo(const T* src, int64_t n, std::vector<T>& host) {
    host.resize(static_cast<size_t>(n));
    return Download(src, n, host.data());
  }
  template <typename T>
  absl::StatusOr<std::vector<T>> ToHost(const T* src, int64_t n) {
    std::vector<T> out(static_cast<size_t>(n));
    if (absl::Status s = Download(src, n, out.data()); !s.ok()) return s;
    return out;
  }

  // Writes n elements at dst (scratch memory) with `write(T* where)`: in place when the backend's
  // memory is host memory, else into a host staging array that is then uploaded.
  template <typename T, typename F>
  absl::Status Fill(T* dst, int64_t n, F&& write) {
    if (host_visible()) return write(dst);
    std::vector<T> tmp(static_cast<size_t>(n));
    if (absl::Status s = write(tmp.data()); !s.ok()) return s;
    return Upload(dst, tmp.data(), n);
  }
  // Reads n elements at src (scratch memory) with `read(const T* where)`: in place when the
  // backend's memory is host memory, else from a downloaded copy.
  template <typename T, typename F>
  absl::Status Read(const T* src, int64_t n, F&& read) {
    if (host_visible()) return read(src);
    std::vector<T> tmp(static_cast<size_t>(n));
    if (absl::Status s = Download(src, n, tmp.data()); !s.ok()) return s;
    return read(static_cast<const T*>(tmp.data()));
  }

  // Whether the host may read and write this backend's memory directly (the CPU backend).
  bool host_visible() const { return backend_.memory_kind() == kernels::MemoryKind::kHost; }
  kernels::Backend& backend() { return backend_; }
  // Where this scratch's arrays come from (null: straight from the backend); a nested call's
  // scratch takes the same.
  ScratchPool* pool() const { return pool_; }

 private:
  // The host arrays packed into one host blob, and where each part is in it.
  template <size_t... I, typename... T>
  static std::pair<std::vector<uint8_t>, Packing<sizeof...(T)>> Pack(
      std::index_sequence<I...>, const std::vector<T>&... host) {
    const std::array<int64_t, sizeof...(T)> bytes = {
        static_cast<int64_t>(host.size() * sizeof(T))...};
    const Packing<sizeof...(T)> packing = PackingOf(bytes);
    std::vector<uint8_t> blob(static_cast<size_t>(packing.bytes), 0);
    ((bytes[I] > 0
          ? static_cast<void>(std::memcpy(blob.data() + packing.at[I], host.data(), bytes[I]))
          : static_cast<void>(0)),
     ...);
    return {std::move(blob), packing};
  }
  template <size_t... I, typename... T>
  absl::StatusOr<std::tuple<T*...>> CopyAllOf(std::index_sequence<I...> seq,
                                              const std::vector<T>&... host) {
    const auto [blob, packing] = Pack(seq, host...);
    auto dev = Copy(blob);
    if (!dev.ok()) return dev.status();
    return std::tuple<T*...>{reinterpret_cast<T*>(*dev + packing.at[I])...};
  }

  // Arrays up to kSmallBytes share chunks of kChunkBytes (one pool operation for many arrays; a
  // call makes dozens of small ones); larger arrays get a buffer each. A chunk's arrays start at
  // multiples of 256 bytes from its start (a buffer itself has the backend's alignment: 256 on
  // CUDA, 64 on the CPU).
  static constexpr int64_t kSmallBytes = 16 << 10, kChunkBytes = 64 << 10, kAlign = 256;
  absl::StatusOr<void*> AllocBytes(int64_t bytes) {
    const int64_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    if (rounded <= kSmallBytes && chunk_ != nullptr && chunk_used_ + rounded <= kChunkBytes) {
      void* p = chunk_ + chunk_used_;
      chunk_used_ += rounded;
      return p;
    }
    const int64_t take = rounded <= kSmallBytes ? kChunkBytes : rounded;
    auto buf = pool_ != nullptr ? pool_->Take(take) : backend_.Allocate(take);
    if (!buf.ok()) return buf.status();
    auto* base = buf->template as<uint8_t>();
    buffers_.emplace(reinterpret_cast<uintptr_t>(base), std::move(*buf));
    if (rounded <= kSmallBytes) {
      chunk_ = base;
      chunk_used_ = rounded;
    }
    return base;
  }

  // The buffer holding [p, p + bytes), and p's offset in it.
  kernels::Buffer* Find(const void* p, int64_t bytes, int64_t* offset) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = buffers_.upper_bound(a);
    if (it != buffers_.begin()) {
      --it;
      const int64_t off = static_cast<int64_t>(a - it->first);
      if (off + bytes <= it->second.bytes()) {
        *offset = off;
        return &it->second;
      }
    }
    return parent_ != nullptr ? parent_->Find(p, bytes, offset) : nullptr;
  }

  kernels::Backend& backend_;
  ScratchPool* pool_;
  Scratch* parent_;
  uint8_t* chunk_ = nullptr;  // the chunk small arrays are carved from
  int64_t chunk_used_ = 0;
  std::map<uintptr_t, kernels::Buffer> buffers_;  // by start address
};

}  // namespace epd::model
