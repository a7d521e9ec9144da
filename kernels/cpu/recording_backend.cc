// The CPU backend's graphs (CpuBackendOptions::graphs): a Backend that forwards every op to the
// CPU backend, except from BeginCapture to EndCapture on the capturing thread, where it records
// each op as a closure over its arguments (pointers and scalars, as a CUDA graph keeps them) and
// runs the closures in order at each LaunchGraph. The model's decode step graphs
// (docs/cuda.md, "Decode step graphs") thus run on the CPU as on a GPU: a segment that reads host
// data, or whose pointers or scalars should have changed from step to step, gives different
// results than the op-by-op step, which the tests compare bit for bit.
//
// The CPU backend's argument checks run when a recorded op runs (at launch), so a bad argument
// fails the launch, not the capture. op_calls (when set) counts what this backend is given: each
// op called directly, "LaunchGraph", and "graph ops" (the ops launched inside graphs); the
// forwarded backend counts nothing.
#include "kernels/cpu/recording_backend.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace epd::kernels::cpu {
namespace {

using absl::OkStatus;
using absl::Status;

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

class RecordingBackend final : public Backend {
 public:
  RecordingBackend(std::unique_ptr<Backend> in, std::map<std::string, int64_t>* op_calls)
      : in_(std::move(in)), op_calls_(op_calls) {}

  std::string_view Name() const override { return in_->Name(); }
  MemoryKind memory_kind() const override { return in_->memory_kind(); }
  int64_t free_memory_bytes() const override { return in_->free_memory_bytes(); }
  absl::StatusOr<Buffer> Allocate(int64_t bytes, Stream stream) override {
    return in_->Allocate(bytes, stream);
  }
  Status Upload(const void* host, int64_t bytes, Buffer& dst, int64_t dst_offset) override {
    if (Status s = RefusedWhileCapturing("Upload"); !s.ok()) return s;
    Count("Upload");
    return in_->Upload(host, bytes, dst, dst_offset);
  }
  Status Download(const Buffer& src, int64_t src_offset, int64_t bytes, void* host) override {
    if (Status s = RefusedWhileCapturing("Download"); !s.ok()) return s;
    Count("Download");
    return in_->Download(src, src_offset, bytes, host);
  }
  Status Synchronize(Stream stream) override {
    if (Status s = RefusedWhileCapturing("Synchronize"); !s.ok()) return s;
    return in_->Synchronize(stream);
  }
  Status Copy(void* dst, const void* src, int64_t bytes) override {
    return Do("Copy", [=, this] { return in_->Copy(dst, src, bytes); });
  }

  // ---- Graphs ----
  bool supports_graphs() const override { return true; }
  Status BeginCapture() override {
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
    if (Status s = RefusedWhileCapturing("LaunchGraph"); !s.ok()) return s;
    auto* g = dynamic_cast<RecordedGraph*>(&graph);
    if (g == nullptr || g->owner() != this) {
      return absl::InvalidArgumentError(
          "cpu backend: LaunchGraph: the graph was not recorded by this backend");
    }
    Count("LaunchGraph");
    if (op_calls_ != nullptr) (*op_calls_)["graph ops"] += g->ops();
    return g->Run();
  }

  // ---- Ops: forwarded, or recorded while capturing ----
  Status LinearQuant(const float* x, int64_t rows, const QuantWeight& w, float* y) override {
    return Do("LinearQuant", [=, this, &w] { return in_->LinearQuant(x, rows, w, y); });
  }
  Status LinearBf16(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                    float* y) override {
    return Do("LinearBf16", [=, this] { return in_->LinearBf16(x, rows, w, out, in, y); });
  }
  Status LinearF32(const float* x, int64_t rows, PlainWeight w, int64_t out, int64_t in,
                   float* y) override {
    return Do("LinearF32", [=, this] { return in_->LinearF32(x, rows, w, out, in, y); });
  }
  Status RmsNorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                 float* y) override {
    return Do("RmsNorm", [=, this] { return in_->RmsNorm(x, w, rows, dim, eps, y); });
  }
  Status RopeTables(const float* freqs, int n_pairs, const int64_t* positions, int64_t rows,
                    float* cos, float* sin) override {
    return Do("RopeTables",
              [=, this] { return in_->RopeTables(freqs, n_pairs, positions, rows, cos, sin); });
  }
  Status Rope(float* x, int64_t rows, int heads, int stride, int offset, int n_pairs,
              const float* cos, const float* sin, bool inverse) override {
    return Do("Rope", [=, this] {
      return in_->Rope(x, rows, heads, stride, offset, n_pairs, cos, sin, inverse);
    });
  }
  Status RoundBf16(float* x, int64_t n) override {
    return Do("RoundBf16", [=, this] { return in_->RoundBf16(x, n); });
  }
  Status ScaleRoundBf16(float* x, int64_t n, float scale) override {
    return Do("ScaleRoundBf16", [=, this] { return in_->ScaleRoundBf16(x, n, scale); });
  }
  Status Add(float* x, const float* y, int64_t n) override {
    return Do("Add", [=, this] { return in_->Add(x, y, n); });
  }
  Status SparseAttention(const SparseAttentionArgs& args) override {
    return Do("SparseAttention", [=, this] { return in_->SparseAttention(args); });
  }
  Status CompressPool(const float* kv, const float* score, int64_t groups, int ratio, int64_t dim,
                      float* out) override {
    return Do("CompressPool",
              [=, this] { return in_->CompressPool(kv, score, groups, ratio, dim, out); });
  }
  Status IndexerScores(const float* q, const float* w, int heads, const float* keys, int64_t n,
                       int64_t dim, float* score) override {
    return Do("IndexerScores",
              [=, this] { return in_->IndexerScores(q, w, heads, keys, n, dim, score); });
  }
  Status MaskScores(float* score, int64_t n, int64_t valid, const uint8_t* mask,
                    int64_t mask_cols) override {
    return Do("MaskScores",
              [=, this] { return in_->MaskScores(score, n, valid, mask, mask_cols); });
  }
  Status StableTopK(const float* v, int64_t n, int64_t k, int32_t* out) override {
    return Do("StableTopK", [=, this] { return in_->StableTopK(v, n, k, out); });
  }
  Status CandidateMask(const float* score, int64_t n, int64_t block, int64_t visible,
                       int64_t keep_blocks, uint8_t* mask) override {
    return Do("CandidateMask", [=, this] {
      return in_->CandidateMask(score, n, block, visible, keep_blocks, mask);
    });
  }
  Status SelectTopK(const float* score, int64_t n, int64_t k, int64_t visible, int64_t offset,
                    int32_t* out) override {
    return Do("SelectTopK",
              [=, this] { return in_->SelectTopK(score, n, k, visible, offset, out); });
  }
  Status IndexerScoresRows(const float* q, const float* w, int heads, const float* keys, int64_t n,
                           int64_t dim, int64_t rows, const int64_t* valid, float* score) override {
    return Do("IndexerScoresRows", [=, this] {
      return in_->IndexerScoresRows(q, w, heads, keys, n, dim, rows, valid, score);
    });
  }
  Status CandidateMaskRows(const float* score, int64_t rows, int64_t n, int64_t block,
                           const int64_t* visible, const int64_t* cols, int64_t keep_blocks,
                           uint8_t* mask) override {
    return Do("CandidateMaskRows", [=, this] {
      return in_->CandidateMaskRows(score, rows, n, block, visible, cols, keep_blocks, mask);
    });
  }
  Status IndexerScoresPaged(const float* q, const float* w, int heads, RowCodec codec,
                            const uint8_t* const* const* tables, const int64_t* rows_per_page,
                            const int64_t* valid, int64_t n, int64_t dim, int64_t rows,
                            float* score) override {
    return Do("IndexerScoresPaged", [=, this] {
      return in_->IndexerScoresPaged(q, w, heads, codec, tables, rows_per_page, valid, n, dim, rows,
                                     score);
    });
  }
  Status SelectTopKRows(const float* score, int64_t rows, int64_t n, int64_t k,
                        const int64_t* visible, int64_t offset, const uint8_t* mask,
                        int64_t mask_cols, int32_t* out) override {
    return Do("SelectTopKRows", [=, this] {
      return in_->SelectTopKRows(score, rows, n, k, visible, offset, mask, mask_cols, out);
    });
  }
  Status HcMixes(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                 const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                 float norm_eps, float* pre, float* post, float* comb) override {
    return Do("HcMixes", [=, this] {
      return in_->HcMixes(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, pre,
                          post, comb);
    });
  }
  Status HcMixesSingleToken(int64_t rows, const float* h, int hc, int64_t dim, const float* fn,
                            const float* scale, const float* base, int sinkhorn_iters, float hc_eps,
                            float norm_eps, float* pre, float* post, float* comb) override {
    return Do("HcMixesSingleToken", [=, this] {
      return in_->HcMixesSingleToken(rows, h, hc, dim, fn, scale, base, sinkhorn_iters, hc_eps,
                                     norm_eps, pre, post, comb);
    });
  }
  Status HcPre(int64_t rows, const float* h, int hc, int64_t dim, const float* pre,
               float* y) override {
    return Do("HcPre", [=, this] { return in_->HcPre(rows, h, hc, dim, pre, y); });
  }
  Status HcPost(int64_t rows, const float* y, const float* res, int hc, int64_t dim,
                const float* post, const float* comb, float* out) override {
    return Do("HcPost", [=, this] { return in_->HcPost(rows, y, res, hc, dim, post, comb, out); });
  }
  Status HcMean(int64_t rows, const float* h, int hc, int64_t dim, float* y,
                int64_t y_stride) override {
    return Do("HcMean", [=, this] { return in_->HcMean(rows, h, hc, dim, y, y_stride); });
  }
  Status MoeRoute(const float* z, int64_t rows, int n_experts, const float* bias, int top_k,
                  float route_scale, int32_t* experts, float* weights,
                  int32_t* ranked = nullptr) override {
    return Do("MoeRoute", [=, this] {
      return in_->MoeRoute(z, rows, n_experts, bias, top_k, route_scale, experts, weights, ranked);
    });
  }
  Status SwiGlu(const float* g, const float* u, int64_t rows, int64_t inter, float limit,
                const float* row_weights, float* h) override {
    return Do("SwiGlu",
              [=, this] { return in_->SwiGlu(g, u, rows, inter, limit, row_weights, h); });
  }
  Status CopyRows(const float* src, const int64_t* src_rows, float* dst, const int64_t* dst_rows,
                  int64_t n, int64_t dim) override {
    return Do("CopyRows",
              [=, this] { return in_->CopyRows(src, src_rows, dst, dst_rows, n, dim); });
  }
  Status MoeGroup(const int32_t* experts, const float* weights, int64_t rows, int n_experts,
                  int top_k, int n_shared, int64_t* starts, int64_t* src_rows, int64_t* slot_rows,
                  float* entry_weights) override {
    return Do("MoeGroup", [=, this] {
      return in_->MoeGroup(experts, weights, rows, n_experts, top_k, n_shared, starts, src_rows,
                           slot_rows, entry_weights);
    });
  }
  Status GroupedLinearQuant(const float* x, int64_t rows, const int64_t* starts,
                            const QuantWeight* const* ws, int n_groups, float* y) override {
    // The weight list is the caller's (often a local array): the recording keeps a copy.
    std::vector<const QuantWeight*> list(ws, ws + std::max(n_groups, 0));
    return Do("GroupedLinearQuant", [=, this, list = std::move(list)] {
      return in_->GroupedLinearQuant(x, rows, starts, list.data(), n_groups, y);
    });
  }
  Status SumSlots(const float* ys, int64_t rows, int64_t slots, int64_t dim, float* out) override {
    return Do("SumSlots", [=, this] { return in_->SumSlots(ys, rows, slots, dim, out); });
  }
  Status Fp8RowLookup(const uint8_t* table, const uint8_t* table_scale, int64_t dim,
                      const int64_t* ids, int64_t n, float* out) override {
    return Do("Fp8RowLookup",
              [=, this] { return in_->Fp8RowLookup(table, table_scale, dim, ids, n, out); });
  }
  Status EngramGate(float* h, const float* e, int64_t rows, int hc, int64_t dim,
                    const float* q_weight, const float* k_weight, float norm_eps) override {
    return Do("EngramGate", [=, this] {
      return in_->EngramGate(h, e, rows, hc, dim, q_weight, k_weight, norm_eps);
    });
  }
  Status EngramGateSingleToken(float* h, const float* e, int64_t rows, int hc, int64_t dim,
                               const float* q_weight, const float* k_weight,
                               float norm_eps) override {
    return Do("EngramGateSingleToken", [=, this] {
      return in_->EngramGateSingleToken(h, e, rows, hc, dim, q_weight, k_weight, norm_eps);
    });
  }
  Status Embed(PlainWeight table, int64_t dim, const int32_t* ids, int64_t rows, int hc,
               float* h) override {
    return Do("Embed", [=, this] { return in_->Embed(table, dim, ids, rows, hc, h); });
  }
  Status PackRows(RowCodec codec, const float* x, int64_t n, int64_t dim, uint8_t* const* pages,
                  int64_t rows_per_page, const int32_t* rows, int64_t first) override {
    return Do("PackRows", [=, this] {
      return in_->PackRows(codec, x, n, dim, pages, rows_per_page, rows, first);
    });
  }
  Status UnpackRows(RowCodec codec, const uint8_t* const* pages, int64_t rows_per_page, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    return Do("UnpackRows", [=, this] {
      return in_->UnpackRows(codec, pages, rows_per_page, dim, rows, first, n, out);
    });
  }
  Status GatherRows(RowCodec codec, const uint8_t* const* const* tables,
                    const int64_t* rows_per_page, int64_t per_table, int64_t dim,
                    const int32_t* rows, int64_t first, int64_t n, float* out) override {
    return Do("GatherRows", [=, this] {
      return in_->GatherRows(codec, tables, rows_per_page, per_table, dim, rows, first, n, out);
    });
  }
  Status TopKSlots(const int32_t* topk, int64_t rows, int64_t k, int64_t base, bool per_slot,
                   int32_t* list, int64_t list_len, int64_t offset) override {
    return Do("TopKSlots", [=, this] {
      return in_->TopKSlots(topk, rows, k, base, per_slot, list, list_len, offset);
    });
  }
  Status DigestBlocks(const uint8_t* const* blocks, const int64_t* bytes, int64_t n,
                      uint64_t* out) override {
    return Do("DigestBlocks", [=, this] { return in_->DigestBlocks(blocks, bytes, n, out); });
  }
  Status BlocksEqual(const uint8_t* const* a, const uint8_t* const* b, const int64_t* bytes,
                     int64_t n, int32_t* equal) override {
    return Do("BlocksEqual", [=, this] { return in_->BlocksEqual(a, b, bytes, n, equal); });
  }
  Status CopyBlocks(uint8_t* const* dst, const uint8_t* const* src, const int64_t* bytes,
                    int64_t n) override {
    return Do("CopyBlocks", [=, this] { return in_->CopyBlocks(dst, src, bytes, n); });
  }
  Status QuantDequant(Qdq kind, float* x, int64_t rows, int64_t dim) override {
    return Do("QuantDequant", [=, this] { return in_->QuantDequant(kind, x, rows, dim); });
  }
  Status Argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    return Do("Argmax", [=, this] { return in_->Argmax(x, rows, n, out); });
  }
  Status PenalizeLogits(float* x, int64_t total, const int64_t* at, const int32_t* counts,
                        int64_t entries, float repetition, float frequency,
                        float presence) override {
    return Do("PenalizeLogits", [=, this] {
      return in_->PenalizeLogits(x, total, at, counts, entries, repetition, frequency, presence);
    });
  }
  Status SampleLogits(const float* x, int64_t rows, int64_t n, const SampleParams& p,
                      const double* u, int32_t* out, float* probs) override {
    return Do("SampleLogits",
              [=, this] { return in_->SampleLogits(x, rows, n, p, u, out, probs); });
  }
  Status VerifyDrafts(const float* p, const float* q, const int32_t* drafts, int64_t k, int64_t n,
                      const double* u, int32_t* out, int32_t* chosen) override {
    return Do("VerifyDrafts",
              [=, this] { return in_->VerifyDrafts(p, q, drafts, k, n, u, out, chosen); });
  }
  Status TopLogprobs(const float* x, int64_t rows, int64_t n, const int32_t* chosen, int64_t top,
                     float* chosen_lp, int32_t* top_ids, float* top_lp) override {
    return Do("TopLogprobs", [=, this] {
      return in_->TopLogprobs(x, rows, n, chosen, top, chosen_lp, top_ids, top_lp);
    });
  }

 private:
  // On the capturing thread during a capture: records `op` (Ok); else runs it.
  template <typename F>
  Status Do(const char* name, F&& op) {
    if (Capturing()) {
      std::lock_guard<std::mutex> lock(mu_);
      recorded_.emplace_back(std::forward<F>(op));
      return OkStatus();
    }
    Count(name);
    return op();
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
    if (op_calls_ != nullptr) ++(*op_calls_)[name];
  }

  std::unique_ptr<Backend> in_;
  std::map<std::string, int64_t>* op_calls_;
  std::mutex mu_;
  bool capturing_ = false;
  std::thread::id capture_thread_;
  std::vector<std::function<Status()>> recorded_;
  Status first_error_;  // of the capture under way
};

}  // namespace

std::unique_ptr<Backend> MakeRecordingBackend(std::unique_ptr<Backend> cpu,
                                              std::map<std::string, int64_t>* op_calls) {
  return std::make_unique<RecordingBackend>(std::move(cpu), op_calls);
}

}  // namespace epd::kernels::cpu
