#include "model/prefix_state.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/format.h"
#include "model/engram.h"
#include "model/sequence_state.h"
#include "model/stages.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;

constexpr uint32_t kMagic = 0x50445045;  // "EPDP" little-endian
constexpr uint16_t kKindBlock = 1, kKindSnapshot = 2;
constexpr size_t kHeaderBytes = 40;

struct Value {
  uint16_t kind = 0;
  int64_t block_tokens = 0, end = 0, index = 0;
  std::map<std::string, std::string> segs;
};

template <typename T>
void Put(std::string& b, T v) {
  char t[sizeof(T)];
  std::memcpy(t, &v, sizeof(T));
  b.append(t, sizeof(T));
}
template <typename T>
bool Take(std::string_view& in, T* v) {
  if (in.size() < sizeof(T)) return false;
  std::memcpy(v, in.data(), sizeof(T));
  in.remove_prefix(sizeof(T));
  return true;
}

std::string Encode(uint16_t kind, int64_t block_tokens, int64_t end, int64_t index,
                   const std::vector<std::pair<std::string, std::string>>& segs) {
  std::string b;
  Put<uint32_t>(b, kMagic);
  Put<uint16_t>(b, kPrefixValueVersion);
  Put<uint16_t>(b, kind);
  Put<int64_t>(b, block_tokens);
  Put<int64_t>(b, end);
  Put<int64_t>(b, index);
  Put<int64_t>(b, static_cast<int64_t>(segs.size()));
  for (const auto& [name, bytes] : segs) {
    Put<uint32_t>(b, static_cast<uint32_t>(name.size()));
    b += name;
    Put<uint64_t>(b, bytes.size());
    b += bytes;
  }
  return b;
}

absl::StatusOr<Value> Decode(std::string_view in, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("prefix value ", what, ": ", why));
  };
  if (in.size() < kHeaderBytes) return bad("shorter than its header");
  uint32_t magic = 0;
  uint16_t version = 0;
  Value v;
  int64_t n = 0;
  Take(in, &magic);
  Take(in, &version);
  Take(in, &v.kind);
  Take(in, &v.block_tokens);
  Take(in, &v.end);
  Take(in, &v.index);
  Take(in, &n);
  if (magic != kMagic) return bad("bad magic");
  if (version != kPrefixValueVersion)
    return bad(absl::StrCat("version ", version, ", expected ", kPrefixValueVersion));
  if (n < 0 || n > 4096) return bad(absl::StrCat("segment count ", n));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t nl = 0;
    uint64_t bl = 0;
    if (!Take(in, &nl) || in.size() < nl) return bad("truncated segment name");
    std::string name(in.substr(0, nl));
    in.remove_prefix(nl);
    if (!Take(in, &bl) || in.size() < bl)
      return bad(absl::StrCat("truncated segment '", name, "'"));
    v.segs[name] = std::string(in.substr(0, bl));
    in.remove_prefix(bl);
  }
  if (!in.empty()) return bad(absl::StrCat(in.size(), " trailing bytes"));
  return v;
}

std::string I64s(std::span<const int64_t> v) {
  std::string b;
  for (int64_t x : v) Put<int64_t>(b, x);
  return b;
}

// Rows [e0, e1) of a stream in its packed format, for a store block: the bytes the pool's blocks
// hold (KvRows::CopyPacked: read from device memory on a device pool; packed from fp32 for the
// unquantized switch).
absl::StatusOr<std::string> PackedRows(const KvRows& rows, int64_t e0, int64_t e1,
                                       KvRowFormat packed) {
  std::vector<uint8_t> v;
  RETURN_IF_ERROR(rows.CopyPacked(e0, e1 - e0, v, packed));
  return std::string(v.begin(), v.end());
}

// Compressed ids of the last max_ngram-1 tokens before `end` (the Engram history at `end`).
std::vector<int64_t> HistoryAt(const Model& model, std::span<const int32_t> prompt, int64_t end) {
  const int64_t keep = std::max(0, model.config().engram_max_ngram_size - 1);
  std::vector<int64_t> h;
  for (int64_t p = std::max<int64_t>(0, end - keep); p < end; ++p)
    h.push_back(EngramCompressedId(model.engram(), prompt[p]));
  return h;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> CutPrefixBlocks(const Model& model,
                                                         const SequenceState& state,
                                                         std::span<const int32_t> prompt,
                                                         int64_t first_block, int64_t end_block,
                                                         int64_t B) {
  const ModelConfig& c = model.config();
  if (B <= 0 || first_block < 0 || end_block < first_block)
    return absl::InvalidArgumentError("prefix cut: bad block range");
  if (state.pos != end_block * B) {
    return absl::FailedPreconditionError(
        absl::StrCat("prefix cut: state at ", state.pos, ", blocks end at ", end_block * B));
  }
  if (static_cast<int64_t>(prompt.size()) < state.pos)
    return absl::InvalidArgumentError("prefix cut: fewer tokens than the state's position");
  const int64_t hd = c.head_dim;
  // The kv / keys segments come from the pool's blocks as they are (no whole-state
  // serialization, no re-pack). Each source's rows of all the blocks are read once, and its
  // compressor log once when a block before the last rebuilds its tail from it: on a device
  // pool a few Downloads per source, not per block (a 1M-token prompt cuts 16K blocks).
  struct SourceRows {
    int ratio = 1;
    std::string kv, keys;  // entries [first_block * B / ratio, end_block * B / ratio)
    std::vector<float> log_kv, log_score;  // the whole log ([rows, hd] each), when read
  };
  std::map<int, SourceRows> rows;
  const int64_t n_blocks = end_block - first_block;
  for (const auto& [l, src] : state.sources) {
    if (n_blocks == 0) break;
    SourceRows& sr = rows[l];
    sr.ratio = std::max(1, src.ratio);
    const int r = sr.ratio;
    if (B % r != 0)
      return absl::InvalidArgumentError(
          absl::StrCat("prefix cut: block of ", B, " tokens is not a multiple of ratio ", r));
    const int64_t e0 = first_block * B / r, e1 = end_block * B / r;
    if (src.n < e1) {  // the first block past the source's entries
      const int64_t short_block = std::max(first_block, src.n / (B / r));
      return absl::FailedPreconditionError(absl::StrCat("prefix cut: source ", l, " has ", src.n,
                                                        " entries, block needs ",
                                                        (short_block + 1) * B / r));
    }
    ASSIGN_OR_RETURN(sr.kv, PackedRows(src.kv, e0, e1, KvRowFormat::kPackedKv));
    ASSIGN_OR_RETURN(sr.keys, PackedRows(src.keys, e0, e1, KvRowFormat::kPackedKey));
    if (r > 1 && n_blocks > 1 && src.log != nullptr) {
      const int64_t logged = src.log->rows();
      sr.log_kv.resize(static_cast<size_t>(logged * hd));
      sr.log_score.resize(static_cast<size_t>(logged * hd));
      RETURN_IF_ERROR(src.log->ReadRows(0, logged, sr.log_kv.data(), sr.log_score.data()));
    }
  }
  std::vector<std::string> out;
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t end = (b + 1) * B;
    std::vector<std::pair<std::string, std::string>> segs;
    std::string meta;
    Put<int64_t>(meta, state.published_keys);
    segs.emplace_back("meta", meta);
    for (const auto& [l, src] : state.sources) {
      const SourceRows& sr = rows.at(l);
      const int r = sr.ratio;
      // This block's entries [b * B / r, end / r) of the source's rows read above.
      auto slice = [&](const std::string& all) {
        const size_t per = all.size() / static_cast<size_t>(n_blocks);
        return all.substr(static_cast<size_t>(b - first_block) * per, per);
      };
      segs.emplace_back(absl::StrCat("kv.", l), slice(sr.kv));
      segs.emplace_back(absl::StrCat("keys.", l), slice(sr.keys));
      if (src.ratio > 1) {
        std::string tail;
        if (b + 1 == end_block) {
          // The compressor tail as the hand-off holds it: fp32 kv, then score.
          tail.resize(static_cast<size_t>(src.tail.bytes()));
          RETURN_IF_ERROR(src.tail.CopyBytes(reinterpret_cast<uint8_t*>(tail.data())));
        } else {
          // Rebuild the tail at `end` from the compressor log: slot q % r holds row q.
          std::vector<float> t(static_cast<size_t>(2 * r * hd));
          for (int64_t q = end - r; q < end; ++q) {
            const int64_t i = src.log != nullptr ? src.log->Find(q) : -1;
            if (i < 0 || sr.log_kv.empty()) {
              return absl::FailedPreconditionError(absl::StrCat(
                  "prefix cut: compressor log of source ", l, " does not cover block ", b));
            }
            std::copy_n(sr.log_kv.begin() + i * hd, hd, t.begin() + (q % r) * hd);
            std::copy_n(sr.log_score.begin() + i * hd, hd, t.begin() + (r + q % r) * hd);
          }
          tail.resize(t.size() * 4);
          std::memcpy(tail.data(), t.data(), tail.size());
        }
        segs.emplace_back(absl::StrCat("tail.", l), std::move(tail));
      }
    }
    const std::vector<int64_t> hist = HistoryAt(model, prompt, end);
    if (b + 1 == end_block && hist != state.engram_history)
      return absl::InvalidArgumentError("prefix cut: the tokens are not the state's prompt");
    segs.emplace_back("engram", I64s(hist));
    out.push_back(Encode(kKindBlock, B, end, b, segs));
  }
  return out;
}

absl::StatusOr<std::string> CutSwaSnapshot(const Model& model, const SequenceState& state,
                                           int64_t B) {
  const ModelConfig& c = model.config();
  if (B <= 0 || state.pos <= 0 || state.pos % B != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("swa snapshot: state at ", state.pos, " is not at a block boundary"));
  }
  const int split = DecoderSplitLayer(c);
  // The encoder layers' SWA rings in the hand-off's packed slot format (only those: no
  // whole-state serialization).
  const int64_t hd = c.head_dim, slot = kf::PackedSwaSlotBytes(hd);
  std::vector<std::pair<std::string, std::string>> segs;
  for (int l = 0; l < split; ++l) {
    std::string ring(static_cast<size_t>(c.window_size * slot), '\0');
    RETURN_IF_ERROR(state.swa[l].CopyPacked(reinterpret_cast<uint8_t*>(ring.data())));
    segs.emplace_back(absl::StrCat("swa.", l), std::move(ring));
  }
  segs.emplace_back("engram", I64s(state.engram_history));
  return Encode(kKindSnapshot, B, state.pos, state.pos / B - 1, segs);
}

absl::StatusOr<std::unique_ptr<SequenceState>> AssemblePrefixState(
    const Model& model, std::span<const std::string> blocks, const std::string* snapshot,
    int64_t B) {
  const ModelConfig& c = model.config();
  if (blocks.empty()) return absl::InvalidArgumentError("prefix assemble: no blocks");
  const int64_t nb = static_cast<int64_t>(blocks.size()), P = nb * B;
  std::vector<Value> vals;
  for (int64_t b = 0; b < nb; ++b) {
    const std::string what = absl::StrCat("block ", b);
    auto v = Decode(blocks[b], what);
    if (!v.ok()) return v.status();
    if (v->kind != kKindBlock)
      return absl::DataLossError(absl::StrCat("prefix value ", what, ": kind ", v->kind));
    if (v->block_tokens != B || v->index != b || v->end != (b + 1) * B) {
      return absl::DataLossError(absl::StrCat(
          "prefix value ", what, ": header says block ", v->index, " ending at ", v->end, " (",
          v->block_tokens, " tokens a block), expected block ", b, " ending at ", (b + 1) * B));
    }
    vals.push_back(*std::move(v));
  }
  auto seg = [](const Value& v, const std::string& name,
                const std::string& what) -> absl::StatusOr<const std::string*> {
    auto it = v.segs.find(name);
    if (it == v.segs.end())
      return absl::DataLossError(absl::StrCat("prefix value ", what, ": no segment '", name, "'"));
    return &it->second;
  };
  const Value& last = vals.back();
  const std::string last_what = absl::StrCat("block ", nb - 1);
  auto meta = seg(last, "meta", last_what);
  if (!meta.ok()) return meta.status();
  if ((*meta)->size() != 8)
    return absl::DataLossError(absl::StrCat("prefix value ", last_what, ": bad 'meta'"));
  int64_t published = 0;
  std::memcpy(&published, (*meta)->data(), 8);

  std::vector<StateSegment> segs;
  StateSegment m{"meta", {}};
  auto put = [&](int64_t x) {
    uint8_t t[8];
    std::memcpy(t, &x, 8);
    m.bytes.insert(m.bytes.end(), t, t + 8);
  };
  put(P);
  put(published);
  put(-1);
  put(static_cast<int64_t>(c.kv_source_layers.size()));
  std::map<int, int> ratios;
  for (int l : c.kv_source_layers) ratios[l] = std::max(1, c.compress_ratios[l]);
  for (const auto& [l, r] : ratios) {
    put(l);
    put(P / r);
  }
  segs.push_back(std::move(m));

  const int split = DecoderSplitLayer(c);
  std::optional<Value> snap;
  if (snapshot != nullptr) {
    auto v = Decode(*snapshot, "swa snapshot");
    if (!v.ok()) return v.status();
    if (v->kind != kKindSnapshot || v->block_tokens != B || v->end != P || v->index != nb - 1) {
      return absl::DataLossError(absl::StrCat("prefix value swa snapshot: header says kind ",
                                              v->kind, " at ", v->end, ", expected a snapshot at ",
                                              P));
    }
    snap = *std::move(v);
  }
  const int64_t slot = kf::PackedSwaSlotBytes(c.head_dim);
  std::vector<uint8_t> zero_ring(c.window_size * slot);
  {
    std::vector<float> z(c.head_dim, 0.f);
    for (int64_t w = 0; w < c.window_size; ++w)
      kf::PackSwaSlot(z.data(), c.head_dim, zero_ring.data() + w * slot);
  }
  for (int l = 0; l < c.total_layers(); ++l) {
    StateSegment s{absl::StrCat("swa.", l), zero_ring};
    if (snap && l < split) {
      auto b = seg(*snap, s.name, "swa snapshot");
      if (!b.ok()) return b.status();
      s.bytes.assign((*b)->begin(), (*b)->end());
    }
    segs.push_back(std::move(s));
  }
  for (const auto& [l, r] : ratios) {
    StateSegment kv{absl::StrCat("kv.", l), {}}, keys{absl::StrCat("keys.", l), {}};
    for (int64_t b = 0; b < nb; ++b) {
      const std::string what = absl::StrCat("block ", b);
      auto k = seg(vals[b], kv.name, what);
      if (!k.ok()) return k.status();
      auto x = seg(vals[b], keys.name, what);
      if (!x.ok()) return x.status();
      kv.bytes.insert(kv.bytes.end(), (*k)->begin(), (*k)->end());
      keys.bytes.insert(keys.bytes.end(), (*x)->begin(), (*x)->end());
    }
    segs.push_back(std::move(kv));
    segs.push_back(std::move(keys));
    if (r > 1) {
      auto t = seg(last, absl::StrCat("tail.", l), last_what);
      if (!t.ok()) return t.status();
      segs.push_back(StateSegment{absl::StrCat("tail.", l), {(*t)->begin(), (*t)->end()}});
    }
  }
  auto eg = seg(last, "engram", last_what);
  if (!eg.ok()) return eg.status();
  if (snap) {
    auto se = seg(*snap, "engram", "swa snapshot");
    if (!se.ok()) return se.status();
    if (**se != **eg)
      return absl::DataLossError(
          "prefix value swa snapshot: Engram history differs from the last block's");
  }
  segs.push_back(StateSegment{"engram", {(*eg)->begin(), (*eg)->end()}});
  segs.push_back(StateSegment{"main_hidden", {}});
  // DeserializeState checks every segment's size against the config and the meta counts.
  auto st = DeserializeState(model, segs);
  if (!st.ok())
    return absl::Status(st.status().code(),
                        absl::StrCat("prefix assemble: ", st.status().message()));
  return st;
}

int64_t PrefixReplayTokens(const ModelConfig& config, int64_t prefix) {
  // Layer l's ring at P holds the keys of [P-W, P), computed from layer l's input there, which
  // layer l-1 computed from its own window: the ring of the last encoder layer depends on
  // split x W tokens before P. A replay of that many (windows truncated at its start) is exact;
  // a shorter one leaves every ring but the first layer's approximate, and greedy outputs then
  // depart from the run without a store (the chaos campaign's wrong outputs, docs/chaos.md).
  return std::min<int64_t>(prefix, int64_t{DecoderSplitLayer(config)} * config.window_size);
}

absl::Status PrefixReplay(const Model& model, SequenceState& state,
                          std::span<const int32_t> prompt) {
  const int64_t P = state.pos;
  if (static_cast<int64_t>(prompt.size()) < P)
    return absl::InvalidArgumentError("prefix replay: fewer tokens than the prefix");
  const int64_t n = PrefixReplayTokens(model.config(), P), start = P - n;
  const int64_t keep = std::max(0, model.config().engram_max_ngram_size - 1);
  const int64_t h0 = std::max<int64_t>(0, start - keep);
  return EncoderReplay(model, state, prompt.subspan(start, n), prompt.subspan(h0, start - h0));
}

}  // namespace epd::model
