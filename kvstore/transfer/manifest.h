#pragma once

// Manifests: what a hand-off carries, derived independently on both sides (DESIGN.md §4).
//
// The sender builds its manifest from what it actually computed; the receiver builds the one it
// expects with BuildExpectedManifest() from (layout, prompt length, cached length, DSpark on/off)
// and CompareManifests() checks the offer field by field before any byte is used. The exact list
// of segments per hand-off is documented in docs/transfer.md. Layout numbers are plain values here
// (kvstore must not depend on model/); the model code fills a HandoffLayout from its config.
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

// layout_id values (dtype + byte layout of one entry). Never renumber: they are on the wire.
enum LayoutId : uint32_t {
  kLayoutRawBytes = 0xff,         // opaque bytes (store blocks, tests)
  kLayoutGlobalKvFp4 = 1,         // 512 x E2M1 packed 2/byte + 32 x E4M3 scales (16/scale)
  kLayoutIndexKFp4 = 2,           // 128 x E2M1 packed + 4 x UE8M0 scales (32/scale)
  kLayoutSwaFp8 = 3,              // 512 x E4M3 + 16 x UE8M0 scales (32/scale), one ring slot
  kLayoutCompressorStateF32 = 4,  // kv_state then score_state, fp32 [ratio, head_dim] each
  kLayoutTokenIdsI32 = 5,         // little-endian int32 token ids
  kLayoutHiddenBf16 = 6,          // bf16 [hidden]
  kLayoutResidualBf16 = 7,        // bf16 [hc_mult, hidden] per row
};

// One KV source layer (a layer with its own compressor).
struct KvSourceLayout {
  int layer_id = 0;
  int compress_ratio = 1;      // m: tokens per compressed entry (2 encoder, 1 decoder)
  int kv_entry_bytes = 288;    // Default: 288 (FP4 latent of 512 + 32 E4M3 scales)
  int index_entry_bytes = 68;  // Default: 68 (FP4 index key of 128 + 4 scales); 0 = no index
};

enum class HandoffKind { kEncoderToPrefill, kPrefillToDecode };

// Everything the expected-manifest builder needs, as plain numbers.
struct HandoffLayout {
  HandoffKind handoff = HandoffKind::kPrefillToDecode;
  int num_layers = 0;  // main layers (40 real, 12 nano), DSpark stages not included
  // First decoder layer (CED split). Layers [0, first_decoder_layer) are the encoder. Its source
  // (ratio 1) is the decoder's global KV. Default: the last source layer.
  int first_decoder_layer = -1;
  int window = 128;          // SWA ring slots. Default: 128
  int swa_slot_bytes = 528;  // Default: 528 (512 FP8 + 16 UE8M0)
  std::vector<KvSourceLayout> sources;
  bool dspark = true;         // DSpark on: draft block, draft rings, target hidden. Default: on
  int dspark_stages = 3;      // Default: 3
  int dspark_block_size = 5;  // last sampled token + (block-1) noise slots. Default: 5
  int num_target_layers = 3;  // DSpark target layers = the last N main layers. Default: 3
  int hidden_size = 0;
  int hc_mult = 4;         // mHC residual streams. Default: 4
  int head_dim = 512;      // compressor state width. Default: 512
  int engram_history = 3;  // last compressed engram ids carried; 0 = none. Default: 3
  // Encoder SWA rings travel encoder -> prefill -> decode (instead of decode reading the SWA pool).
  // Default: on.
  bool carry_encoder_swa = true;

  absl::Status Validate() const;
  int DecoderStart() const;  // first_decoder_layer resolved
};

// The nano-like layout the transfer tests use (12 layers + 3 DSpark stages, sources 2,4 (m=2)
// and 6 (m=1), hidden 256, hc_mult 4).
HandoffLayout NanoTestLayout(HandoffKind handoff);

struct HandoffRequest {
  std::string request_id;
  std::string config_fingerprint;
  int64_t prompt_length = 0;  // N: prompt tokens
  int64_t cached_length = 0;  // P: prefix already in the store (whole blocks)
};

// The manifest the receiver expects (checksums unset). Errors on impossible inputs (P > N, P not a
// multiple of every ratio, N == 0).
absl::StatusOr<epd::v1::Manifest> BuildExpectedManifest(const HandoffLayout& layout,
                                                        const HandoffRequest& request);

// Short bounded label of a segment kind ("swa_kv", "dspark_noise", ...) for metrics and errors.
absl::string_view SegmentKindLabel(epd::v1::SegmentKind kind);
// "segment 17 (swa_kv layer 5)".
std::string DescribeSegment(const epd::v1::Manifest& manifest, int index);

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
