#!/usr/bin/env bash
# Runs the load generator against two kvtd ranks (separate processes) in verify mode and
# fails unless every byte checks out and both daemons exit 0 on SIGTERM.
set -euo pipefail
kvtd=$1 loadgen=$2
suffix="ctest$$"
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
geo=(--mp-num 2 --num-layers 4 --num-host-blocks 48 --key-cache-shape 64,8,64,128 --value-cache-shape 64,8,64,128)
for r in 0 1; do
  timeout 240 "$kvtd" --rank $r "${geo[@]}" --session "$suffix" --log-dir "$dir" >"$dir/out$r" 2>&1 &
  pids+=($!)
done
timeout 240 "$loadgen" --session "$suffix" --ranks 2 --layers 4 --device-blocks 64 --host-blocks 48 \
  --iterations 30 --blocks-per-task 12
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
grep -q "serving" "$dir/kvtd_rank0.log"
grep -q "serving" "$dir/kvtd_rank1.log"
echo "demo check passed"
