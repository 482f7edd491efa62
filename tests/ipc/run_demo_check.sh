#!/usr/bin/env bash
# Runs the load generator against two kvtd ranks (separate processes) in verify mode and
# fails unless every byte checks out and both daemons exit 0 on SIGTERM. A third argument
# `cuda` puts the engine's tensors in device memory and runs the daemons' CUDA backend (a GPU,
# or the CUDA stand-in build): the daemons then open the loadgen's IPC handles. A fourth argument
# `groups` describes the cache as three cache groups (state, sliding window, full attention, each
# its own tensors and block counts) instead of one shape: every task moves blocks of each. A
# fifth argument `storage` gives the daemons a file store and adds kvtd-loadgen's storage-verify
# (with groups: a block per key and group, each load checked against its group's rule); `redis`
# does the same through a redis-server of its own on loopback (skipped, 77, without one).
#
# The daemons are started directly (not under `timeout`), so the pids recorded are theirs and
# the cleanup kills them, not a wrapper that would leave them orphaned. A watchdog bounds the
# whole check: it terminates this script, whose EXIT trap then kills every child.
set -euo pipefail
kvtd=$1 loadgen=$2 tensors=${3:-host} cache=${4:-shape} storage=${5:-}
backend=(--device-backend host)
[ "$tensors" = cuda ] && backend=(--device-backend cuda --scatter-mode kernel)
suffix="ctest$$"
dir=$(mktemp -d)
pids=()
watchdog=""
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [ -n "$watchdog" ]; then
    pkill -P "$watchdog" 2>/dev/null || true
    kill "$watchdog" 2>/dev/null || true
  fi
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'echo "demo check: watchdog expired" >&2; exit 1' TERM
( sleep 240; kill -TERM $$ ) >/dev/null 2>&1 &  # no open pipe: ctest must not wait for it
watchdog=$!
geo=(--mp-num 2 --num-layers 4 --num-host-blocks 48 --key-cache-shape 64,8,64,128 --value-cache-shape 64,8,64,128)
shape=(--layers 4 --device-blocks 64 --host-blocks 48)
if [ "$cache" = groups ]; then
  geo=(--mp-num 2
       --cache-group "kind=state,layers=0-3:3,tensors=512x3@2+4x64x64@4,device_blocks=6,host_blocks=9"
       --cache-group "kind=sliding_window,layers=1-4:3,tensors=4x16x64@2+4x16x64@2,device_blocks=48,host_blocks=40,block_tokens=16,window=64"
       --cache-group "kind=full_attention,layers=2-5:3,tensors=4x16x64@2+4x16x64@2,device_blocks=64,host_blocks=48,block_tokens=16")
  shape=("${geo[@]:2}")
fi
store=()
[ "$storage" = storage ] && store=(--storage-backend file --storage-path "$dir/store" --model-id ctest)
if [ "$storage" = redis ]; then
  command -v redis-server > /dev/null || { echo "no redis-server: skipped"; exit 77; }
  port=$((23000 + ($$ % 97) * 7))
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no --dir "$dir" \
    --logfile "$dir/redis.log" &
  pids+=($!)
  for _ in $(seq 100); do redis-cli -p "$port" ping > /dev/null 2>&1 && break; sleep 0.05; done
  store=(--storage-backend redis --redis-endpoints "127.0.0.1:$port" --model-id ctest)
fi
for r in 0 1; do
  "$kvtd" --rank $r "${geo[@]}" "${backend[@]}" "${store[@]}" --session "$suffix" --log-dir "$dir" --attach-timeout 60 \
    >"$dir/out$r" 2>&1 &
  pids+=($!)
done
"$loadgen" --session "$suffix" --ranks 2 "${shape[@]}" --iterations 30 --blocks-per-task 12 --device-tensors "$tensors"
# The daemons serve the session's next engine once this one has gone (same suffix).
[ "$storage" = storage ] && "$loadgen" --session "$suffix" --ranks 2 "${shape[@]}" --mode storage-verify \
  --device-tensors "$tensors" --storage-blocks 8
[ "$storage" = redis ] && "$loadgen" --session "$suffix" --ranks 2 "${shape[@]}" --mode storage-verify \
  --device-tensors "$tensors" --storage-blocks 8 --storage redis
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
grep -q "serving" "$dir/kvtd_dp0_rank0.log"
grep -q "serving" "$dir/kvtd_dp0_rank1.log"
echo "demo check passed"
