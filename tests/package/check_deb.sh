#!/usr/bin/env bash
# `cpack -G DEB` over this build makes a package that installs the daemon, the
# client library and header, the CMake and pkg-config files, the Python module, the units (with
# ExecStart at /usr/bin/kvtd) and the example settings; its postinst makes the kvtd system user;
# lintian finds no error; and what it unpacks runs (kvtd --version, `man kvtd` and `man
# kvtd-loadgen` from man pages made by help2man at build time, the Python module loading the
# packaged library).
# Usage: check_deb.sh <build dir>
set -euo pipefail
build=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# A tree where Python ran (the python tests, a bench) has python/kvtd/__pycache__: the package must
# not carry it (an empty one was installed, and lintian failed on it). Made here, as Python would.
/usr/bin/python3 -c 'import py_compile, sys; py_compile.compile(sys.argv[1])' \
  "$(dirname "$0")/../../python/kvtd/__init__.py" || true
cpack -G DEB --config "$build/CPackConfig.cmake" -B "$out" > "$out/cpack.log" 2>&1 || { cat "$out/cpack.log" >&2; exit 1; }
deb=$(ls "$out"/kvtd_*.deb)
echo "== $(basename "$deb"): $(stat -c %s "$deb") bytes"

dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./|/|' > "$out/files"
for f in /usr/bin/kvtd /usr/lib/libkvtd_client.so.1 /usr/include/kvtd/kvtd_client.h /usr/lib/cmake/kvtd/kvtdConfig.cmake \
         /usr/lib/pkgconfig/kvtd.pc /usr/lib/python3/dist-packages/kvtd/__init__.py /usr/lib/systemd/system/kvtd@.service \
         /usr/lib/systemd/system/kvtd.target /usr/lib/systemd/system/kvtd-group@.target \
         /usr/share/doc/kvtd/kvtd.toml.example /usr/share/doc/kvtd/group.toml.example /usr/share/doc/kvtd/copyright \
         /usr/share/doc/kvtd/changelog.gz /usr/share/man/man1/kvtd.1.gz /usr/share/man/man1/kvtd-loadgen.1.gz; do
  grep -qx "$f" "$out/files" || { echo "the package lacks $f" >&2; cat "$out/files" >&2; exit 1; }
done
if grep -q '__pycache__' "$out/files"; then
  echo "the package carries a __pycache__:" >&2; grep '__pycache__' "$out/files" >&2; exit 1
fi
if grep -v '^/usr/' "$out/files" | grep -v '^/$' | grep -q .; then
  echo "files outside /usr:" >&2; grep -v '^/usr/' "$out/files" >&2; exit 1
fi
echo "contents: $(grep -vc '/$' "$out/files") files, all under /usr"

echo "== control and maintainer scripts"
dpkg-deb -e "$deb" "$out/control"
grep -q '^Depends:.*adduser' "$out/control/control" || { echo "Depends lacks adduser (postinst uses it)" >&2; exit 1; }
grep -q '^Depends:.*libzmq5' "$out/control/control" || { echo "Depends lacks libzmq5 (dpkg-shlibdeps)" >&2; exit 1; }
grep -q 'adduser --system --group .* kvtd' "$out/control/postinst" || { echo "postinst makes no kvtd system user" >&2; exit 1; }
grep -qx 'activate-noawait ldconfig' "$out/control/triggers" || { echo "no ldconfig trigger" >&2; exit 1; }
sh -n "$out/control/postinst" && sh -n "$out/control/postrm"
echo "Depends: $(sed -n 's/^Depends: //p' "$out/control/control")"

echo "== the payload runs"
dpkg-deb -x "$deb" "$out/root"
grep -q "^ExecStart=/usr/bin/kvtd --instance %i " "$out/root/usr/lib/systemd/system/kvtd@.service" ||
  { echo "the packaged unit does not start /usr/bin/kvtd:" >&2; grep ExecStart "$out/root/usr/lib/systemd/system/kvtd@.service" >&2; exit 1; }
"$out/root/usr/bin/kvtd" --version
# `man kvtd` from the package's man tree: the page carries the daemon's flags.
LC_ALL=C MANPATH="$out/root/usr/share/man" MANPAGER=cat MANWIDTH=100 man kvtd > "$out/man.txt" 2>&1 ||
  { echo "man kvtd fails on the packaged page:" >&2; cat "$out/man.txt" >&2; exit 1; }
for want in "--rank" "--host-pool-pin-threads" "kvtd - KV-cache transfer daemon"; do
  grep -qF -- "$want" "$out/man.txt" || { echo "man kvtd lacks '$want':" >&2; head -40 "$out/man.txt" >&2; exit 1; }
done
LC_ALL=C MANPATH="$out/root/usr/share/man" MANPAGER=cat man kvtd-loadgen 2>&1 | grep -qF -- "--blocks-per-task" ||
  { echo "man kvtd-loadgen lacks its flags" >&2; exit 1; }
echo "man kvtd: $(wc -l < "$out/man.txt") lines"
if [ -x /usr/bin/python3 ]; then
  KVTD_CLIENT_LIBRARY="$out/root/usr/lib/libkvtd_client.so.1" PYTHONPATH="$out/root/usr/lib/python3/dist-packages" \
    /usr/bin/python3 -c "import kvtd; print('python module kvtd', kvtd.__version__, 'over the packaged library')" 2>&1 ||
    { echo "the packaged Python module does not load the packaged library" >&2; exit 1; }
fi

echo "== lintian"
if command -v lintian > /dev/null; then
  lintian --allow-root "$deb" > "$out/lintian" 2>&1 || true
  cat "$out/lintian"
  if grep -q '^E:' "$out/lintian"; then echo "lintian reports errors" >&2; exit 1; fi
  echo "lintian: no errors ($(grep -c '^W:' "$out/lintian" || true) warnings)"
else
  echo "(lintian not installed: skipped; scripts/setup.sh installs it)"
fi
echo "package OK"
