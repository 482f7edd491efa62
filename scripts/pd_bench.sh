#!/usr/bin/env bash
# Prefill -> decode KV transfer bench: two "machines" on this one (network namespaces joined by a
# veth pair, UCX over TCP between them), kvtd's transport (tools/pd_bench, every block checksummed
# at the source and verified at the destination) and ucx_perftest (ucp_am_bw: UCX active messages,
# no checksums, no grants) on the same link and message size, in the same run.
#
#   sudo scripts/pd_bench.sh [BUILD_DIR] [--bytes N] [--blocks-kib "16 256 2048"] [--rounds R]
#
# Prints FIGURE lines: per block size kvtd's GB/s, ucx_perftest's and `<ratio>x ucx_perftest`;
# CPU seconds per GB on each side; the per-layer push latency (p50/p99) of a 32-layer model's
# blocks sent layer after layer. Needs root (ip netns) and ucx-utils (scripts/setup.sh installs it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
bytes=$((1 << 30))
blocks_kib="16 256 2048"
rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --bytes) bytes=$2; shift 2 ;;
    --blocks-kib) blocks_kib=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set /p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "pd_bench: unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
bench=$build/tools/pd_bench/kvtd-pd-bench
[ -x "$bench" ] || { echo "pd_bench: no $bench (build first)" >&2; exit 2; }
command -v ucx_perftest >/dev/null || { echo "pd_bench: no ucx_perftest (apt-get install ucx-utils)" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "pd_bench: needs root for network namespaces" >&2; exit 2; }

tag=$$
a=kvtdpd_a$tag b=kvtdpd_b$tag
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$a"
ip netns add "$b"
ip link add "va$tag" type veth peer name "vb$tag"
ip link set "va$tag" netns "$a"
ip link set "vb$tag" netns "$b"
ip -n "$a" addr add 10.77.0.1/24 dev "va$tag"
ip -n "$b" addr add 10.77.0.2/24 dev "vb$tag"
for n in "$a" "$b"; do ip -n "$n" link set lo up; done
ip -n "$a" link set "va$tag" up
ip -n "$b" link set "vb$tag" up
in_a=(ip netns exec "$a" env UCX_TLS=tcp UCX_NET_DEVICES="va$tag")
in_b=(ip netns exec "$b" env UCX_TLS=tcp UCX_NET_DEVICES="vb$tag")
port=19000

# ucx_perftest's overall bandwidth in GB/s (it prints MB/s of 2^20 bytes).
perftest() {
  local size=$1 iters=$2
  port=$((port + 1))
  "${in_b[@]}" timeout 300 ucx_perftest -p "$port" >/dev/null 2>&1 &
  pids+=($!)
  sleep 0.5
  "${in_a[@]}" timeout 300 ucx_perftest 10.77.0.2 -p "$port" -t ucp_am_bw -s "$size" -n "$iters" -w 16 2>/dev/null |
    awk '/^Final:/ {printf "%.3f", $7 * 1048576 / 1e9}'
}

# kvtd-pd-bench between the namespaces; its FIGURE lines.
kvtd_run() {
  local kib=$1 total=$2 layers=$3 r=$4
  port=$((port + 1))
  "${in_b[@]}" timeout 600 "$bench" decode --port "$port" --bytes "$total" --block-kib "$kib" --rounds "$r" \
    --layers "$layers" 2>/dev/null &
  pids+=($!)
  "${in_a[@]}" timeout 600 "$bench" prefill --connect "10.77.0.2:$port" --layers "$layers" \
    --layer-interval-us "${5:-0}" 2>/dev/null
}

echo "== prefill -> decode over UCX (TCP over a veth pair between two network namespaces), $((bytes >> 20)) MiB a round"
for kib in $blocks_kib; do
  iters=$((bytes / (kib * 1024)))
  peer=$(perftest $((kib * 1024)) $((iters * rounds)))
  out=$(kvtd_run "$kib" "$bytes" 0 "$rounds")
  echo "$out" | grep '^FIGURE pd cpu' | sed "s/^FIGURE pd cpu:/FIGURE pd cpu ($kib KiB blocks):/"
  gbps=$(echo "$out" | awk '/^FIGURE pd transfer:/ {print $4}')
  ratio=$(awk -v k="$gbps" -v p="$peer" 'BEGIN {printf "%.2f", (p > 0 ? k / p : 0)}')
  echo "FIGURE pd $kib KiB blocks: kvtd $gbps GB/s (checksummed, granted), ucx_perftest ucp_am_bw $peer GB/s = ${ratio}x ucx_perftest"
done
# A 32-layer model's blocks pushed as the model computes them: a layer (8 blocks of 256 KiB) every
# 10 ms, each timed from its first send to its last block verified.
kvtd_run 256 $((32 * 8 * 256 * 1024)) 32 10 10000 | grep '^FIGURE pd per-layer'
