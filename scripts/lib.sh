# Sourced by the scripts: paths and the build step.
KVTD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVTD_BUILD_DIR=${KVTD_BUILD_DIR:-$KVTD_ROOT/build}

# kvtd_build [extra cmake args...]: configure once, then build incrementally.
kvtd_build() {
  if [ ! -f "$KVTD_BUILD_DIR/build.ninja" ]; then
    cmake -S "$KVTD_ROOT" -B "$KVTD_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTD_WARNINGS_AS_ERRORS=ON "$@" >/dev/null
  fi
  ninja -C "$KVTD_BUILD_DIR" -j "$(nproc)" | grep -v '^\[' || true
  test -x "$KVTD_BUILD_DIR/daemon/kvtd"
}

# Builds if needed and sets the tool paths; children started by the caller go in `pids` and are
# killed if the script exits early.
kvtd_prepare() {
  bash "$KVTD_ROOT/scripts/setup.sh"
  kvtd_build
  kvtd=$KVTD_BUILD_DIR/daemon/kvtd
  loadgen=$KVTD_BUILD_DIR/tools/loadgen/kvtd-loadgen
  pids=()
  trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done' EXIT
}
