#pragma once

// The ops the model calls, behind one device-agnostic interface (DESIGN.md §7). kernels/cpu/ is
// the deterministic reference; a CUDA backend implements the same interface. Nothing outside
// kernels/ includes a backend's own headers: model/, services/, kvstore/ use this interface and
// the packed-format module (kernels/format.h).
//
// Memory: a backend owns its memory (MemoryKind::kHost for the CPU backend, kDevice for a GPU
// one). Allocate gives a Buffer that knows where it lives and which stream it belongs to; Upload
// and Download move bytes between the host and a Buffer; Synchronize waits for a stream's work.
// Op arguments are pointers into the backend's memory (a Buffer's data(), or for the CPU backend
// any host memory); an op is queued on `stream` (the CPU backend runs it before returning).
//
// Tensor convention: row-major float buffers. A "bf16 tensor" holds values that are exactly
// representable in bf16 (every op that the reference runs in bf16 rounds its outputs). Every op
// processes each row independently of the other rows (batch-invariant): a row's result does not
// depend on how many rows are in the call or where it sits.
//
// Errors: every op returns absl::Status; bad shapes or arguments give InvalidArgument naming the
// op and the cause, and leave the outputs unspecified.
//
// Thread-safety: a Backend's ops may be used from one thread at a time; Allocate, Upload,
// Download and Copy, and the block ops CopyBlocks, DigestBlocks and BlocksEqual, may also be
// called from other threads meanwhile (the KV pool's host surfaces, a hand-off serializing a
// sequence and a block's seal use them; both backends make them from thread-safe runtime calls,
// and none of them takes the backend's scratch). During a graph capture (BeginCapture) such a
// call of another thread is never recorded: it runs now, or waits for the capture to end. The
// weights it reads are immutable and may be shared.

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/row_codec.h"
#include "kernels/sampling_math.h"

namespace epd::kernels {

// Where a buffer's bytes live.
enum class MemoryKind { kHost, kDevice };

// An ordered queue of a backend's work (a CUDA stream; the CPU backend has only the default).
struct Stream {
  int64_t id = 0;
};

// Memory owned by a backend: move-only, freed by the backend's deleter on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, int64_t bytes, MemoryKind kind, Stream stream, std::function<void(void*)> free)
      : data_(data), bytes_(bytes), kind_(kind), stream_(stream), free_(std::move(free)) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      kind_ = o.kind_;
      stream_ = o.stream_;
      free_ = std::move(o.free_);
      o.free_ = nullptr;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* as() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data_);
  }
  int64_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  Stream stream() const { return stream_; }
  bool empty() const { return bytes_ == 0; }

 private:
  void Reset() {
    if (data_ != nullptr && free_) free_(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  MemoryKind kind_ = MemoryKind::kHost;
  Stream stream_;
  std::function<void(void*)> free_;
};

// A non-owning typed view of `numel` elements in some backend's memory.
template <typename T>
struct TensorView {
  T* data = nullptr;
  int64_t numel = 0;
  MemoryKind kind = MemoryKind::kHost;
  Stream stream;
};

// Checkpoint formats a QuantWeight's codes are stored in.
enum class WeightFormat {
  kFp8E4M3,  // one E4M3 byte per element; E8M0 scale per 32x32 block
  kFp4E2M1,  // two E2M1 codes per byte (low nibble = even element); E8M0 scale per 1x32 block
};

// A block-scaled quantized weight [out, in] with an E8M0 scale per block_rows x block_cols block
// (row-major [ceil(out/block_rows), ceil(in/block_cols)]). FP8 linears: 32x32 blocks. FP4
// (MXFP4) experts: 1x32 blocks. Two storage forms with bit-identical results:
// - packed (the model's form): `codes` hold the checkpoint's bytes in backend memory (FP8: one
//   E4M3 byte per element, [out, in]; FP4: two E2M1 codes per byte, [out, in/2], low nibble =
//   even element) and `scale_codes` the E8M0 scale bytes; the kernels decode them on the fly.
// - decoded (tests, tools): `values` hold the element values as floats, `scales` the scales.
struct QuantWeight {
  int64_t out = 0;
  int64_t in = 0;
  int block_rows = 32;
  int block_cols = 32;
  WeightFormat format = WeightFormat::kFp8E4M3;
  Buffer codes;               // packed: checkpoint element codes
  Buffer scale_codes;         // packed: E8M0 scale bytes
  std::vector<float> values;  // decoded: [out, in]
  std::vector<float> scales;  // decoded: [ceil(out/block_rows), ceil(in/block_cols)]
  bool packed() const { return !codes.empty(); }
  int64_t scale_rows() const { return (out + block_rows - 1) / block_rows; }
  int64_t scale_cols() const { return (in + block_cols - 1) / block_cols; }
  // Bytes of the packed codes for this shape and format.
  int64_t code_bytes() const { return format == WeightFormat::kFp8E4M3 ? out * in : out * in / 2; }
  // Bytes this weight holds in memory.
  int64_t resident_bytes() const {
    return codes.bytes() + scale_codes.bytes() +
           static_cast<int64_t>((values.size() + scales.size()) * sizeof(float));
  }
};

// A plain linear's weight [out, in] (LinearBf16, LinearF32) or an embedding table [vocab, dim]
// (Embed) in backend memory, in one of two forms with bit-identical results: fp32 values, or bf16
// values held as their 16 bits (the model's form for its bf16 tensors and wo_a: half the bytes a
// decode step reads and half the memory they hold; widening a bf16 value to fp32 is exact). A
// `const float*` converts implicitly to the fp32 form.
enum class PlainDtype : uint8_t { kF32, kBf16 };
struct PlainWeight {
  const void* data = nullptr;
  PlainDtype dtype = PlainDtype::kF32;

  PlainWeight() = default;
  PlainWeight(const float* w) : data(w) {}  // NOLINT(google-explicit-constructor): fp32 form
  static PlainWeight Bf16(const uint16_t* bits) {
    PlainWeight w;
    w.data = bits;
    w.dtype = PlainDtype::kBf16;
    return w;
  }
  static int64_t ElementBytes(PlainDtype d) { return d == PlainDtype::kBf16 ? 2 : 4; }
  // The weight from row-major element `i` on (a group of rows of a larger array).
  PlainWeight From(int64_t i) const {
    PlainWeight w = *this;
    if (data != nullptr) w.data = static_cast<const uint8_t*>(data) + i * ElementBytes(dtype);
    return w;
  }
};

// The argument check every backend makes on a plain linear's weight: why `w` cannot be one
// (empty when it can).
inline std::string PlainWeightProblem(const PlainWeight& w) {
  if (w.dtype != PlainDtype::kF32 && w.dtype != PlainDtype::kBf16) return "unknown weight dtype";
  return {};
}

// The argument checks every backend makes on LinearQuant's weight: why `w` cannot be one (empty
// when it can). Shape and bytes only; where the bytes live is the backend's own check.
inline std::string QuantWeightProblem(const QuantWeight& w) {
  if (w.out < 0 || w.in < 0 || w.block_rows <= 0 || w.block_cols <= 0) return "shape";
  if (w.packed()) {
    if (w.format == WeightFormat::kFp4E2M1 && w.in % 2 != 0)
      return "FP4 weight with an odd number of columns";
    if (w.codes.bytes() != w.code_bytes() ||
        w.scale_codes.bytes() != w.scale_rows() * w.scale_cols())
      return "packed weight bytes do not match its shape";
  } else if (static_cast<int64_t>(w.values.size()) != w.out * w.in ||
             static_cast<int64_t>(w.scales.size()) != w.scale_rows() * w.scale_cols()) {
    return "weight values do not match [out, in]";
  }
  return {};
}
// GroupedLinearQuant's weights ws[0 .. n): each a LinearQuant weight, all of one shape, block
// size, format and storage form.
inline std::string WeightGroupProblem(const QuantWeight* const* ws, int n) {
  for (int g = 0; g < n; ++g) {
    if (ws == nullptr || ws[g] == nullptr) return "weight " + std::to_string(g) + " is null";
    const QuantWeight& w = *ws[g];
    if (std::string why = QuantWeightProblem(w); !why.empty())
      return "weight " + std::to_string(g) + ": " + why;
    const QuantWeight& w0 = *ws[0];
    if (w.out != w0.out || w.in != w0.in || w.block_rows != w0.block_rows ||
        w.block_cols != w0.block_cols || w.format != w0.format || w.packed() != w0.packed())
      return "weight " + std::to_string(g) + " differs in shape or format from weight 0";
  }
  return {};
}

// GroupedLinearQuant's starts [n + 1] (host memory) for `rows` rows: why they cannot be (empty
// when they can): non-decreasing, within 0 .. rows.
inline std::string StartsProblem(const int64_t* starts, int n, int64_t rows) {
  if (starts[0] < 0 || starts[n] > rows) {
    return "starts run from " + std::to_string(starts[0]) + " to " + std::to_string(starts[n]) +
           ", outside 0 to " + std::to_string(rows);
  }
  for (int g = 0; g < n; ++g) {
    if (starts[g + 1] < starts[g]) return "starts decrease at group " + std::to_string(g);
  }
  return {};
}

// Bytes of one row of `codec` (kernels/row_codec.h) at `dim`.
inline int64_t RowCodecBytes(RowCodec codec, int64_t dim) {
  return row_codec::RowBytes(codec, dim);
}
// Why rows of `dim` cannot be in `codec` (empty when they can): the block of the codec's scales
// must divide dim.
inline std::string RowCodecProblem(RowCodec codec, int64_t dim) {
  if (dim <= 0) return "dim " + std::to_string(dim) + " is not positive";
  const int64_t block = row_codec::Block(codec);
  if (dim % block != 0) {
    return "dim " + std::to_string(dim) + " is not a multiple of the codec's block of " +
           std::to_string(block);
  }
  return {};
}

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

// A recording of ops that a backend launches again as one unit (Backend::BeginCapture): a CUDA
// graph on a GPU, closures on the tests' CPU backend (tests/testing/test_cpu_backend.h). It keeps
// the pointers and scalars its ops were given, so what changes from launch to launch is the
// contents of the memory they point at. Must not outlive its backend.
class Graph {
 public:
  virtual ~Graph() = default;
  // Ops recorded.
  virtual int64_t ops() const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view Name() const = 0;

  // ---- Memory ----
  // Where this backend's buffers live.
  virtual MemoryKind memory_kind() const = 0;
  // `bytes` >= 0 bytes of backend memory (64-byte aligned, contents unspecified).
  virtual absl::StatusOr<Buffer> Allocate(int64_t bytes, Stream stream = {}) = 0;
  // Host -> dst[dst_offset, dst_offset + bytes).
  virtual absl::Status Upload(const void* host, int64_t bytes, Buffer& dst,
                              int64_t dst_offset = 0) = 0;
  // src[src_offset, src_offset + bytes) -> host.
  virtual absl::Status Download(const Buffer& src, int64_t src_offset, int64_t bytes,
                                void* host) = 0;
  // Waits until every op queued on `stream` has finished.
  virtual absl::Status Synchronize(Stream stream = {}) = 0;
  // Bytes of this backend's memory still free for Allocate, or -1 when the backend does not
  // know (host memory: the operating system's). A device backend's decode worker sizes its KV
  // pool from it.
  virtual int64_t free_memory_bytes() const { return -1; }
  // dst = src (bytes), both in backend memory; may not overlap.
  virtual absl::Status Copy(void* dst, const void* src, int64_t bytes) = 0;

  // ---- Graphs (docs/cuda.md, "Decode step graphs") ----
  // Whether BeginCapture can succeed (false: every capture call gives Unimplemented).
  virtual bool supports_graphs() const { return false; }
  // From BeginCapture to EndCapture, the ops this backend is given (on stream 0, from the
  // capturing thread) are recorded into a new Graph instead of run. An op's argument checks that
  // need no operand's contents still fail it at once; those that read operand contents (the CPU
  // backend's) run at each launch. Allocate may be used meanwhile; Copy is recorded like an op;
  // Upload, Download and Synchronize fail with FailedPrecondition (a recording must hold no host
  // data: what a launch reads comes from backend memory the caller writes before it), and so
  // does an op that would have to wait for the device (a device backend's scratch growing, a
  // weight table it has not made before). One capture at a time.
  virtual absl::Status BeginCapture() {
    return absl::UnimplementedError("backend: BeginCapture: this backend records no graphs");
  }
  // Ends the capture. The Graph, or the first error a call gave while recording (an op, or a
  // refused Upload, Download or Synchronize): the capture ends either way, and nothing recorded
  // runs.
  virtual absl::StatusOr<std::unique_ptr<Graph>> EndCapture() {
    return absl::UnimplementedError("backend: EndCapture: this backend records no graphs");
  }
  // Queues `graph`'s ops on stream 0, in their recorded order, after the work queued before. The
  // CPU backend runs them before returning and gives the first error one of them gives (an op
  // whose checks read operand contents); a device backend, which checks nothing it cannot see,
  // gives launch errors only.
  virtual absl::Status LaunchGraph(Graph& graph) {
    (void)graph;
    return absl::UnimplementedError("backend: LaunchGraph: this backend records no graphs");
  }

  // ---- Linears ----
  // y[r, :] = bf16(x[r, :] @ w^T) with per-32 FP8 activation quantization of x and per-K-block
  // fp32 accumulation: x [rows, w.in] bf16, y [rows, w.out] bf16.
  virtual absl::Status LinearQuant(const float* x, int64_t rows, const QuantWeight& w,
                                   float* y) = 0;
  // y = bf16(x @ w^T), fp32 accumulation. x [rows, in], w [out, in] (bf16 values, either form),
  // y [rows, out].
  virtual absl::Status LinearBf16(const float* x, int64_t rows, PlainWeight w, int64_t out,
                                  int64_t in, float* y) = 0;
  // y = x @ w^T in fp32 (no rounding). x [rows, in], w [out, in] (either form), y [rows, out].
  virtual absl::Status LinearF32(const float* x, int64_t rows, PlainWeight w, int64_t out,
                                 int64_t in, float* y) = 0;

  // ---- Norms, RoPE, bf16 rounding ----
  // y = bf16(x * rsqrt(mean(x^2) + eps) * w), fp32 math. x, y [rows, dim]; may alias.
  virtual absl::Status RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                               float* y) = 0;
  // cos/sin tables [rows, n_pairs] for RoPE at `positions` [rows]: angle = fp32(pos * freq_i)
  // with freqs [n_pairs] from RopeFrequencies (kernels/rope.h).
  virtual absl::Status RopeTables(const float* freqs, int n_pairs, const int64_t* positions,
                                  int64_t rows, float* cos, float* sin) = 0;
  // Interleaved RoPE on x[r, h, offset : offset + 2*n_pairs] with cos/sin tables [rows, n_pairs]
  // (already for each row's position); inverse rotates by -angle. Result rounded to bf16.
  virtual absl::Status Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
                            const float* cos, const float* sin, bool inverse) = 0;
  // x[i] = bf16(x[i]), n elements.
  virtual absl::Status RoundBf16(float* x, int64_t n) = 0;
  // x[i] = bf16(x[i] * scale) (fp32 product).
  virtual absl::Status ScaleRoundBf16(float* x, int64_t n, float scale) = 0;
  // x[i] += y[i] in fp32.
  virtual absl::Status Add(float* x, const float* y, int64_t n) = 0;

  // ---- Attention ----
  virtual absl::Status SparseAttention(const SparseAttentionArgs& args) = 0;
  // Compressor pooling (MODEL.md §3 step 5) of `groups` groups: kv, score [groups, ratio, dim]
  // (ratio <= 8); out[g, ch] = bf16(sum_r kv[g, r, ch] * softmax_r(score[g, :, ch])[r]),
  // out [groups, dim]. Groups are independent.
  virtual absl::Status CompressPool(const float* kv, const float* score, int64_t groups, int ratio,
                                    int64_t dim, float* out) = 0;
  // Indexer scores of one query row against keys [n, dim] (MODEL.md §3 step 6): for each key t,
  // score[t] = bf16(sum over heads h in order of bf16(max(bf16(q_h . k_t), 0) * w[h])), each dot
  // an fp32 sum in index order. q [heads, dim], w [heads], score [n].
  virtual absl::Status IndexerScores(const float* q, const float* w, int heads, const float* keys,
                                     int64_t n, int64_t dim, float* score) = 0;
  // score[t] = -inf for t >= valid, and where mask is given, for t >= mask_cols or !mask[t].
  virtual absl::Status MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                                  int64_t mask_cols) = 0;
  // Stable top-k: the min(k, n) largest values of v [n], descending, equal values -> lower index
  // first; out [min(k, n)].
  virtual absl::Status StableTopK(const float* v, int64_t n, int64_t k, int32_t* out) = 0;
  // Candidate selection (MODEL.md §3 step 6): block scores = max of score over each `block`
  // consecutive keys (the block holding key visible-1 scores +inf when visible > 0); the
  // keep_blocks best blocks (stable top-k) that are not all -inf mark their keys: mask [n] 0/1.
  virtual absl::Status CandidateMask(const float* score, int64_t n, int64_t block, int64_t visible,
                                     int64_t keep_blocks, uint8_t* mask) = 0;
  // Index list of one row: the stable top-k (k <= n) of score [n], ascending by key; out[j] = -1
  // for keys >= visible, else key + offset.
  virtual absl::Status SelectTopK(const float* score, int64_t n, int64_t k, int64_t visible,
                                  int64_t offset, int32_t* out) = 0;
  // ---- The indexer's selection, many query rows in one call (prefill) ----
  // Per row r < rows, with valid [rows] and visible [rows] in backend memory:
  // IndexerScoresRows: score row r [n] = IndexerScores(q row r [heads, dim], w row r [heads],
  //   keys, valid[r]) then -inf for valid[r] <= t < n (MaskScores(score_r, n, valid[r])); keys
  //   holds at least max(valid) rows, 0 <= valid[r] <= n. q [rows, heads, dim], w [rows, heads],
  //   score [rows, n].
  virtual absl::Status IndexerScoresRows(const float* q, const float* w, int heads,
                                         const float* keys, int64_t n, int64_t dim, int64_t rows,
                                         const int64_t* valid, float* score) = 0;
  // IndexerScoresPaged: IndexerScoresRows with each row's keys read from a paged stream of
  //   packed rows of its own (as UnpackRows, below, reads one): key t of row r is row t of the
  //   stream whose page table is tables[r], rows_per_page[r] rows a page, for t < valid[r]. So
  //   rows of different sequences (and of different key sources) score in one call, straight
  //   from the pool's blocks. tables, rows_per_page, valid [rows] in backend memory.
  virtual absl::Status IndexerScoresPaged(const float* q, const float* w, int heads, RowCodec codec,
                                          const uint8_t* const* const* tables,
                                          const int64_t* rows_per_page, const int64_t* valid,
                                          int64_t n, int64_t dim, int64_t rows, float* score) = 0;
  // CandidateMaskRows: mask row r [n] = CandidateMask(score row r, cols[r], block, visible[r],
  //   keep_blocks), then 0 for cols[r] <= t < n (cols [rows], 0 <= cols[r] <= n, or null: n).
  //   score [rows, n], mask [rows, n].
  virtual absl::Status CandidateMaskRows(const float* score, int64_t rows, int64_t n, int64_t block,
                                         const int64_t* visible, const int64_t* cols,
                                         int64_t keep_blocks, uint8_t* mask) = 0;
  // SelectTopKRows: out row r [k] = SelectTopK(score row r, n, k, visible[r], offset), where a
  //   mask, when given ([rows, mask_cols]), first sets score -inf at t >= mask_cols or
  //   !mask[r, t] (as MaskScores; score itself is not written). k <= n.
  virtual absl::Status SelectTopKRows(const float* score, int64_t rows, int64_t n, int64_t k,
                                      const int64_t* visible, int64_t offset, const uint8_t* mask,
                                      int64_t mask_cols, int32_t* out) = 0;

  // ---- mHC (MODEL.md §3), `rows` independent rows ----
  // h [rows, hc, dim] bf16; fn [(2+hc)*hc, hc*dim], scale [3], base [(2+hc)*hc] fp32. Out: pre,
  // post [rows, hc], comb [rows, hc, hc] (source j -> destination k at comb[j*hc + k]).
  virtual absl::Status HcMixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                               const float* scale, const float* base, int sinkhorn_iters,
                               float hc_eps, float norm_eps, float* pre, float* post,
                               float* comb) = 0;
  // HcMixes of rows that are each a single-token reference call (decode). The same math; the
  // reference's torch computes the pre/post sigmoids of a 4-element tensor on its scalar path
  // (glibc's expf) and those of a prompt on its vectorized path (Sleef's expf), which the CPU
  // backend reproduces. Default: HcMixes.
  virtual absl::Status HcMixesSingleToken(int64_t rows, const float* h, int hc, int64_t dim,
                                          const float* fn, const float* scale, const float* base,
                                          int sinkhorn_iters, float hc_eps, float norm_eps,
                                          float* pre, float* post, float* comb) {
    return HcMixes(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, pre, post,
                   comb);
  }
  // y[r, :] = bf16(sum_j pre[r, j] * h[r, j, :]). y [rows, dim].
  virtual absl::Status HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
                             float* y) = 0;
  // out[r, k, :] = bf16(post[r, k] * y[r, :] + sum_j comb[r, j, k] * res[r, j, :]); out may
  // alias res.
  virtual absl::Status HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                              const float* post, const float* comb, float* out) = 0;
  // y[r, :] = bf16((sum_j h[r, j, :]) / hc) (the DSpark target hidden). y rows are y_stride apart.
  virtual absl::Status HcMean(int64_t rows, const float* h, int hc, int64_t dim, float* y,
                              int64_t y_stride) = 0;

  // ---- MoE ----
  // Routing of `rows` rows (MODEL.md §3 step 9): gate logits z [rows, n_experts] fp32, bias
  // [n_experts]; s = sqrt(softplus(z)), the top_k of s + bias (stable), weights s normalised over
  // the chosen (when top_k > 1) times route_scale. Out, per row in ascending expert id order:
  // experts [rows, top_k], weights [rows, top_k]; optionally `ranked` [rows, top_k]: the experts
  // in top-k order (traces).
  virtual absl::Status MoeRoute(const float* z, int64_t rows, int n_experts, const float* bias,
                                int top_k, float route_scale, int32_t* experts, float* weights,
                                int32_t* ranked = nullptr) = 0;
  // h[r, j] = bf16(silu(min(g, limit)) * clamp(u, -limit, limit) [* row_weights[r]]); g, u, h
  // [rows, inter]; row_weights [rows] or null.
  virtual absl::Status SwiGlu(const float* g, const float* u, int64_t rows, int64_t inter,
                              float limit, const float* row_weights, float* h) = 0;
  // Row copies: dst[dst_rows[i], :] = src[src_rows[i], :] for i < n, rows of `dim` floats; a null
  // index list means rows 0..n-1 (a gather: dst_rows null; a scatter: src_rows null). Each
  // destination row must appear once. Exact (the MoE's grouping of rows by expert).
  virtual absl::Status CopyRows(const float* src, const int64_t* src_rows, float* dst,
                                const int64_t* dst_rows, int64_t n, int64_t dim) = 0;
  // Groups a MoE call's rows by expert on the backend (no host round trip): the entries of
  // list e < n_experts are the rows routed to expert e, ascending; those of list n_experts + s
  // (s < n_shared) are every row, for shared expert s. experts, weights [rows, top_k]: MoeRoute's
  // outputs (each row's top_k distinct experts in ascending id order; a device backend does not
  // check this, the CPU backend does). Out:
  // - starts [n_experts + n_shared + 1]: list L is entries starts[L] .. starts[L+1]
  //   (starts[n_experts] = rows * top_k, the last = rows * (top_k + n_shared));
  // - src_rows [rows * (top_k + n_shared)]: the row each entry reads (CopyRows' gather list);
  // - slot_rows [same]: r * (top_k + n_shared) + slot, the entry's row of SumSlots' ys (slot j <
  //   top_k: the row's j-th expert, then the shared experts);
  // - entry_weights [rows * top_k]: each routed entry's routing weight (SwiGlu's row_weights).
  // Exact (integer bookkeeping and copies).
  virtual absl::Status MoeGroup(const int32_t* experts, const float* weights, int64_t rows,
                                int n_experts, int top_k, int n_shared, int64_t* starts,
                                int64_t* src_rows, int64_t* slot_rows, float* entry_weights) = 0;
  // Grouped LinearQuant (the MoE's experts in one call): rows starts[g] .. starts[g+1] of x
  // [rows, in] go through ws[g] into the same rows of y [rows, out], for g < n_groups; starts
  // [n_groups + 1] lies in backend memory (MoeGroup's output, or a run of it), non-decreasing,
  // with 0 <= starts[0] and starts[n_groups] <= rows; rows outside starts[0] .. starts[n_groups]
  // are neither read into y nor written. Every weight has the same shape, blocks and format (a
  // model whose experts differ, as routed FP4 and shared FP8 do, makes one call per run of
  // like weights). Bit-identical to one LinearQuant per group (rows are independent).
  virtual absl::Status GroupedLinearQuant(const float* x, int64_t rows, const int64_t* starts,
                                          const QuantWeight* const* ws, int n_groups, float* y) = 0;
  // out[r, :] = bf16(sum_j ys[r, j, :]) (in order j), ys [rows, slots, dim].
  virtual absl::Status SumSlots(const float* ys, int64_t rows, int64_t slots, int64_t dim,
                                float* out) = 0;

  // ---- Engram ----
  // out[i, :] = bf16(E4M3 table row ids[i] * its E8M0 scales), table [*, dim] (one byte per
  // element), table_scale [*, dim/32]; out [n, dim].
  virtual absl::Status Fp8RowLookup(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                                    const int64_t* ids, int64_t n, float* out) = 0;
  // Engram gate on the residual h [rows, hc, dim] in place with e [rows, hc+1, dim] (keys then the
  // value), q_weight/k_weight [hc, dim] (MODEL.md §3 Engram).
  virtual absl::Status EngramGate(float* h, const float* e, int64_t rows, int hc, int64_t dim,
                                  const float* q_weight, const float* k_weight, float norm_eps) = 0;
  // EngramGate of rows that are each a single-token reference call (decode): see
  // HcMixesSingleToken. Default: EngramGate.
  virtual absl::Status EngramGateSingleToken(float* h, const float* e, int64_t rows, int hc,
                                             int64_t dim, const float* q_weight,
                                             const float* k_weight, float norm_eps) {
    return EngramGate(h, e, rows, hc, dim, q_weight, k_weight, norm_eps);
  }
  // Embedding: h[r, j, :] = table[ids[r], :] for j < hc; table [vocab, dim] (either form).
  virtual absl::Status Embed(PlainWeight table, int64_t dim, const int32_t* ids, int64_t rows,
                             int hc, float* h) = 0;

  // ---- Paged packed rows (the KV pool's blocks) ----
  // A paged stream's row r lives at pages[r / rows_per_page] + (r % rows_per_page) *
  // RowCodecBytes(codec, dim); `pages` (an array in backend memory) holds page addresses in
  // backend memory. The i-th row an op touches is rows[i] + first, `rows` [n] a list in backend
  // memory, or first + i when rows is null.
  // PackRows: that row = codec(x[i, :]) for i < n, x [n, dim]. The codec quantizes (values the
  // codec holds exactly, as the model writes, are stored exactly). Each row is listed at most
  // once; a negative row is an error.
  virtual absl::Status PackRows(RowCodec codec, const float* x, int64_t n, int64_t dim,
                                uint8_t* const* pages, int64_t rows_per_page, const int32_t* rows,
                                int64_t first) = 0;
  // UnpackRows: out[i, :] = the values of that row (bf16-exact for the packed codecs, as
  // kernels/format.h's Unpack*), out [n, dim]; a negative row (a top-k's -1 with an offset)
  // leaves out[i, :] as it is. Exact.
  virtual absl::Status UnpackRows(RowCodec codec, const uint8_t* const* pages,
                                  int64_t rows_per_page, int64_t dim, const int32_t* rows,
                                  int64_t first, int64_t n, float* out) = 0;
  // GatherRows: UnpackRows over many streams, per_table listed rows each: out[i, :] = the
  // values of row rows[i] + first of the stream whose page table is tables[i / per_table]
  // (rows_per_page[i / per_table] rows a page); a negative row leaves out[i, :] as it is (the
  // top-k rows of a batched step's sequences, each over its own KV source, in one call). tables,
  // rows_per_page [ceil(n / per_table)] in backend memory. Exact.
  virtual absl::Status GatherRows(RowCodec codec, const uint8_t* const* const* tables,
                                  const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                                  const int32_t* rows, int64_t first, int64_t n, float* out) = 0;

  // The top-k part of a call's attention lists, built on the backend (the lists then need no
  // round trip through the host): list[r * list_len + offset + j] = -1 when topk[r * k + j] < 0,
  // else, with per_slot, base + r * k + j (the row of UnpackRows(topk, first = -key offset) that
  // gathers each slot's entry: a decode call), and without, base + topk[r * k + j] (the entry
  // itself, in a whole source unpacked once: a large call on a device), for r < rows, j < k;
  // other entries are untouched. Exact.
  virtual absl::Status TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base,
                                 bool per_slot, int32_t* list, int64_t list_len,
                                 int64_t offset) = 0;

  // Pool blocks' content (model/kv_pool.h, SealPending: a full block is sealed under a hash of
  // its bytes, and shared with a registered block only when their bytes are equal). Block i is
  // bytes[i] bytes at blocks[i] (or at a[i] and b[i]); `blocks`, `a`, `b` and `bytes` are arrays
  // of n entries in backend memory, like `pages` above, and so are the outputs.
  // DigestBlocks: out[i] = XXH3-64 (seed 0) of block i, libxxhash's value (the CUDA kernel is
  // kernels/xxh3_lanes.h). Exact.
  virtual absl::Status DigestBlocks(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                                    uint64_t* out) = 0;
  // BlocksEqual: equal[i] = 1 when block i's bytes at a[i] equal those at b[i], else 0. Exact.
  virtual absl::Status BlocksEqual(const uint8_t* const* a, const uint8_t* const* b,
                                   const int64_t* bytes, int64_t n, int32_t* equal) = 0;
  // CopyBlocks: block i's bytes from src[i] to dst[i] (a hand-off's blocks to or from one staging
  // buffer in one call: model/kv_pool.h ReadBlocks, WriteBlocks). The ranges must not overlap.
  // Exact.
  virtual absl::Status CopyBlocks(uint8_t* const* dst, const uint8_t* const* src,
                                  const int64_t* bytes, int64_t n) = 0;

  // ---- Quantize-dequantize ----
  // In-place quantize-dequantize of `rows` rows of length dim (MODEL.md §3/§4).
  enum class Qdq {
    kFp8Window,  // E4M3, UE8M0 per 32 (SWA KV)
    kFp4Index,   // E2M1, UE8M0 per 32 (indexer q/k)
    kFp4Kv,      // E2M1, E4M3 scale per 16 (compressed KV)
  };
  virtual absl::Status QuantDequant(Qdq kind, float* x, int64_t rows, int64_t dim) = 0;

  // ---- Sampling ----
  // out[r] = the first index of the largest value of x[r, :] (x [rows, n]).
  virtual absl::Status Argmax(const float* x, int64_t rows, int64_t n, int32_t* out) = 0;
  // Sampling penalties in place on logits (x: `total` floats, rows of the vocabulary): for each
  // i < entries, x[at[i]] = Penalized(x[at[i]], counts[i], repetition, frequency, presence)
  // (kernels/penalty.h: the host Sampler's arithmetic). at (distinct, in [0, total)) and counts
  // lie in backend memory. Exact. The CPU backend refuses an index out of range; a device
  // backend, which cannot read the list without a round trip, skips it.
  virtual absl::Status PenalizeLogits(float* x, int64_t total, const int64_t* at,
                                      const int32_t* counts, int64_t entries, float repetition,
                                      float frequency, float presence) = 0;
  // Seeded T > 0 draws: out[r] = the token a draw with uniform u[r] in [0, 1) takes from the
  // logits row x[r, :] (x [rows, n], penalties already applied) under `p`: the temperature,
  // top-k, top-p and min-p filters and the inverse CDF of kernels/sampling_math.h, the host
  // Sampler's arithmetic (FilteredProbs, then DrawIndex). u [rows] doubles and out [rows] lie in
  // backend memory. Exact (the same token as the host for the same logits and u). `probs` (null:
  // not wanted; else [rows, n] in backend memory) receives each row's distribution
  // (FilteredProbs): a DSpark draft's q, a verified row's p.
  virtual absl::Status SampleLogits(const float* x, int64_t rows, int64_t n, const SampleParams& p,
                                    const double* u, int32_t* out, float* probs) = 0;
  // Speculative verification of one sequence's k >= 0 drafts (kernels/sampling_math.h,
  // VerifyDrafts): p [k + 1, n] the target rows' distributions and q [k, n] the drafts' (both as
  // SampleLogits' probs), drafts [k], uniforms u [k + 1]; out [2] = {drafts accepted, the token
  // after them}. `chosen` (null: not wanted; else [k + 1]) receives each row's token for its
  // logprobs: out[1] at r = out[0] (and at r = k), else drafts[r]. All in backend
  // memory. Exact (one arithmetic with the host's Drafter::Verify). The CPU backend refuses a
  // draft outside [0, n); a device backend, which cannot read the drafts without a round trip,
  // takes one as rejected.
  virtual absl::Status VerifyDrafts(const float* p, const float* q, const int32_t* drafts,
                                    int64_t k, int64_t n, const double* u, int32_t* out,
                                    int32_t* chosen) = 0;
  // Logprobs of raw logits rows (model::ComputeLogprobs; kernels/sampling_math.h): for each row r
  // of x [rows, n], chosen_lp[r] = the logprob of token chosen[r] (in [0, n)), and the row's `top`
  // (in [0, n]) largest entries, descending with ties to the lower index, as top_ids and top_lp
  // [rows, top] (unused when top is 0). All in backend memory. Ids exact; a logprob may differ
  // from the host's in its last bit (the device's double log).
  virtual absl::Status TopLogprobs(const float* x, int64_t rows, int64_t n, const int32_t* chosen,
                                   int64_t top, float* chosen_lp, int32_t* top_ids,
                                   float* top_lp) = 0;
};

// Every op of the Backend interface (each virtual method returning a Status), by name. The parity
// suite (tests/gpu/backend_parity_test.cc) has one case per name and fails when a name has none;
// a unit test there also checks this list against the declarations above, so a new op must be
// added here (and get a parity case) to pass.
inline constexpr std::string_view kBackendOpNames[] = {
    "Allocate",
    "Upload",
    "Download",
    "Synchronize",
    "Copy",
    "BeginCapture",
    "EndCapture",
    "LaunchGraph",
    "LinearQuant",
    "LinearBf16",
    "LinearF32",
    "RmsNorm",
    "RopeTables",
    "Rope",
    "RoundBf16",
    "ScaleRoundBf16",
    "Add",
    "SparseAttention",
    "CompressPool",
    "IndexerScores",
    "MaskScores",
    "StableTopK",
    "CandidateMask",
    "SelectTopK",
    "IndexerScoresRows",
    "IndexerScoresPaged",
    "CandidateMaskRows",
    "SelectTopKRows",
    "HcMixes",
    "HcPre",
    "HcPost",
    "HcMean",
    "MoeRoute",
    "MoeGroup",
    "GroupedLinearQuant",
    "SwiGlu",
    "SumSlots",
    "CopyRows",
    "Fp8RowLookup",
    "EngramGate",
    "Embed",
    "PackRows",
    "UnpackRows",
    "GatherRows",
    "TopKSlots",
    "DigestBlocks",
    "BlocksEqual",
    "CopyBlocks",
    "QuantDequant",
    "Argmax",
    "PenalizeLogits",
    "SampleLogits",
    "VerifyDrafts",
    "TopLogprobs",
    "HcMixesSingleToken",
    "EngramGateSingleToken",
};

// The CPU reference backend (kernels/cpu/cpu_backend.cc): host memory, one synchronous stream, no
// graphs (supports_graphs() is false: the model runs every step op by op). It has no options: the
// seams tests use (device labels, operand checks, op counts, the scalar kernels, graph recording)
// are a wrapper in the test tree (tests/testing/test_cpu_backend.h).
std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace epd::kernels
