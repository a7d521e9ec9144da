#include "transfer/manifest.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"

namespace epd::transfer {
using epd::v1::Manifest;
using epd::v1::Segment;
using epd::v1::SegmentKind;

Segment* AddSegment(Manifest& m, SegmentKind kind, int layer, int64_t pos_begin, int64_t pos_end,
                    int64_t entries, uint32_t layout, uint64_t bytes) {
  Segment* s = m.add_segments();
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
  return AddSegment(manifest, kind, layer, pos_begin, pos_end, 1, kLayoutRawBytes, bytes);
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
