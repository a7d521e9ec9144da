#!/usr/bin/env bash
# Configures and builds epd into ./build (or $EPD_BUILD_DIR). Used by serve.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${EPD_BUILD_DIR:-build}"
JOBS="${EPD_JOBS:-$(nproc)}"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="${EPD_BUILD_TYPE:-RelWithDebInfo}" "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
