#pragma once

// The ops the model calls, behind one interface (DESIGN.md §7). kernels/cpu/ is the deterministic
// reference; a CUDA backend implements the same interface.
//
// Tensor convention: row-major float buffers. A "bf16 tensor" holds values that are exactly
// representable in bf16 (every op that the reference runs in bf16 rounds its outputs). Every op
// processes each row independently of the other rows (batch-invariant): a row's result does not
// depend on how many rows are in the call or where it sits.
//
// Thread-safety: a Backend may be used from one thread at a time; the weights it reads are
// immutable and may be shared.

#include <cstdint>
#include <limits>
#include <memory>
#include <string_view>
#include <vector>

namespace epd::kernels {

// A block-scaled quantized weight [out, in], stored decoded for compute: `values` hold the
// E4M3 (FP8) or E2M1 (FP4) element values as floats, `scales` the E8M0 scale of each
// block_rows x block_cols block, row-major [ceil(out/block_rows), ceil(in/block_cols)].
// FP8 linears: 32x32 blocks. FP4 (MXFP4) experts: 1x32 blocks.
struct QuantWeight {
  int64_t out = 0;
  int64_t in = 0;
  int block_rows = 32;
  int block_cols = 32;
  std::vector<float> values;  // [out, in]
  std::vector<float> scales;  // [ceil(out/block_rows), ceil(in/block_cols)]
  int64_t scale_cols() const { return (in + block_cols - 1) / block_cols; }
};

// Sparse single-KV-head attention with sink (MODEL.md §3 step 8).
struct SparseAttentionArgs {
  const float* q = nullptr;      // [rows, heads, head_dim] bf16
  const float* kv = nullptr;     // [kv_rows, head_dim] bf16; K and V are the same vector
  const float* sink = nullptr;   // [heads] fp32
  const int32_t* idx = nullptr;  // [rows, list_len] rows of kv, -1 = skip
  // Optional second KV buffer (the compressed KV, read in place): list entries t >= kv_ext_start
  // read row t - kv_ext_start of kv_ext [*, head_dim] instead of kv.
  const float* kv_ext = nullptr;
  int64_t kv_ext_start = std::numeric_limits<int64_t>::max();
  int64_t rows = 0;
  int heads = 0;
  int head_dim = 0;
  int64_t list_len = 0;
  float scale = 1.f;     // fp32 softmax scale
  float* out = nullptr;  // [rows, heads, head_dim] bf16
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view Name() const = 0;

  // y[r, :] = bf16(x[r, :] @ w^T) with per-32 FP8 activation quantization of x and per-K-block
  // fp32 accumulation: x [rows, w.in] bf16, y [rows, w.out] bf16.
  virtual void LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) = 0;
  // y = bf16(x @ w^T), fp32 accumulation. x [rows, in], w [out, in] (bf16 values), y [rows, out].
  virtual void LinearBf16(const float* x, int64_t rows, const float* w, int64_t out, int64_t in,
                          float* y) = 0;
  // y = x @ w^T in fp32 (no rounding). x [rows, in], w [out, in], y [rows, out].
  virtual void LinearF32(const float* x, int64_t rows, const float* w, int64_t out, int64_t in,
                         float* y) = 0;
  // y = bf16(x * rsqrt(mean(x^2) + eps) * w), fp32 math. x, y [rows, dim]; may alias.
  virtual void RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                       float* y) = 0;
  // Interleaved RoPE on x[r, h, offset : offset + 2*n_pairs] with cos/sin tables [rows, n_pairs]
  // (already for each row's position); inverse rotates by -angle. Result rounded to bf16.
  virtual void Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
                    const float* cos, const float* sin, bool inverse) = 0;
  virtual void SparseAttention(const SparseAttentionArgs& args) = 0;

  // mHC (MODEL.md §3), `rows` independent rows. h [rows, hc, dim] bf16; fn [(2+hc)*hc, hc*dim],
  // scale [3], base [(2+hc)*hc] fp32. Out: pre, post [rows, hc], comb [rows, hc, hc] (source j ->
  // destination k at comb[j*hc + k]).
  virtual void HcMixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                       const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                       float norm_eps, float* pre, float* post, float* comb) = 0;
  // y[r, :] = bf16(sum_j pre[r, j] * h[r, j, :]). y [rows, dim].
  virtual void HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
                     float* y) = 0;
  // out[r, k, :] = bf16(post[r, k] * y[r, :] + sum_j comb[r, j, k] * res[r, j, :]); out may
  // alias res.
  virtual void HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                      const float* post, const float* comb, float* out) = 0;

  // In-place quantize-dequantize of `rows` rows of length dim (MODEL.md §3/§4).
  enum class Qdq {
    kFp8Window,  // E4M3, UE8M0 per 32 (SWA KV)
    kFp4Index,   // E2M1, UE8M0 per 32 (indexer q/k)
    kFp4Kv,      // E2M1, E4M3 scale per 16 (compressed KV)
  };
  virtual void QuantDequant(Qdq kind, float* x, int64_t rows, int64_t dim) = 0;
};

std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace epd::kernels
