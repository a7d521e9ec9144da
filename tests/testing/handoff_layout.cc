#include "tests/testing/handoff_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "transfer/manifest.h"

namespace epd::testing {

using epd::v1::Manifest;
using epd::v1::SegmentKind;

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
    transfer::AddSegment(m, kind, s.layer_id, first * ratio, last * ratio, count, kLayoutGlobalKvFp4,
               static_cast<uint64_t>(count) * s.kv_entry_bytes);
    if (s.index_entry_bytes > 0)
      transfer::AddSegment(m, epd::v1::SEGMENT_INDEX_K, s.layer_id, first * ratio, last * ratio, count,
                 kLayoutIndexKFp4, static_cast<uint64_t>(count) * s.index_entry_bytes);
  }
  // Ratio > 1 compressors carry their incomplete trailing group (kv_state + score_state).
  for (const KvSourceLayout& s : layout.sources) {
    if (s.compress_ratio <= 1) continue;
    const int64_t ratio = s.compress_ratio;
    transfer::AddSegment(m, epd::v1::SEGMENT_COMPRESSOR_STATE, s.layer_id, (n / ratio) * ratio, n, n % ratio,
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
    transfer::AddSegment(m, epd::v1::SEGMENT_SWA_KV, l, n - ring, n, ring, kLayoutSwaFp8,
               static_cast<uint64_t>(ring) * layout.swa_slot_bytes);

  if (enc_to_prefill) {
    // Residual stream after the last encoder layer, tail rows (the prefill's replay input).
    transfer::AddSegment(m, epd::v1::SEGMENT_ENC_OUTPUT_TAIL, dec - 1, n - ring, n, ring,
               kLayoutResidualBf16,
               static_cast<uint64_t>(ring) * layout.hc_mult * layout.hidden_size * 2);
  } else if (layout.dspark) {
    for (int b = 0; b < layout.dspark_stages; ++b)
      transfer::AddSegment(m, epd::v1::SEGMENT_DSPARK_DRAFT_KV, layout.num_layers + b, n - ring, n, ring,
                 kLayoutSwaFp8, static_cast<uint64_t>(ring) * layout.swa_slot_bytes);
    transfer::AddSegment(m, epd::v1::SEGMENT_DSPARK_NOISE, -1, n, n + layout.dspark_block_size,
               layout.dspark_block_size, kLayoutTokenIdsI32,
               static_cast<uint64_t>(layout.dspark_block_size) * 4);
    for (int t = 0; t < layout.num_target_layers; ++t)
      transfer::AddSegment(m, epd::v1::SEGMENT_TARGET_HIDDEN,
                 layout.num_layers - layout.num_target_layers + t, n - 1, n, 1, kLayoutHiddenBf16,
                 static_cast<uint64_t>(layout.hidden_size) * 2);
  }
  if (layout.engram_history > 0) {
    const int64_t h = std::min<int64_t>(n, layout.engram_history);
    transfer::AddSegment(m, epd::v1::SEGMENT_ENGRAM_HISTORY, -1, n - h, n, h, kLayoutTokenIdsI32,
               static_cast<uint64_t>(h) * 4);
  }
  return m;
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

}  // namespace epd::testing
