#!/usr/bin/env bash
# Packs the GPU check's binaries, built on this machine, into a folder that the device tool can
# carry (default .gpu-prebuilt/, git-ignored). The folder holds bin/ and, in lib/, every shared
# library they load except glibc's. The GPU machine's image has nvcc and CMake but not this
# project's C++ dependencies (absl, gtest, gRPC, ...), so the full configure of
# tests/gpu/device_check.sh fails there; the script then runs these binaries instead
# (docs/cuda.md). The binaries need a glibc at least as new as this machine's (Debian 12: 2.36).
#
# Usage: bash tests/gpu/pack_prebuilt.sh [outdir]    (EPD_BUILD_DIR, default build; EPD_JOBS)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD="${EPD_BUILD_DIR:-build}"
OUTDIR="${1:-.gpu-prebuilt}"
BINS="tests/backend_parity_cuda_test tests/backend_parity_test tests/cuda_kernels_test
      tests/cuda_weights_test tests/cuda_model_test tests/device_test tests/codec_test cuda_bench"
targets=""
for b in $BINS; do targets="$targets $(basename "$b")"; done
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "${EPD_JOBS:-2}" --target $targets
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/bin" "$OUTDIR/lib"
for b in $BINS; do cp "$BUILD/$b" "$OUTDIR/bin/"; done
for b in "$OUTDIR"/bin/*; do ldd "$b" | awk '/=> \// {print $3}'; done | sort -u |
  while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux*) ;;
      *) cp -L "$lib" "$OUTDIR/lib/" ;;
    esac
  done
du -sh "$OUTDIR"
echo "carry $OUTDIR and run: bash tests/gpu/device_check.sh (it falls back to $OUTDIR)"
