#include "kvstore/transfer/manifest.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"

namespace epd::transfer {
namespace {

using epd::v1::Manifest;
using epd::v1::Segment;
using epd::v1::SegmentKind;

Segment* AddSegment(Manifest* m, SegmentKind kind, int layer, int64_t pos_begin, int64_t pos_end,
                    int64_t entries, uint32_t layout, uint64_t bytes) {
  Segment* s = m->add_segments();
  s->set_kind(kind);
  s->set_layer_id(layer);
  s->set_pos_begin(pos_begin);
  s->set_pos_end(pos_end);
  s->set_entry_count(entries);
  s->set_layout_id(layout);
  s->set_byte_length(bytes);
  s->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
  return s;
}

}  // namespace

int HandoffLayout::DecoderStart() const {
  if (first_decoder_layer >= 0) return first_decoder_layer;
  return sources.empty() ? num_layers : sources.back().layer_id;
}

absl::Status HandoffLayout::Validate() const {
  if (num_layers <= 0) return absl::InvalidArgumentError("HandoffLayout.num_layers must be > 0");
  if (window <= 0 || swa_slot_bytes <= 0)
    return absl::InvalidArgumentError("HandoffLayout.window and swa_slot_bytes must be > 0");
  if (sources.empty()) return absl::InvalidArgumentError("HandoffLayout.sources is empty");
  for (const KvSourceLayout& s : sources) {
    if (s.layer_id < 0 || s.layer_id >= num_layers || s.compress_ratio <= 0 ||
        s.kv_entry_bytes <= 0 || s.index_entry_bytes < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("HandoffLayout: bad source layer ", s.layer_id));
  }
  if (DecoderStart() <= 0 || DecoderStart() > num_layers)
    return absl::InvalidArgumentError("HandoffLayout.first_decoder_layer out of range");
  if (hidden_size <= 0 || hc_mult <= 0 || head_dim <= 0)
    return absl::InvalidArgumentError("HandoffLayout.hidden_size/hc_mult/head_dim must be > 0");
  if (dspark && (dspark_stages <= 0 || dspark_block_size <= 0 || num_target_layers <= 0 ||
                 num_target_layers > num_layers))
    return absl::InvalidArgumentError("HandoffLayout: bad DSpark numbers");
  return absl::OkStatus();
}

HandoffLayout NanoTestLayout(HandoffKind handoff) {
  HandoffLayout l;
  l.handoff = handoff;
  l.num_layers = 12;
  l.first_decoder_layer = 6;
  l.sources = {{2, 2, 288, 68}, {4, 2, 288, 68}, {6, 1, 288, 68}};
  l.hidden_size = 256;
  l.hc_mult = 4;
  return l;
}

absl::StatusOr<Manifest> BuildExpectedManifest(const HandoffLayout& layout,
                                               const HandoffRequest& req) {
  if (absl::Status st = layout.Validate(); !st.ok()) return st;
  const int64_t n = req.prompt_length;
  const int64_t p = req.cached_length;
  if (n <= 0) return absl::InvalidArgumentError("prompt_length must be > 0");
  // Far above any context; keeps n + block and count x entry bytes inside int64/uint64 (a header
  // of INT64_MAX overflowed n + dspark_block_size: found probing tests/fuzz/fuzz_handoff_manifest).
  constexpr int64_t kMaxPromptLength = int64_t{1} << 40;
  if (n > kMaxPromptLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_length ", n, " exceeds the limit of ", kMaxPromptLength));
  }
  if (p < 0 || p > n)
    return absl::InvalidArgumentError(
        absl::StrCat("cached_length ", p, " outside [0, prompt_length ", n, "]"));
  const bool enc_to_prefill = layout.handoff == HandoffKind::kEncoderToPrefill;
  const int dec = layout.DecoderStart();

  Manifest m;
  m.set_request_id(req.request_id);
  m.set_config_fingerprint(req.config_fingerprint);
  m.set_prompt_length(n);
  m.set_cached_length(p);
  m.set_dspark(layout.dspark);

  // Global KV and index keys of every source: encoder -> prefill carries only what the encoder
  // computed ([P, N)); prefill -> decode carries the whole sequence ([0, N)).
  for (const KvSourceLayout& s : layout.sources) {
    const int64_t ratio = s.compress_ratio;
    if (enc_to_prefill && p % ratio != 0)
      return absl::InvalidArgumentError(absl::StrCat("cached_length ", p,
                                                     " is not a multiple of the ratio ", ratio,
                                                     " of source layer ", s.layer_id));
    const int64_t first = enc_to_prefill ? p / ratio : 0;
    const int64_t last = n / ratio;  // complete entries only; the tail is compressor state
    const int64_t count = std::max<int64_t>(0, last - first);
    const SegmentKind kind =
        s.layer_id >= dec ? epd::v1::SEGMENT_DEC_GLOBAL_KV : epd::v1::SEGMENT_ENC_GLOBAL_KV;
    AddSegment(&m, kind, s.layer_id, first * ratio, last * ratio, count, kLayoutGlobalKvFp4,
               static_cast<uint64_t>(count) * s.kv_entry_bytes);
    if (s.index_entry_bytes > 0)
      AddSegment(&m, epd::v1::SEGMENT_INDEX_K, s.layer_id, first * ratio, last * ratio, count,
                 kLayoutIndexKFp4, static_cast<uint64_t>(count) * s.index_entry_bytes);
  }
  // Ratio > 1 compressors carry their incomplete trailing group (kv_state + score_state).
  for (const KvSourceLayout& s : layout.sources) {
    if (s.compress_ratio <= 1) continue;
    const int64_t ratio = s.compress_ratio;
    AddSegment(&m, epd::v1::SEGMENT_COMPRESSOR_STATE, s.layer_id, (n / ratio) * ratio, n, n % ratio,
               kLayoutCompressorStateF32, 2ull * ratio * layout.head_dim * sizeof(float));
  }
  // SWA rings: the valid entries, oldest first.
  const int64_t ring = std::min<int64_t>(n, layout.window);
  int swa_begin = 0;
  int swa_end = 0;
  if (enc_to_prefill) {
    swa_end = layout.carry_encoder_swa ? dec : 0;
  } else {
    swa_begin = layout.carry_encoder_swa ? 0 : dec;
    swa_end = layout.num_layers;
  }
  for (int l = swa_begin; l < swa_end; ++l)
    AddSegment(&m, epd::v1::SEGMENT_SWA_KV, l, n - ring, n, ring, kLayoutSwaFp8,
               static_cast<uint64_t>(ring) * layout.swa_slot_bytes);

  if (enc_to_prefill) {
    // Residual stream after the last encoder layer, tail rows (the prefill's replay input).
    AddSegment(&m, epd::v1::SEGMENT_ENC_OUTPUT_TAIL, dec - 1, n - ring, n, ring,
               kLayoutResidualBf16,
               static_cast<uint64_t>(ring) * layout.hc_mult * layout.hidden_size * 2);
  } else if (layout.dspark) {
    for (int b = 0; b < layout.dspark_stages; ++b)
      AddSegment(&m, epd::v1::SEGMENT_DSPARK_DRAFT_KV, layout.num_layers + b, n - ring, n, ring,
                 kLayoutSwaFp8, static_cast<uint64_t>(ring) * layout.swa_slot_bytes);
    AddSegment(&m, epd::v1::SEGMENT_DSPARK_NOISE, -1, n, n + layout.dspark_block_size,
               layout.dspark_block_size, kLayoutTokenIdsI32,
               static_cast<uint64_t>(layout.dspark_block_size) * 4);
    for (int t = 0; t < layout.num_target_layers; ++t)
      AddSegment(&m, epd::v1::SEGMENT_TARGET_HIDDEN,
                 layout.num_layers - layout.num_target_layers + t, n - 1, n, 1, kLayoutHiddenBf16,
                 static_cast<uint64_t>(layout.hidden_size) * 2);
  }
  if (layout.engram_history > 0) {
    const int64_t h = std::min<int64_t>(n, layout.engram_history);
    AddSegment(&m, epd::v1::SEGMENT_ENGRAM_HISTORY, -1, n - h, n, h, kLayoutTokenIdsI32,
               static_cast<uint64_t>(h) * 4);
  }
  return m;
}

absl::string_view SegmentKindLabel(SegmentKind kind) {
  switch (kind) {
    case epd::v1::SEGMENT_ENC_GLOBAL_KV:
      return "enc_global_kv";
    case epd::v1::SEGMENT_DEC_GLOBAL_KV:
      return "dec_global_kv";
    case epd::v1::SEGMENT_INDEX_K:
      return "index_k";
    case epd::v1::SEGMENT_SWA_KV:
      return "swa_kv";
    case epd::v1::SEGMENT_DSPARK_NOISE:
      return "dspark_noise";
    case epd::v1::SEGMENT_DSPARK_DRAFT_KV:
      return "dspark_draft_kv";
    case epd::v1::SEGMENT_TARGET_HIDDEN:
      return "target_hidden";
    case epd::v1::SEGMENT_ENC_OUTPUT_TAIL:
      return "enc_output_tail";
    case epd::v1::SEGMENT_COMPRESSOR_STATE:
      return "compressor_state";
    case epd::v1::SEGMENT_ENGRAM_HISTORY:
      return "engram_history";
    case epd::v1::SEGMENT_BLOCK:
      return "block";
    default:
      return "unspecified";
  }
}

std::string DescribeSegment(const Manifest& manifest, int index) {
  if (index < 0 || index >= manifest.segments_size()) return absl::StrCat("segment ", index);
  const Segment& s = manifest.segments(index);
  std::string out = absl::StrCat("segment ", index, " (", SegmentKindLabel(s.kind()));
  if (s.layer_id() >= 0) absl::StrAppend(&out, " layer ", s.layer_id());
  absl::StrAppend(&out, ")");
  return out;
}

epd::v1::Segment* AddRawBytesSegment(Manifest& manifest, epd::v1::SegmentKind kind, int layer,
                                     int64_t pos_begin, int64_t pos_end, uint64_t bytes) {
  epd::v1::Segment* s = manifest.add_segments();
  s->set_kind(kind);
  s->set_layer_id(layer);
  s->set_pos_begin(pos_begin);
  s->set_pos_end(pos_end);
  s->set_entry_count(1);
  s->set_layout_id(kLayoutRawBytes);
  s->set_byte_length(bytes);
  s->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
  return s;
}

uint64_t TotalBytes(const Manifest& manifest) {
  uint64_t total = 0;
  for (const Segment& s : manifest.segments()) total += s.byte_length();
  return total;
}

std::optional<uint64_t> CheckedTotalBytes(const Manifest& manifest) {
  uint64_t total = 0;
  for (const Segment& s : manifest.segments()) {
    if (total + s.byte_length() < total) return std::nullopt;
    total += s.byte_length();
  }
  return total;
}

std::vector<uint64_t> SegmentOffsets(const Manifest& manifest) {
  std::vector<uint64_t> offsets;
  offsets.reserve(manifest.segments_size());
  uint64_t at = 0;
  for (const Segment& s : manifest.segments()) {
    offsets.push_back(at);
    at += s.byte_length();
  }
  return offsets;
}

std::optional<ManifestMismatch> CompareManifests(const Manifest& expected,
                                                 const Manifest& offered) {
  auto header = [&](std::string field, const auto& want,
                    const auto& got) -> std::optional<ManifestMismatch> {
    if (want == got) return std::nullopt;
    ManifestMismatch mm;
    mm.segment_label = "header";
    mm.field = field;
    mm.message = absl::StrCat("accounting error in request '", expected.request_id(),
                              "': manifest field ", field, " expected ", want, ", got ", got);
    return mm;
  };
  if (auto mm = header("request_id", expected.request_id(), offered.request_id())) return mm;
  if (auto mm =
          header("config_fingerprint", expected.config_fingerprint(), offered.config_fingerprint()))
    return mm;
  if (auto mm = header("prompt_length", expected.prompt_length(), offered.prompt_length()))
    return mm;
  if (auto mm = header("cached_length", expected.cached_length(), offered.cached_length()))
    return mm;
  if (auto mm = header("dspark", expected.dspark() ? "on" : "off", offered.dspark() ? "on" : "off"))
    return mm;

  const int common = std::min(expected.segments_size(), offered.segments_size());
  for (int i = 0; i < common; ++i) {
    const Segment& e = expected.segments(i);
    const Segment& o = offered.segments(i);
    auto field = [&](std::string name, auto want, auto got) -> std::optional<ManifestMismatch> {
      if (want == got) return std::nullopt;
      ManifestMismatch mm;
      mm.segment_index = i;
      mm.segment_label = std::string(SegmentKindLabel(e.kind()));
      mm.field = name;
      mm.message = absl::StrCat("accounting error in request '", expected.request_id(),
                                "': ", DescribeSegment(expected, i), " field ", name, " expected ",
                                want, ", got ", got);
      return mm;
    };
    if (e.kind() != o.kind())
      return field("kind", SegmentKindLabel(e.kind()), SegmentKindLabel(o.kind()));
    if (auto mm = field("layer_id", e.layer_id(), o.layer_id())) return mm;
    if (auto mm = field("pos_begin", e.pos_begin(), o.pos_begin())) return mm;
    if (auto mm = field("pos_end", e.pos_end(), o.pos_end())) return mm;
    if (auto mm = field("entry_count", e.entry_count(), o.entry_count())) return mm;
    if (auto mm = field("layout_id", e.layout_id(), o.layout_id())) return mm;
    if (auto mm = field("byte_length", e.byte_length(), o.byte_length())) return mm;
    if (auto mm = field("checksum_kind", static_cast<int>(e.checksum_kind()),
                        static_cast<int>(o.checksum_kind())))
      return mm;
  }
  if (expected.segments_size() != offered.segments_size()) {
    ManifestMismatch mm;
    mm.field = "segment_count";
    const bool missing = offered.segments_size() < expected.segments_size();
    mm.segment_index = common;
    const Manifest& longer = missing ? expected : offered;
    mm.segment_label = std::string(SegmentKindLabel(longer.segments(common).kind()));
    mm.message =
        absl::StrCat("accounting error in request '", expected.request_id(),
                     "': manifest field segment_count expected ", expected.segments_size(),
                     ", got ", offered.segments_size(), " (", DescribeSegment(longer, common),
                     missing ? " missing" : " extra", ")");
    return mm;
  }
  return std::nullopt;
}

uint64_t CopyAndChecksum(std::span<const uint8_t> src, uint8_t* dst) {
  constexpr size_t kPiece = 64 << 10;  // stays in L2 between the copy and the hash
  if (src.size() <= kPiece) {
    if (!src.empty()) std::memcpy(dst, src.data(), src.size());
    return XXH3_64bits(dst, src.size());
  }
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (state == nullptr) {  // out of memory for 576 bytes: copy, then hash in one call
    std::memcpy(dst, src.data(), src.size());
    return XXH3_64bits(dst, src.size());
  }
  XXH3_64bits_reset(state.get());
  for (size_t off = 0; off < src.size(); off += kPiece) {
    const size_t n = std::min(kPiece, src.size() - off);
    std::memcpy(dst + off, src.data() + off, n);
    XXH3_64bits_update(state.get(), dst + off, n);
  }
  return XXH3_64bits_digest(state.get());
}

}  // namespace epd::transfer
