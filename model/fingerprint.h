#pragma once

// The config fingerprint of a model directory (common/fingerprint.h over the directory's
// config.json, re-serialized canonically). Every process that exchanges KV for a model (workers,
// the kvstore's chain hashes, the router's prefix oracle) computes it the same way.
// Thread-safety: reentrant.
#include <string>

#include "absl/status/statusor.h"

namespace epd::model {

// 32 hex chars. Errors name the file (missing, unreadable, not JSON).
absl::StatusOr<std::string> ModelDirFingerprint(const std::string& model_dir,
                                                int cache_layout_version = 1, bool dspark = true);

}  // namespace epd::model
