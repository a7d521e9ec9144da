#!/usr/bin/env bash
# Packs binaries built on this machine for the GPU machine, whose image has nvcc and CMake but
# not this project's C++ dependencies (absl, gtest, gRPC, RocksDB, UCX, ...), so the full
# configure of tests/gpu/device_check.sh fails there (docs/cuda.md, "The device run").
#
#   tests (default): the GPU tests and benchmarks -> .gpu-prebuilt/, archived as
#                    .gpu-pack/prebuilt.tar.xz (about 15 MB); device_check.sh runs them.
#   serve:           epd and every process `epd serve` starts -> .gpu-prebuilt-serve/, archived as
#                    .gpu-pack/serve.tar.xz (about 23 MB); tests/gpu/serve_check.sh runs them.
#
# A folder holds bin/ (stripped) and, in lib/, every shared library they load except glibc's
# (serve: also UCX's transport modules, in lib/ucx). The device tool carries at most 64 MiB with
# the working tree, so each archive travels in its own call (carry: [".gpu-pack"]). The binaries
# need a glibc at least as new as this machine's (Debian 12: 2.36).
#
# Usage: bash tests/gpu/pack_prebuilt.sh [tests|serve]    (EPD_BUILD_DIR, default build; EPD_JOBS)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD="${EPD_BUILD_DIR:-build}"
MODE="${1:-tests}"
case "$MODE" in
  tests)
    OUTDIR=.gpu-prebuilt
    ARCHIVE=.gpu-pack/prebuilt.tar.xz
    # (backend_parity_test, the CPU SIMD-vs-scalar parity, runs in CI and stays out: size.)
    BINS="tests/backend_parity_cuda_test tests/cuda_kernels_test tests/cuda_weights_test
          tests/cuda_model_test tests/device_test tests/codec_test cuda_bench cuda_model_bench" ;;
  serve)
    OUTDIR=.gpu-prebuilt-serve
    ARCHIVE=.gpu-pack/serve.tar.xz
    BINS="epd epd-encoder epd-prefill epd-decode epd-kvstore epd-router" ;;
  *) echo "usage: pack_prebuilt.sh [tests|serve]" >&2; exit 2 ;;
esac
targets=""
for b in $BINS; do targets="$targets $(basename "$b")"; done
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "${EPD_JOBS:-2}" --target $targets
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/bin" "$OUTDIR/lib"
for b in $BINS; do strip --strip-all -o "$OUTDIR/bin/$(basename "$b")" "$BUILD/$b"; done
for b in "$OUTDIR"/bin/*; do ldd "$b" | awk '/=> \// {print $3}'; done | sort -u |
  while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux*) ;;
      *) cp -L "$lib" "$OUTDIR/lib/" && strip --strip-unneeded "$OUTDIR/lib/$(basename "$lib")" ;;
    esac
  done
if [ "$MODE" = serve ]; then
  ucx_dir="$(dirname "$(ldd "$OUTDIR/bin/epd-decode" | awk '/libucs.so/ {print $3}')")/ucx"
  mkdir -p "$OUTDIR/lib/ucx"
  for m in "$ucx_dir"/libuct_cma.so.0 "$ucx_dir"/libucm_cuda.so.0 "$ucx_dir"/libuct_cuda.so.0; do
    [ -e "$m" ] && cp -L "$m" "$OUTDIR/lib/ucx/"
  done
fi
du -sh "$OUTDIR"
mkdir -p .gpu-pack
tar -cf - "$OUTDIR" | xz -T2 -9 >"$ARCHIVE"
ls -la "$ARCHIVE"
echo "carry .gpu-pack; on the GPU machine: tar -xJf $ARCHIVE, then" \
  "$([ "$MODE" = serve ] && echo "bash tests/gpu/serve_check.sh $OUTDIR/bin" ||
     echo "bash tests/gpu/device_check.sh")"
