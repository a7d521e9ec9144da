#!/usr/bin/env bash
# Installs every Debian 12 package epd needs to build, test and serve. Safe to run twice: it asks
# apt only for what is missing. CUDA/NCCL are used from /usr/local/cuda when present (never installed here).
# clang + libclang-rt-14-dev (Debian 12's clang 14 and its libFuzzer runtime) build tests/fuzz;
# openssl makes the TLS test's certificates.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev librocksdb-dev libucx-dev ucx-utils prometheus-cpp-dev
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev libspdlog-dev libxxhash-dev libicu-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev libboost-context-dev
  prometheus curl iproute2 nodejs npm
  clang libclang-rt-14-dev openssl libssl-dev
)
# --test (deploy/test.sh): also what only the tests need. python3-torch runs the PyTorch port's
# checks against the golden sets (tools/train; ctest train_port_intermediates_test,
# train_tool_torch_test), which skip without it.
if [ "${1:-}" = "--test" ]; then
  PACKAGES+=(python3-torch python3-numpy)
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# node/npm may come from elsewhere than Debian (e.g. a preinstalled Node.js): accept any working one.
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
  filtered=()
  for p in "${missing[@]}"; do
    [ "$p" = nodejs ] || [ "$p" = npm ] || filtered+=("$p")
  done
  missing=("${filtered[@]+"${filtered[@]}"}")
fi

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y --no-install-recommends "${missing[@]}"
