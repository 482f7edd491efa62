#!/usr/bin/env bash
# scripts/gpu/pool_start.sh KVTD LOADGEN [GIB] [--small] - a large host pool serving before it is
# all pinned: one CUDA daemon with a GIB (default 32) /dev/shm host pool of 2 MiB blocks (32 layers
# x K/V x 32 KiB), pinned in the background after its first piece; kvtd-loadgen with device tensors
# times one-block round trips from the first task. Prints the daemon's own lines: when it served
# (time to first swap) and when the whole pool was pinned (GB/s). --small: the stand-in in CI (1 GiB).
# The engine stays attached while the pool pins (enough latency samples to outlast it): a session
# that ends takes its pool with it, and on the H100 (2026-11-28) 200 samples ended the session
# within a second, before the background pinning could say it had finished.
set -euo pipefail
kvtd=$1 loadgen=$2 gib=${3:-32}
[ "${4:-${3:-}}" = --small ] && gib=1
host=$((gib * 512)) dev=256 suffix="ps$$" samples=${KVTD_POOL_START_SAMPLES:-$((gib > 1 ? 100000 : 200))}
shape="$dev,8,16,128"
log=$(mktemp /tmp/kvtd_pool_start.XXXXXX.log)
daemon=
stop() { [ -z "$daemon" ] || { kill -TERM "$daemon" 2>/dev/null; wait "$daemon" || echo "daemon exit $?"; }; daemon=; }
trap 'stop; rm -f "$log"' EXIT
"$kvtd" --rank 0 --num-layers 32 --num-host-blocks "$host" --key-cache-shape "$shape" --value-cache-shape "$shape" \
  --session "$suffix" --device-backend cuda --numa-node auto --log-level info >"$log" 2>&1 &
daemon=$!
"$loadgen" --session "$suffix" --ranks 1 --layers 32 --kv-heads 8 --block-size 16 --head-dim 128 \
  --device-blocks "$dev" --host-blocks "$host" --device-tensors cuda --mode latency --latency-samples "$samples" \
  --task-timeout 300 2>/dev/null | grep -E '^latency:' || { cat "$log" >&2; exit 1; }
echo "host pool of $gib GiB (2 MiB blocks):"
grep -E 'host pool|first swap served' "$log" | sed -E 's/^.*\] //; s/^/  /'
stop
grep -q 'host pool pinned' "$log" || { echo "pool start: the pool was not all pinned while the engine was attached"; exit 1; }
echo "pool start: OK"
