#!/usr/bin/env bash
# Benchmarks behind the figures of docs/figures.md: task round trip (1 and 2 ranks), swap throughput next
# to memcpy (1 and 2 ranks), planning cost per block, the storage backends alone, storage tasks
# through the daemons next to them, the agreement round trip, daemon memory during a large read,
# the cost of metrics on the round trip, storage of cache groups next to sglang's HiCacheFile v2
# (tools/bench/group_storage.sh), kvtd.sglang next to sglang's HiCacheFile (tools/bench/sglang_backend.py), kvtd.vllm's worker next to vLLM's copy
# mechanism (tools/bench/vllm_offload.py), a page-first host pool, the Python client's round trip and throughput (as a
# ratio to kvtd-loadgen's), and a Python peer of sglang's
# HiCacheFile mechanism. Prints figures; asserts nothing.
# --plot DIR: instead, sweep swap and storage throughput over block size and rank count and draw
# them as PNG with gnuplot (scripts/bench_plot.sh).
set -euo pipefail
plot_dir=
if [ "${1:-}" = --plot ]; then
  [ -n "${2:-}" ] || { echo "usage: scripts/bench.sh [--plot DIR]" >&2; exit 2; }
  command -v gnuplot > /dev/null || { echo "bench.sh --plot needs gnuplot (scripts/setup.sh installs it)" >&2; exit 2; }
  plot_dir=$(mkdir -p "$2" && cd "$2" && pwd)
elif [ $# -gt 0 ]; then
  echo "usage: scripts/bench.sh [--plot DIR]" >&2
  exit 2
fi
source "$(dirname "$0")/lib.sh"
kvtd_prepare

# with_daemons RANKS LAYERS HEADS BLOCK DIM DEVBLOCKS HOSTBLOCKS -- loadgen args...
# (daemon_extra: more kvtd flags, e.g. the storage backend)
daemon_extra=()
with_daemons() {
  local ranks=$1 layers=$2 heads=$3 bs=$4 dim=$5 dev=$6 host=$7; shift 8
  local suffix="bench$$_$RANDOM" shape="$dev,$heads,$bs,$dim"
  local outer=("${pids[@]}")  # e.g. a redis-server: stopped by its own section, not here
  pids=()
  for ((r = 0; r < ranks; r++)); do
    "$kvtd" --rank $r --mp-num "$ranks" --num-layers "$layers" --num-host-blocks "$host" \
      --key-cache-shape "$shape" --value-cache-shape "$shape" --session "$suffix" --log-level warn \
      "${daemon_extra[@]}" &
    pids+=($!)
  done
  "$loadgen" --session "$suffix" --ranks "$ranks" --layers "$layers" --kv-heads "$heads" --block-size "$bs" \
    --head-dim "$dim" --device-blocks "$dev" --host-blocks "$host" "$@" 2>/dev/null
  for p in "${pids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
  pids=("${outer[@]}")
}

if [ -n "$plot_dir" ]; then
  source "$KVTD_ROOT/scripts/bench_plot.sh" "$plot_dir"
  exit 0
fi

echo "== task round trip, one-block SWAP_TO_HOST (1 layer, 2 KiB key + 2 KiB value per block)"
for ranks in 1 2; do
  with_daemons "$ranks" 1 1 16 64 16 16 -- --mode latency --latency-samples 20000
done
echo "== metrics cost: the same round trip, 1 rank, without and with --metrics-port (scraped every second), alternating"
for round in 1 2 3; do
  daemon_extra=()
  echo -n "without metrics: "
  with_daemons 1 1 1 16 64 16 16 -- --mode latency --latency-samples 20000 | grep -o "p50.*"
  mport=$((30000 + RANDOM % 20000))
  daemon_extra=(--metrics-port "$mport")
  ( while sleep 1; do curl -s "http://127.0.0.1:$mport/metrics" > /dev/null || true; done ) &
  scraper=$!
  echo -n "with metrics:    "
  with_daemons 1 1 1 16 64 16 16 -- --mode latency --latency-samples 20000 | grep -o "p50.*"
  kill "$scraper" 2>/dev/null; wait "$scraper" 2>/dev/null || true
done
daemon_extra=()
echo "== KV events cost: storage writes (32 KiB objects, 1 rank, tasks of 32) and the swap round trip, without and with"
echo "   --kv-events-endpoint (a subscriber draining every event) and --metrics-port (scraped every second), alternating"
edir=$(mktemp -d "$KVTD_ROOT/.bench-storage.XXXXXX")
for round in 1 2 3; do
  for events in without with; do
    rm -rf "$edir/store"
    daemon_extra=(--storage-backend file --storage-path "$edir/store" --model-id bench)
    sub=
    if [ $events = with ]; then
      daemon_extra+=(--kv-events-endpoint "ipc://$edir/events.sock")
      /usr/bin/python3 -c "
import sys, zmq
s = zmq.Context().socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b''); s.connect(sys.argv[1])
while True: s.recv_multipart()" "ipc://$edir/events.sock" 2>/dev/null &
      sub=$!
      mport=$((30000 + RANDOM % 20000))
      daemon_extra+=(--metrics-port "$mport")
      ( while sleep 1; do curl -s "http://127.0.0.1:$mport/metrics" > /dev/null || true; done ) &
      scraper=$!
    fi
    echo -n "$events events: "
    with_daemons 1 2 2 16 128 128 8 -- --mode storage-throughput --storage file --blocks-per-task 32 \
      --storage-blocks 2048 | grep -o "STORAGE_WRITE [0-9.]* GB/s per rank" | tr '\n' ' '
    with_daemons 1 1 1 16 64 16 16 -- --mode latency --latency-samples 20000 | grep -o "p50.*"
    if [ -n "$sub" ]; then
      kill "$sub" "$scraper"
      wait "$sub" "$scraper" 2>/dev/null || true
    fi
  done
done
rm -rf "$edir"
daemon_extra=()
echo "== swap throughput, 128 KiB blocks, random ids, 32 layers x K+V, 16 blocks per task"
for ranks in 1 2; do
  with_daemons "$ranks" 32 8 64 128 128 96 -- --mode throughput --blocks-per-task 16 --seconds 4
done
echo "== cache groups: four real models' caches (tools/bench/model_groups.py, from their config.json), every group's"
echo "   blocks in each task: verify, then throughput at 16 blocks of each group per task"
for spec in "llama-3.1-8b 2" "gpt-oss-20b 2" "qwen3-next-80b 2" "deepseek-v3.2 1"; do
  read -r model tp <<< "$spec"
  mapfile -t groups < <(/usr/bin/python3 "$KVTD_ROOT/tools/bench/model_groups.py" "$model" "$tp")
  suffix="bench$$_$RANDOM"
  pids=()
  for ((r = 0; r < tp; r++)); do
    "$kvtd" --rank $r --mp-num "$tp" "${groups[@]}" --session "$suffix" --log-level warn &
    pids+=($!)
  done
  echo -n "$model TP $tp: "
  "$loadgen" --session "$suffix" --ranks "$tp" "${groups[@]}" --mode verify --iterations 10 --blocks-per-task 8 \
    2>/dev/null | grep -o "verify:.*"
  echo -n "$model TP $tp: "
  "$loadgen" --session "$suffix" --ranks "$tp" "${groups[@]}" --mode throughput --blocks-per-task 16 --seconds 4 \
    2>/dev/null | grep -o "throughput:.*"
  for p in "${pids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
  pids=()
done
"$KVTD_ROOT/tools/bench/group_storage.sh" "$KVTD_BUILD_DIR" 2 512
echo "== sglang HiCache through kvtd.sglang next to sglang's own HiCacheFile (tools/bench/sglang_backend.py)"
for layout in page_first layer_first; do
  KVTD_BINARY="$KVTD_BUILD_DIR/daemon/kvtd" KVTD_CLIENT_LIBRARY="$KVTD_BUILD_DIR/client/libkvtd_client.so" \
    PYTHONPATH="$KVTD_ROOT/python:$KVTD_ROOT/tests/python" /usr/bin/python3 "$KVTD_ROOT/tools/bench/sglang_backend.py" \
    --layout "$layout" 2>/dev/null | grep '^FIGURE' || echo "(sglang backend bench: needs sglang's source, see tests/python/sglang/sglang_harness.py)"
done
echo "== sglang hybrid model (KV + Mamba pools, v2 calls) next to sglang's own HiCacheFile v2 (tools/bench/sglang_hybrid.py)"
KVTD_BINARY="$KVTD_BUILD_DIR/daemon/kvtd" KVTD_CLIENT_LIBRARY="$KVTD_BUILD_DIR/client/libkvtd_client.so" \
  PYTHONPATH="$KVTD_ROOT/python:$KVTD_ROOT/tests/python" /usr/bin/python3 "$KVTD_ROOT/tools/bench/sglang_hybrid.py" \
  2>/dev/null | grep '^FIGURE' || echo "(sglang hybrid bench: needs sglang's source, see tests/python/sglang/sglang_harness.py)"
echo "== vLLM's offloading worker through kvtd.vllm next to vLLM's copy mechanism (tools/bench/vllm_offload.py)"
KVTD_BINARY="$KVTD_BUILD_DIR/daemon/kvtd" KVTD_CLIENT_LIBRARY="$KVTD_BUILD_DIR/client/libkvtd_client.so" \
  PYTHONPATH="$KVTD_ROOT/python:$KVTD_ROOT/tests/python" /usr/bin/python3 "$KVTD_ROOT/tools/bench/vllm_offload.py" \
  2>/dev/null | grep '^FIGURE' || echo "(vLLM offload bench: needs vLLM's source, see tests/python/vllm/vllm_harness.py)"
echo "== swap throughput as above, page-first host pool (--host-layout page_first: the transform is in the copy)"
daemon_extra=(--host-layout page_first)
for ranks in 1 2; do
  with_daemons "$ranks" 32 8 64 128 128 96 -- --mode throughput --blocks-per-task 16 --seconds 4
done
daemon_extra=()
echo "== task round trip through the Python client (ctypes), same shape as the first section"
if /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
  for ranks in 1 2; do
    KVTD_BINARY=$kvtd KVTD_CLIENT_LIBRARY=$KVTD_BUILD_DIR/client/libkvtd_client.so.1 \
      /usr/bin/python3 "$KVTD_ROOT/tools/bench/python_roundtrip.py" --ranks "$ranks"
  done
else
  echo "(skipped: /usr/bin/python3 lacks torch or numpy; scripts/setup.sh installs them)"
fi
echo "== swap throughput through the Python client against kvtd-loadgen, 128 MiB tasks (16 blocks of 32 layers x K/V"
echo "   x 128 KiB), one in flight, 1 rank, alternating; ratio = Python / C++ of the same round"
if /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
  for round in 1 2 3; do
    cxx=$(with_daemons 1 32 8 64 128 128 96 -- --mode throughput --blocks-per-task 16 --seconds 4 |
      sed -n 's/.*swap \([0-9.]*\) GB\/s per rank.*/\1/p')
    py=$(KVTD_BINARY=$kvtd KVTD_CLIENT_LIBRARY=$KVTD_BUILD_DIR/client/libkvtd_client.so.1 \
      /usr/bin/python3 "$KVTD_ROOT/tools/bench/python_roundtrip.py" --mode throughput --seconds 4 |
      sed -n 's/.*swap \([0-9.]*\) GB\/s per rank.*/\1/p')
    echo "round $round: C++ $cxx GB/s, Python $py GB/s, ratio $(awk -v a="$py" -v b="$cxx" 'BEGIN { printf "%.2f", a / b }')"
  done
else
  echo "(skipped: /usr/bin/python3 lacks torch or numpy; scripts/setup.sh installs them)"
fi
echo "== weight update: clear_caches + restore_caches (host backend: closing and re-mapping the arenas)"
if /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
  for layers in 1 32; do
    KVTD_BINARY=$kvtd KVTD_CLIENT_LIBRARY=$KVTD_BUILD_DIR/client/libkvtd_client.so.1 \
      /usr/bin/python3 "$KVTD_ROOT/tools/bench/clear_restore.py" --ranks 2 --layers "$layers" --cycles 10
  done
fi
echo "== kvtd selftest, host backend (bandwidth through the device-backend interface)"
"$kvtd" selftest --device-backend host | grep -E "bandwidth|selftest"
echo "== copy planning cost"
"$KVTD_BUILD_DIR/tests/copy_plan_bench" --benchmark_min_time=0.2

echo "== storage: 1 MiB objects in batches of 32"
sbench=$KVTD_BUILD_DIR/tools/storage_bench/kvtd-storage-bench
sdir=$(mktemp -d "$KVTD_ROOT/.bench-storage.XXXXXX")  # on the project's disk, like a local SSD tier
"$sbench" --backend file --dir "$sdir/store" --batches 32
rm -rf "$sdir/store"

# Storage tasks through the daemons (1 MiB objects: 8 layers x K+V x 4 heads x 64 tokens x 128
# x bf16), 1024 objects per rank in tasks of 32, next to the store alone above.
echo "== storage tasks through the daemons, file store (same disk, same object size), buffered and direct reads"
for io in buffered direct; do
  for ranks in 1 2; do
    rm -rf "$sdir/daemon"
    daemon_extra=(--storage-backend file --storage-path "$sdir/daemon" --model-id bench --storage-io "$io")
    echo -n "--storage-io $io: "
    with_daemons "$ranks" 8 4 64 128 128 8 -- --mode storage-throughput --storage file --blocks-per-task 32 \
      --storage-blocks 1024
  done
done
rm -rf "$sdir/daemon"
echo "== the same, 1 rank, buffered, 4 tasks in flight (an engine serving several requests: the pipeline never drains)"
rm -rf "$sdir/daemon"
daemon_extra=(--storage-backend file --storage-path "$sdir/daemon" --model-id bench)
with_daemons 1 8 4 64 128 128 8 -- --mode storage-throughput --storage file --blocks-per-task 32 \
  --storage-blocks 1024 --in-flight 4
rm -rf "$sdir/daemon"
echo "== stored by head (--storage-object-heads) vs by rank: 1 rank, 4 KV heads, 1 MiB blocks, alternating"
for round in 1 2 3; do
  for heads in 0 4 1; do
    rm -rf "$sdir/daemon"
    daemon_extra=(--storage-backend file --storage-path "$sdir/daemon" --model-id bench --storage-object-heads "$heads")
    echo -n "--storage-object-heads $heads: "
    with_daemons 1 8 4 64 128 128 8 -- --mode storage-throughput --storage file --blocks-per-task 32 \
      --storage-blocks 1024 | grep -o "STORAGE_[A-Z]* [0-9.]* GB/s per rank" | tr '\n' ' '
    echo
  done
done
rm -rf "$sdir/daemon"
echo "== storage tasks on host-pool blocks, 1 rank (loads read each object straight into the block's pieces)"
for layout in layer_first page_first; do
  rm -rf "$sdir/daemon"
  daemon_extra=(--storage-backend file --storage-path "$sdir/daemon" --model-id bench --host-layout "$layout")
  echo -n "--host-layout $layout: "
  with_daemons 1 8 4 64 128 128 96 -- --mode storage-throughput --storage file --blocks-per-task 32 \
    --storage-blocks 1024 --storage-host-blocks
done
rm -rf "$sdir/daemon"
echo "== peer: the mechanism of sglang's HiCacheFile backend in Python (1 thread, no checksum), same disk"
if /usr/bin/python3 -c "import numpy" 2>/dev/null; then
  /usr/bin/python3 "$KVTD_ROOT/tools/bench/hicache_file_peer.py" --dir "$sdir" --objects 1024
else
  echo "(skipped: /usr/bin/python3 has no numpy; apt-get install python3-numpy)"
fi
# Issue 31 part 4: one daemon, one task in flight, against the peer in the same round. The peer
# once into one buffer (it stays in the CPU cache: the figure the issue quotes) and once into 128
# buffers, one per object in turn (sglang's HiCacheFile.get reads each key into its own host-pool
# page; the daemon's reads land in 128 distinct device blocks). Cold: the page cache dropped before
# the reads (root only).
echo "== STORAGE_READ against the peer, 1 rank, tasks of 32 x 1 MiB, 1 in flight, warm and cold page cache (ratio: daemon / peer)"
cold_ok=1
[ -w /proc/sys/vm/drop_caches ] || cold_ok=0
for cache in warm cold; do
  if [ "$cache" = cold ] && [ "$cold_ok" = 0 ]; then echo "(cold skipped: /proc/sys/vm/drop_caches is not writable; needs root)"; break; fi
  if ! /usr/bin/python3 -c "import numpy" 2>/dev/null; then echo "(skipped: /usr/bin/python3 has no numpy)"; break; fi
  ratios=()
  for round in 1 2 3 4 5; do
    rm -rf "$sdir/daemon" "$sdir"/peer-*
    daemon_extra=(--storage-backend file --storage-path "$sdir/daemon" --model-id bench)
    cold_flag=(); peer_cold=()
    [ "$cache" = cold ] && { cold_flag=(--cold-read); peer_cold=(--cold); }
    line=$(with_daemons 1 8 4 64 128 128 8 -- --mode storage-throughput --storage file --blocks-per-task 32 \
      --storage-blocks 1024 "${cold_flag[@]}")
    kvtd_gbs=$(grep -o "STORAGE_READ [0-9.]*" <<< "$line" | awk '{print $2}')
    one=$(/usr/bin/python3 "$KVTD_ROOT/tools/bench/hicache_file_peer.py" --dir "$sdir" --objects 1024 "${peer_cold[@]}" |
      grep -o "get [0-9.]*" | awk '{print $2}')
    many=$(/usr/bin/python3 "$KVTD_ROOT/tools/bench/hicache_file_peer.py" --dir "$sdir" --objects 1024 --slots 128 \
      "${peer_cold[@]}" | grep -o "get [0-9.]*" | awk '{print $2}')
    awk -v c="$cache" -v r="$round" -v k="$kvtd_gbs" -v o="$one" -v m="$many" 'BEGIN {
      printf "%s %s: kvtd STORAGE_READ %.2f GB/s; peer get into 1 buffer %.2f GB/s (%.2fx), into 128 buffers %.2f GB/s (%.2fx)\n",
        c, r, k, o, k / o, m, k / m }'
    ratios+=("$(awk -v k="$kvtd_gbs" -v o="$one" -v m="$many" 'BEGIN { printf "%.4f %.4f", k / o, k / m }')")
  done
  # Run to run the peer alone swings by a quarter on a shared VM: the medians of the rounds' ratios.
  printf '%s\n' "${ratios[@]}" | awk -v c="$cache" '{ a[NR] = $1; b[NR] = $2 }
    function median(v, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
      return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2 }
    END { printf "%s, median of %d rounds: %.2fx the peer into 1 buffer, %.2fx into 128 buffers\n", c, NR, median(a, NR), median(b, NR) }'
done
rm -rf "$sdir/daemon"
echo "== storage agreement: STORAGE_QUERY of one stored key (file store), round trip"
for ranks in 2 4; do
  rm -rf "$sdir/lat"
  daemon_extra=(--storage-backend file --storage-path "$sdir/lat" --model-id bench)
  with_daemons "$ranks" 1 1 16 64 16 16 -- --mode storage-latency --storage file --latency-samples 20000
done
for io in buffered direct; do
echo "== daemon memory: one STORAGE_WRITE then one STORAGE_READ of 4 GiB (512 x 8 MiB) with 64 MiB staging, --storage-io $io"
rm -rf "$sdir/rss"
rss_suffix="benchrss$$$io"
"$kvtd" --rank 0 --mp-num 1 --num-layers 32 --num-host-blocks 1 --key-cache-shape 520,8,64,128 \
  --value-cache-shape 520,8,64,128 --session "$rss_suffix" --storage-backend file --storage-path "$sdir/rss" --model-id bench \
  --storage-staging-mib 64 --storage-io "$io" --log-level warn &
rss_pid=$!
pids+=("$rss_pid")
( while kill -0 "$rss_pid" 2>/dev/null; do
    awk '/RssAnon|RssShmem/ {printf "%s ", $2} END {print ""}' "/proc/$rss_pid/status" 2>/dev/null || true
    sleep 0.05
  done ) >"$sdir/rss.samples" &
"$loadgen" --session "$rss_suffix" --ranks 1 --layers 32 --kv-heads 8 --block-size 64 --head-dim 128 \
  --device-blocks 520 --host-blocks 1 --mode storage-throughput --blocks-per-task 512 --storage-blocks 512 \
  --task-timeout 600 2>/dev/null
kill -TERM "$rss_pid"; wait "$rss_pid" || true
pids=()
awk 'NF >= 2 { if ($1 > a) a = $1; if ($2 > s) s = $2 } END {
  printf "daemon peak RssAnon %.1f MiB (target <= 64 MiB staging + 64 MiB = 128 MiB); peak RssShmem %.1f MiB (the engine'"'"'s device tensors and the host pool, mapped)\n", a / 1024, s / 1024 }' "$sdir/rss.samples"
done
rm -rf "$sdir"
port=$((27000 + RANDOM % 1000))
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  --logfile /dev/null &
rpid=$!
pids+=("$rpid")
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
"$sbench" --backend redis --endpoint "127.0.0.1:$port" --batches 16
echo "== storage tasks through the daemons, Redis (same server)"
for ranks in 1 2; do
  redis-cli -p "$port" flushall >/dev/null
  daemon_extra=(--storage-backend redis --redis-endpoints "127.0.0.1:$port" --model-id bench)
  with_daemons "$ranks" 8 4 64 128 128 8 -- --mode storage-throughput --storage redis --blocks-per-task 32 \
    --storage-blocks 512
done
redis-cli -p "$port" flushall >/dev/null
rb=$(redis-benchmark -p "$port" -d 1048576 -P 32 -n 512 -t set,get -q 2>&1 | tr '\r' '\n' | grep "requests per second")
echo "$rb" | sed 's/^/redis-benchmark -d 1048576 -P 32: /'
echo "$rb" | awk '/^SET/ {printf "redis-benchmark SET = %.2f GB/s\n", $2 * 1048576 / 1e9} /^GET/ {printf "redis-benchmark GET = %.2f GB/s\n", $2 * 1048576 / 1e9}'
kill "$rpid"; wait "$rpid" 2>/dev/null || true
pids=()
