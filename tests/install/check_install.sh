#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, then everything an installer gets must work from
# there: a C and a C++ consumer built with find_package(kvtd) and again with pkg-config, run
# against the installed library; only kvtd_* symbols exported; the installed systemd units
# pass `systemd-analyze verify` with no complaint.
set -euo pipefail
build=$1 src=$(cd "$(dirname "$0")" && pwd)
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" > /dev/null

echo "== find_package(kvtd)"
cmake -S "$src/consumer" -B "$prefix/consumer-build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_RPATH="$prefix/lib" > /dev/null
cmake --build "$prefix/consumer-build" > /dev/null
"$prefix/consumer-build/consumer_c"
"$prefix/consumer-build/consumer_cpp"

echo "== pkg-config kvtd"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
flags=$(pkg-config --cflags --libs kvtd)
cc -std=c11 -Wall -Werror "$src/consumer/consumer.c" $flags -Wl,-rpath,"$prefix/lib" -o "$prefix/pc_consumer_c"
c++ -std=c++17 -Wall -Werror "$src/consumer/consumer.cpp" $flags -Wl,-rpath,"$prefix/lib" -o "$prefix/pc_consumer_cpp"
"$prefix/pc_consumer_c"
"$prefix/pc_consumer_cpp"

echo "== exported symbols"
others=$(nm -D --defined-only "$prefix/lib/libkvtd_client.so.1" | awk '{print $3}' | grep -v '^kvtd_' | grep -v '^KVTD_CLIENT_1$' || true)
if [ -n "$others" ]; then
  echo "libkvtd_client.so exports more than kvtd_*: $others" >&2
  exit 1
fi
echo "only kvtd_* ($(nm -D --defined-only "$prefix/lib/libkvtd_client.so.1" | grep -c ' kvtd_') functions)"

echo "== systemd-analyze verify"
if command -v systemd-analyze > /dev/null; then
  units="$prefix/units"
  mkdir -p "$units"
  bindir=$(sed -n 's|^ExecStart=\(.*\)/kvtd .*|\1|p' "$prefix/lib/systemd/system/kvtd@.service")
  # The unit names the configured prefix's binary; point it at this prefix's to check the rest.
  sed "s|^ExecStart=$bindir/kvtd|ExecStart=$prefix/bin/kvtd|" "$prefix/lib/systemd/system/kvtd@.service" > "$units/kvtd@.service"
  cp "$prefix/lib/systemd/system/kvtd.target" "$prefix/lib/systemd/system/kvtd-group@.target" "$units/"
  if ! out=$(systemd-analyze verify "$units/kvtd@0.service" "$units/kvtd@3.service" "$units/kvtd@llama-70b-3.service" \
      "$units/kvtd.target" "$units/kvtd-group@llama-70b.target" 2>&1) || [ -n "$out" ]; then
    echo "systemd-analyze verify complained:" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "units verified"
else
  echo "(systemd-analyze not installed: skipped)"
fi

echo "== two groups of two ranks side by side, started by the unit's own command line"
bash "$src/check_groups.sh" "$prefix" "$build/tools/loadgen/kvtd-loadgen"
echo "install OK"
