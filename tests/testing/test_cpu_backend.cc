// The CPU backend with the test seams (test_cpu_backend.h): a Backend that forwards every op to a
// plain CPU backend (kernels::MakeCpuBackend), adding on the way what TestCpuBackendOptions asks
// for. Every op goes through Do, which checks its pointer operands (check_operands), counts it
// (op_calls) and runs it under the scalar kernels (simd = false).
//
// Graphs (graphs): from BeginCapture to EndCapture on the capturing thread, Do records each op as
// a closure over its arguments (pointers and scalars, as a CUDA graph keeps them) and runs the
// closures in order at each LaunchGraph. The model's decode step graphs (docs/cuda.md, "Decode
// step graphs") thus run on the CPU as on a GPU: a segment that reads host data, or whose
// pointers or scalars should have changed from step to step, gives different results than the
// op-by-op step, which the tests compare bit for bit. The CPU backend's argument checks and the
// operand checks run when a recorded op runs (at launch), so a bad argument fails the launch, not
// the capture; an op given no work runs at once (it has nothing to record).
#include "tests/testing/test_cpu_backend.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/ops.h"

namespace epd::testing {
namespace {

using absl::OkStatus;
using absl::Status;
using kernels::Backend;
using kernels::Buffer;
using kernels::Graph;
using kernels::MemoryKind;
using kernels::PlainWeight;
using kernels::QuantWeight;
using kernels::RowCodec;
using kernels::SampleParams;
using kernels::SparseAttentionArgs;
using kernels::Stream;

// The live allocations of a backend with check_operands, by start address. Shared with the
// buffers' deleters, which may run after the backend is gone.
struct Allocations {
  std::mutex mu;
  std::map<uintptr_t, int64_t> live;

  bool Contains(const void* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.upper_bound(a);
    if (it == live.begin()) return false;
    --it;
    return a < it->first + static_cast<uintptr_t>(it->second);
  }
};

// An op's pointer operands by name (null ones are not checked).
class Operands {
 public:
  using Operand = std::pair<const char*, const void*>;
  Operands(std::initializer_list<Operand> list) {
    for (const Operand& o : list) {
      if (n_ < static_cast<int>(at_.size())) at_[n_++] = o;
    }
  }
  const Operand* begin() const { return at_.data(); }
  const Operand* end() const { return at_.data() + n_; }

 private:
  std::array<Operand, 8> at_{};
  int n_ = 0;
};

class RecordedGraph final : public Graph {
 public:
  RecordedGraph(const void* owner, std::vector<std::function<Status()>> ops)
      : owner_(owner), ops_(std::move(ops)) {}
  const void* owner() const { return owner_; }
  int64_t ops() const override { return static_cast<int64_t>(ops_.size()); }
  Status Run() const {
    for (const auto& op : ops_) {
      if (Status s = op(); !s.ok()) return s;
    }
    return OkStatus();
  }

 private:
  const void* owner_;  // the backend that recorded it
  std::vector<std::function<Status()>> ops_;
};

class TestCpuBackend final : public Backend {
 public:
  explicit TestCpuBackend(TestCpuBackendOptions options)
      : in_(kernels::MakeCpuBackend()),
        options_(options),
        allocations_(options.check_operands ? std::make_shared<Allocations>() : nullptr) {}

  std::string_view Name() const override { return in_->Name(); }

  // ---- Memory ----
  MemoryKind memory_kind() const override {
    return options_.report_device_memory ? MemoryKind::kDevice : in_->memory_kind();
  }
  int64_t free_memory_bytes() const override { return options_.free_memory_bytes; }
  // The plain backend's buffer, relabelled (report_device_memory) and tracked (check_operands).
  absl::StatusOr<Buffer> Allocate(int64_t bytes, Stream stream) override {
    absl::StatusOr<Buffer> b = in_->Allocate(bytes, stream);
    if (!b.ok() || (!options_.report_device_memory && allocations_ == nullptr)) return b;
    void* p = b->data();
    const int64_t n = b->bytes();
    if (p == nullptr) return Buffer(nullptr, n, memory_kind(), stream, nullptr);
    if (allocations_ != nullptr) {
      std::lock_guard<std::mutex> lock(allocations_->mu);
      allocations_->live[reinterpret_cast<uintptr_t>(p)] = n;
    }
    auto held = std::make_shared<Buffer>(std::move(*b));
    return Buffer(p, n, memory_kind(), stream, [held, a = allocations_](void* q) mutable {
      if (a != nullptr) {
        std::lock_guard<std::mutex> lock(a->mu);
        a->live.erase(reinterpret_cast<uintptr_t>(q));
      }
      held.reset();
    });
  }
  Status Upload(const void* host, int64_t bytes, Buffer& dst, int64_t dst_offset) override {
    if (Status s = RefusedWhileCapturing("Upload"); !s.ok()) return s;
    Status s = in_->Upload(host, bytes, dst, dst_offset);
    if (s.ok()) Count("Upload");
    return s;
  }
  Status Download(const Buffer& src, int64_t src_offset, int64_t bytes, void* host) override {
    if (Status s = RefusedWhileCapturing("Download"); !s.ok()) return s;
    Status s = in_->Download(src, src_offset, bytes, host);
    if (s.ok()) {
      Count("Download");
      if (options_.download_bytes != nullptr) *options_.download_bytes += bytes;
    }
    return s;
  }
  Status Synchronize(Stream stream) override {
    if (Status s = RefusedWhileCapturing("Synchronize"); !s.ok()) return s;
    return in_->Synchronize(stream);
  }
  Status Copy(void* dst, const void* src, int64_t bytes) override {
    return Do("Copy", {{"dst", dst}, {"src", src}},
              [=, this] { return in_->Copy(dst, src, bytes); });
  }

  // ---- Graphs (the plain backend's refusals without the option) ----
  bool supports_graphs() const override { return options_.graphs; }
  Status BeginCapture() override {
    if (!options_.graphs) return in_->BeginCapture();
    std::lock_guard<std::mutex> lock(mu_);
    if (capturing_) {
      return absl::FailedPreconditionError("cpu backend: BeginCapture: a capture is under way");
    }
    capturing_ = true;
    capture_thread_ = std::this_thread::get_id();
    recorded_.clear();
    first_error_ = OkStatus();
    return OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture() override {
    if (!options_.graphs) return in_->EndCapture();
    std::lock_guard<std::mutex> lock(mu_);
    if (!capturing_ || capture_thread_ != std::this_thread::get_id()) {
      return absl::FailedPreconditionError(
          "cpu backend: EndCapture: no capture under way on this thread");
    }
    capturing_ = false;
    if (!first_error_.ok()) return std::exchange(first_error_, OkStatus());
    return std::unique_ptr<Graph>(std::make_unique<RecordedGraph>(this, std::move(recorded_)));
  }
  Status LaunchGraph(Graph& graph) override {
    if (!options_.graphs) return in_->LaunchGraph(graph);
    if (Status s = RefusedWhileCapturing("LaunchGraph"); !s.ok()) return s;
    auto* g = dynamic_cast<RecordedGraph*>(&graph);
    if (g == nullptr || g->owner() != this) {
      return absl::InvalidArgumentError(
          "cpu backend: LaunchGraph: the graph was not recorded by this backend");
    }
    Count("LaunchGraph");
    if (options_.op_calls != nullptr) (*options_.op_calls)["graph ops"] += g->ops();
    return g->Run();
  }

  // ---- Ops: checked, counted and forwarded, or recorded while capturing ----
  Status LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) override {
    return Do("LinearQuant",
              {{"x", x},
               {"w.codes", w.packed() ? w.codes.data() : nullptr},
               {"w.scale_codes", w.packed() ? w.scale_codes.data() : nullptr},
               {"y", y}},
              [=, this, &w] { return in_->LinearQuant(x, rows, w, y); });
  }
  Status LinearBf16(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                    float* y) override {
    return Do("LinearBf16", {{"x", x}, {"w", w.data}, {"y", y}},
              [=, this] { return in_->LinearBf16(x, rows, w, out, in, y); });
  }
  Status LinearF32(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                   float* y) override {
    return Do("LinearF32", {{"x", x}, {"w", w.data}, {"y", y}},
              [=, this] { return in_->LinearF32(x, rows, w, out, in, y); });
  }
  Status RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                 float* y) override {
    return Do("RmsNorm", {{"x", x}, {"w", w}, {"y", y}},
              [=, this] { return in_->RmsNorm(x, w, rows, dim, eps, y); });
  }
  Status RopeTables(const float* freqs, int n_pairs, const int64_t* positions, int64_t rows,
                    float* cos, float* sin) override {
    return Do("RopeTables",
              {{"freqs", freqs}, {"positions", positions}, {"cos", cos}, {"sin", sin}},
              [=, this] { return in_->RopeTables(freqs, n_pairs, positions, rows, cos, sin); });
  }
  Status Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
              const float* cos, const float* sin, bool inverse) override {
    return Do("Rope", {{"x", x}, {"cos", cos}, {"sin", sin}}, [=, this] {
      return in_->Rope(x, rows, heads, stride, offset, n_pairs, cos, sin, inverse);
    });
  }
  Status RoundBf16(float* x, int64_t n) override {
    return Do("RoundBf16", {{"x", x}}, [=, this] { return in_->RoundBf16(x, n); });
  }
  Status ScaleRoundBf16(float* x, int64_t n, float scale) override {
    return Do("ScaleRoundBf16", {{"x", x}}, [=, this] { return in_->ScaleRoundBf16(x, n, scale); });
  }
  Status Add(float* x, const float* y, int64_t n) override {
    return Do("Add", {{"x", x}, {"y", y}}, [=, this] { return in_->Add(x, y, n); });
  }
  Status SparseAttention(const SparseAttentionArgs& args) override {
    return Do("SparseAttention",
              {{"q", args.q},
               {"kv", args.kv},
               {"sink", args.sink},
               {"idx", args.idx},
               {"kv_ext", args.kv_ext},
               {"out", args.out}},
              [=, this] { return in_->SparseAttention(args); });
  }
  Status CompressPool(const float* kv, const float* score, int64_t groups, int ratio, int64_t dim,
                      float* out) override {
    return Do("CompressPool", {{"kv", kv}, {"score", score}, {"out", out}},
              [=, this] { return in_->CompressPool(kv, score, groups, ratio, dim, out); });
  }
  Status IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                       int64_t dim, float* score) override {
    return Do("IndexerScores", {{"q", q}, {"w", w}, {"keys", keys}, {"score", score}},
              [=, this] { return in_->IndexerScores(q, w, heads, keys, n, dim, score); });
  }
  Status MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                    int64_t mask_cols) override {
    return Do("MaskScores", {{"score", score}, {"mask", mask}},
              [=, this] { return in_->MaskScores(score, n, valid, mask, mask_cols); });
  }
  Status StableTopK(const float* v, int64_t n, int64_t k, int32_t* out) override {
    return Do("StableTopK", {{"v", v}, {"out", out}},
              [=, this] { return in_->StableTopK(v, n, k, out); });
  }
  Status CandidateMask(const float* score, int64_t n, int64_t block, int64_t visible,
                       int64_t keep_blocks, uint8_t* mask) override {
    return Do("CandidateMask", {{"score", score}, {"mask", mask}}, [=, this] {
      return in_->CandidateMask(score, n, block, visible, keep_blocks, mask);
    });
  }
  Status SelectTopK(const float* score, int64_t n, int64_t k, int64_t visible, int64_t offset,
                    int32_t* out) override {
    return Do("SelectTopK", {{"score", score}, {"out", out}},
              [=, this] { return in_->SelectTopK(score, n, k, visible, offset, out); });
  }
  Status IndexerScoresRows(const float* q, const float* w, int heads, const float* keys, int64_t n,
                           int64_t dim, int64_t rows, const int64_t* valid, float* score) override {
    return Do("IndexerScoresRows",
              {{"q", q}, {"w", w}, {"keys", keys}, {"valid", valid}, {"score", score}}, [=, this] {
                return in_->IndexerScoresRows(q, w, heads, keys, n, dim, rows, valid, score);
              });
  }
  Status CandidateMaskRows(const float* score, int64_t rows, int64_t n, int64_t block,
                           const int64_t* visible, const int64_t* cols, int64_t keep_blocks,
                           uint8_t* mask) override {
    return Do("CandidateMaskRows",
              {{"score", score}, {"visible", visible}, {"cols", cols}, {"mask", mask}}, [=, this] {
                return in_->CandidateMaskRows(score, rows, n, block, visible, cols, keep_blocks,
                                              mask);
              });
  }
  Status IndexerScoresPaged(const float* q, const float* w, int heads, RowCodec codec,
                            const uint8_t* const* const* tables, const int64_t* rows_per_page,
                            const int64_t* valid, int64_t n, int64_t dim, int64_t rows,
                            float* score) override {
    return Do("IndexerScoresPaged",
              {{"q", q},
               {"w", w},
               {"tables", tables},
               {"rows_per_page", rows_per_page},
               {"valid", valid},
               {"score", score}},
              [=, this]() -> Status {
                for (int64_t r = 0; r < rows; ++r) {
                  if (valid[r] <= 0 || valid[r] > n)
                    continue;  // reads nothing, or refused by the op
                  if (Status s = PagesProblem("IndexerScoresPaged", tables[r], rows_per_page[r],
                                              nullptr, 0, valid[r], /*table=*/true);
                      !s.ok()) {
                    return s;
                  }
                }
                return in_->IndexerScoresPaged(q, w, heads, codec, tables, rows_per_page, valid, n,
                                               dim, rows, score);
              });
  }
  Status SelectTopKRows(const float* score, int64_t rows, int64_t n, int64_t k,
                        const int64_t* visible, int64_t offset, const uint8_t* mask,
                        int64_t mask_cols, int32_t* out) override {
    return Do("SelectTopKRows",
              {{"score", score}, {"visible", visible}, {"mask", mask}, {"out", out}}, [=, this] {
                return in_->SelectTopKRows(score, rows, n, k, visible, offset, mask, mask_cols,
                                           out);
              });
  }
  Status HcMixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                 const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                 float norm_eps, float* pre, float* post, float* comb) override {
    return Do("HcMixes", MixesOperands(h, fn, scale, base, pre, post, comb), [=, this] {
      return in_->HcMixes(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, pre,
                          post, comb);
    });
  }
  Status HcMixesSingleToken(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                            const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                            float norm_eps, float* pre, float* post, float* comb) override {
    return Do("HcMixesSingleToken", MixesOperands(h, fn, scale, base, pre, post, comb), [=, this] {
      return in_->HcMixesSingleToken(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps,
                                     norm_eps, pre, post, comb);
    });
  }
  Status HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
               float* y) override {
    return Do("HcPre", {{"h", h}, {"pre", pre}, {"y", y}},
              [=, this] { return in_->HcPre(rows, h, hc, dim, pre, y); });
  }
  Status HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                const float* post, const float* comb, float* out) override {
    return Do("HcPost", {{"y", y}, {"res", res}, {"post", post}, {"comb", comb}, {"out", out}},
              [=, this] { return in_->HcPost(rows, y, res, hc, dim, post, comb, out); });
  }
  Status HcMean(int64_t rows, const float* h, int hc, int64_t dim, float* y,
                int64_t y_stride) override {
    return Do("HcMean", {{"h", h}, {"y", y}},
              [=, this] { return in_->HcMean(rows, h, hc, dim, y, y_stride); });
  }
  Status MoeRoute(const float* z, int64_t rows, int n_experts, const float* bias, int top_k,
                  float route_scale, int32_t* experts, float* weights,
                  int32_t* ranked = nullptr) override {
    return Do(
        "MoeRoute",
        {{"z", z}, {"bias", bias}, {"experts", experts}, {"weights", weights}, {"ranked", ranked}},
        [=, this] {
          return in_->MoeRoute(z, rows, n_experts, bias, top_k, route_scale, experts, weights,
                               ranked);
        });
  }
  Status SwiGlu(const float* g, const float* u, int64_t rows, int64_t inter, float limit,
                const float* row_weights, float* h) override {
    return Do("SwiGlu", {{"g", g}, {"u", u}, {"row_weights", row_weights}, {"h", h}},
              [=, this] { return in_->SwiGlu(g, u, rows, inter, limit, row_weights, h); });
  }
  Status CopyRows(const float* src, const int64_t* src_rows, float* dst, const int64_t* dst_rows,
                  int64_t n, int64_t dim) override {
    return Do("CopyRows",
              {{"src", src}, {"src_rows", src_rows}, {"dst", dst}, {"dst_rows", dst_rows}},
              [=, this] { return in_->CopyRows(src, src_rows, dst, dst_rows, n, dim); });
  }
  Status MoeGroup(const int32_t* experts, const float* weights, int64_t rows, int n_experts,
                  int top_k, int n_shared, int64_t* starts, int64_t* src_rows, int64_t* slot_rows,
                  float* entry_weights) override {
    return Do("MoeGroup",
              {{"experts", experts},
               {"weights", weights},
               {"starts", starts},
               {"src_rows", src_rows},
               {"slot_rows", slot_rows},
               {"entry_weights", entry_weights}},
              [=, this] {
                return in_->MoeGroup(experts, weights, rows, n_experts, top_k, n_shared, starts,
                                     src_rows, slot_rows, entry_weights);
              });
  }
  Status GroupedLinearQuant(const float* x, int64_t rows, const int64_t* starts,
                            const QuantWeight* const* ws, int n_groups, float* y) override {
    // The weight list is the caller's (often a local array): the recording keeps a copy.
    std::vector<const QuantWeight*> list(ws, ws + std::max(n_groups, 0));
    return Do("GroupedLinearQuant", {{"x", x}, {"starts", starts}, {"y", y}},
              [=, this, list = std::move(list)]() -> Status {
                for (const QuantWeight* w : list) {
                  if (w == nullptr || !w->packed()) continue;
                  if (Status s = CheckOperands(
                          "GroupedLinearQuant",
                          {{"w.codes", w->codes.data()}, {"w.scale_codes", w->scale_codes.data()}});
                      !s.ok()) {
                    return s;
                  }
                }
                return in_->GroupedLinearQuant(x, rows, starts, list.data(), n_groups, y);
              });
  }
  Status SumSlots(const float* ys, int64_t rows, int64_t slots, int64_t dim, float* out) override {
    return Do("SumSlots", {{"ys", ys}, {"out", out}},
              [=, this] { return in_->SumSlots(ys, rows, slots, dim, out); });
  }
  Status Fp8RowLookup(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                      const int64_t* ids, int64_t n, float* out) override {
    return Do("Fp8RowLookup",
              {{"table", table}, {"table_scale", table_scale}, {"ids", ids}, {"out", out}},
              [=, this] { return in_->Fp8RowLookup(table, table_scale, dim, ids, n, out); });
  }
  Status EngramGate(float* h, const float* e, int64_t rows, int hc, int64_t dim,
                    const float* q_weight, const float* k_weight, float norm_eps) override {
    return Do(
        "EngramGate", {{"h", h}, {"e", e}, {"q_weight", q_weight}, {"k_weight", k_weight}},
        [=, this] { return in_->EngramGate(h, e, rows, hc, dim, q_weight, k_weight, norm_eps); });
  }
  Status EngramGateSingleToken(float* h, const float* e, int64_t rows, int hc, int64_t dim,
                               const float* q_weight, const float* k_weight,
                               float norm_eps) override {
    return Do("EngramGateSingleToken",
              {{"h", h}, {"e", e}, {"q_weight", q_weight}, {"k_weight", k_weight}}, [=, this] {
                return in_->EngramGateSingleToken(h, e, rows, hc, dim, q_weight, k_weight,
                                                  norm_eps);
              });
  }
  Status Embed(PlainWeight table, int64_t dim, const int32_t* ids, int64_t rows, int hc,
               float* h) override {
    return Do("Embed", {{"table", table.data}, {"ids", ids}, {"h", h}},
              [=, this] { return in_->Embed(table, dim, ids, rows, hc, h); });
  }
  Status PackRows(RowCodec codec, const float* x, int64_t n, int64_t dim, uint8_t* const* pages,
                  int64_t rows_per_page, const int32_t* rows, int64_t first) override {
    return Do("PackRows", {{"x", x}, {"pages", pages}, {"rows", rows}}, [=, this]() -> Status {
      if (Status s = PagesProblem("PackRows", pages, rows_per_page, rows, first, n, false);
          !s.ok()) {
        return s;
      }
      return in_->PackRows(codec, x, n, dim, pages, rows_per_page, rows, first);
    });
  }
  Status UnpackRows(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    return Do(
        "UnpackRows", {{"pages", pages}, {"rows", rows}, {"out", out}}, [=, this]() -> Status {
          if (Status s = PagesProblem("UnpackRows", pages, rows_per_page, rows, first, n, false);
              !s.ok()) {
            return s;
          }
          return in_->UnpackRows(codec, pages, rows_per_page, dim, rows, first, n, out);
        });
  }
  Status GatherRows(RowCodec codec, const uint8_t* const* const* tables,
                    const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    return Do(
        "GatherRows",
        {{"tables", tables}, {"rows_per_page", rows_per_page}, {"rows", rows}, {"out", out}},
        [=, this]() -> Status {
          for (int64_t g = 0; per_table > 0 && g * per_table < n; ++g) {
            if (Status s =
                    PagesProblem("GatherRows", tables[g], rows_per_page[g], rows + g * per_table,
                                 first, std::min(per_table, n - g * per_table), /*table=*/true);
                !s.ok()) {
              return s;
            }
          }
          return in_->GatherRows(codec, tables, rows_per_page, per_table, dim, rows, first, n, out);
        });
  }
  Status TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base, bool per_slot,
                   int32_t* list, int64_t list_len, int64_t offset) override {
    return Do("TopKSlots", {{"topk", topk}, {"list", list}}, [=, this] {
      return in_->TopKSlots(topk, rows, k, base, per_slot, list, list_len, offset);
    });
  }
  Status DigestBlocks(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                      uint64_t* out) override {
    return Do(
        "DigestBlocks", {{"blocks", blocks}, {"bytes", bytes}, {"out", out}},
        [=, this] { return in_->DigestBlocks(blocks, bytes, n, out); }, n > 0);
  }
  Status BlocksEqual(const uint8_t* const* a, const uint8_t* const* b, const int64_t* bytes,
                     int64_t n, int32_t* equal) override {
    return Do(
        "BlocksEqual", {{"a", a}, {"b", b}, {"bytes", bytes}, {"equal", equal}},
        [=, this] { return in_->BlocksEqual(a, b, bytes, n, equal); }, n > 0);
  }
  Status CopyBlocks(uint8_t* const* dst, const uint8_t* const* src, const int64_t* bytes,
                    int64_t n) override {
    return Do(
        "CopyBlocks", {{"dst", dst}, {"src", src}, {"bytes", bytes}},
        [=, this] { return in_->CopyBlocks(dst, src, bytes, n); }, n > 0);
  }
  Status QuantDequant(Qdq kind, float* x, int64_t rows, int64_t dim) override {
    return Do("QuantDequant", {{"x", x}},
              [=, this] { return in_->QuantDequant(kind, x, rows, dim); });
  }
  Status Argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    return Do("Argmax", {{"x", x}, {"out", out}},
              [=, this] { return in_->Argmax(x, rows, n, out); });
  }
  Status PenalizeLogits(float* x, int64_t total, const int64_t* at, const int32_t* counts,
                        int64_t entries, float repetition, float frequency,
                        float presence) override {
    return Do(
        "PenalizeLogits", {{"x", x}, {"at", at}, {"counts", counts}},
        [=, this] {
          return in_->PenalizeLogits(x, total, at, counts, entries, repetition, frequency,
                                     presence);
        },
        entries > 0);
  }
  Status SampleLogits(const float* x, int64_t rows, int64_t n, const SampleParams& p,
                      const double* u, int32_t* out, float* probs) override {
    return Do(
        "SampleLogits", {{"x", x}, {"u", u}, {"out", out}},
        [=, this] { return in_->SampleLogits(x, rows, n, p, u, out, probs); }, rows > 0);
  }
  Status VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k, int64_t n,
                      const double* u, int32_t* out, int32_t* chosen) override {
    return Do("VerifyDrafts",
              {{"p", p},
               {"u", u},
               {"out", out},
               {"q", k > 0 ? q : nullptr},
               {"drafts", k > 0 ? drafts : nullptr},
               {"chosen", chosen}},
              [=, this] { return in_->VerifyDrafts(p, q, drafts, k, n, u, out, chosen); });
  }
  Status TopLogprobs(const float* x, int64_t rows, int64_t n, const int32_t* chosen, int64_t top,
                     float* chosen_lp, int32_t* top_ids, float* top_lp) override {
    return Do(
        "TopLogprobs",
        {{"x", x},
         {"chosen", chosen},
         {"chosen_lp", chosen_lp},
         {"top_ids", top > 0 ? top_ids : nullptr},
         {"top_lp", top > 0 ? top_lp : nullptr}},
        [=, this] { return in_->TopLogprobs(x, rows, n, chosen, top, chosen_lp, top_ids, top_lp); },
        rows > 0);
  }

 private:
  // The op `name`: with `work`, its operands checked and `op` run under the scalar kernels (when
  // asked), counted when called directly, recorded instead on the capturing thread during a
  // capture. Without work (no blocks, rows or entries) `op` runs at once, neither checked nor
  // counted: it reads and writes nothing.
  template <typename F>
  Status Do(const char* name, Operands operands, F&& op, bool work = true) {
    if (!work) return op();
    auto run = [this, name, operands, op = std::forward<F>(op)]() -> Status {
      if (Status s = CheckOperands(name, operands); !s.ok()) return s;
      kernels::cpu::ScopedScalarKernels scalar(!options_.simd);
      return op();
    };
    if (Capturing()) {
      std::lock_guard<std::mutex> lock(mu_);
      recorded_.emplace_back(std::move(run));
      return OkStatus();
    }
    Count(name);
    return run();
  }
  bool Capturing() {
    std::lock_guard<std::mutex> lock(mu_);
    return capturing_ && capture_thread_ == std::this_thread::get_id();
  }
  // A refused call also fails the capture (EndCapture gives the first such error).
  Status RefusedWhileCapturing(const char* op) {
    if (!Capturing()) return OkStatus();
    Status refused = absl::FailedPreconditionError(
        absl::StrCat("cpu backend: ", op, " during a graph capture (a graph holds no host data)"));
    std::lock_guard<std::mutex> lock(mu_);
    if (first_error_.ok()) first_error_ = refused;
    return refused;
  }
  void Count(const char* name) {
    if (options_.op_calls != nullptr) ++(*options_.op_calls)[name];
  }

  // ---- check_operands ----
  // HcMixes' and HcMixesSingleToken's operands.
  static Operands MixesOperands(const float* h, const float* fn, const float* scale,
                                const float* base, const float* pre, const float* post,
                                const float* comb) {
    return Operands{{"h", h},     {"fn", fn},     {"scale", scale}, {"base", base},
                    {"pre", pre}, {"post", post}, {"comb", comb}};
  }
  bool Ours(const void* p) const { return allocations_ == nullptr || allocations_->Contains(p); }
  Status CheckOperands(const char* op, const Operands& operands) const {
    for (const auto& [name, p] : operands) {
      if (p != nullptr && !Ours(p)) {
        return absl::InternalError(absl::StrCat("cpu backend: ", op, ": operand ", name,
                                                " is not memory of this backend"));
      }
    }
    return OkStatus();
  }
  // A paged stream's pages (and, with `table`, its page table `pages`) that the op reads: those
  // of rows (rows ? rows[i] : i) + first, i < n; a negative row reads nothing. Arguments the op
  // refuses (a page size, a null page) are left to it.
  Status PagesProblem(const char* op, const uint8_t* const* pages, int64_t rows_per_page,
                      const int32_t* rows, int64_t first, int64_t n, bool table) const {
    if (allocations_ == nullptr || pages == nullptr || rows_per_page <= 0) return OkStatus();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (rows != nullptr ? rows[i] : i) + first;
      if (r < 0) continue;
      if (table && !Ours(pages)) {
        return absl::InternalError(
            absl::StrCat("cpu backend: ", op, ": a page table is not memory of this backend"));
      }
      table = false;
      const uint8_t* page = pages[r / rows_per_page];
      if (page != nullptr && !Ours(page)) {
        return absl::InternalError(absl::StrCat("cpu backend: ", op, ": the page of row ", r,
                                                " is not memory of this backend"));
      }
    }
    return OkStatus();
  }

  std::unique_ptr<Backend> in_;
  TestCpuBackendOptions options_;
  std::shared_ptr<Allocations> allocations_;  // check_operands only
  std::mutex mu_;
  bool capturing_ = false;
  std::thread::id capture_thread_;
  std::vector<std::function<Status()>> recorded_;
  Status first_error_;  // of the capture under way
};

}  // namespace

std::unique_ptr<Backend> MakeTestCpuBackend(TestCpuBackendOptions options) {
  return std::make_unique<TestCpuBackend>(options);
}

}  // namespace epd::testing
