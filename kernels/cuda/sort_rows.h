#pragma once

// The stable top-k order of each row (topk.cu), shared by the .cu files that sort rows by it:
// topk.cu's SelectTopKRows and CandidateMaskRows, sampling.cu's SampleLogits (top-k / top-p).
// Plain C++ on the CUDA runtime API types, as launch.h; every pointer is device memory.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace epd::kernels::cuda {

// CUB's temporary storage for SortTopKRows of `rows` rows of n values.
size_t SortTopKRowsTempBytes(int64_t rows, int64_t n);
// Sorts each row of v [rows, n] into keys_out [rows, n] in the stable top-k order (descending
// value, ties to the lower index; a key's low 32 bits are its index in the row). mask (or null)
// [rows, mask_cols]: an entry not set, or past mask_cols, counts as -inf (as MaskScores makes
// it). keys_in [rows, n] and off [rows + 1] are scratch; temp holds temp_bytes (at least
// SortTopKRowsTempBytes) of CUB's storage. rows * n < 2^31.
cudaError_t SortTopKRows(const float* v, int64_t rows, int64_t n, const uint8_t* mask,
                         int64_t mask_cols, uint64_t* keys_in, uint64_t* keys_out, int* off,
                         void* temp, size_t temp_bytes, cudaStream_t stream);

}  // namespace epd::kernels::cuda
