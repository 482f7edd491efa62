# Sourced by the scripts: paths and the build step.
KVTD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVTD_BUILD_DIR=${KVTD_BUILD_DIR:-$KVTD_ROOT/build}

# kvtd_build [extra cmake args...]: configure once, then build incrementally.
kvtd_build() {
  if [ ! -f "$KVTD_BUILD_DIR/build.ninja" ]; then
    cmake -S "$KVTD_ROOT" -B "$KVTD_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  fi
  ninja -C "$KVTD_BUILD_DIR" -j "$(nproc)" | grep -v '^\[' || true
  test -x "$KVTD_BUILD_DIR/daemon/kvtd"
}
