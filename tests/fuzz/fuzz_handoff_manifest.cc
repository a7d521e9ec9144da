// libFuzzer target: a hand-off manifest as the receiving worker decodes it. The offer arrives as
// protobuf bytes (epd.v1.Manifest: the hand-off header fields request_id, config_fingerprint,
// prompt_length, cached_length, dspark, then the segments); the receiver builds the manifest it
// expects from the header it was told and compares the two field by field, then sizes the
// segments. Input: byte 0 selects the hand-off kind and DSpark; the rest is the Manifest bytes.
#include <cstddef>
#include <cstdint>

#include "epd/v1/transfer.pb.h"
#include "transfer/manifest.h"
#include "tests/testing/handoff_layout.h"

namespace t = epd::transfer;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  epd::v1::Manifest offered;
  if (!offered.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  epd::testing::HandoffLayout layout = epd::testing::NanoTestLayout((data[0] & 1) ? epd::testing::HandoffKind::kEncoderToPrefill
                                                            : epd::testing::HandoffKind::kPrefillToDecode);
  layout.dspark = (data[0] & 2) != 0;
  epd::testing::HandoffRequest request;
  request.request_id = offered.request_id();
  request.config_fingerprint = offered.config_fingerprint();
  request.prompt_length = offered.prompt_length();
  request.cached_length = offered.cached_length();
  auto expected = epd::testing::BuildExpectedManifest(layout, request);
  if (expected.ok()) {
    auto mismatch = t::CompareManifests(*expected, offered);
    if (mismatch && mismatch->message.empty()) __builtin_trap();
    if (!mismatch) {
      // Agreed manifests size identically.
      if (t::TotalBytes(*expected) != t::TotalBytes(offered)) __builtin_trap();
    }
  }
  (void)t::TotalBytes(offered);
  (void)t::SegmentOffsets(offered);
  for (int i = 0; i < offered.segments_size() && i < 64; ++i) {
    (void)t::DescribeSegment(offered, i);
    (void)t::SegmentKindLabel(offered.segments(i).kind());
  }
  return 0;
}
