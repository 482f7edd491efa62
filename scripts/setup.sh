#!/usr/bin/env bash
# Installs the Debian packages kvtd needs to build and test, if any are missing.
# Idempotent and non-interactive: with everything present it does nothing (no apt-get at all).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache
  libboost-dev libcli11-dev libspdlog-dev libfmt-dev libzmq3-dev cppzmq-dev libsystemd-dev libnuma-dev
  libxxhash-dev libhiredis-dev liburing-dev libucx-dev ucx-utils iproute2 redis-server redis-tools nlohmann-json3-dev
  python3-numpy python3-pytest python3-torch python3-msgpack python3-zmq python3-yaml python3-prometheus-client prometheus gnuplot-nox lintian fakeroot help2man
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-16 libfuzzer-16-dev libclang-rt-16-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup: installing missing packages: ${missing[*]}"
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo -n)
  else
    echo "setup: not root and no sudo; please install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
