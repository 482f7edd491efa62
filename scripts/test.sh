#!/usr/bin/env bash
# Builds the tree with clang's thread-safety analysis as errors, then runs every test: unit, ipc
# (real processes), storage, chaos; gpu tests skip without a GPU, and
# run in the stand-in build against cudasim, the CPU stand-in of the CUDA runtime.
# Then the same suites again under AddressSanitizer + UndefinedBehaviorSanitizer, and under
# ThreadSanitizer (KVTD_SKIP_SANITIZERS=1 skips both), and every libFuzzer target for
# KVTD_FUZZ_SECONDS each (default 20; KVTD_FUZZ_SECONDS=0 skips; scripts/fuzz.sh runs longer).
set -euo pipefail
source "$(dirname "$0")/lib.sh"

# Each stage's wall time, printed as a table when the script ends (failed or not): CI has 90
# minutes, and a stage that grows must show where.
stage_names=() stage_secs=()
stage_start=$SECONDS stage_name=""
stage() {
  if [ -n "$stage_name" ]; then stage_names+=("$stage_name") stage_secs+=($((SECONDS - stage_start))); fi
  stage_name=$1 stage_start=$SECONDS
  echo "== $1"
}
stage_table() {
  local rc=$? i
  if [ -n "$stage_name" ]; then
    [ "$rc" = 0 ] || stage_name="$stage_name (failed, exit $rc)"
    stage_names+=("$stage_name") stage_secs+=($((SECONDS - stage_start)))
  fi
  echo "== stage times (scripts/test.sh)"
  for i in "${!stage_names[@]}"; do printf '%6d s  %s\n' "${stage_secs[$i]}" "${stage_names[$i]}"; done
  printf '%6d s  total\n' "$SECONDS"
  return "$rc"
}
trap stage_table EXIT

stage "set-up (packages)"
bash "$KVTD_ROOT/scripts/setup.sh"
# The engines' tests run their own code from these (tests/python/reference_source.py); without
# them they skip, so say where they come from or that they are missing.
reference=${KVTD_REFERENCE_DIR:-$KVTD_ROOT/../shared/reference}
if [ -d "$reference" ]; then echo "engines' reference sources: $(cd "$reference" && pwd)"
else echo "WARNING: no engines' reference sources at $reference (set KVTD_REFERENCE_DIR): the engine tests skip"; fi
stage "build (gcc, CUDA)"
kvtd_build

# Every mutex-guarded field carries GUARDED_BY (kvtd/base/thread_annotations.h): clang checks each
# access. The whole tree (tests and the CUDA backend against the stand-in included), as errors.
# The same build is the CUDA runtime stand-in's (-DKVTD_CUDA_SIM=ON, see cudasim/README.md): no
# machine of this project has a GPU, so the CUDA backend, its kernels, IPC handles and events run
# against cudasim there; one clang build serves both (a separate gcc stand-in build cost CI a
# whole build).
#
# The builds after the first are unity builds (CMAKE_UNITY_BUILD: each target's sources compiled as
# a few files): the same code and checks in about half the compile time, which keeps CI inside its
# budget. The gcc build above compiles every file on its own, so a file that leans on another's
# includes still fails there.
stage "clang thread-safety + CUDA stand-in build (-Wthread-safety -Werror)"
CC=clang-16 CXX=clang++-16 KVTD_BUILD_DIR=$KVTD_ROOT/build-sim kvtd_build -DKVTD_THREAD_SAFETY=ON -DKVTD_CUDA_SIM=ON \
  -DCMAKE_UNITY_BUILD=ON

# Three at a time on CI's two cores: the suite waits on daemons, sockets and deadlines as much as it
# computes (at -j 2 it kept 1.24 cores busy).
stage "tests (build: $KVTD_BUILD_DIR)"
ctest --test-dir "$KVTD_BUILD_DIR" --output-on-failure -j 3 --timeout 900

# The gpu tests gpu-check runs below (from the staged folder) are not run twice.
stage "the CUDA path on the CUDA runtime stand-in (label gpu)"
ctest --test-dir "$KVTD_ROOT/build-sim" -L gpu -E "$(bash "$KVTD_ROOT/scripts/gpu-check.sh" --ctest-names)" \
  --output-on-failure -j 2 --timeout 900
# The one-command GPU check users run on a GPU, here on the stand-in so it cannot rot, and on a
# staged copy of the build (one flat folder, as ../shared/gpu/stage.sh makes for a GPU machine).
stage "scripts/gpu-check.sh on the stand-in build, staged as for a GPU machine"
bash "$KVTD_ROOT/tests/gpu/check_staged_gpu_check.sh" "$KVTD_ROOT/build-sim"

if [ "${KVTD_SKIP_SANITIZERS:-0}" != 1 ]; then
  # clang's ASan+UBSan (the fuzz targets' too): a quarter less compile time than gcc's.
  stage "address,undefined sanitizers: build"
  CC=clang-16 CXX=clang++-16 KVTD_BUILD_DIR=$KVTD_ROOT/build-asan kvtd_build -DKVTD_SANITIZE=address,undefined \
    -DKVTD_WITH_CUDA=OFF -DCMAKE_UNITY_BUILD=ON
  stage "address,undefined sanitizers: tests"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir "$KVTD_ROOT/build-asan" --output-on-failure -j 2 --timeout 900
  stage "thread sanitizer: build"
  KVTD_BUILD_DIR=$KVTD_ROOT/build-tsan kvtd_build -DKVTD_SANITIZE=thread -DKVTD_WITH_CUDA=OFF -DCMAKE_UNITY_BUILD=ON
  stage "thread sanitizer: tests"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$KVTD_ROOT/tests/tsan.supp \
    ctest --test-dir "$KVTD_ROOT/build-tsan" --output-on-failure -j 2 --timeout 900
fi

if [ "${KVTD_FUZZ_SECONDS:-20}" != 0 ]; then
  stage "fuzz targets (build and ${KVTD_FUZZ_SECONDS:-20}s each)"
  bash "$KVTD_ROOT/scripts/fuzz.sh" "${KVTD_FUZZ_SECONDS:-20}"
fi
