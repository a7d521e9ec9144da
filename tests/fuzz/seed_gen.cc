// Writes the binary seeds of tests/fuzz/corpus that are easier to compute than to write by hand:
// G3 values (header + checksum) and hand-off manifests exactly as the receiver expects them.
// Usage (docs/fuzzing.md): build-fuzz/fuzz_seed_gen tests/fuzz/corpus
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "epd/v1/transfer.pb.h"
#include "kvstore/g3_value.h"
#include "transfer/manifest.h"
#include "tests/testing/handoff_layout.h"

namespace {

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  std::cout << path << " (" << bytes.size() << " bytes)\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_seed_gen <corpus dir>\n";
    return 2;
  }
  const std::string dir = argv[1];
  namespace kv = epd::kvstore;
  const std::vector<std::pair<std::string, std::string>> payloads = {
      {"empty", ""}, {"short", "kv block bytes"}, {"block", std::string(288, '\x5a')}};
  for (const auto& [name, p] : payloads) {
    const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(p.data()), p.size());
    Write(dir + "/fuzz_kvstore_value/" + name, kv::EncodeG3Value(1764547200000, bytes));
  }
  namespace t = epd::transfer;
  for (int kind = 0; kind < 2; ++kind) {
    for (int dspark = 0; dspark < 2; ++dspark) {
      for (auto [n, p] : std::vector<std::pair<int64_t, int64_t>>{{5, 0}, {130, 64}, {300, 256}}) {
        epd::testing::HandoffLayout layout = epd::testing::NanoTestLayout(kind ? epd::testing::HandoffKind::kEncoderToPrefill
                                                         : epd::testing::HandoffKind::kPrefillToDecode);
        layout.dspark = dspark;
        auto m = epd::testing::BuildExpectedManifest(layout, {"req-seed", "fp-seed", n, p});
        if (!m.ok()) {
          std::cerr << m.status() << "\n";
          return 1;
        }
        const char flags = static_cast<char>(kind | (dspark << 1));
        Write(dir + "/fuzz_handoff_manifest/expected_k" + std::to_string(kind) + "_d" +
                  std::to_string(dspark) + "_n" + std::to_string(n),
              std::string(1, flags) + m->SerializeAsString());
      }
    }
  }
  return 0;
}
