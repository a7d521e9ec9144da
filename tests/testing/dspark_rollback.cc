#include "tests/testing/dspark_rollback.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace epd::testing {

using model::SequenceState;

StepJournal::StepJournal(const model::ModelConfig& config)
    : window_(config.window_size),
      head_dim_(config.head_dim),
      index_head_dim_(config.index_head_dim) {}

StepJournal::Small StepJournal::Capture(const SequenceState& s) {
  Small m;
  m.pos = s.pos;
  m.published_keys = s.published_keys;
  m.engram_history = s.engram_history;
  m.main_hidden = s.main_hidden;
  m.main_hidden_pos = s.main_hidden_pos;
  for (const auto& [layer, src] : s.sources) {
    SourceTail& t = m.sources[layer];
    t.n = src.n;
    t.tail = src.tail.Values();
  }
  return m;
}

void StepJournal::Begin(const SequenceState& state) {
  after_.clear();
  slots_.clear();
  base_ = Capture(state);
  active_ = true;
}

void StepJournal::BeforePosition(const SequenceState& state) {
  const int64_t slot = state.pos % window_;
  std::vector<float> saved(state.swa.size() * head_dim_);
  for (size_t l = 0; l < state.swa.size(); ++l)
    state.swa[l].ReadSlot(slot, saved.data() + l * head_dim_);
  slots_.push_back(std::move(saved));
}

void StepJournal::AfterPosition(const SequenceState& state) { after_.push_back(Capture(state)); }

absl::Status StepJournal::Rollback(SequenceState& state, int64_t keep) {
  if (!active_) return absl::FailedPreconditionError("dspark rollback: no step journaled");
  if (keep < 0 || keep > positions() || slots_.size() != after_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dspark rollback: keep ", keep, " of ", positions(), " positions"));
  }
  // Ring slots: newest first, so a slot written twice in one step ends at its oldest value.
  for (int64_t i = positions() - 1; i >= keep; --i) {
    const int64_t slot = (base_.pos + i) % window_;
    for (size_t l = 0; l < state.swa.size(); ++l) {
      if (absl::Status s = state.swa[l].WriteSlot(slot, slots_[i].data() + l * head_dim_); !s.ok())
        return s;
    }
  }
  const Small& m = keep == 0 ? base_ : after_[keep - 1];
  state.pos = m.pos;
  state.published_keys = m.published_keys;
  state.engram_history = m.engram_history;
  state.main_hidden = m.main_hidden;
  state.main_hidden_pos = m.main_hidden_pos;
  for (auto& [layer, src] : state.sources) {
    auto it = m.sources.find(layer);
    if (it == m.sources.end())
      return absl::InternalError(absl::StrCat("dspark rollback: source ", layer, " not journaled"));
    const SourceTail& t = it->second;
    src.n = t.n;
    src.kv.resize(t.n * head_dim_);
    src.keys.resize(t.n * index_head_dim_);
    if (src.ratio > 1) {
      if (absl::Status s = src.tail.WriteBytes(reinterpret_cast<const uint8_t*>(t.tail.data()));
          !s.ok())
        return s;
    }
  }
  after_.clear();
  slots_.clear();
  active_ = false;
  return absl::OkStatus();
}

int64_t StepJournal::bytes() const {
  int64_t b = 0;
  auto small = [](const Small& m) {
    int64_t s = static_cast<int64_t>(m.engram_history.size() * 8 + m.main_hidden.size() * 4 + 32);
    for (const auto& [l, t] : m.sources)
      s += static_cast<int64_t>(t.tail.size() * 4 + 8);
    return s;
  };
  b += small(base_);
  for (const Small& m : after_) b += small(m);
  for (const auto& v : slots_) b += static_cast<int64_t>(v.size() * 4);
  return b;
}

namespace {
template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}
bool SameBits(const model::KvRows& a, const model::KvRows& b) {
  return SameBits(a.ToVector(), b.ToVector());
}
bool SameBits(const model::SwaRing& a, const model::SwaRing& b) {
  return SameBits(a.ToVector(), b.ToVector());
}
}  // namespace

std::string DiffStates(const SequenceState& a, const SequenceState& b) {
  if (a.pos != b.pos) return absl::StrCat("pos ", a.pos, " vs ", b.pos);
  if (a.swa.size() != b.swa.size()) return "swa layer count";
  for (size_t l = 0; l < a.swa.size(); ++l) {
    if (!SameBits(a.swa[l], b.swa[l])) return absl::StrCat("swa[", l, "]");
  }
  if (a.sources.size() != b.sources.size()) return "source count";
  for (const auto& [layer, sa] : a.sources) {
    auto it = b.sources.find(layer);
    if (it == b.sources.end()) return absl::StrCat("source ", layer, " missing");
    const SequenceState::Source& sb = it->second;
    if (sa.ratio != sb.ratio || sa.n != sb.n) return absl::StrCat("source ", layer, " n/ratio");
    if (!SameBits(sa.kv, sb.kv)) return absl::StrCat("source ", layer, " kv");
    if (!SameBits(sa.keys, sb.keys)) return absl::StrCat("source ", layer, " keys");
    if (!SameBits(sa.tail.Values(), sb.tail.Values()))
      return absl::StrCat("source ", layer, " compressor tail");
  }
  if (a.published_keys != b.published_keys) return "published_keys";
  if (a.engram_history != b.engram_history) return "engram_history";
  if (!SameBits(a.main_hidden, b.main_hidden)) return "main_hidden";
  if (a.main_hidden_pos != b.main_hidden_pos) return "main_hidden_pos";
  return "";
}

int64_t StateBytes(const SequenceState& s) {
  int64_t b = 0;
  for (const auto& r : s.swa) b += r.held_bytes();
  for (const auto& [l, src] : s.sources) {
    b += src.kv.held_bytes() + src.keys.held_bytes() + (src.ratio > 1 ? src.tail.bytes() : 0);
  }
  b += static_cast<int64_t>(s.engram_history.size() * 8 + s.main_hidden.size() * 4);
  return b;
}

}  // namespace epd::testing
