#!/usr/bin/env bash
# Builds the libFuzzer targets (clang-16, ASan + UBSan) and runs each for a bounded time from a
# copy of its seed corpus (tests/fuzz/corpus/<target>; the repository is never written).
#   scripts/fuzz.sh [seconds per target, default 300]     e.g. scripts/fuzz.sh 3600 for a long run
# A crash, timeout (5 s per input) or leak fails the run; the input is kept in $KVTD_FUZZ_OUT
# (default /tmp/kvtd-fuzz) for replay: build-fuzz/tests/fuzz/<target> <input>.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
seconds=${1:-300}
bash "$KVTD_ROOT/scripts/setup.sh"
build=$KVTD_ROOT/build-fuzz
if [ ! -f "$build/build.ninja" ]; then
  CC=clang-16 CXX=clang++-16 cmake -S "$KVTD_ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVTD_FUZZ=ON -DKVTD_WITH_CUDA=OFF -DKVTD_WARNINGS_AS_ERRORS=ON -DCMAKE_UNITY_BUILD=ON >/dev/null
fi
ninja -C "$build" -j "$(nproc)" | grep -v '^\[' || true
# UBSan recovers by default: a finding would only be printed. Make it a crash the run fails on
# (a null memcpy in the storage-section decoder was printed and passed unnoticed).
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
out=${KVTD_FUZZ_OUT:-/tmp/kvtd-fuzz}
mkdir -p "$out"
# One target per core at a time: each fuzzer is one process on one core, so every target still gets
# its whole time (one after another they took CI's fuzz stage 8 x 20 s).
targets=(fuzz_task_record fuzz_session_header fuzz_object_header fuzz_object_name fuzz_cache_groups fuzz_config
         fuzz_control_request fuzz_version_yaml)
jobs=$(nproc)
# fuzz_one TARGET: runs it from a copy of its corpus; its findings and log stay in $out.
fuzz_one() {
  local target=$1 work rc=0
  work=$(mktemp -d)
  cp "$KVTD_ROOT/tests/fuzz/corpus/$target/"* "$work/"
  (cd "$out" && "$build/tests/fuzz/$target" -max_total_time="$seconds" -timeout=5 -rss_limit_mb=2048 \
     -print_final_stats=1 "$work" 2>"$out/$target.log") || rc=$?
  rm -rf "$work"
  return $rc
}
failed=()
for ((i = 0; i < ${#targets[@]}; i += jobs)); do
  batch=("${targets[@]:i:jobs}")
  fuzz_pids=()
  for target in "${batch[@]}"; do
    echo "== $target for ${seconds}s"
    fuzz_one "$target" &
    fuzz_pids+=($!)
  done
  for j in "${!batch[@]}"; do
    target=${batch[$j]}
    if wait "${fuzz_pids[$j]}"; then
      grep -E "^Done|stat::number_of_executed_units" "$out/$target.log" | head -2 | sed "s/^/$target: /"
    else
      tail -n 30 "$out/$target.log"
      failed+=("$target")
    fi
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: ${failed[*]} failed; the inputs are in $out" >&2
  exit 1
fi
echo "fuzz: no crash, hang or leak"
