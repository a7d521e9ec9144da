#include "model/compressor_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace epd::model {

// ---------------------------------------------------------------- CompressorTail

CompressorTail::CompressorTail(std::shared_ptr<KvPool> pool, int ratio, int64_t dim)
    : pool_(std::move(pool)), ratio_(ratio), dim_(dim) {}

CompressorTail::CompressorTail(const CompressorTail& o)
    : pool_(o.pool_), ratio_(o.ratio_), dim_(o.dim_), block_(o.block_) {
  if (allocated()) pool_->Ref(block_.id);
}

CompressorTail& CompressorTail::operator=(const CompressorTail& o) {
  if (this == &o) return *this;
  CompressorTail copy(o);
  *this = std::move(copy);
  return *this;
}

CompressorTail::CompressorTail(CompressorTail&& o) noexcept { *this = std::move(o); }

CompressorTail& CompressorTail::operator=(CompressorTail&& o) noexcept {
  if (this == &o) return *this;
  Release();
  pool_ = std::move(o.pool_);
  ratio_ = o.ratio_;
  dim_ = o.dim_;
  block_ = std::exchange(o.block_, KvPool::Block{});
  return *this;
}

CompressorTail::~CompressorTail() { Release(); }

void CompressorTail::Release() {
  if (allocated()) pool_->Unref(block_.id);
  block_ = KvPool::Block{};
}

std::vector<uint8_t> CompressorTail::FreshBytes() const {
  std::vector<float> v(static_cast<size_t>(2 * ratio_ * dim_), 0.f);
  std::fill(v.begin() + ratio_ * dim_, v.end(), -INFINITY);
  std::vector<uint8_t> b(static_cast<size_t>(bytes()));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

absl::Status CompressorTail::Writable() {
  if (pool_ == nullptr) return absl::FailedPreconditionError("compressor tail: no pool");
  // The first write allocates the block with the fresh values; a shared one is copied.
  return pool_->MakeWritable(block_, bytes(), [&](const KvPool::Block& nb) {
    const std::vector<uint8_t> fresh = FreshBytes();
    return pool_->Write(nb, 0, fresh.data(), bytes());
  });
}

absl::Status CompressorTail::WriteSlotsFrom(int64_t slot, int64_t n, const float* kv,
                                            const float* score) {
  if (n <= 0) return absl::OkStatus();
  if (slot < 0 || slot + n > ratio_) {
    return absl::InvalidArgumentError(
        absl::StrCat("compressor tail: slots ", slot, "+", n, " of ", ratio_));
  }
  RETURN_IF_ERROR(Writable());
  kernels::Backend& be = pool_->backend();
  auto* base = reinterpret_cast<float*>(block_.data);
  const int64_t row = dim_ * 4;
  RETURN_IF_ERROR(be.Copy(base + slot * dim_, kv, n * row));
  return be.Copy(base + (ratio_ + slot) * dim_, score, n * row);
}

absl::StatusOr<std::pair<float*, float*>> CompressorTail::WritableSlot(int64_t slot) {
  if (slot < 0 || slot >= ratio_) {
    return absl::InvalidArgumentError(absl::StrCat("compressor tail: slot ", slot, " of ", ratio_));
  }
  RETURN_IF_ERROR(Writable());
  auto* base = reinterpret_cast<float*>(block_.data);
  return std::make_pair(base + slot * dim_, base + (ratio_ + slot) * dim_);
}

absl::Status CompressorTail::CopySlotFrom(int64_t slot, const CompressorTail& src, int64_t from) {
  if (src.ratio_ != ratio_ || src.dim_ != dim_ || slot < 0 || slot >= ratio_ || from < 0 ||
      from >= ratio_) {
    return absl::InvalidArgumentError("compressor tail: copy between different shapes");
  }
  if (!src.allocated()) {  // the fresh values: kv 0, score -inf
    RETURN_IF_ERROR(Writable());
    const std::vector<uint8_t> fresh = FreshBytes();
    const int64_t row = dim_ * 4;
    RETURN_IF_ERROR(pool_->Write(block_, slot * row, fresh.data(), row));
    return pool_->Write(block_, (ratio_ + slot) * row, fresh.data() + ratio_ * row, row);
  }
  // src's block stays referenced by src while this one may be copied on write.
  return WriteSlotsFrom(slot, 1, src.kv() + from * dim_, src.score() + from * dim_);
}

absl::Status CompressorTail::CopyBytes(uint8_t* out) const {
  if (!allocated()) {
    const std::vector<uint8_t> fresh = FreshBytes();
    if (!fresh.empty()) std::memcpy(out, fresh.data(), fresh.size());
    return absl::OkStatus();
  }
  return pool_->Read(block_, 0, bytes(), out);
}

absl::Status CompressorTail::WriteBytes(const uint8_t* bytes_in) {
  RETURN_IF_ERROR(Writable());
  return pool_->Write(block_, 0, bytes_in, bytes());
}

std::vector<float> CompressorTail::Values() const {
  std::vector<float> all(static_cast<size_t>(2 * ratio_ * dim_));
  AbortUnlessOk(CopyBytes(reinterpret_cast<uint8_t*>(all.data())), "read a compressor tail");
  return all;
}

std::vector<float> CompressorTail::Kv() const {
  std::vector<float> all = Values();
  all.resize(static_cast<size_t>(ratio_ * dim_));
  return all;
}

std::vector<float> CompressorTail::Score() const {
  const std::vector<float> all = Values();
  return {all.begin() + ratio_ * dim_, all.end()};
}

// ---------------------------------------------------------------- CompressorLog

absl::StatusOr<std::shared_ptr<CompressorLog>> CompressorLog::Make(
    kernels::Backend& backend, int64_t dim, int64_t rows, std::shared_ptr<CompressorLog> reuse) {
  if (reuse != nullptr && reuse.use_count() == 1 && reuse->backend_ == &backend &&
      reuse->dim_ == dim && reuse->capacity_ >= rows) {
    reuse->pos_.clear();
    return reuse;
  }
  // Some room beyond `rows`, so that a steady state of calls of a few rows keeps one buffer.
  const int64_t capacity = std::max<int64_t>(rows, 16);
  ASSIGN_OR_RETURN(kernels::Buffer buf, backend.Allocate(2 * capacity * dim * 4));
  return std::shared_ptr<CompressorLog>(new CompressorLog(backend, dim, capacity, std::move(buf)));
}

int64_t CompressorLog::Find(int64_t q) const {
  auto it = std::lower_bound(pos_.begin(), pos_.end(), q);
  return it != pos_.end() && *it == q ? static_cast<int64_t>(it - pos_.begin()) : -1;
}

absl::Status CompressorLog::Room(int64_t first_pos, int64_t n) const {
  if (rows() + n > capacity_ || (!pos_.empty() && first_pos <= pos_.back())) {
    return absl::InternalError(absl::StrCat("compressor log: ", n, " rows at ", first_pos,
                                            " do not fit after ", rows(), " of ", capacity_));
  }
  return absl::OkStatus();
}

absl::Status CompressorLog::Append(int64_t first_pos, int64_t n, const float* kv,
                                   const float* score) {
  if (n <= 0) return absl::OkStatus();
  RETURN_IF_ERROR(Room(first_pos, n));
  const int64_t i = rows();
  RETURN_IF_ERROR(backend_->Copy(base() + i * dim_, kv, n * dim_ * 4));
  RETURN_IF_ERROR(backend_->Copy(base() + (capacity_ + i) * dim_, score, n * dim_ * 4));
  for (int64_t k = 0; k < n; ++k) pos_.push_back(first_pos + k);
  return absl::OkStatus();
}

absl::StatusOr<std::pair<float*, float*>> CompressorLog::ClaimRow(int64_t pos) {
  RETURN_IF_ERROR(Room(pos, 1));
  const int64_t i = rows();
  pos_.push_back(pos);
  return std::make_pair(base() + i * dim_, base() + (capacity_ + i) * dim_);
}

absl::Status CompressorLog::AppendGathered(const std::vector<int64_t>& positions,
                                           const int64_t* rows_dev, const float* kv,
                                           const float* score) {
  const int64_t n = static_cast<int64_t>(positions.size());
  if (n <= 0) return absl::OkStatus();
  if (!std::is_sorted(positions.begin(), positions.end()))
    return absl::InternalError("compressor log: positions out of order");
  RETURN_IF_ERROR(Room(positions.front(), n));
  const int64_t i = rows();
  RETURN_IF_ERROR(backend_->CopyRows(kv, rows_dev, base() + i * dim_, nullptr, n, dim_));
  RETURN_IF_ERROR(
      backend_->CopyRows(score, rows_dev, base() + (capacity_ + i) * dim_, nullptr, n, dim_));
  pos_.insert(pos_.end(), positions.begin(), positions.end());
  return absl::OkStatus();
}

absl::Status CompressorLog::ReadRow(int64_t i, float* kv_out, float* score_out) const {
  return ReadRows(i, 1, kv_out, score_out);
}

absl::Status CompressorLog::ReadRows(int64_t i, int64_t n, float* kv_out, float* score_out) const {
  if (n <= 0) return absl::OkStatus();
  if (i < 0 || i + n > rows()) return absl::OutOfRangeError("compressor log: no such row");
  RETURN_IF_ERROR(backend_->Download(rows_, i * dim_ * 4, n * dim_ * 4, kv_out));
  return backend_->Download(rows_, (capacity_ + i) * dim_ * 4, n * dim_ * 4, score_out);
}

}  // namespace epd::model
