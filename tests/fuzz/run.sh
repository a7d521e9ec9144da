#!/usr/bin/env bash
# Builds the libFuzzer targets with clang into build-fuzz/ and runs each one for a bounded time
# over its corpus (tests/fuzz/corpus/<target>, every regression input included). New inputs the
# fuzzer finds go to build-fuzz/corpus/<target>, never into the repo; a crash stops the run with
# the reproducer written to build-fuzz/crashes/. See docs/fuzzing.md.
#
#   bash tests/fuzz/run.sh                 # CI: 5 s per target
#   bash tests/fuzz/run.sh 600 fuzz_dsml   # a longer run of one target
#   bash tests/fuzz/run.sh 0               # only replay the corpus (no new inputs)
#
# The seed is fixed (EPD_FUZZ_SEED, default 1) so CI's short run explores the same inputs on
# every commit and fails only on a change, never on a lucky draw; long hunts pass another seed.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_PER_TARGET="${1:-5}"
shift || true
BUILD_DIR="${EPD_FUZZ_BUILD_DIR:-build-fuzz}"
JOBS="${EPD_JOBS:-$(nproc)}"
CC="${EPD_FUZZ_CC:-clang}" CXX="${EPD_FUZZ_CXX:-clang++}" \
  cmake -S tests/fuzz -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
  targets=(fuzz_openai_request fuzz_chat_messages fuzz_dsml fuzz_handoff_manifest
           fuzz_kvstore_value fuzz_safetensors fuzz_tokenizer fuzz_grammar)
fi
mkdir -p "$BUILD_DIR/crashes"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
for t in "${targets[@]}"; do
  seeds="tests/fuzz/corpus/$t"
  work="$BUILD_DIR/corpus/$t"
  mkdir -p "$work"
  echo "== $t: ${SECONDS_PER_TARGET} s over $(ls "$seeds" | wc -l) corpus inputs =="
  if [ "$SECONDS_PER_TARGET" = 0 ]; then
    "$BUILD_DIR/$t" -runs=0 "$seeds"  # replay: every input once
  else
    log="$BUILD_DIR/$t.log"
    if ! "$BUILD_DIR/$t" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
        -max_len=65536 -seed="${EPD_FUZZ_SEED:-1}" -print_final_stats=1 -artifact_prefix="$BUILD_DIR/crashes/$t-" \
        "$work" "$seeds" >"$log" 2>&1; then
      tail -n 80 "$log"
      echo "fuzz: $t failed; reproducer under $BUILD_DIR/crashes/ (log $log)"
      exit 1
    fi
    grep -E "^stat::number_of_executed_units|^Done" "$log" || true
  fi
done
echo "== fuzz: ${#targets[@]} target(s) clean =="
