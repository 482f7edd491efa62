#!/usr/bin/env bash
# FastDeploy cache manager v1 through kvtd on a GPU: the scenarios of
# tests/python/fastdeploy_v1/fastdeploy_v1_scenarios.py with the workers' KV tensors in device memory (torch CUDA
# tensors stand in for paddle's: both are registered by their allocation's CUDA IPC handle) and
# --device-backend cuda daemons. FastDeploy's own CacheManager and CacheController run from
# $KVTD_FASTDEPLOY_V1_SRC (a copy of ../shared/reference/fastdeploy-v1).
#   fastdeploy_v1.sh KVTD LIBKVTD_CLIENT PYTHON
set -uo pipefail
kvtd=$1 client=$2 python=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
failed=0
for scenario in "evict_and_swap_back 1" "evict_and_swap_back 2" "fp8_evict_and_swap_back 1" \
                "four_callers_at_once 1" "host_tier_survives_a_daemon_restart 1" \
                "host_tier_survives_a_worker_restart 1"; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # "name tp": two arguments
  if out=$(timeout 180 env KVTD_FDV1_DEVICE=cuda KVTD_BINARY="$kvtd" KVTD_CLIENT_LIBRARY="$client" \
             PYTHONPATH="$root/python:$root/tests/python:$root/tests/python/fastdeploy_v1" "$python" "$root/tests/python/fastdeploy_v1/fastdeploy_v1_scenarios.py" \
             $scenario 2>&1) && [ "$(printf '%s\n' "$out" | tail -1)" = ok ]; then
    printf 'CHECK fastdeploy v1 %s (device tensors): ok in %.1f s\n' "$scenario" "$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { print e - s }')"
  else
    failed=1
    printf 'CHECK fastdeploy v1 %s (device tensors): FAILED\n%s\n' "$scenario" "$(printf '%s\n' "$out" | tail -40)"
  fi
done
exit $failed
