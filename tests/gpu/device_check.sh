#!/usr/bin/env bash
# The one prepared GPU run (docs/cuda.md): configure + build the CUDA targets (Release, sm_90
# only, -j16), run `ctest -L gpu`, run the GPU benchmarks, print one summary table. Sized to
# finish in under 8 minutes on one H200 (each step has its own time limit; the script goes on to
# the next step and reports a step that ran out of time as TIMEOUT).
#
# When the configure fails (the GPU image lacks this project's C++ dependencies) and a folder of
# binaries packed here by tests/gpu/pack_prebuilt.sh is present (EPD_GPU_PREBUILT, default
# .gpu-prebuilt), the script runs those binaries instead of building.
#
# Usage: bash tests/gpu/device_check.sh [--quick]
#   EPD_GPU_BUILD_DIR (default build-gpu), EPD_GPU_JOBS (default 16), EPD_CUDA_ARCHS (default 90),
#   EPD_GPU_FORCE_PREBUILT=1 (skip the build, run the packed binaries), EPD_GPU_RELEASE_EXPERTS
#   (routed experts of cuda_model_bench's release layer, default 64; 0 skips it: it took about 3
#   minutes with the one-thread generator, which now runs on every core; 384 is the released count).
#   Output files go to $OUT when it is set (the device tool's folder), else to the build folder.
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$(pwd)"
BUILD="${EPD_GPU_BUILD_DIR:-build-gpu}"
JOBS="${EPD_GPU_JOBS:-16}"
ARCHS="${EPD_CUDA_ARCHS:-90}"
PREBUILT="${EPD_GPU_PREBUILT:-.gpu-prebuilt}"
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK="--quick"
LOGS="${OUT:-$BUILD/device_check}"
mkdir -p "$LOGS"
start=$(date +%s)
declare -a ROWS=()
status=0
row() { ROWS+=("$(printf '%-28s %-8s %6ss  %s' "$1" "$2" "$3" "$4")"); }

step() {  # step <name> <limit_s> <log> <command...>
  local name="$1" limit="$2" log="$3"
  shift 3
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then
    row "$name" PASS "$dt" "$(basename "$log")"
  elif [ $rc -eq 124 ]; then
    row "$name" TIMEOUT "$dt" "limit ${limit}s; $(basename "$log")"
    status=1
  else
    row "$name" FAIL "$dt" "exit $rc; $(basename "$log")"
    status=1
  fi
  return $rc
}

echo "== device =="
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
else
  echo "no nvidia-smi on this machine"
fi | tee "$LOGS/device.txt"

echo "== configure + build (Release, sm_$ARCHS, -j$JOBS) =="
BIN=""  # folder of cuda_bench; the tests are in $BIN/tests (build) or $BIN (prebuilt)
TESTS=""
TARGETS="backend_parity_cuda_test backend_parity_test cuda_kernels_test device_test codec_test
         cuda_weights_test cuda_model_test cuda_bench cuda_model_bench"
if [ "${EPD_GPU_FORCE_PREBUILT:-0}" != 1 ] && step configure 120 "$LOGS/configure.log" \
     cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DEPD_CUDA_ARCHS="$ARCHS" \
           -DCMAKE_CUDA_ARCHITECTURES="$ARCHS"; then
  # shellcheck disable=SC2086
  step build 300 "$LOGS/build.log" cmake --build "$BUILD" -j "$JOBS" --target $TARGETS
  if grep -q "kvstore_device_arena_test" "$BUILD/Makefile" 2>/dev/null; then
    step build_arena_test 120 "$LOGS/build_arena.log" \
      cmake --build "$BUILD" -j "$JOBS" --target kvstore_device_arena_test
  fi
  tail -3 "$LOGS/build.log" 2>/dev/null
  BIN="$BUILD"
  TESTS="$BUILD/tests"
elif [ -x "$PREBUILT/bin/backend_parity_cuda_test" ]; then
  echo "no build here: running the binaries packed in $PREBUILT"
  row prebuilt PASS 0 "$PREBUILT (tests/gpu/pack_prebuilt.sh)"
  export LD_LIBRARY_PATH="$ROOT/$PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export EPD_SOURCE_DIR="$ROOT"
  BIN="$PREBUILT/bin"
  TESTS="$PREBUILT/bin"
fi

echo "== GPU tests =="
if [ -n "$TESTS" ] && [ -x "$TESTS/backend_parity_cuda_test" ]; then
  if [ "$BIN" = "$BUILD" ]; then
    step ctest_gpu 180 "$LOGS/ctest_gpu.log" \
      bash -c "cd '$BUILD' && ctest -L gpu --output-on-failure -j 4 --timeout 150"
    step ctest_unit_parity 60 "$LOGS/ctest_unit.log" \
      bash -c "cd '$BUILD' && ctest -R 'BackendParity|CodecTest|DeviceTest' -L unit -j 8 --timeout 50"
  else
    # The binaries run side by side (one GPU, 16 cores): device minutes are the scarce thing.
    # Each writes its exit status to <log>.rc; the rows are collected once all have finished.
    PAR_TESTS="cuda_kernels_test cuda_weights_test cuda_model_test codec_test device_test"
    t0=$(date +%s)
    for t in $PAR_TESTS; do
      ( timeout 150 "$TESTS/$t" >"$LOGS/$t.log" 2>&1; echo $? >"$LOGS/$t.rc" ) &
    done
    timeout 150 "$TESTS/backend_parity_cuda_test" >"$LOGS/parity_cuda.txt" 2>&1
    wait
    dt=$(( $(date +%s) - t0 ))
    for t in $PAR_TESTS; do
      rc=$(cat "$LOGS/$t.rc" 2>/dev/null || echo 1)
      if [ "$rc" = 0 ]; then row "$t" PASS "$dt" "$t.log"
      elif [ "$rc" = 124 ]; then row "$t" TIMEOUT "$dt" "limit 150s; $t.log"; status=1
      else row "$t" FAIL "$dt" "exit $rc; $t.log"; status=1
      fi
    done
  fi
  # Per-op parity lines for the table (the prebuilt branch ran it alongside the other tests).
  [ "$BIN" = "$BUILD" ] && timeout 150 "$TESTS/backend_parity_cuda_test" >"$LOGS/parity_cuda.txt" 2>&1
  passed=$(grep '^\[       OK \] CudaVsCpuReference' "$LOGS/parity_cuda.txt" | sort -u | wc -l)
  failed=$(grep '^\[  FAILED  \] CudaVsCpuReference' "$LOGS/parity_cuda.txt" | sort -u |
           sed 's/.*MatchesTheCpuReference\///; s/ (.*//' | sort -u | tr '\n' ' ')
  skipped=$(grep '^\[  SKIPPED \] CudaVsCpuReference' "$LOGS/parity_cuda.txt" |
            sed 's/ (.*//' | sort -u | wc -l)
  ok=FAIL
  [ -z "$failed" ] && [ "$passed" -gt 0 ] && ok=PASS
  row "parity ops (CUDA vs CPU)" "$ok" "-" "passed $passed, skipped $skipped, failed: ${failed:-none}"
  [ "$ok" = PASS ] || status=1
else
  row gpu_tests FAIL 0 "no test binaries (build failed, no $PREBUILT)"
  status=1
fi

echo "== GPU benchmarks =="
if [ -n "$BIN" ] && [ -x "$BIN/cuda_bench" ]; then
  # shellcheck disable=SC2086
  step cuda_bench 240 "$LOGS/cuda_bench.txt" "$BIN/cuda_bench" $QUICK
  # shellcheck disable=SC2086
  [ -x "$BIN/cuda_model_bench" ] &&
    # The release layer with 64 of its 384 routed experts: generating all of them (13.6 G random
    # values, one thread) would take minutes of the loan.
    step cuda_model_bench 330 "$LOGS/cuda_model_bench.txt" "$BIN/cuda_model_bench" $QUICK \
      --release-experts "${EPD_GPU_RELEASE_EXPERTS:-64}"
  cat "$LOGS/cuda_bench.txt" "$LOGS/cuda_model_bench.txt" 2>/dev/null | grep '^BENCH' \
    >"$LOGS/bench_lines.txt" || true
  grep '^PROFILE' "$LOGS/cuda_model_bench.txt" >"$LOGS/profile_lines.txt" 2>/dev/null || true
else
  row cuda_bench FAIL 0 "not built"
  status=1
fi

echo
echo "================ device_check summary: $(head -1 "$LOGS/device.txt") ================"
printf '%-28s %-8s %7s  %s\n' step result time detail
for r in "${ROWS[@]}"; do echo "$r"; done
echo "---- benchmarks (ratio = fraction of the physical limit) ----"
sed 's/^BENCH //' "$LOGS/bench_lines.txt" 2>/dev/null || echo "(none)"
echo "---- where an op-by-op decode step's device time goes (cuda_model_bench PROFILE) ----"
sed 's/^PROFILE //' "$LOGS/profile_lines.txt" 2>/dev/null || echo "(none)"
echo "total $(( $(date +%s) - start )) s; logs in $LOGS"
exit $status
