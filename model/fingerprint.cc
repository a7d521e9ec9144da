#include "model/fingerprint.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/fingerprint.h"

namespace epd::model {

absl::StatusOr<std::string> ModelDirFingerprint(const std::string& model_dir,
                                                int cache_layout_version, bool dspark) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string canonical = common::CanonicalJson(ss.str());
  if (canonical.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " is not JSON"));
  return common::ConfigFingerprint({std::move(canonical), cache_layout_version, dspark});
}

}  // namespace epd::model
