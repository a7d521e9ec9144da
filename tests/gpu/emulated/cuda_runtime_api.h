#pragma once
// The host emulation of the runtime API (tests/gpu/emulated/cuda_runtime.h).
#include "cuda_runtime.h"
