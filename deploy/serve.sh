#!/usr/bin/env bash
# The README's first command: install what is missing, build, and start `epd serve` on 127.0.0.1
# with the trained demo model models/epd-nano (docs/demo.md). Extra arguments go to `epd serve`
# (see `build/epd serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install_deps.sh
EPD_BUILD_TYPE="${EPD_BUILD_TYPE:-Release}" bash deploy/build.sh  # the optimized build users serve with
exec ./build/epd serve "$@"
