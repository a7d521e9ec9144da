#pragma once
// The host emulation's CUB (tests/gpu/emulated/cuda_runtime.h): the radix sorts kernels/cuda
// uses, as stable sorts of the keys' bits [begin_bit, end_bit) in the stream's order.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda_runtime.h"

namespace cub {
namespace emulated {
template <class Key>
Key Bits(Key k, int begin_bit, int end_bit) {
  const int width = static_cast<int>(sizeof(Key) * 8);
  Key v = end_bit >= width ? k : static_cast<Key>(k & ((Key{1} << end_bit) - 1));
  return static_cast<Key>(v >> begin_bit);
}
template <class Key>
void SortRange(const Key* in, Key* out, int64_t n, int begin_bit, int end_bit) {
  std::vector<Key> v(in, in + n);
  std::stable_sort(v.begin(), v.end(), [&](Key a, Key b) {
    return Bits(a, begin_bit, end_bit) < Bits(b, begin_bit, end_bit);
  });
  std::copy(v.begin(), v.end(), out);
}
}  // namespace emulated

struct DeviceRadixSort {
  template <class Key>
  static cudaError_t SortKeys(void* temp, size_t& temp_bytes, const Key* in, Key* out, int n,
                              int begin_bit = 0, int end_bit = sizeof(Key) * 8,
                              cudaStream_t stream = nullptr) {
    if (temp == nullptr) {
      temp_bytes = 256;
      return cudaSuccess;
    }
    emu::Enqueue(stream, [=] { emulated::SortRange(in, out, n, begin_bit, end_bit); });
    return cudaSuccess;
  }
};
}  // namespace cub
