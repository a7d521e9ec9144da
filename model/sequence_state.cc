#include "model/sequence_state.h"

#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "kernels/format.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;

void PutI64(std::vector<uint8_t>& b, int64_t v) {
  // resize + memcpy, not insert(end, t, t + 8): GCC 12 at -O3 (Release) reports a false
  // -Wstringop-overflow for the inlined range insert into a grown vector.
  const size_t at = b.size();
  b.resize(at + 8);
  std::memcpy(b.data() + at, &v, 8);
}
int64_t GetI64(const std::vector<uint8_t>& b, size_t i) {
  int64_t v;
  std::memcpy(&v, b.data() + 8 * i, 8);
  return v;
}

// Rows in their packed segment format into a stream of the pool (fp32 streams unpack them).
absl::Status AppendPackedRows(KvRows& rows, const std::vector<uint8_t>& bytes, int64_t n,
                              bool keys) {
  if (rows.format() != KvRowFormat::kF32) return rows.AppendPacked(bytes.data(), n);
  const int64_t d = rows.dim();
  const KvRowFormat packed = keys ? KvRowFormat::kPackedKey : KvRowFormat::kPackedKv;
  const int64_t pb = KvRowBytes(packed, d);
  std::vector<float> f(n * d);
  for (int64_t j = 0; j < n; ++j)
    kf::UnpackRow(KvRowCodec(packed), bytes.data() + j * pb, d, f.data() + j * d);
  return rows.Append(f.data(), n);
}

}  // namespace

std::vector<StateSegment> SerializeState(const ModelConfig& c, const SequenceState& s) {
  return SerializeStateSegments(c, s, [](const std::string&) { return true; });
}

std::vector<StateSegment> SerializeStateSegments(
    const ModelConfig& c, const SequenceState& s,
    const std::function<bool(const std::string& name)>& keep) {
  std::vector<StateSegment> out;
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  if (keep("meta")) {
    StateSegment meta{"meta", {}};
    PutI64(meta.bytes, s.pos);
    PutI64(meta.bytes, s.published_keys);
    PutI64(meta.bytes, s.main_hidden_pos);
    PutI64(meta.bytes, static_cast<int64_t>(s.sources.size()));
    for (const auto& [l, src] : s.sources) {
      PutI64(meta.bytes, l);
      PutI64(meta.bytes, src.n);
    }
    out.push_back(std::move(meta));
  }
  const int64_t slot = kf::PackedSwaSlotBytes(hd);
  for (size_t l = 0; l < s.swa.size(); ++l) {
    std::string name = absl::StrCat("swa.", l);
    if (!keep(name)) continue;
    // The ring's pool block as it is (no re-pack).
    StateSegment seg{std::move(name), std::vector<uint8_t>(c.window_size * slot)};
    AbortUnlessOk(s.swa[l].CopyPacked(seg.bytes.data()), "serialize a ring");
    out.push_back(std::move(seg));
  }
  const int64_t eb = kf::PackedKvEntryBytes(hd), kb = kf::PackedIndexKeyBytes(ihd);
  for (const auto& [l, src] : s.sources) {
    // The pool's blocks hold the packed rows: copied as they are (no re-pack).
    StateSegment kv{absl::StrCat("kv.", l), {}};
    StateSegment keys{absl::StrCat("keys.", l), {}};
    if (keep(kv.name)) {
      kv.bytes.reserve(src.n * eb);
      AbortUnlessOk(src.kv.CopyPacked(0, src.n, kv.bytes, KvRowFormat::kPackedKv),
                    "serialize kv rows");
      out.push_back(std::move(kv));
    }
    if (keep(keys.name)) {
      keys.bytes.reserve(src.n * kb);
      AbortUnlessOk(src.keys.CopyPacked(0, src.n, keys.bytes, KvRowFormat::kPackedKey),
                    "serialize index keys");
      out.push_back(std::move(keys));
    }
    if (src.ratio > 1 && keep(absl::StrCat("tail.", l))) {
      StateSegment tail{absl::StrCat("tail.", l), {}};
      tail.bytes.resize(static_cast<size_t>(src.tail.bytes()));
      AbortUnlessOk(src.tail.CopyBytes(tail.bytes.data()), "serialize a compressor tail");
      out.push_back(std::move(tail));
    }
  }
  if (keep("engram")) {
    StateSegment eg{"engram", {}};
    for (int64_t id : s.engram_history) PutI64(eg.bytes, id);
    out.push_back(std::move(eg));
  }
  if (keep("main_hidden")) {
    absl::StatusOr<std::vector<float>> main_hidden = MainHiddenOf(s);
    AbortUnlessOk(main_hidden.status(), "read the DSpark input");
    StateSegment mh{"main_hidden", std::vector<uint8_t>(main_hidden->size() * 2)};
    for (size_t i = 0; i < main_hidden->size(); ++i) {
      const uint16_t b = kf::F32ToBf16Bits((*main_hidden)[i]);
      std::memcpy(mh.bytes.data() + 2 * i, &b, 2);
    }
    out.push_back(std::move(mh));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<SequenceState>> DeserializeState(
    const Model& model, const std::vector<StateSegment>& segs) {
  const ModelConfig& c = model.config();
  std::map<std::string, const std::vector<uint8_t>*> by;
  for (const StateSegment& s : segs) by[s.name] = &s.bytes;
  auto get = [&](const std::string& n,
                 int64_t want) -> absl::StatusOr<const std::vector<uint8_t>*> {
    auto it = by.find(n);
    if (it == by.end())
      return absl::NotFoundError(absl::StrCat("state: missing segment '", n, "'"));
    if (want >= 0 && static_cast<int64_t>(it->second->size()) != want) {
      return absl::DataLossError(absl::StrCat("state: segment '", n, "' has ", it->second->size(),
                                              " bytes, expected ", want));
    }
    return it->second;
  };
  auto st = model.NewSequence();
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  auto meta = get("meta", -1);
  if (!meta.ok()) return meta.status();
  const std::vector<uint8_t>& m = **meta;
  if (m.size() < 32) return absl::DataLossError("state: segment 'meta' too short");
  st->pos = GetI64(m, 0);
  st->published_keys = static_cast<int>(GetI64(m, 1));
  st->main_hidden_pos = GetI64(m, 2);
  const int64_t ns = GetI64(m, 3);
  if (ns != static_cast<int64_t>(st->sources.size()) ||
      m.size() != static_cast<size_t>(32 + 16 * ns)) {
    return absl::DataLossError("state: segment 'meta' does not match the model's KV sources");
  }
  const int64_t slot = kf::PackedSwaSlotBytes(hd);
  for (size_t l = 0; l < st->swa.size(); ++l) {
    auto b = get(absl::StrCat("swa.", l), c.window_size * slot);
    if (!b.ok()) return b.status();
    if (absl::Status s = st->swa[l].WritePacked((*b)->data()); !s.ok()) return s;
  }
  const int64_t eb = kf::PackedKvEntryBytes(hd), kb = kf::PackedIndexKeyBytes(ihd);
  for (int64_t i = 0; i < ns; ++i) {
    const int l = static_cast<int>(GetI64(m, 4 + 2 * i));
    const int64_t n = GetI64(m, 5 + 2 * i);
    auto it = st->sources.find(l);
    if (it == st->sources.end() || n < 0)
      return absl::DataLossError(absl::StrCat("state: bad source layer ", l));
    SequenceState::Source& src = it->second;
    auto kv = get(absl::StrCat("kv.", l), n * eb);
    if (!kv.ok()) return kv.status();
    auto keys = get(absl::StrCat("keys.", l), n * kb);
    if (!keys.ok()) return keys.status();
    src.n = n;
    src.kv.Truncate(0);
    src.keys.Truncate(0);
    if (absl::Status s = AppendPackedRows(src.kv, **kv, n, false); !s.ok()) return s;
    if (absl::Status s = AppendPackedRows(src.keys, **keys, n, true); !s.ok()) return s;
    if (src.ratio > 1) {
      auto t = get(absl::StrCat("tail.", l), src.tail.bytes());
      if (!t.ok()) return t.status();
      if (absl::Status s = src.tail.WriteBytes((*t)->data()); !s.ok()) return s;
    }
  }
  auto eg = get("engram", -1);
  if (!eg.ok()) return eg.status();
  if ((*eg)->size() % 8 != 0)
    return absl::DataLossError("state: segment 'engram' size is not a multiple of 8");
  for (size_t i = 0; i < (*eg)->size() / 8; ++i) st->engram_history.push_back(GetI64(**eg, i));
  auto mh = get("main_hidden", -1);
  if (!mh.ok()) return mh.status();
  st->main_hidden.resize((*mh)->size() / 2);
  for (size_t i = 0; i < st->main_hidden.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, (*mh)->data() + 2 * i, 2);
    st->main_hidden[i] = kf::Bf16BitsToF32(b);
  }
  return st;
}

std::vector<std::pair<std::string, int64_t>> StateByteAccounting(const ModelConfig& c,
                                                                 int64_t tokens) {
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  int64_t global = 0, tails = 0;
  for (int l : c.kv_source_layers) {
    const int r = c.compress_ratios[l];
    global += (tokens / r) * (kf::PackedKvEntryBytes(hd) + kf::PackedIndexKeyBytes(ihd));
    if (r > 1) tails += int64_t{2} * r * hd * 4;
  }
  const int64_t swa = int64_t{c.total_layers()} * c.window_size * kf::PackedSwaSlotBytes(hd);
  const int64_t engram =
      c.engram_layer_ids.empty() ? 0 : std::min<int64_t>(tokens, c.engram_max_ngram_size - 1) * 8;
  const int64_t mh = static_cast<int64_t>(c.dspark_target_layer_ids.size()) * c.dim * 2;
  const int64_t meta = 32 + 16 * static_cast<int64_t>(c.kv_source_layers.size());
  return {{"global_kv", global},
          {"swa", swa},
          {"compressor_tails", tails},
          {"engram", engram},
          {"main_hidden", mh},
          {"meta", meta},
          {"total", global + swa + tails + engram + mh + meta}};
}

}  // namespace epd::model
