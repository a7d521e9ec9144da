#!/usr/bin/env bash
# epd end to end on a GPU (issue 12): the processes a user runs, with --device cuda, against the
# same commands with --device cpu.
# - `epd generate` on each golden set's prompt (tests/data/golden/*, the official checkpoints):
#   the greedy ids of --device cuda equal those of --device cpu (the whole output line).
# - `epd serve` (encoder, prefill and decode workers, kvstore, router) on the golden set v41-tiny-a
#   and on the demo model: a greedy /v1/completions request (DSpark on) gives --device cpu's
#   answer, token for token (the completion's logprobs name each token's bytes).
# Prints one PASS/FAIL line per check; exit status 0 when all passed.
#
# Usage: bash tests/gpu/serve_check.sh [bin_dir]   (epd and its workers; default build)
#   Outputs go to $EPD_SERVE_CHECK_DIR (default /tmp/epd-serve-check).
#   EPD_SERVE_CHECK_EMULATED=1: the --device cuda runs use the binaries built against the emulated
#   CUDA runtime (epd-emulated, epd-<pool>-emulated: tests/gpu/CMakeLists.txt), so this script
#   runs without a GPU; CI does so (ctest serve_check_emulated), keeping it working for the GPU
#   runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$(pwd)"
BIN="$(cd "${1:-build}" && pwd)"
# Binaries packed by tests/gpu/pack_prebuilt.sh serve: their libraries and UCX's modules beside.
if [ -d "$BIN/../lib" ] && [ ! -e "$BIN/../CMakeCache.txt" ]; then
  export LD_LIBRARY_PATH="$BIN/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export UCX_MODULE_DIR="$BIN/../lib/ucx"
fi
export EPD_SOURCE_DIR="$ROOT"
WORK="${EPD_SERVE_CHECK_DIR:-/tmp/epd-serve-check}"
EPD_CUDA="$BIN/epd"
SERVE_CUDA_ARGS=()
if [ "${EPD_SERVE_CHECK_EMULATED:-0}" = 1 ]; then
  EPD_CUDA="$BIN/epd-emulated"
  SERVE_CUDA_ARGS=(--worker-binary
    encoder=epd-encoder-emulated,prefill=epd-prefill-emulated,decode=epd-decode-emulated)
fi
epd_for() { if [ "$1" = cuda ]; then echo "$EPD_CUDA"; else echo "$BIN/epd"; fi; }
rm -rf "$WORK"
mkdir -p "$WORK"
status=0
result() {  # result <name> <PASS|FAIL> <detail>
  printf '%-34s %-5s %s\n' "$1" "$2" "$3"
  [ "$2" = PASS ] || status=1
}

# 1. epd generate, every golden set.
for set_dir in "$ROOT"/tests/data/golden/*/; do
  set=$(basename "$set_dir")
  for dev in cpu cuda; do
    timeout 300 "$(epd_for "$dev")" generate --device "$dev" --model "$set_dir" \
      --prompt-ids "$set_dir/prompt.json" --max-tokens 24 --ignore-eos \
      >"$WORK/generate-$set-$dev.json" 2>"$WORK/generate-$set-$dev.log"
    echo $? >"$WORK/generate-$set-$dev.rc"
  done
  if [ "$(cat "$WORK/generate-$set-cuda.rc")" != 0 ]; then
    result "generate $set" FAIL "cuda: exit $(cat "$WORK/generate-$set-cuda.rc"): $(tail -1 "$WORK/generate-$set-cuda.log")"
  elif cmp -s "$WORK/generate-$set-cpu.json" "$WORK/generate-$set-cuda.json"; then
    result "generate $set" PASS "cuda == cpu: $(head -c 160 "$WORK/generate-$set-cuda.json")"
  else
    result "generate $set" FAIL "cpu $(head -c 120 "$WORK/generate-$set-cpu.json") / cuda $(head -c 120 "$WORK/generate-$set-cuda.json")"
  fi
done

# 2. epd serve: start, wait for ready, one greedy completion, stop.
serve_once() {  # serve_once <name> <device> <model_dir> <request_json>
  local name="$1" dev="$2" model="$3" req="$4" port
  local data="$WORK/serve-$name-$dev" extra=()
  [ "$dev" = cuda ] && extra=("${SERVE_CUDA_ARGS[@]}")
  # Free ports, picked by the router (the ready message names them).
  "$(epd_for "$dev")" serve --device "$dev" --model "$model" --data-dir "$data" --http-port 0 \
    --grpc-port 0 --kv-pool-bytes 1073741824 "${extra[@]}" >"$data.out" 2>&1 &
  local pid=$!
  local t=0
  until grep -q "epd serve: ready" "$data.out" 2>/dev/null; do
    sleep 1
    t=$((t + 1))
    if [ $t -ge 180 ] || ! kill -0 $pid 2>/dev/null; then
      echo "not ready after ${t}s" >"$data.answer"
      kill -TERM $pid 2>/dev/null
      wait $pid 2>/dev/null
      return 1
    fi
  done
  port=$(sed -n 's|.*OpenAI API  https\{0,1\}://[^ ]*:\([0-9]*\)/v1.*|\1|p' "$data.out")
  python3 - "$port" "$req" >"$data.answer" 2>&1 <<'EOF'
import json, sys, urllib.error, urllib.request
port, req = sys.argv[1], sys.argv[2]
r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=req.encode(),
                           headers={"content-type": "application/json"})
try:
    body = json.load(urllib.request.urlopen(r, timeout=600))
except urllib.error.HTTPError as e:
    sys.exit(f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
c = body["choices"][0]
print(json.dumps({"text": c["text"], "tokens": c["logprobs"]["tokens"],
                  "token_logprobs": c["logprobs"]["token_logprobs"],
                  "finish_reason": c["finish_reason"], "usage": body["usage"]}))
EOF
  local rc=$?
  kill -TERM $pid 2>/dev/null
  wait $pid 2>/dev/null
  return $rc
}

GOLDEN_A="$ROOT/tests/data/golden/v41-tiny-a"
golden_req=$(python3 -c "
import json; p = json.load(open('$GOLDEN_A/prompt.json'))['prompt_ids']
print(json.dumps({'model': 'epd-nano', 'prompt': p, 'max_tokens': 24, 'temperature': 0, 'logprobs': 1}))")
nano_req='{"model":"epd-nano","prompt":"Tell me about files.","max_tokens":32,"temperature":0,"logprobs":1}'
for c in "golden-a|$GOLDEN_A|$golden_req" "nano|$ROOT/models/epd-nano|$nano_req"; do
  IFS='|' read -r name model req <<<"$c"
  ok=1
  for dev in cpu cuda; do serve_once "$name" "$dev" "$model" "$req" || ok=0; done
  a="$WORK/serve-$name-cpu.answer" b="$WORK/serve-$name-cuda.answer"
  # Each worker of the cuda run says where its model runs (cuda:0 on one GPU; spread over several).
  on_gpu=$(grep -l "the model runs on cuda:[0-9]* (backend cuda)" "$WORK/serve-$name-cuda"/logs/epd-*.log |
           wc -l)
  [ "$on_gpu" = 3 ] || ok=0
  if [ $ok = 1 ] && cmp -s "$a" "$b"; then
    result "serve $name" PASS "cuda == cpu (3 workers on a GPU): $(head -c 160 "$b")"
  else
    result "serve $name" FAIL "workers on a GPU: $on_gpu of 3; cpu: $(head -c 200 "$a") / cuda: $(head -c 200 "$b") (logs: $WORK/serve-$name-*/logs)"
  fi
done
exit $status
