#!/usr/bin/env bash
# Layer-streamed hand-offs over a shaped link (issue 14; docs/transfer.md "Layer-streamed
# hand-offs"): TTFT of a long prompt with the encoder's --handoff-streaming on and off.
#
#   host      address  runs
#   router    .1       epd-router (HTTP 8000)
#   enc       .4       epd-encoder   <- its eth0 egress is shaped: tc tbf --rate (the hand-off's
#                                       direction), so the encoder -> prefill hand-off crosses a
#                                       slow link, as between hosts
#   pd        .5       epd-prefill + epd-decode (their hand-off stays on this host)
#   (this shell: .254 on the bridge)
# UCX over TCP on eth0 only (no shared memory), as between hosts; no kvstore (nothing cached).
#
# Per round (--rounds, default 3): for mode in off, on: start the encoder with
# --handoff-streaming <mode>, one warm-up request, then one request of the --tokens prompt
# (greedy, --max-tokens); stop the encoder. TTFT = request sent -> first SSE chunk with text. The
# off rounds are also run once unshaped (tc removed) to size the hand-off's share of TTFT:
#   handoff share = (TTFT off shaped - TTFT off unshaped) / TTFT off shaped   (goal >= 1/3)
# The texts of every on and off run must be identical. Last line: `streaming ratio: <median TTFT
# on / median TTFT off>` (goal <= 0.8).
#
# Usage (root; iproute2 with tc): tests/bench/stream_bench.sh [--tokens 8000] [--rate 4mbit]
#   [--rounds 3] [--max-tokens 4] [--bin build] [--model models/epd-nano]
# Exits 77 (skipped) without root or network namespaces. Cleans up everything it made.
set -euo pipefail
cd "$(dirname "$0")/../.."

tokens=8000
rate=4mbit
rounds=3
max_tokens=4
bin=build
model=models/epd-nano
while [ $# -gt 0 ]; do
  case "$1" in
    --tokens) tokens="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --max-tokens) max_tokens="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    *) echo "stream_bench: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

if [ "$(id -u)" != 0 ]; then echo "stream_bench: skipped (needs root for ip netns and tc)"; exit 77; fi
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "stream_bench: skipped (needs iproute2: ip, tc)"; exit 77
fi
bin="$(cd "$bin" && pwd)"
model="$(cd "$model" && pwd)"
for b in epd-router epd-encoder epd-prefill epd-decode; do
  [ -x "$bin/$b" ] || { echo "stream_bench: $bin/$b missing (build first)" >&2; exit 2; }
done

name="sb$(printf '%04x' $((RANDOM % 65536)))"  # netns/link prefix, unique per run
subnet="10.$((200 + RANDOM % 50)).$((RANDOM % 250))"
state="$(mktemp -d /tmp/stream_bench.XXXXXX)"
declare -A OCTET=([router]=1 [enc]=4 [pd]=5)
HOSTS=(router enc pd)
ns() { echo "$name-$1"; }
link() { echo "${name}${OCTET[$1]}"; }
bridge="${name}br"
addr() { echo "$subnet.${OCTET[$1]}"; }
export EPD_CLUSTER_TOKEN="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"

stop_pid() {  # <pidfile>: SIGTERM, then SIGKILL after 10 s
  local f="$1"
  [ -f "$f" ] || return 0
  local pid
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}
cleanup() {
  for p in encoder decode prefill router; do stop_pid "$state/$p.pid"; done
  for h in "${HOSTS[@]}"; do
    ip netns del "$(ns "$h")" 2>/dev/null || true
    ip link del "$(link "$h")" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  if [ -z "${EPD_KEEP_STATE:-}" ]; then rm -rf "$state"; fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT

if ! ip netns add "$(ns probe)" 2>/dev/null; then
  echo "stream_bench: skipped (ip netns add not permitted here)"; exit 77
fi
ip netns del "$(ns probe)"

ip link add "$bridge" type bridge
ip addr add "$subnet.254/24" dev "$bridge"
ip link set "$bridge" up
for h in "${HOSTS[@]}"; do
  ip netns add "$(ns "$h")"
  ip link add "$(link "$h")" type veth peer name "$(link "$h")p"
  ip link set "$(link "$h")p" netns "$(ns "$h")"
  ip -n "$(ns "$h")" link set "$(link "$h")p" name eth0
  ip -n "$(ns "$h")" addr add "$(addr "$h")/24" dev eth0
  ip -n "$(ns "$h")" link set eth0 up
  ip -n "$(ns "$h")" link set lo up
  ip link set "$(link "$h")" master "$bridge"
  ip link set "$(link "$h")" up
done

shape() {  # on|off: the encoder host's egress at --rate
  ip netns exec "$(ns enc)" tc qdisc del dev eth0 root 2>/dev/null || true
  if [ "$1" = on ]; then
    ip netns exec "$(ns enc)" tc qdisc add dev eth0 root tbf rate "$rate" burst 64kb latency 2s
  fi
}

wait_key() {  # <port file> <key>: up to 60 s
  for _ in $(seq 600); do
    if [ -f "$1" ] && grep -q "\"$2\"" "$1"; then return 0; fi
    sleep 0.1
  done
  echo "stream_bench: $1 never published '$2'" >&2
  tail -20 "${1%.ports.json}.log" >&2 || true
  return 1
}

start() {  # <host> <name> <binary> <args...>
  local h="$1" p="$2" b="$3"
  shift 3
  rm -f "$state/$p.ports.json"
  ip netns exec "$(ns "$h")" env UCX_TLS=tcp UCX_NET_DEVICES=eth0 \
    "$bin/$b" --port-file "$state/$p.ports.json" --log-level "${EPD_LOG_LEVEL:-warn}" "$@" \
    >"$state/$p.log" 2>&1 </dev/null &
  echo $! >"$state/$p.pid"
}

worker_args() {  # <host> <id>
  echo --host 0.0.0.0 --advertise-address "$(addr "$1")" --metrics-port 0 \
    --router "$(addr router):50051" --model "$model" --worker-id "$2" \
    --handoff-deadline-ms 120000
}

start router router epd-router --host "$(addr router)" --http-port 8000 --grpc-port 50051 \
  --metrics-port 0 --model "$model" --heartbeat-interval-ms 200 --heartbeat-miss-limit 10
wait_key "$state/router.ports.json" grpc
# shellcheck disable=SC2046
start pd prefill epd-prefill $(worker_args pd prefill-0)
# shellcheck disable=SC2046
start pd decode epd-decode $(worker_args pd decode-0)
wait_key "$state/prefill.ports.json" registered
wait_key "$state/decode.ports.json" registered

url="http://$(addr router):8000"
# One completion: prints "<ttft seconds> <text as JSON>".
ask() {  # <tokens> <salt>
  python3 - "$url" "$1" "$2" "$max_tokens" <<'EOF'
import json, sys, time, urllib.request
url, n, salt, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ids = [20 + (i * 7919 + salt * 104729) % 1900 for i in range(n)]
body = json.dumps({"model": "epd-nano", "prompt": ids, "max_tokens": max_tokens,
                   "temperature": 0, "stream": True}).encode()
req = urllib.request.Request(url + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
start = time.monotonic()
ttft, text = None, ""
with urllib.request.urlopen(req, timeout=600) as resp:
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        msg = json.loads(line[5:])
        if "error" in msg:
            sys.exit("stream_bench: request failed: " + json.dumps(msg["error"]))
        for ch in msg.get("choices", []):
            t = ch.get("text") or ""
            if t and ttft is None:
                ttft = time.monotonic() - start
            text += t
if ttft is None:
    sys.exit("stream_bench: no text came back")
print("%.4f %s" % (ttft, json.dumps(text)))
EOF
}

declare -A ttfts=([on]="" [off]="" [off_unshaped]="")
declare -A texts=()
run_mode() {  # <mode> <shaped on|off> <key>
  shape "$2"
  # shellcheck disable=SC2046
  start enc encoder epd-encoder $(worker_args enc encoder-0) --handoff-streaming "$1"
  wait_key "$state/encoder.ports.json" registered
  ask 256 1 >/dev/null  # warm-up: connections, first-call allocations
  local out t x
  out="$(ask "$tokens" 7)"
  t="${out%% *}"
  x="${out#* }"
  ttfts[$3]="${ttfts[$3]} $t"
  texts[$3.$r]="$x"
  echo "round $r: $3: TTFT ${t} s  text ${x}"
  # With EPD_LOG_LEVEL=info: the encoder's pass / hand-off times and the prefill's wait.
  grep -h "hand-off" "$state/encoder.log" | tail -1 || true
  grep -h "hand-off of" "$state/prefill.log" | tail -1 || true
  stop_pid "$state/encoder.pid"
  sleep 1  # the router drops the drained encoder
}

echo "stream_bench: prompt $tokens tokens, link $rate (encoder egress), $rounds rounds"
for r in $(seq "$rounds"); do
  run_mode off on off
  run_mode on on on
done
r=0
run_mode off off off_unshaped

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
on="$(echo "${ttfts[on]}" | median)"
off="$(echo "${ttfts[off]}" | median)"
off_unshaped="$(echo "${ttfts[off_unshaped]}" | median)"
same=yes
for r in $(seq "$rounds"); do
  [ "${texts[on.$r]}" = "${texts[off.$r]}" ] || same=no
  [ "${texts[on.$r]}" = "${texts[off_unshaped.0]}" ] || same=no
done
echo "TTFT median: off $off s, on $on s (off over the unshaped link: $off_unshaped s)"
awk -v s="$off" -v u="$off_unshaped" 'BEGIN {printf "hand-off share of TTFT (off): %.2f (shaped %.3f s - unshaped %.3f s)\n", (s-u)/s, s, u}'
echo "identical output on/off: $same"
[ "$same" = yes ] || { echo "stream_bench: outputs differ" >&2; exit 1; }
awk -v a="$on" -v b="$off" 'BEGIN {printf "streaming ratio: %.3f\n", a/b}'
