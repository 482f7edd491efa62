#!/usr/bin/env bash
# Benchmarks behind the README figures: task round trip (1 and 2 ranks), swap throughput next
# to memcpy (1 and 2 ranks), and planning cost per block. Prints figures; asserts nothing.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
kvtd_prepare

# with_daemons RANKS LAYERS HEADS BLOCK DIM DEVBLOCKS HOSTBLOCKS -- loadgen args...
with_daemons() {
  local ranks=$1 layers=$2 heads=$3 bs=$4 dim=$5 dev=$6 host=$7; shift 8
  local suffix="bench$$_$RANDOM" shape="$dev,$heads,$bs,$dim"
  for ((r = 0; r < ranks; r++)); do
    "$kvtd" --rank $r --mp-num "$ranks" --num-layers "$layers" --num-host-blocks "$host" \
      --key-cache-shape "$shape" --value-cache-shape "$shape" --session "$suffix" --log-level warn &
    pids+=($!)
  done
  "$loadgen" --session "$suffix" --ranks "$ranks" --layers "$layers" --kv-heads "$heads" --block-size "$bs" \
    --head-dim "$dim" --device-blocks "$dev" --host-blocks "$host" "$@" 2>/dev/null
  for p in "${pids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
  pids=()
}

echo "== task round trip, one-block SWAP_TO_HOST (1 layer, 2 KiB key + 2 KiB value per block)"
for ranks in 1 2; do
  with_daemons "$ranks" 1 1 16 64 16 16 -- --mode latency --latency-samples 20000
done
echo "== swap throughput, 128 KiB blocks, random ids, 32 layers x K+V, 16 blocks per task"
for ranks in 1 2; do
  with_daemons "$ranks" 32 8 64 128 128 96 -- --mode throughput --blocks-per-task 16 --seconds 4
done
echo "== kvtd selftest, host backend (bandwidth through the device-backend interface)"
"$kvtd" selftest --device-backend host | grep -E "bandwidth|selftest"
echo "== copy planning cost"
"$KVTD_BUILD_DIR/tests/copy_plan_bench" --benchmark_min_time=0.2

echo "== storage: 1 MiB objects in batches of 32"
sbench=$KVTD_BUILD_DIR/tools/storage_bench/kvtd-storage-bench
sdir=$(mktemp -d "$KVTD_ROOT/.bench-storage.XXXXXX")  # on the project's disk, like a local SSD tier
"$sbench" --backend file --dir "$sdir/store" --batches 32
rm -rf "$sdir"
port=$((27000 + RANDOM % 1000))
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  --logfile /dev/null &
rpid=$!
pids+=("$rpid")
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
"$sbench" --backend redis --endpoint "127.0.0.1:$port" --batches 16
rb=$(redis-benchmark -p "$port" -d 1048576 -P 32 -n 512 -t set,get -q 2>&1 | tr '\r' '\n' | grep "requests per second")
echo "$rb" | sed 's/^/redis-benchmark -d 1048576 -P 32: /'
echo "$rb" | awk '/^SET/ {printf "redis-benchmark SET = %.2f GB/s\n", $2 * 1048576 / 1e9} /^GET/ {printf "redis-benchmark GET = %.2f GB/s\n", $2 * 1048576 / 1e9}'
kill "$rpid"; wait "$rpid" 2>/dev/null || true
pids=()
