#!/usr/bin/env bash
# Installs the build into a temporary prefix and imports the installed `kvtd` module with no
# environment help: it must load the installed libkvtd_client.so, not the build tree's.
set -euo pipefail
build=$1 python=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" > /dev/null
unset KVTD_CLIENT_LIBRARY
loaded=$(cd / && PYTHONPATH="$prefix/lib/python3/dist-packages" "$python" -c 'import kvtd; print(kvtd._native.lib._name)')
echo "loaded $loaded"
case "$loaded" in
  "$prefix"/lib/libkvtd_client.so.*) ;;
  *) echo "expected the library under $prefix/lib" >&2; exit 1 ;;
esac
test -f "$prefix/include/kvtd/kvtd_client.h"
test -x "$prefix/bin/kvtd"
# FastDeploy finds kvtd's plugin (kvtd.fastdeploy_v1) through the installed dist-info's entry point.
plugin=$(cd / && PYTHONPATH="$prefix/lib/python3/dist-packages" "$python" -c \
  'from importlib.metadata import entry_points; print([e.value for e in entry_points(group="fastdeploy.model_register_plugins") if e.name == "kvtd"])')
echo "fastdeploy plugin $plugin"
test "$plugin" = "['kvtd.fastdeploy_v1:register']"
