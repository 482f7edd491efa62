#!/usr/bin/env bash
# scripts/gpu/verify_cost.sh KVTD LOADGEN [--small] - what --verify-swaps costs on the device: one
# CUDA daemon and kvtd-loadgen with device tensors (the block shape of through_daemon.sh: 32
# layers x K/V, 32 KiB block-tensors; 512 device and 256 host blocks, so each run starts in
# seconds), swap throughput at 128 and 16 blocks per task with --verify-swaps off, full, sampled,
# off, full (alternating, so drift shows as a difference between the two offs), 128-block tasks
# whose swap-ins go layer by layer (each layer checked as it lands) off and full, then the
# one-block round trip off and full. Prints each figure and full's cost against the mean of the offs
# (goal: <= 3%). The scatter mode is the daemon's default unless KVTD_SCATTER_MODE names one. --small:
# the stand-in in CI (few blocks, short rounds). Run by scripts/gpu-check.sh.
set -euo pipefail
kvtd=$1 loadgen=$2
dev=512 host=256 layers=32 seconds=2 samples=5000 settings="off full sampled off full"
# (8 layers on the stand-in: its copies are memcpy, and 32 layers' fills made this CI's slowest step.)
[ "${3:-}" = --small ] && { dev=256; host=128; layers=8; seconds=0.3; samples=20; settings="off full sampled"; }
shape="$dev,8,16,128" suffix="vc$$"
mode=()
[ -n "${KVTD_SCATTER_MODE:-}" ] && mode=(--scatter-mode "$KVTD_SCATTER_MODE")
log=$(mktemp /tmp/kvtd_verify_cost.XXXXXX.log)
out=$(mktemp /tmp/kvtd_verify_cost_out.XXXXXX)
daemon=
stop() { [ -z "$daemon" ] || { kill -TERM "$daemon" 2>/dev/null; wait "$daemon" || echo "daemon exit $?"; }; daemon=; }
trap 'stop; rm -f "$log" "$out"' EXIT
run() {  # verify setting, loadgen args...
  local verify=$1; shift
  "$kvtd" --rank 0 --num-layers "$layers" --num-host-blocks "$host" --key-cache-shape "$shape" --value-cache-shape "$shape" \
    --session "$suffix" --device-backend cuda --numa-node auto --log-level warn --verify-swaps "$verify" "${mode[@]}" \
    >"$log" 2>&1 &
  daemon=$!
  "$loadgen" --session "$suffix" --ranks 1 --layers "$layers" --kv-heads 8 --block-size 16 --head-dim 128 \
    --device-blocks "$dev" --host-blocks "$host" --device-tensors cuda --task-timeout 120 "$@" 2>/dev/null |
    grep -E '^(latency|throughput):' || { cat "$log" >&2; return 1; }
  stop
}
rate() { sed -n 's/^throughput: .* swap \([0-9.]*\) GB\/s per rank.*/\1/p'; }
p50() { sed -n 's/^latency: .*p50 \([0-9.]*\) us.*/\1/p'; }
echo "scatter mode: ${KVTD_SCATTER_MODE:-default}"
for per in 128 16; do
  for verify in $settings; do
    r=$(run "$verify" --mode throughput --blocks-per-task "$per" --seconds "$seconds" | rate)
    echo "verify-swaps $verify, $per blocks a task: $r GB/s"
    echo "$per $verify $r" >>"$out"
  done
done
for verify in off full; do
  r=$(run "$verify" --mode throughput --blocks-per-task 128 --seconds "$seconds" --layerwise | rate)
  echo "verify-swaps $verify, 128 blocks a task, swap-ins layer by layer: $r GB/s"
  echo "lw $verify $r" >>"$out"
done
for verify in off full; do
  l=$(run "$verify" --mode latency --latency-samples "$samples" | p50)
  echo "verify-swaps $verify, one-block round trip: p50 $l us"
  echo "rt $verify $l" >>"$out"
done
# full's cost against the mean of the offs, per task size (goal <= 3%); the round trip's difference.
awk '$1 != "rt" && $1 != "lw" { s[$1 " " $2] += $3; n[$1 " " $2]++ }
     $1 == "rt" { rt[$2] = $3 }
     $1 == "lw" { lw[$2] = $3 }
     END {
       for (p = 128; p >= 16; p -= 112) {
         off = s[p " off"] / n[p " off"]; full = s[p " full"] / n[p " full"]; smp = s[p " sampled"] / n[p " sampled"]
         printf "verify-swaps cost: %d blocks a task: off %.2f, sampled %.2f (%+.1f%%), full %.2f GB/s (%+.1f%%; goal >= -3%%)\n",
           p, off, smp, 100 * (smp / off - 1), full, 100 * (full / off - 1)
       }
       printf "verify-swaps cost: 128 blocks a task, swap-ins layer by layer: off %.2f, full %.2f GB/s (%+.1f%%)\n",
         lw["off"], lw["full"], 100 * (lw["full"] / lw["off"] - 1)
       printf "verify-swaps cost: one-block round trip p50 off %.1f us, full %.1f us (%+.1f us)\n", rt["off"], rt["full"], rt["full"] - rt["off"]
     }' "$out"
echo "verify cost: OK"
