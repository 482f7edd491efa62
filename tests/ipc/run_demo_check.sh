#!/usr/bin/env bash
# Runs the load generator against two kvtd ranks (separate processes) in verify mode and
# fails unless every byte checks out and both daemons exit 0 on SIGTERM. A third argument
# `cuda` puts the engine's tensors in device memory and runs the daemons' CUDA backend (a GPU,
# or the CUDA stand-in build): the daemons then open the loadgen's IPC handles.
#
# The daemons are started directly (not under `timeout`), so the pids recorded are theirs and
# the cleanup kills them, not a wrapper that would leave them orphaned. A watchdog bounds the
# whole check: it terminates this script, whose EXIT trap then kills every child.
set -euo pipefail
kvtd=$1 loadgen=$2 tensors=${3:-host}
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
for r in 0 1; do
  "$kvtd" --rank $r "${geo[@]}" "${backend[@]}" --session "$suffix" --log-dir "$dir" --attach-timeout 60 >"$dir/out$r" 2>&1 &
  pids+=($!)
done
"$loadgen" --session "$suffix" --ranks 2 --layers 4 --device-blocks 64 --host-blocks 48 \
  --iterations 30 --blocks-per-task 12 --device-tensors "$tensors"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
grep -q "serving" "$dir/kvtd_dp0_rank0.log"
grep -q "serving" "$dir/kvtd_dp0_rank1.log"
echo "demo check passed"
