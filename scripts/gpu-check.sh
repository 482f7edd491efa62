#!/usr/bin/env bash
# scripts/gpu-check.sh [--bin DIR] - proves kvtd's CUDA path end to end and prints one table.
#
# On a GPU machine: point --bin at a CUDA build (build/, or the staged .gpu/bin of
# ../shared/gpu/stage.sh); every step runs on the real device. In CI it runs on the stand-in
# build (build-sim: cudasim, the CPU stand-in of the CUDA runtime), so the script cannot rot; the
# steps that need real hardware (torch CUDA, compute-sanitizer) say SKIP there.
#
# Steps: the CUDA unit and daemon tests; `kvtd selftest --device-backend cuda` in every scatter
# mode (bytes against the host executor, an engine process's tensors and event opened across
# processes, GB/s by direction and block size over the daemon's shared-memory host pool,
# pinning time, the daemon's own device memory), then page_first and layer by layer; the demo check with
# the engine's tensors in device memory and two CUDA daemons; one daemon under kvtd-loadgen with
# device tensors (verify, one-block round trip, 16 and 128 blocks a task, the Python client in the
# same shape: scripts/gpu/through_daemon.sh), in the default scatter mode and in kernel mode; what
# --verify-swaps costs (scripts/gpu/verify_cost.sh); storage tasks between a file store and device
# blocks next to the HiCacheFile peer (scripts/gpu/storage_device.sh); a 32 GiB host pool's time to
# its first swap (scripts/gpu/pool_start.sh); the Python client (real torch CUDA
# tensors on a GPU, scripts/gpu/torch_check.py; the stand-in's driver on cudasim); FastDeploy
# cache manager v1's own code swapping device tensors through kvtd (scripts/gpu/fastdeploy_v1.sh,
# torch CUDA; its source from $KVTD_FASTDEPLOY_V1_SRC); kvtd.vllm's worker beside vLLM's own copy
# mechanism with the ordering check, then with the KV registered by vLLM's own code, cross-layer and
# per layer (tools/bench/vllm_offload.py; its source from $KVTD_VLLM_SRC); memcheck of the kernels where
# compute-sanitizer exists. Exit status: 0 when nothing failed, 1 otherwise.
#
# Environment: KVTD_PYTHON, the python with torch (default /usr/bin/python3; on the GPU machines
# torch lives in a venv: KVTD_PYTHON=/opt/torch/.venv/bin/python3). Programs are found under
# --bin whether it is a build tree or a flat staged folder; the tests it runs take KVTD_BINARY,
# KVTD_LOADGEN, KVTD_BIN_DIR and KVTD_CLIENT_LIBRARY (as .gpu/env.sh sets them) before the build
# paths compiled into them. KVTD_SCATTER_MODE is for scripts/gpu/through_daemon.sh, set per step.
# KVTD_GPU_CHECK_LOGS=DIR keeps each step's whole output in DIR (otherwise a temporary folder).
# --steps REGEX runs only the steps whose names match (grep -E, case-insensitive), the rest say
# SKIP "not selected": a device call is limited to 10 minutes and a session to 15, so a whole
# check may take two calls (say which steps each ran). --list prints the step names and exits;
# --ctest-names the ctest pattern of the tests its steps run.
# KVTD_GPU_CHECK_STEP_LIMIT=SECONDS caps every step's deadline (one stuck step cannot eat a call).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${KVTD_BUILD_DIR:-$root/build-sim}
selected=''
list_only=0
# The CUDA tests run as steps (ctest's names), and the ctest of `kvtd selftest --device-backend cuda`,
# which the selftest steps cover: --ctest-names prints them as a ctest -E pattern, so CI's gpu tier
# does not run them a second time (scripts/test.sh).
cuda_tests=(cudasim_test cuda_backend_test cuda_limits_test cuda_daemon_test cuda_faults_test)
while [ $# -gt 0 ]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --steps) selected=$2; shift 2
      echo | grep -qE "$selected" 2>/dev/null; [ $? -le 1 ] || { echo "gpu-check: --steps '$selected' is not an extended regex" >&2; exit 2; } ;;
    --list) list_only=1; shift ;;
    --ctest-names) (IFS='|'; echo "^(${cuda_tests[*]}|selftest_cuda)\$"); exit 0 ;;
    -h|--help) sed -n '2,/^set /p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (usage: gpu-check.sh [--bin DIR] [--steps REGEX] [--list] [--ctest-names])" >&2; exit 2 ;;
  esac
done
[ -d "$bin" ] || { echo "gpu-check: --bin $bin is not a directory" >&2; exit 2; }
bin=$(cd "$bin" && pwd)
python=${KVTD_PYTHON:-/usr/bin/python3}
[ -x "$python" ] || python=python3

# A program of the build: a flat directory (staged) or a build tree (daemon/, tests/, tools/...).
find_prog() {
  local name=$1 d
  for d in "$bin" "$bin/daemon" "$bin/tests" "$bin/tools/loadgen" "$bin/tools"; do
    [ -x "$d/$name" ] && { echo "$d/$name"; return 0; }
  done
  find "$bin" -maxdepth 3 -type f -name "$name" -perm -u+x 2>/dev/null | head -1
}
lib_of() { find "$bin" -maxdepth 3 -name "$1" 2>/dev/null | head -1; }

kvtd=$(find_prog kvtd)
[ -n "$kvtd" ] || { echo "gpu-check: no kvtd binary under $bin" >&2; exit 2; }
loadgen=$(find_prog kvtd-loadgen)
# The tests below start these, not the build paths compiled into them (a staged folder has none).
export KVTD_BINARY=${KVTD_BINARY:-$kvtd}
[ -z "$loadgen" ] || export KVTD_LOADGEN=${KVTD_LOADGEN:-$loadgen}
stand_in=0
[ -n "$(find_prog cudasim_test)" ] && stand_in=1
if [ -n "${KVTD_GPU_CHECK_LOGS:-}" ]; then  # every step's whole output kept there (a device run's $OUT)
  log=$KVTD_GPU_CHECK_LOGS; mkdir -p "$log"
else
  log=$(mktemp -d); trap 'rm -rf "$log"' EXIT
fi
rows=()
failed=0

# step NAME SECONDS COMMAND...: runs the command under a deadline, keeps its output.
step() {
  local name=$1 limit=$2; shift 2
  if [ $list_only -eq 1 ]; then echo "$name"; return 0; fi
  if [ -n "$selected" ] && ! grep -qiE -- "$selected" <<<"$name"; then skip "$name" "not selected (--steps)"; return 0; fi
  [ -z "${KVTD_GPU_CHECK_STEP_LIMIT:-}" ] || [ "$limit" -le "$KVTD_GPU_CHECK_STEP_LIMIT" ] || limit=$KVTD_GPU_CHECK_STEP_LIMIT
  local out="$log/$(echo "$name" | tr -c 'a-zA-Z0-9' _).log" start rc
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ]; then
    rows+=("PASS|$name|${took}s|$(summary "$name" "$out")")
  else  # "no usable GPU" (selftest's 77) fails too: proving the device path is the point
    failed=1
    rows+=("FAIL|$name|${took}s|exit $rc (log below)")
    echo "---- $name (exit $rc) ----"; tail -40 "$out"
  fi
}
skip() { [ $list_only -eq 1 ] || rows+=("SKIP|$1|-|$2"); }

# The figure lines a step printed, joined (selftest bandwidth, pinning; gtest totals).
summary() {
  case $1 in
    selftest*) grep -E '^selftest' "$2" | tail -1 ;;
    through*) grep -E '^throughput' "$2" | tail -1 | grep -oE '[0-9]+ random blocks per task.*per rank \(' | sed 's/ (//' ;;
    vLLM*) grep -E '^ORDERING|^FIGURE vllm (store|load)' "$2" | sed 's/;.*//' | paste -sd ' ' - ;;
    *) grep -E '^\[  PASSED  \]|passed|PASS ' "$2" | tail -1 ;;
  esac
}

for t in "${cuda_tests[@]}"; do
  p=$(find_prog "$t")
  if [ -n "$p" ]; then step "$t" 600 "$p"; else skip "$t" "not in this build (stand-in builds only)"; fi
done
# Every scatter mode at four block sizes; on the stand-in one size (its figures measure no device,
# and the four took 4 of CI's minutes).
bench_kib=8,16,32,64; [ $stand_in -eq 1 ] && bench_kib=16
step "selftest (every scatter mode)" 600 "$kvtd" selftest --device-backend cuda --bench-block-kib "$bench_kib"
# The daemon's other shapes: its page_first host pool, a layer-by-layer load, 1024 blocks.
step "selftest (page_first, layer by layer)" 600 "$kvtd" selftest --device-backend cuda --scatter-mode kernel \
  --bench-layerwise --bench-host-layout page_first --bench-blocks 1024 --bench-block-kib 16 --pin-mib 0 --no-ipc
if [ -n "$loadgen" ]; then
  step "demo check (engine tensors in device memory)" 300 "$root/tests/ipc/run_demo_check.sh" "$kvtd" "$loadgen" cuda
  # One daemon, the engine's tensors in device memory: verify, round trip, 16 and 128 blocks a task.
  small=(); [ $stand_in -eq 1 ] && small=(--small)
  step "through the daemon (loadgen, device tensors)" 600 "$root/scripts/gpu/through_daemon.sh" "$kvtd" "$loadgen" "${small[@]}"
  step "through the daemon, kernel mode" 600 env KVTD_SCATTER_MODE=kernel "$root/scripts/gpu/through_daemon.sh" "$kvtd" \
    "$loadgen" "${small[@]}"
  # What --verify-swaps costs (off, full, sampled alternating), storage between a file store and
  # device blocks next to the HiCacheFile peer, and a 32 GiB host pool's time to its first swap.
  step "verify-swaps cost, kernel mode" 600 env KVTD_SCATTER_MODE=kernel "$root/scripts/gpu/verify_cost.sh" "$kvtd" \
    "$loadgen" "${small[@]}"
  # (Kernel mode only: batch-mode swaps scatter by +-10% run to run, more than the cost; run
  # verify_cost.sh by hand for them. One call must hold the whole check.)
  step "storage into device blocks (file store)" 600 env KVTD_PYTHON="$python" "$root/scripts/gpu/storage_device.sh" \
    "$kvtd" "$loadgen" "${small[@]}"
  step "host pool start-up (32 GiB)" 600 "$root/scripts/gpu/pool_start.sh" "$kvtd" "$loadgen" 32 "${small[@]}"
else
  skip "demo check" "no kvtd-loadgen under $bin"
fi
client=$(lib_of 'libkvtd_client.so*')
if [ $stand_in -eq 1 ]; then
  sim=$(lib_of 'libkvtd_cudasim.so')
  step "python client (stand-in driver)" 300 env KVTD_BINARY="$kvtd" KVTD_CLIENT_LIBRARY="$client" \
    PYTHONPATH="$root/python" KVTD_CUDASIM_LIBRARY="$sim" KVTD_CUDA_DRIVER="$sim" \
    "$python" -m pytest -q -p no:cacheprovider "$root/tests/python/test_cuda_handles.py"
  skip "python client (torch CUDA)" "stand-in build: no torch CUDA here"
elif "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  step "python client (torch CUDA)" 600 env KVTD_BINARY="$kvtd" KVTD_CLIENT_LIBRARY="$client" \
    PYTHONPATH="$root/python" "$python" "$root/scripts/gpu/torch_check.py"
  # The GEMM's slowdown is the price of kernel mode (the copies use SMs): measured, not assumed.
  step "python client (torch CUDA), kernel mode" 600 env KVTD_BINARY="$kvtd" KVTD_CLIENT_LIBRARY="$client" \
    KVTD_SCATTER_MODE=kernel PYTHONPATH="$root/python" "$python" "$root/scripts/gpu/torch_check.py"
  fdv1=${KVTD_FASTDEPLOY_V1_SRC:-${KVTD_REFERENCE_DIR:-$root/../shared/reference}/fastdeploy-v1}
  if [ -f "$fdv1/fastdeploy/cache_manager/v1/cache_controller.py" ]; then
    step "FastDeploy v1 (device tensors)" 600 env KVTD_FASTDEPLOY_V1_SRC="$fdv1" \
      "$root/scripts/gpu/fastdeploy_v1.sh" "$kvtd" "$client" "$python"
  else
    skip "FastDeploy v1 (device tensors)" "no FastDeploy v1 source: set KVTD_FASTDEPLOY_V1_SRC"
  fi
  # 16 KiB pages: below THRESHOLD_BYTES, where vLLM loads with its Triton kernel (swap_blocks_triton.py).
  vllm_src=${KVTD_VLLM_SRC:-${KVTD_REFERENCE_DIR:-$root/../shared/reference}/vllm}
  if [ -f "$vllm_src/vllm/v1/kv_offload/base.py" ]; then
    # Then the ordering check: a store and a load submitted behind queued GPU work move the model's bytes.
    vllm_bench=(env KVTD_VLLM_SRC="$vllm_src" KVTD_BINARY="$kvtd" KVTD_CLIENT_LIBRARY="$client"
      PYTHONPATH="$root/python:$root/tests/python:$root/tests/python/vllm" "$python"
      "$root/tools/bench/vllm_offload.py" --device cuda --page-kib 16)
    step "vLLM offloading worker (device tensors)" 600 "${vllm_bench[@]}" --blocks 1024
    # The KV registered by vLLM's own code: its default cross-layer slab, and a layer at a time
    # (register_kv_caches: hybrid models, backends without the cross-layer layout); ordering included.
    for reg in cross_layer per_layer; do
      step "vLLM registration $reg (device tensors)" 600 "${vllm_bench[@]}" --blocks 512 --rounds 1 --registration "$reg"
    done
  else
    skip "vLLM offloading worker (device tensors)" "no vLLM source: set KVTD_VLLM_SRC"
  fi
  # sglang's own pinned memfd host pools (KV, and its MambaPoolHost) beside CUDA device pools: the
  # device's bytes backed up and loaded through a daemon, compared on the device.
  sglang_src=${KVTD_SGLANG_SRC:-${KVTD_REFERENCE_DIR:-$root/../shared/reference}/sglang}
  if [ ! -f "$sglang_src/python/sglang/srt/mem_cache/hicache_storage.py" ]; then
    skip "sglang pinned pools (device copies)" "no sglang source: set KVTD_SGLANG_SRC"
  elif ! "$python" -c "import psutil" 2>/dev/null; then
    skip "sglang pinned pools (device copies)" "no psutil in $python (sglang's host pools import it)"
  else
    step "sglang pinned pools (device copies)" 300 env KVTD_SGLANG_SRC="$sglang_src" KVTD_BINARY="$kvtd" \
      KVTD_CLIENT_LIBRARY="$client" PYTHONPATH="$root/python:$root/tests/python:$root/tests/python/sglang" \
      "$python" "$root/scripts/gpu/sglang_pinned.py" --device cuda
  fi
else
  skip "python client (torch CUDA)" "no torch with CUDA in $python"
fi
if [ $stand_in -eq 0 ] && command -v compute-sanitizer >/dev/null; then
  p=$(find_prog cuda_backend_test)
  if [ -n "$p" ]; then step "compute-sanitizer memcheck (kernels)" 600 compute-sanitizer --tool memcheck \
    --error-exitcode 1 "$p" --gtest_filter='Modes/*'; fi
else
  skip "compute-sanitizer memcheck" "$([ $stand_in -eq 1 ] && echo 'stand-in build' || echo 'compute-sanitizer not found')"
fi

[ $list_only -eq 0 ] || exit 0
echo
echo "kvtd gpu-check: $([ $stand_in -eq 1 ] && echo 'CUDA runtime stand-in (cudasim): no GPU figure below is a GPU figure' || \
  (command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 || echo 'CUDA device'))"
printf '%-5s %-48s %-6s %s\n' result step time detail
for r in "${rows[@]}"; do
  IFS='|' read -r res name took detail <<<"$r"
  printf '%-5s %-48s %-6s %s\n' "$res" "$name" "$took" "$detail"
done
echo
echo "figures (kvtd selftest: GB/s per direction, scatter mode and block size; contiguous = one plain copy"
echo "per tensor, the link's own figure; pinning = cudaHostRegister speed, the host pool's start-up cost;"
echo "footprint = the daemon's own device memory (NVML), what the engine loses to it):"
grep -hE '^(bandwidth|pinning|footprint)' "$log"/selftest*.log 2>/dev/null | sed 's/^/  /'
grep -hE '^(FIGURE|CHECK)' "$log"/python_client*.log 2>/dev/null | sed 's/^/  /'  # torch: interference
for f in "$log"/through_the_daemon*.log; do  # one daemon, device tensors: each figure with its mode
  [ -f "$f" ] || continue
  m=$(grep -m1 '^scatter mode' "$f" | sed 's/^scatter mode: //')
  grep -hE '^((latency|throughput)( breakdown \(| ratio:|:| python client:)|copy wait:)' "$f" | sed "s/^/  [$m] /"
done
for f in "$log"/verify_swaps_cost*.log; do
  [ -f "$f" ] || continue
  m=$(grep -m1 '^scatter mode' "$f" | sed 's/^scatter mode: //')
  grep -hE '^verify-swaps cost:' "$f" | sed "s/^/  [$m] /"
done
grep -hE '^storage device blocks' "$log"/storage_into*.log 2>/dev/null | sed 's/^/  /'
grep -hE '^(host pool of|  )' "$log"/host_pool*.log 2>/dev/null | sed 's/^/  /'
exit $failed
