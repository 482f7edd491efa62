#!/usr/bin/env bash
# Storage of cache groups through the daemons (file store) next to sglang's own HiCacheFile v2 on the
# same pages (tools/bench/hicache_v2_peer.py), for four real models at TP 1, alternating, and a
# plain GQA model as one group next to the same cache as a single shape (the storage path before
# groups). Called by scripts/bench.sh; alone:
#   tools/bench/group_storage.sh BUILD_DIR [ROUNDS] [KEYS]
# Prints figures; asserts nothing.
set -euo pipefail
build=${1:?usage: tools/bench/group_storage.sh BUILD_DIR [ROUNDS] [KEYS]}
rounds=${2:-2}
keys=${3:-512}
here=$(cd "$(dirname "$0")" && pwd)
kvtd=$build/daemon/kvtd
loadgen=$build/tools/loadgen/kvtd-loadgen
work=$(mktemp -d /tmp/kvtd-group-storage.XXXXXX)
trap 'rm -rf "$work"' EXIT

# run_one DAEMON-FLAGS... -- LOADGEN-ARGS...: one rank with a fresh file store, then kvtd-loadgen.
run_one() {
  local flags=() args=()
  while [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  args=("$@")
  rm -rf "$work/store"
  local suffix="gs$$_$RANDOM"
  "$kvtd" --rank 0 --mp-num 1 "${flags[@]}" --session "$suffix" --log-level error --storage-backend file --storage-staging-mib 256 \
    --storage-path "$work/store" --model-id bench &
  local pid=$!
  "$loadgen" --session "$suffix" --ranks 1 "${args[@]}" 2>/dev/null | grep -o "storage-[a-z]* \[.*" || true
  kill -TERM "$pid"
  wait "$pid" || true
}

echo "== storage of cache groups, 1 rank, file store, $keys keys in tasks of 16 (every block group's page of each"
echo "   key, the state at each task's last key; a load takes what each group's rule needs), next to sglang's"
echo "   HiCacheFile v2 on the same pages, alternating"
for ((round = 1; round <= rounds; round++)); do
  for model in llama-3.1-8b gpt-oss-20b qwen3-next-80b deepseek-v3.2; do
    mapfile -t groups < <(/usr/bin/python3 "$here/model_groups.py" "$model" 1)
    echo -n "$model kvtd: "
    run_one "${groups[@]}" -- "${groups[@]}" --mode storage-throughput --blocks-per-task 16 --storage-blocks "$keys"
    echo -n "$model "
    /usr/bin/python3 "$here/hicache_v2_peer.py" "$model" 1 --dir "$work" --keys "$keys" --per-task 16 2>&1 | tail -1
  done
done
echo "== Llama-3.1-8B at TP 1 (32 layers x K/V x 8 heads x 16 tokens x 128, bf16: 2 MiB a key): one cache group vs"
echo "   the same cache as a single shape, alternating"
mapfile -t llama < <(/usr/bin/python3 "$here/model_groups.py" llama-3.1-8b 1)
for ((round = 1; round <= rounds; round++)); do
  echo -n "one cache group: "
  run_one "${llama[@]}" -- "${llama[@]}" --mode storage-throughput --blocks-per-task 16 --storage-blocks "$keys"
  echo -n "single shape:    "
  run_one --num-layers 32 --key-cache-shape 64,8,16,128 --value-cache-shape 64,8,16,128 --num-host-blocks 96 -- \
    --mode storage-throughput --blocks-per-task 16 --storage-blocks "$keys" --layers 32 --kv-heads 8 --block-size 16 \
    --head-dim 128 --device-blocks 64 --host-blocks 96
done
