#pragma once

// The number formats moved to the packed-format module (kernels/format.h); this header keeps the
// kernels::cpu spelling for the CPU backend's own code and its tests.

#include "kernels/format.h"

namespace epd::kernels::cpu {
using namespace ::epd::kernels::format;  // NOLINT(build/namespaces)
}  // namespace epd::kernels::cpu
