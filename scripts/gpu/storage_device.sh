#!/usr/bin/env bash
# scripts/gpu/storage_device.sh KVTD LOADGEN [--small] - storage tasks between a file store and
# device blocks: one CUDA daemon, kvtd-loadgen --mode storage-throughput --device-tensors cuda
# (1,024 objects of 1 MiB = 8 layers x K/V x 64 KiB, tasks of 32, every object checksummed), with 1
# and 4 tasks in flight, page cache warm and (as root) cold; beside it, in the same round and on the
# same disk, the mechanism of sglang's HiCacheFile backend (tools/bench/hicache_file_peer.py: put,
# and get into 128 buffers as its host pool's pages). Prints each figure and kvtd / peer (goal:
# STORAGE_READ >= 1.0x the peer's get, STORAGE_WRITE >= 1.0x its put). KVTD_PYTHON: a python with
# numpy for the peer (else /usr/bin/python3 or python3 if they have it; skipped without). KVTD_STORAGE_DIR: where the
# stores live (default: a new folder under /var/tmp, on disk rather than tmpfs). --small: the
# stand-in in CI (128 objects, warm only). Run by scripts/gpu-check.sh.
set -euo pipefail
kvtd=$1 loadgen=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
objects=1024 caches="warm cold"
[ "${3:-}" = --small ] && { objects=128; caches=warm; }
python=
for p in "${KVTD_PYTHON:-}" /usr/bin/python3 python3; do  # the first with numpy
  [ -n "$p" ] && "$p" -c 'import numpy' 2>/dev/null && { python=$p; break; }
done
dir=$(mktemp -d "${KVTD_STORAGE_DIR:-/var/tmp}/kvtd_storage_device.XXXXXX")
log="$dir/daemon.log" suffix="sd$$"
shape="128,4,64,128"  # 64 KiB block-tensors in bf16, 8 layers x K/V: 1 MiB an object
daemon=
stop() { [ -z "$daemon" ] || { kill -TERM "$daemon" 2>/dev/null; wait "$daemon" || echo "daemon exit $?"; }; daemon=; }
trap 'stop; rm -rf "$dir"' EXIT
peer_ok=1
[ -n "$python" ] || { peer_ok=0; echo "(peer skipped: no python with numpy: KVTD_PYTHON, /usr/bin/python3, python3)"; }
cold_ok=1
[ -w /proc/sys/vm/drop_caches ] || cold_ok=0
for cache in $caches; do
  if [ "$cache" = cold ] && [ $cold_ok = 0 ]; then echo "(cold skipped: /proc/sys/vm/drop_caches is not writable; needs root)"; break; fi
  cold=(); peer_cold=()
  [ "$cache" = cold ] && { cold=(--cold-read); peer_cold=(--cold); }
  for inflight in 1 4; do
    rm -rf "$dir/store" "$dir"/peer-*
    "$kvtd" --rank 0 --num-layers 8 --num-host-blocks 8 --key-cache-shape "$shape" --value-cache-shape "$shape" \
      --session "$suffix" --device-backend cuda --numa-node auto --log-level warn --storage-backend file \
      --storage-path "$dir/store" --model-id bench >"$log" 2>&1 &
    daemon=$!
    line=$("$loadgen" --session "$suffix" --ranks 1 --layers 8 --kv-heads 4 --block-size 64 --head-dim 128 \
      --device-blocks 128 --host-blocks 8 --device-tensors cuda --mode storage-throughput --storage file \
      --blocks-per-task 32 --storage-blocks "$objects" --in-flight "$inflight" --task-timeout 120 "${cold[@]}" 2>/dev/null |
      grep -E '^storage-throughput') || { cat "$log" >&2; exit 1; }
    stop
    w=$(sed -n 's/.*STORAGE_WRITE \([0-9.]*\) GB\/s per rank.*/\1/p' <<<"$line")
    r=$(sed -n 's/.*STORAGE_READ \([0-9.]*\) GB\/s per rank.*/\1/p' <<<"$line")
    if [ $peer_ok = 1 ]; then
      peer=$("$python" "$root/tools/bench/hicache_file_peer.py" --dir "$dir" --objects "$objects" --slots 128 "${peer_cold[@]}")
      pp=$(sed -n 's/.*put \([0-9.]*\) GB\/s.*/\1/p' <<<"$peer")
      pg=$(sed -n 's/.*get \([0-9.]*\) GB\/s.*/\1/p' <<<"$peer")
      awk -v c="$cache" -v f="$inflight" -v w="$w" -v r="$r" -v pp="$pp" -v pg="$pg" 'BEGIN {
        printf "storage device blocks, %s, %d in flight: STORAGE_WRITE %.2f GB/s (%.2fx peer put %.2f), STORAGE_READ %.2f GB/s (%.2fx peer get %.2f)\n",
          c, f, w, w / pp, pp, r, r / pg, pg }'
    else
      echo "storage device blocks, $cache, $inflight in flight: STORAGE_WRITE $w GB/s, STORAGE_READ $r GB/s"
    fi
  done
done
echo "storage into device blocks: OK"
