#pragma once

// Launchers of the CUDA kernels behind CudaBackend (kernels/cuda/cuda_backend.cc). Plain C++ on
// the CUDA runtime API types: the .cu files implement them and never see absl; the backend class
// (host code) checks the arguments, owns the streams and the scratch memory, and calls these.
// Every pointer is device memory; every launcher only queues work on `stream` and returns the
// launch error (cudaSuccess when queued). The arithmetic of each kernel mirrors the CPU reference
// (kernels/cpu/ops.cc, kernels/cpu/cpu_backend.cc, kernels/format.cc) operation by operation;
// the comment in the .cu file names the reference function each kernel mirrors.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/row_codec.h"

namespace epd::kernels::cuda {

// ---- Linears (linear.cu) ----
// How a GEMM reads its weight rows.
enum class WeightKind { kF32, kBf16, kFp8Packed, kFp4Packed };
struct GemmWeight {
  WeightKind kind = WeightKind::kF32;
  const void* data = nullptr;  // kF32: float [out, in]; kBf16: bf16 bits [out, in];
                               // kFp8Packed: E4M3 [out, in]; kFp4Packed: E2M1 pairs [out, in/2]
  int64_t out = 0;
  int64_t in = 0;
};
// FP8 activation quantization (format::QuantizeFp8Row per row): q [rows, k], scales [rows, nb].
cudaError_t QuantizeFp8Rows(const float* x, int64_t rows, int64_t k, float* q, float* scales,
                            cudaStream_t stream);
// LinearQuant's GEMM on quantized rows: y[r, o] = bf16(sum_b BlockDot(q_r, w_o)_b * s[r, b] *
// wscale[o / block_rows, b*32 / block_cols]). `scale_codes` (E8M0 bytes) or `scale_values`
// (floats), one of them non-null. At most 8 rows (a decode step) take skinny tiles: a warp per
// output reading its row's codes in coalesced 16-byte loads. `terms` (GemmQuantTermsBytes of device
// memory, or null): 9 to 16 rows then spread K over the grid and add the blocks' terms in a second
// kernel. Every path is bit-identical to the one-kernel path.
cudaError_t GemmQuant(const float* q, const float* s, int64_t rows, const GemmWeight& w,
                      const uint8_t* scale_codes, const float* scale_values, int block_rows,
                      int block_cols, int64_t scale_cols, float* y, float* terms,
                      cudaStream_t stream);
// Bytes of GemmQuant's `terms` for `rows` rows of `w`: 0 when the call takes the one-kernel path.
int64_t GemmQuantTermsBytes(int64_t rows, const GemmWeight& w);
// One group's packed weight (GroupedGemmQuant): E4M3 or E2M1 codes and E8M0 scale bytes.
struct GroupWeight {
  const void* codes = nullptr;
  const uint8_t* scale_codes = nullptr;
};
// Whether GroupedGemmQuant takes skinny tiles of 8 rows (at most 8 rows a group on average: a
// decode step's experts) rather than 16-row tiles through shared memory (a prefill's).
bool GroupedGemmSkinny(int64_t rows, int n_groups);
// Row tiles GroupedGemmQuant launches for `rows` rows in `n_groups` groups: a bound on the sum of
// the groups' tiles (the grid's y, at most 65535).
int64_t GroupedGemmGridRows(int64_t rows, int n_groups);
// GemmQuant of packed weights by group (GroupedLinearQuant): rows starts[g] .. starts[g+1] of
// q / s through groups[g] (device array); `w` gives the shared kind, out and in (w.data unused).
cudaError_t GroupedGemmQuant(const float* q, const float* s, int64_t rows, const int64_t* starts,
                             int n_groups, const GroupWeight* groups, const GemmWeight& w,
                             int block_rows, int block_cols, int64_t scale_cols, float* y,
                             cudaStream_t stream);
// bf16: y[r, o] = bf16(DotDp(x_r, w_o)) (LinearBf16); else y[r, o] = DotSeq(x_r, w_o) (LinearF32,
// HcMixes' projection); kernels/torch_math.h. w kind kF32. At most 8 rows (a decode step): one
// thread an output and row, its chain fed from double-buffered shared memory.
cudaError_t GemmPlain(const float* x, int64_t rows, const GemmWeight& w, bool bf16, float* y,
                      cudaStream_t stream);

// ---- Element-wise and per-row ops (rowwise.cu) ----
cudaError_t RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y,
                    cudaStream_t stream);
cudaError_t RopeTables(const float* freqs, int n_pairs, const int64_t* positions, int64_t rows,
                       float* cos, float* sin, cudaStream_t stream);
cudaError_t Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
                 const float* cos, const float* sin, bool inverse, cudaStream_t stream);
cudaError_t ScaleRoundBf16(float* x, int64_t n, float scale, bool scaled, cudaStream_t stream);
cudaError_t Add(float* x, const float* y, int64_t n, cudaStream_t stream);
// m [rows, nm] = DotSeq products (GemmPlain), finished here into pre/post/comb. vector_exp:
// torch's vectorized exp (TorchExp) in the sigmoids, else glibc's (ExpF; single-token calls).
cudaError_t HcMixesFinish(int64_t rows, const float* h, int hc, int64_t dim, const float* m,
                          const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                          float norm_eps, float* pre, float* post, float* comb, bool vector_exp,
                          cudaStream_t stream);
cudaError_t HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre, float* y,
                  cudaStream_t stream);
// tmp [rows, hc, dim] scratch; out may alias res.
cudaError_t HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                   const float* post, const float* comb, float* tmp, float* out,
                   cudaStream_t stream);
cudaError_t HcMean(int64_t rows, const float* h, int hc, int64_t dim, float* y, int64_t y_stride,
                   cudaStream_t stream);
cudaError_t SwiGlu(const float* g, const float* u, int64_t rows, int64_t inter, float limit,
                   const float* row_weights, float* h, cudaStream_t stream);
cudaError_t CopyRows(const float* src, const int64_t* src_rows, float* dst, const int64_t* dst_rows,
                     int64_t n, int64_t dim, cudaStream_t stream);
cudaError_t SumSlots(const float* ys, int64_t rows, int64_t slots, int64_t dim, float* out,
                     cudaStream_t stream);
cudaError_t Fp8RowLookup(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                         const int64_t* ids, int64_t n, float* out, cudaStream_t stream);
// inv_sqrt_d = fp32(pow(double(dim), -0.5)), computed on the host as the reference does.
// vector_exp: the gate's sigmoid with torch's vectorized exp (TorchExp), else glibc's (ExpF).
cudaError_t EngramGate(float* h, const float* e, int64_t rows, int hc, int64_t dim,
                       const float* q_weight, const float* k_weight, float norm_eps,
                       float inv_sqrt_d, bool vector_exp, cudaStream_t stream);
cudaError_t Embed(const void* table, bool bf16, int64_t dim, const int32_t* ids, int64_t rows,
                  int hc, float* h, cudaStream_t stream);
// kind: 0 = FP8 window, 1 = FP4 index, 2 = FP4 KV (Backend::Qdq order).
cudaError_t QuantDequant(int kind, float* x, int64_t rows, int64_t dim, cudaStream_t stream);

// ---- Attention (attention.cu) ----
struct AttentionArgs {
  const float* q = nullptr;
  const float* kv = nullptr;
  const float* sink = nullptr;
  const int32_t* idx = nullptr;
  const float* kv_ext = nullptr;
  int64_t kv_ext_start = 0;
  int64_t rows = 0;
  int heads = 0;
  int head_dim = 0;
  int64_t list_len = 0;
  float scale = 1.f;
  float* out = nullptr;
};
cudaError_t SparseAttention(const AttentionArgs& a, cudaStream_t stream);
cudaError_t CompressPool(const float* kv, const float* score, int64_t groups, int ratio,
                         int64_t dim, float* out, cudaStream_t stream);
cudaError_t IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                          int64_t dim, float* score, cudaStream_t stream);
cudaError_t MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                       int64_t mask_cols, cudaStream_t stream);
// Backend::IndexerScoresRows; rows <= 65535 (grid.y).
cudaError_t IndexerScoresRows(const float* q, const float* w, int heads, const float* keys,
                              int64_t n, int64_t dim, int64_t rows, const int64_t* valid,
                              float* score, cudaStream_t stream);
// Backend::IndexerScoresPaged (the keys decoded from the pages as UnpackRows decodes them);
// rows <= 65535.
cudaError_t IndexerScoresPaged(const float* q, const float* w, int heads, RowCodec codec,
                               const uint8_t* const* const* tables, const int64_t* rows_per_page,
                               const int64_t* valid, int64_t n, int64_t dim, int64_t rows,
                               float* score, cudaStream_t stream);

// ---- Selection (topk.cu) ----
// Scratch bytes StableTopK / SelectTopK need for n values.
size_t TopKScratchBytes(int64_t n);
// out[0..min(k,n)) = the stable top-k of v (descending, ties to the lower index).
cudaError_t StableTopK(const float* v, int64_t n, int64_t k, int32_t* out, void* scratch,
                       size_t scratch_bytes, cudaStream_t stream);
// Scratch bytes CandidateMask needs for n keys in blocks of `block`.
size_t CandidateMaskScratchBytes(int64_t n, int64_t block);
cudaError_t CandidateMask(const float* score, int64_t n, int64_t block, int64_t visible,
                          int64_t keep_blocks, uint8_t* mask, void* scratch, size_t scratch_bytes,
                          cudaStream_t stream);
cudaError_t SelectTopK(const float* score, int64_t n, int64_t k, int64_t visible, int64_t offset,
                       int32_t* out, void* scratch, size_t scratch_bytes, cudaStream_t stream);
// Backend::CandidateMaskRows / SelectTopKRows: one segmented radix sort (CUB) over every row.
// rows * n (and rows * blocks) < 2^31 (CUB's int item count); rows <= 65535.
size_t CandidateMaskRowsScratchBytes(int64_t rows, int64_t n, int64_t block);
cudaError_t CandidateMaskRows(const float* score, int64_t rows, int64_t n, int64_t block,
                              const int64_t* visible, const int64_t* cols, int64_t keep_blocks,
                              uint8_t* mask, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream);
size_t SelectTopKRowsScratchBytes(int64_t rows, int64_t n, int64_t k);
cudaError_t SelectTopKRows(const float* score, int64_t rows, int64_t n, int64_t k,
                           const int64_t* visible, int64_t offset, const uint8_t* mask,
                           int64_t mask_cols, int32_t* out, void* scratch, size_t scratch_bytes,
                           cudaStream_t stream);
// ---- MoE routing (moe.cu) ----
// Scratch bytes MoeRoute needs.
size_t MoeRouteScratchBytes(int64_t rows, int n_experts, int top_k);
cudaError_t MoeRoute(const float* z, int64_t rows, int n_experts, const float* bias, int top_k,
                     float route_scale, int32_t* experts, float* weights, int32_t* ranked,
                     void* scratch, cudaStream_t stream);
// Backend::MoeGroup on the device (no host round trip): counts per list, their prefix sums,
// then each list's entries in ascending row order.
cudaError_t MoeGroup(const int32_t* experts, const float* weights, int64_t rows, int n_experts,
                     int top_k, int n_shared, int64_t* starts, int64_t* src_rows,
                     int64_t* slot_rows, float* entry_weights, cudaStream_t stream);

// ---- Sampling (sampling.cu) ----
cudaError_t Argmax(const float* x, int64_t rows, int64_t n, int32_t* out, cudaStream_t stream);
cudaError_t PenalizeLogits(float* x, int64_t total, const int64_t* at, const int32_t* counts,
                           int64_t entries, float repetition, float frequency, float presence,
                           cudaStream_t stream);
// Backend::SampleLogits (kernels/sampling_math.h); sort: top_k in (0, n) or top_p < 1. rows * n
// < 2^31 (CUB's int item count).
size_t SampleLogitsScratchBytes(int64_t rows, int64_t n, bool sort);
// probs: null, or [rows, n] for the rows' distributions.
cudaError_t SampleLogits(const float* x, int64_t rows, int64_t n, float temperature, int top_k,
                         float top_p, float min_p, const double* u, int32_t* out, float* probs,
                         void* scratch, size_t scratch_bytes, cudaStream_t stream);
// Backend::VerifyDrafts (kernels/sampling_math.h); (k + 1) * n < 2^31. chosen: null or [k + 1].
size_t VerifyDraftsScratchBytes(int64_t n);
cudaError_t VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k,
                         int64_t n, const double* u, int32_t* out, int32_t* chosen, void* scratch,
                         size_t scratch_bytes, cudaStream_t stream);
// Backend::TopLogprobs (kernels/sampling_math.h's logprobs); rows * n < 2^31.
size_t TopLogprobsScratchBytes(int64_t rows, int64_t n);
cudaError_t TopLogprobs(const float* x, int64_t rows, int64_t n, const int32_t* chosen, int64_t top,
                        float* chosen_lp, int32_t* top_ids, float* top_lp, void* scratch,
                        size_t scratch_bytes, cudaStream_t stream);

// ---- Paged packed rows (kv_rows.cu) ----
// Backend::PackRows / UnpackRows (the arguments checked by the backend).
cudaError_t PackRows(RowCodec codec, const float* x, int64_t n, int64_t dim, uint8_t* const* pages,
                     int64_t rows_per_page, const int32_t* rows, int64_t first,
                     cudaStream_t stream);
cudaError_t UnpackRows(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page,
                       int64_t dim, const int32_t* rows, int64_t first, int64_t n, float* out,
                       cudaStream_t stream);
cudaError_t GatherRows(RowCodec codec, const uint8_t* const* const* tables,
                       const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                       const int32_t* rows, int64_t first, int64_t n, float* out,
                       cudaStream_t stream);
cudaError_t TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base, bool per_slot,
                      int32_t* list, int64_t list_len, int64_t offset, cudaStream_t stream);
// Backend::DigestBlocks / BlocksEqual (n < 2^31: eight threads a block, one thread block a pair).
cudaError_t DigestBlocks(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                         uint64_t* out, cudaStream_t stream);
// Backend::CopyBlocks (n < 2^31: one thread block a range, 16-byte moves where both ends allow).
cudaError_t CopyBlocks(uint8_t* const* dst, const uint8_t* const* src, const int64_t* bytes,
                       int64_t n, cudaStream_t stream);
cudaError_t BlocksEqual(const uint8_t* const* a, const uint8_t* const* b, const int64_t* bytes,
                        int64_t n, int32_t* equal, cudaStream_t stream);

}  // namespace epd::kernels::cuda
