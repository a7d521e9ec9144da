#pragma once

// The typed hand-off layout of DESIGN.md §4 as plain numbers, and the manifest a receiver expects
// from it: what the transfer engine's tests, benchmarks and fuzz targets build manifests from.
// Test-only: the transfer engine knows bytes, not the model, and the workers derive their
// manifests from the model's config (runtime/worker/handoff.h). The segment list per hand-off is
// documented in docs/transfer.md.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/v1/transfer.pb.h"

namespace epd::testing {

// layout_id values (dtype + byte layout of one entry). Never renumber: they are on the wire.
enum LayoutId : uint32_t {
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

// The nano-like layout (12 layers + 3 DSpark stages, KV sources 2 and 4 (m = 2) and 6 (m = 1),
// hidden 256, hc_mult 4).
HandoffLayout NanoTestLayout(HandoffKind handoff);

}  // namespace epd::testing
