#!/usr/bin/env bash
# `scripts/bench.sh --plot DIR` over this build, every run shortened
# (KVTD_BENCH_QUICK=1: the figures mean nothing here), must leave two PNG pictures drawn by
# gnuplot and the tables behind them with a figure in every row.
# Usage: check_plot.sh <build dir>
set -euo pipefail
build=$1 src=$(cd "$(dirname "$0")/../.." && pwd)
command -v gnuplot > /dev/null || { echo "gnuplot not installed (scripts/setup.sh installs it): skipped"; exit 77; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
KVTD_PREBUILT=1 KVTD_BENCH_QUICK=1 KVTD_BUILD_DIR=$build bash "$src/scripts/bench.sh" --plot "$out/plots" > "$out/log" 2>&1 ||
  { tail -n 30 "$out/log" >&2; exit 1; }
check_table() {  # file rows columns
  local rows
  rows=$(grep -vc '^#' "$1")
  [ "$rows" -eq "$2" ] || { echo "$1: $rows rows, expected $2" >&2; cat "$1" >&2; exit 1; }
  awk -v n="$3" '!/^#/ { if (NF != n) exit 1; for (i = 1; i <= NF; i++) if ($i !~ /^[0-9.]+$/ && $i != "nan") exit 1 }' "$1" ||
    { echo "$1: a row without its $3 figures" >&2; cat "$1" >&2; exit 1; }
}
check_table "$out/plots/swap.dat" 10 4        # 5 block sizes x 1 and 2 ranks
check_table "$out/plots/storage.dat" 6 8      # 3 object sizes x 1 and 2 ranks
for png in swap storage; do
  f="$out/plots/$png.png"
  [ "$(head -c 8 "$f" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || { echo "$f is not a PNG" >&2; exit 1; }
  size=$(stat -c %s "$f")
  [ "$size" -gt 10000 ] || { echo "$f is only $size bytes: nothing drawn?" >&2; exit 1; }
  echo "$png.png: $size bytes"
done
echo "plots OK"
