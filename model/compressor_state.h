#pragma once

// A KV source's compressor state between calls (compress ratio > 1; MODEL.md §3, the
// compressor), in the model backend's memory (a GPU's on CUDA), so that a decode step pools a
// group, logs its rows and a rollback restores the tail without a host round trip.
//
// - CompressorTail: the fp32 kv and score inputs of the positions of the current, unfinished
//   group, slot = position % ratio. One KV-pool block: [ratio, dim] kv, then [ratio, dim] score,
//   the bytes of the hand-off's `tail.<L>` segment as they are (transfer/manifest.h,
//   kLayoutCompressorStateF32). A fresh tail is kv 0, score -inf. Value semantics as SwaRing: a
//   copy shares the block (a checkpoint, a fork), the first write on either side copies it; the
//   block is allocated on the first write.
// - CompressorLog: the kv and score rows of the last call's positions that Model::Rollback and
//   CutPrefixBlocks may need (below), in a backend buffer. Immutable once made; a sequence
//   state's copy shares it, and a call reuses the buffer only when nobody else holds it.

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "model/kv_pool.h"

namespace epd::model {

class CompressorTail {
 public:
  CompressorTail() = default;
  CompressorTail(std::shared_ptr<KvPool> pool, int ratio, int64_t dim);
  CompressorTail(const CompressorTail& o);
  CompressorTail& operator=(const CompressorTail& o);
  CompressorTail(CompressorTail&& o) noexcept;
  CompressorTail& operator=(CompressorTail&& o) noexcept;
  ~CompressorTail();

  int ratio() const { return ratio_; }
  int64_t dim() const { return dim_; }
  // Bytes of the state: kv then score, fp32 [ratio, dim] each.
  int64_t bytes() const { return int64_t{2} * ratio_ * dim_ * 4; }
  bool allocated() const { return block_.id >= 0; }
  // Pool bytes this tail holds (a shared block counted in full; 0 before the first write).
  int64_t held_bytes() const { return allocated() ? bytes() : 0; }

  // The block's kv and score arrays in the backend's memory (allocated() only).
  const float* kv() const { return reinterpret_cast<const float*>(block_.data); }
  const float* score() const { return kv() + static_cast<int64_t>(ratio_) * dim_; }

  // Makes the block ours and writable (allocated with the fresh values on the first write, a
  // shared one copied first). ResourceExhausted when the pool is full (the tail is unchanged).
  [[nodiscard]] absl::Status Writable();
  // Slots [slot, slot + n) = the rows kv [n, dim] and score [n, dim] in the backend's memory
  // (slot + n <= ratio).
  [[nodiscard]] absl::Status WriteSlotsFrom(int64_t slot, int64_t n, const float* kv,
                                            const float* score);
  // The block made writable (as WriteSlotsFrom does first): where slot `slot`'s kv and score
  // rows go (backend memory), for a caller that writes many tails' rows in one backend call.
  [[nodiscard]] absl::StatusOr<std::pair<float*, float*>> WritableSlot(int64_t slot);
  // Slot `slot` = slot `from` of `src` (a tail of the same shape).
  [[nodiscard]] absl::Status CopySlotFrom(int64_t slot, const CompressorTail& src, int64_t from);

  // Host surfaces: the state's bytes() bytes, kv then score (the fresh values when the block is
  // not allocated).
  [[nodiscard]] absl::Status CopyBytes(uint8_t* out) const;
  [[nodiscard]] absl::Status WriteBytes(const uint8_t* bytes);
  // Host copies (tests, tools; abort on a failed read): both arrays, kv then score
  // [2, ratio, dim] (one read); the kv or score array [ratio, dim].
  std::vector<float> Values() const;
  std::vector<float> Kv() const;
  std::vector<float> Score() const;

 private:
  void Release();
  // The fresh state's bytes() bytes.
  std::vector<uint8_t> FreshBytes() const;

  std::shared_ptr<KvPool> pool_;
  int ratio_ = 0;
  int64_t dim_ = 0;
  KvPool::Block block_;
};

// The kv and score rows [rows, dim] of the positions `pos` (ascending) of one call, each in the
// backend's memory. Which rows a call logs: LogsPosition.
class CompressorLog {
 public:
  // A log with room for `rows` rows of `dim`: `reuse` itself, emptied, when nothing else holds it
  // and it has the room; else a new one (backend memory).
  static absl::StatusOr<std::shared_ptr<CompressorLog>> Make(
      kernels::Backend& backend, int64_t dim, int64_t rows, std::shared_ptr<CompressorLog> reuse);

  int64_t rows() const { return static_cast<int64_t>(pos_.size()); }
  int64_t dim() const { return dim_; }
  const std::vector<int64_t>& positions() const { return pos_; }
  // The index of position q's row, or -1 when the log does not hold it.
  int64_t Find(int64_t q) const;
  const float* kv(int64_t i) const { return base() + i * dim_; }
  const float* score(int64_t i) const { return base() + (capacity_ + i) * dim_; }

  // Appends n rows at consecutive positions first_pos.. from kv / score [n, dim] (backend
  // memory); first_pos is past the last row's position, and the log has the room.
  [[nodiscard]] absl::Status Append(int64_t first_pos, int64_t n, const float* kv,
                                    const float* score);
  // Appends the rows kv[rows[j]], score[rows[j]] (rows: n indices in the backend's memory) at
  // the ascending positions `positions` (n of them, past the last row's): two CopyRows.
  [[nodiscard]] absl::Status AppendGathered(const std::vector<int64_t>& positions,
                                            const int64_t* rows, const float* kv,
                                            const float* score);
  // Claims the next row for position `pos` (past the last row's) without writing it: where its
  // kv and score rows go (backend memory), for a caller that writes many logs' rows in one
  // backend call (Model::StepPool). The row must be written before the log is read.
  [[nodiscard]] absl::StatusOr<std::pair<float*, float*>> ClaimRow(int64_t pos);
  // Row i's kv and score into host memory ([dim] each).
  [[nodiscard]] absl::Status ReadRow(int64_t i, float* kv, float* score) const;
  // Rows i .. i+n-1 into host memory ([n, dim] each): two Downloads on a device backend.
  [[nodiscard]] absl::Status ReadRows(int64_t i, int64_t n, float* kv, float* score) const;

  // Whether a call whose last position is `last` logs position q of a ratio-`ratio` compressor:
  // the last kLogRecentRows positions (Rollback of a step of up to that many rows), and the
  // `ratio` positions before every multiple of `block` (SequenceState::cut_block_tokens: the tail
  // at that boundary, which CutPrefixBlocks cuts).
  static constexpr int64_t kLogRecentRows = 64;
  static bool LogsPosition(int64_t q, int64_t last, int ratio, int64_t block) {
    return q > last - kLogRecentRows || (block >= ratio && q % block >= block - ratio);
  }

 private:
  CompressorLog(kernels::Backend& backend, int64_t dim, int64_t capacity, kernels::Buffer rows)
      : backend_(&backend), dim_(dim), capacity_(capacity), rows_(std::move(rows)) {}
  // InternalError unless n rows from first_pos fit after the last row.
  absl::Status Room(int64_t first_pos, int64_t n) const;
  const float* base() const { return rows_.as<float>(); }
  float* base() { return rows_.as<float>(); }

  kernels::Backend* backend_;
  int64_t dim_ = 0;
  int64_t capacity_ = 0;
  kernels::Buffer rows_;  // [capacity, dim] kv, then [capacity, dim] score
  std::vector<int64_t> pos_;
};

}  // namespace epd::model
