#!/usr/bin/env bash
# The main job, end to end: an engine stand-in (kvtd-loadgen) and two kvtd rank daemons, each a
# separate process like a real deployment, swap KV blocks of a realistic geometry (32 layers,
# 8 KV heads, 64-token blocks, head dim 128, bf16) through shared memory; every byte is
# verified, then swap throughput is measured; then the storage tier (the embedded file store in a
# temporary directory): blocks are written to storage, queried, read back and verified, and a
# second engine process reads what the first one stored. The daemons are stopped with SIGTERM.
# Then a Python engine loop (examples/engine.py) drives two more ranks through the client library.
# Last, on a machine with a GPU, the same byte check with the tensors in GPU memory and the
# daemons' CUDA backend (without one it says so; test.sh runs it on the CUDA stand-in).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
kvtd_prepare
suffix="demo$$"
logs=$(mktemp -d /tmp/kvtd-demo.XXXXXX)

geometry=(--mp-num 2 --num-layers 32 --num-host-blocks 96 --cache-dtype bfloat16
          --key-cache-shape 128,8,64,128 --value-cache-shape 128,8,64,128)
echo "== starting two kvtd ranks (logs in $logs)"
for rank in 0 1; do
  "$kvtd" --rank $rank "${geometry[@]}" --session "$suffix" --device-backend host \
    --storage-backend file --storage-path "$logs/store" --model-id demo-model \
    --log-dir "$logs" 2>"$logs/stderr$rank" &
  pids+=($!)
done

echo "== engine stand-in: swap out, overwrite, swap back, verify every byte"
"$loadgen" --session "$suffix" --ranks 2 --layers 32 --kv-heads 8 --block-size 64 --head-dim 128 \
  --device-blocks 128 --host-blocks 96 --mode verify --iterations 40 --blocks-per-task 8

echo "== a second session on the same daemons: throughput with random block ids"
"$loadgen" --session "$suffix" --ranks 2 --layers 32 --kv-heads 8 --block-size 64 --head-dim 128 \
  --device-blocks 128 --host-blocks 96 --mode throughput --blocks-per-task 16 --seconds 3

echo "== storage: swap out, write to storage, wipe, query (all hit), read back and prefetch, verify every byte"
"$loadgen" --session "$suffix" --ranks 2 --layers 32 --kv-heads 8 --block-size 64 --head-dim 128 \
  --device-blocks 128 --host-blocks 96 --mode storage-verify --storage file --key-prefix demo

echo "== storage: a second engine process (new session, empty host and device blocks) reads what the first stored"
"$loadgen" --session "$suffix" --ranks 2 --layers 32 --kv-heads 8 --block-size 64 --head-dim 128 \
  --device-blocks 128 --host-blocks 96 --mode storage-verify --storage file --key-prefix demo --storage-phase read

echo "== SIGTERM: the daemons finish what is in flight and exit"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for i in "${!pids[@]}"; do
  code=0
  wait "${pids[$i]}" || code=$?
  echo "rank $i exited with code $code"
  [ "$code" -eq 0 ]
done
pids=()
echo "== last lines of rank 0's log"
tail -n 6 "$logs/kvtd_dp0_rank0.log"
rm -rf "$logs/store"  # 512 MiB of objects; the logs stay

echo "== a Python engine (examples/engine.py over libkvtd_client.so): LRU prefix cache evicting to host and a"
echo "   file store, layer-by-layer reloads, every byte checked; it starts its own two kvtd ranks"
KVTD_BINARY=$kvtd KVTD_CLIENT_LIBRARY=$KVTD_BUILD_DIR/client/libkvtd_client.so.1 PYTHONPATH=$KVTD_ROOT/python \
  /usr/bin/python3 "$KVTD_ROOT/examples/engine.py" --requests 300 --host-blocks 48 --storage-path "$logs/pystore"
rm -rf "$logs/pystore"

echo "== the CUDA path: the engine's tensors in GPU memory, two --device-backend cuda ranks opening its IPC handles"
code=0
"$kvtd" selftest --device-backend cuda --bench-layers 0 >"$logs/cuda-selftest" 2>&1 || code=$?
if [ "$code" -eq 0 ]; then
  bash "$KVTD_ROOT/tests/ipc/run_demo_check.sh" "$kvtd" "$loadgen" cuda
elif [ "$code" -eq 77 ]; then
  # No GPU here; scripts/test.sh runs this same check on the CUDA stand-in (build-sim).
  echo "(skipped: $(tail -n 1 "$logs/cuda-selftest"))"
else
  cat "$logs/cuda-selftest"
  exit 1
fi
echo "demo OK"
