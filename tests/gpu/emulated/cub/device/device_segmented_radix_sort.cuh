#pragma once
// The host emulation's CUB segmented radix sort (device_radix_sort.cuh): each segment
// [begin[i], end[i]) sorted stably by the keys' bits; offsets are read when the sort runs.
#include "device_radix_sort.cuh"

namespace cub {
struct DeviceSegmentedRadixSort {
  template <class Key, class Offset>
  static cudaError_t SortKeys(void* temp, size_t& temp_bytes, const Key* in, Key* out,
                              int num_items, int num_segments, Offset begin, Offset end,
                              int begin_bit = 0, int end_bit = sizeof(Key) * 8,
                              cudaStream_t stream = nullptr) {
    if (temp == nullptr) {
      temp_bytes = 256;
      return cudaSuccess;
    }
    emu::Enqueue(stream, [=] {
      std::copy(in, in + num_items, out);
      for (int s = 0; s < num_segments; ++s) {
        if (end[s] > begin[s]) {
          emulated::SortRange(in + begin[s], out + begin[s], end[s] - begin[s], begin_bit, end_bit);
        }
      }
    });
    return cudaSuccess;
  }
};
}  // namespace cub
