#!/usr/bin/env bash
# tests/gpu/check_staged_gpu_check.sh BUILD - scripts/gpu-check.sh on a staged build, as a GPU
# machine runs it. ../shared/gpu/stage.sh copies every program of a build into one flat folder
# (.gpu/bin) away from the build paths compiled into the tests; on the H100 that layout ran
# cuda_daemon_test 0/8 (each test exec'd the daemon from its compiled path: exit 127). This stages
# BUILD (the stand-in build in CI) the same way, puts a recording wrapper in front of the staged
# daemon, runs gpu-check on the folder, and fails unless every step passed and the tests started
# the staged daemon, never the build's.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: check_staged_gpu_check.sh BUILD}" && pwd)
flat=$(mktemp -d /tmp/kvtd_staged.XXXXXX)
trap 'rm -rf "$flat"' EXIT
# Executables: ELF programs with the execute bit (shared objects and CMake's own files left out).
find "$build" -path "$build/CMakeFiles" -prune -o -type f -perm -u+x -print | while read -r f; do
  [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = 177ELF ] || continue
  case $f in *.so*) continue ;; esac
  cp "$f" "$flat/"
done
cp -L "$build"/client/libkvtd_client.so.1 "$flat/"
ln -s libkvtd_client.so.1 "$flat/libkvtd_client.so"
sim=$(find "$build" -name libkvtd_cudasim.so | head -1)
[ -z "$sim" ] || cp -L "$sim" "$flat/"
# The staged daemon, behind a wrapper that records each start: the proof that tests used it.
mv "$flat/kvtd" "$flat/kvtd.staged"
cat >"$flat/kvtd" <<WRAP
#!/usr/bin/env bash
echo "\$*" >>"$flat/kvtd.starts"
exec "$flat/kvtd.staged" "\$@"
WRAP
chmod +x "$flat/kvtd"
export KVTD_BIN_DIR=$flat KVTD_BINARY=$flat/kvtd KVTD_LOADGEN=$flat/kvtd-loadgen
export KVTD_CLIENT_LIBRARY=$flat/libkvtd_client.so.1
[ -z "$sim" ] || export KVTD_CUDASIM_LIBRARY=$flat/libkvtd_cudasim.so KVTD_CUDA_DRIVER=$flat/libkvtd_cudasim.so
echo "== staged $(ls "$flat" | wc -l) files into $flat"
bash "$root/scripts/gpu-check.sh" --bin "$flat"
# The C++ tests' daemons (tests/ipc/daemon_fixture.h: --heartbeat-period 0.02, which no script
# passes): gpu-check itself names the staged daemon, the tests must find it on their own.
starts=$(grep -c -- '--device-backend cuda.*--heartbeat-period 0.02\|--heartbeat-period 0.02.*--device-backend cuda' \
  "$flat/kvtd.starts" 2>/dev/null || true)
echo "the tests started the staged daemon ${starts:-0} times as a CUDA rank"
[ "${starts:-0}" -gt 0 ] || { echo "FAIL: no test started the staged daemon" >&2; exit 1; }
# --steps runs the named steps alone (a GPU session splits the check across calls), --list names them.
steps=$(bash "$root/scripts/gpu-check.sh" --bin "$flat" --list)
grep -qx 'demo check (engine tensors in device memory)' <<<"$steps" || { echo "FAIL: --list misses the demo check:" >&2; echo "$steps" >&2; exit 1; }
one=$(bash "$root/scripts/gpu-check.sh" --bin "$flat" --steps '^cudasim_test$') || { echo "FAIL: --steps '^cudasim_test\$' failed:" >&2; echo "$one" >&2; exit 1; }
ran=$(grep -cE '^PASS ' <<<"$one" || true)
grep -qE '^PASS +cudasim_test ' <<<"$one" && [ "$ran" -eq 1 ] && grep -qE '^SKIP +demo check.*not selected' <<<"$one" ||
  { echo "FAIL: --steps '^cudasim_test\$' should run that step alone:" >&2; echo "$one" >&2; exit 1; }
bash "$root/scripts/gpu-check.sh" --bin "$flat" --steps '(' >/dev/null 2>&1 && { echo "FAIL: --steps '(' was taken" >&2; exit 1; }
echo "staged gpu-check OK"
