#!/usr/bin/env bash
# A cluster across "hosts" on one machine: the recipe for running epd on several hosts, played with
# Linux network namespaces (docs/multihost.md). Each host is a namespace with its own address on a
# bridge; nothing is shared but the bridge, as between machines on one L2 network:
#
#   host       address   runs
#   router     .1        epd-router  (HTTP 8000, gRPC 50051, metrics 9090)
#   kv0, kv1   .2, .3    epd-kvstore (gRPC 7070, metrics 9090): keys placed on a hash ring
#   encoder    .4        epd-encoder \
#   prefill    .5        epd-prefill  > --host 0.0.0.0 --advertise-address <own address>,
#   decode     .6        epd-decode  /  metrics 9090, UCX over TCP on eth0 (no shared memory);
#                                       kvstore values of >= 4 KiB over UCX too (--kvstore-bulk ucx)
#   (this shell: .254 on the bridge, so it reaches every host)
#
# On real hosts the same flags apply: every worker gets --advertise-address (an address the router
# and the other workers can reach), --router <router>:50051 and the same --kvstore list as the
# router; every process gets the same EPD_CLUSTER_TOKEN.
#
# Usage (root; iproute2):
#   deploy/netns_cluster.sh up   <name> <state-dir> [<subnet prefix, e.g. 10.231.7>]
#   deploy/netns_cluster.sh down <name> <state-dir>           # stops everything, removes the netns
#   deploy/netns_cluster.sh stop-host <name> <state-dir> <host>   # SIGKILL + remove that host
# <name> prefixes every namespace and link (at most 8 characters, e.g. so-1a2b3); binaries come
# from $EPD_BIN (default ./build), the model from $EPD_MODEL (default: generated nano model).
# `up` writes <state-dir>/cluster.env (addresses, ports) and one log per host; on any failure it
# tears down what it made.
set -euo pipefail

cmd="${1:?usage: $0 up|down|stop-host <name> <state-dir> ...}"
name="${2:?name}"
state="${3:?state dir}"
HOSTS=(router kv0 kv1 encoder prefill decode)
declare -A OCTET=([router]=1 [kv0]=2 [kv1]=3 [encoder]=4 [prefill]=5 [decode]=6)

if [ "${#name}" -gt 8 ]; then
  echo "netns_cluster: name '$name' is longer than 8 characters (link names are limited)" >&2
  exit 2
fi
ns() { echo "${name}-$1"; }
link() { echo "${name//-/}${OCTET[$1]}"; }  # root-side end of the host's veth pair
bridge="${name//-/}br"

stop_host() {  # SIGTERM, then SIGKILL after 10 s, the process we started on that host
  local h="$1" sig="${2:-TERM}" pidf="$state/$1.pid"
  if [ -f "$pidf" ]; then
    local pid
    pid="$(cat "$pidf")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "-$sig" "$pid" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidf"
  fi
  ip netns del "$(ns "$h")" 2>/dev/null || true
  ip link del "$(link "$h")" 2>/dev/null || true
}

down() {
  # Workers first (they drain), the store last.
  for h in decode prefill encoder router kv1 kv0; do stop_host "$h"; done
  ip link del "$bridge" 2>/dev/null || true
}

wait_port_file() {  # <file> <key>: waits up to 60 s for "key": N in the JSON port file
  local f="$1" key="$2"
  for _ in $(seq 600); do
    if [ -f "$f" ] && grep -q "\"$key\"" "$f"; then return 0; fi
    sleep 0.1
  done
  echo "netns_cluster: $f never published '$key'" >&2
  return 1
}

start() {  # <host> <binary> <args...>: runs it inside the host's namespace, in the background
  local h="$1" bin="$2"
  shift 2
  # UCX: TCP on the host's only interface, as between machines (no shared memory, no loopback).
  ip netns exec "$(ns "$h")" env UCX_TLS=tcp UCX_NET_DEVICES=eth0 \
    "$bin" --port-file "$state/$h.ports.json" --log-level "${EPD_LOG_LEVEL:-info}" "$@" \
    >"$state/$h.log" 2>&1 </dev/null &
  echo $! >"$state/$h.pid"
}

case "$cmd" in
  down)
    down
    exit 0
    ;;
  stop-host)
    stop_host "${4:?host}" KILL
    exit 0
    ;;
  up) ;;
  *)
    echo "netns_cluster: unknown command '$cmd'" >&2
    exit 2
    ;;
esac

subnet="${4:-10.$((200 + RANDOM % 50)).$((RANDOM % 250))}"
bin="$(cd "${EPD_BIN:-build}" && pwd)"
mkdir -p "$state"
trap 'echo "netns_cluster: setup failed; tearing down" >&2; down' ERR

# 1. The "network": a bridge, with this shell at .254 on it.
ip link add "$bridge" type bridge
ip addr add "$subnet.254/24" dev "$bridge"
ip link set "$bridge" up
# 2. The "hosts": one namespace each, eth0 on the bridge.
for h in "${HOSTS[@]}"; do
  ip netns add "$(ns "$h")"
  ip link add "$(link "$h")" type veth peer name "$(link "$h")p"
  ip link set "$(link "$h")p" netns "$(ns "$h")"
  ip -n "$(ns "$h")" link set "$(link "$h")p" name eth0
  ip -n "$(ns "$h")" addr add "$subnet.${OCTET[$h]}/24" dev eth0
  ip -n "$(ns "$h")" link set eth0 up
  ip -n "$(ns "$h")" link set lo up
  ip link set "$(link "$h")" master "$bridge"
  ip link set "$(link "$h")" up
done

# 3. The model: every host reads the same directory (on real hosts: a copy on each, or a share).
model="${EPD_MODEL:-$state/model}"
if [ ! -f "$model/config.json" ]; then
  "$bin/epd" gen-model --preset nano --out "$model" >"$state/gen-model.log" 2>&1
fi
export EPD_CLUSTER_TOKEN="${EPD_CLUSTER_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
addr() { echo "$subnet.${OCTET[$1]}"; }
kvstores="$(addr kv0):7070,$(addr kv1):7070"

# 4. The processes, each on its own host.
for h in kv0 kv1; do
  # --ucx-listener: the bulk endpoint is a UCX TCP listener on the host's address (remote clients).
  start "$h" "$bin/epd-kvstore" --host "$(addr "$h")" --grpc-port 7070 --metrics-port 9090 \
    --data-dir "$state/$h-data" --g1-capacity-bytes 0 --bulk ucx --ucx-listener
done
for h in kv0 kv1; do wait_port_file "$state/$h.ports.json" grpc; done
start router "$bin/epd-router" --host "$(addr router)" --http-port 8000 --grpc-port 50051 \
  --metrics-port 9090 --model "$model" --kvstore "$kvstores" --heartbeat-interval-ms 200 \
  --heartbeat-miss-limit 10 ${EPD_ROUTER_ARGS:-}
wait_port_file "$state/router.ports.json" grpc
for h in encoder prefill decode; do
  start "$h" "$bin/epd-$h" --host 0.0.0.0 --advertise-address "$(addr "$h")" --metrics-port 9090 \
    --router "$(addr router):50051" --kvstore "$kvstores" --model "$model" --worker-id "$h-0" \
    --kvstore-bulk "${EPD_KVSTORE_BULK:-ucx}" --kvstore-bulk-min-bytes "${EPD_KVSTORE_BULK_MIN_BYTES:-4096}"
done
for h in encoder prefill decode; do wait_port_file "$state/$h.ports.json" registered; done
trap - ERR

cat >"$state/cluster.env" <<EOF
EPD_SUBNET=$subnet
EPD_ROUTER_HTTP=http://$(addr router):8000
EPD_ROUTER_GRPC=$(addr router):50051
EPD_KVSTORES=$kvstores
EPD_ROUTER_ADDR=$(addr router)
EPD_KV0_ADDR=$(addr kv0)
EPD_KV1_ADDR=$(addr kv1)
EPD_ENCODER_ADDR=$(addr encoder)
EPD_PREFILL_ADDR=$(addr prefill)
EPD_DECODE_ADDR=$(addr decode)
EPD_METRICS_PORT=9090
EOF
echo "netns_cluster: up: OpenAI API at http://$(addr router):8000/v1 (state in $state)"
