#pragma once

// Manifests: what a hand-off carries, derived independently on both sides (DESIGN.md §4).
//
// The sender builds its manifest from what it actually computed; the receiver builds the one it
// expects from what it knows of the model (runtime/worker/handoff.h: BuildHandoffManifest), and
// CompareManifests() checks the offer field by field before any byte is used. This file knows
// segments, bytes and checksums, not the model: the typed layout the transfer tests build
// manifests from is tests/testing/handoff_layout.h.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "epd/v1/transfer.pb.h"

namespace epd::transfer {

// layout_id of an opaque segment (store blocks, worker hand-offs). Never renumber: on the wire.
// Typed layouts (FP4 KV, FP8 SWA slots, ...) belong to the code that knows the model; the transfer
// engine moves and checks bytes.
inline constexpr uint32_t kLayoutRawBytes = 0xff;

// Short bounded label of a segment kind ("swa_kv", "dspark_noise", ...) for metrics and errors.
absl::string_view SegmentKindLabel(epd::v1::SegmentKind kind);
// "segment 17 (swa_kv layer 5)".
std::string DescribeSegment(const epd::v1::Manifest& manifest, int index);

// Appends one segment of `entries` entries in `layout`, `bytes` long, XXH3-64 checksum.
epd::v1::Segment* AddSegment(epd::v1::Manifest& manifest, epd::v1::SegmentKind kind, int layer,
                             int64_t pos_begin, int64_t pos_end, int64_t entries, uint32_t layout,
                             uint64_t bytes);
// Appends one opaque segment: layout kLayoutRawBytes, one entry of `bytes`, XXH3-64 checksum, token
// positions [pos_begin, pos_end). Store blocks and worker hand-offs describe their bytes this way.
epd::v1::Segment* AddRawBytesSegment(epd::v1::Manifest& manifest, epd::v1::SegmentKind kind,
                                     int layer, int64_t pos_begin, int64_t pos_end, uint64_t bytes);

uint64_t TotalBytes(const epd::v1::Manifest& manifest);
// TotalBytes of a manifest from a peer: nullopt when its byte_lengths overflow 64 bits.
std::optional<uint64_t> CheckedTotalBytes(const epd::v1::Manifest& manifest);
// Copies `src` to `dst` and returns its transfer checksum (XXH3-64) in one pass: each piece is
// hashed while it is still in cache from the copy. For TransferOptions::checksums_in_manifest.
uint64_t CopyAndChecksum(std::span<const uint8_t> src, uint8_t* dst);
std::vector<uint64_t> SegmentOffsets(const epd::v1::Manifest& manifest);

struct ManifestMismatch {
  int segment_index = -1;              // -1: a header field (request_id, prompt_length, ...)
  std::string segment_label = "none";  // metric label: the segment kind, or "header"
  std::string field;                   // "entry_count", "segment_count", ...
  std::string message;                 // full human-readable error
};

// First difference between what the receiver expects and what was offered, in field order, or
// nullopt if they agree. Checksum values are not compared here (verified after the bytes land).
std::optional<ManifestMismatch> CompareManifests(const epd::v1::Manifest& expected,
                                                 const epd::v1::Manifest& offered);

}  // namespace epd::transfer
