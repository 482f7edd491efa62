# Sourced by the scripts: paths and the build step.
KVTD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVTD_BUILD_DIR=${KVTD_BUILD_DIR:-$KVTD_ROOT/build}

# kvtd_build [extra cmake args...]: configures when the build directory is new or the arguments
# differ from the last configure (a new -D flag must never be ignored), then builds incrementally.
# Fails, with the compiler's output, when the build fails: a stale binary is never tested.
kvtd_build() {
  local args="-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTD_WARNINGS_AS_ERRORS=ON $*"
  local stamp="$KVTD_BUILD_DIR/.kvtd_configure_args"
  if [ ! -f "$KVTD_BUILD_DIR/build.ninja" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$args" ]; then
    rm -f "$stamp"
    # shellcheck disable=SC2086  # the arguments are words by design
    cmake -S "$KVTD_ROOT" -B "$KVTD_BUILD_DIR" $args >/dev/null || return 1
    printf '%s' "$args" >"$stamp"
  fi
  local log rc=0
  log=$(mktemp)
  ninja -C "$KVTD_BUILD_DIR" -j "$(nproc)" >"$log" 2>&1 || rc=$?
  grep -v '^\[' "$log" || true
  rm -f "$log"
  if [ "$rc" != 0 ]; then
    echo "kvtd_build: the build in $KVTD_BUILD_DIR failed (ninja exit $rc)" >&2
    return 1
  fi
  test -x "$KVTD_BUILD_DIR/daemon/kvtd"
}

# Builds if needed and sets the tool paths; children started by the caller go in `pids` and are
# killed if the script exits early.
# KVTD_PREBUILT=1 (a test driving a script over the build it runs in): neither set-up nor build.
kvtd_prepare() {
  if [ "${KVTD_PREBUILT:-0}" = 1 ]; then
    test -x "$KVTD_BUILD_DIR/daemon/kvtd" || { echo "KVTD_PREBUILT=1 but $KVTD_BUILD_DIR has no daemon/kvtd" >&2; return 1; }
  else
    bash "$KVTD_ROOT/scripts/setup.sh"
    kvtd_build
  fi
  kvtd=$KVTD_BUILD_DIR/daemon/kvtd
  loadgen=$KVTD_BUILD_DIR/tools/loadgen/kvtd-loadgen
  pids=()
  trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done' EXIT
}
