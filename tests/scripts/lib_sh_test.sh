#!/usr/bin/env bash
# scripts/lib.sh's kvtd_build against stand-in cmake and ninja (on PATH, in a temporary folder):
# - BuildFailureIsNotHiddenByAStaleBinary: `ninja ... | grep || true` used to return success when
#   the build failed and an old daemon/kvtd existed, so the tests ran a stale binary.
# - NewConfigureFlagsReconfigure: the build was configured once, so `-DKVTD_CUDA_SIM=ON` given to
#   an existing build directory was silently ignored.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
cat >"$work/bin/cmake" <<'FAKE_TOOL'
#!/usr/bin/env bash
echo "cmake $*" >>"$FAKE_LOG"
while [ $# -gt 0 ]; do [ "$1" = -B ] && { mkdir -p "$2"; touch "$2/build.ninja"; }; shift; done
FAKE_TOOL
cat >"$work/bin/ninja" <<'FAKE_TOOL'
#!/usr/bin/env bash
echo "ninja" >>"$FAKE_LOG"
if [ "${FAKE_NINJA_RC:-0}" != 0 ]; then echo "FAILED: some.cpp.o"; exit "$FAKE_NINJA_RC"; fi
mkdir -p "$2/daemon" && printf '#!/bin/sh\n' >"$2/daemon/kvtd" && chmod +x "$2/daemon/kvtd"
FAKE_TOOL
chmod +x "$work/bin/cmake" "$work/bin/ninja"
export PATH="$work/bin:$PATH" FAKE_LOG="$work/log" KVTD_BUILD_DIR="$work/build"
source "$root/scripts/lib.sh"
fails=0
check() { if eval "$2"; then echo "[ OK ] $1"; else echo "[FAIL] $1"; fails=$((fails + 1)); fi; }

kvtd_build >/dev/null 2>&1
check "a first build configures and builds" '[ "$(grep -c ^cmake "$FAKE_LOG")" = 1 ] && [ -x "$KVTD_BUILD_DIR/daemon/kvtd" ]'
FAKE_NINJA_RC=1 kvtd_build >/dev/null 2>&1
rc=$?
check "BuildFailureIsNotHiddenByAStaleBinary (kvtd_build returned $rc)" '[ "$rc" != 0 ]'
kvtd_build >/dev/null 2>&1
check "the same flags do not configure again" '[ "$(grep -c ^cmake "$FAKE_LOG")" = 1 ]'
kvtd_build -DKVTD_CUDA_SIM=ON >/dev/null 2>&1
check "NewConfigureFlagsReconfigure" '[ "$(grep -c ^cmake "$FAKE_LOG")" = 2 ] && grep -q "^cmake.*-DKVTD_CUDA_SIM=ON" "$FAKE_LOG"'
exit "$fails"
