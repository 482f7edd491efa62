#!/usr/bin/env bash
# Builds kvtd (scripts/setup.sh first) and its Debian package: build/kvtd_<version>_<arch>.deb.
# Install it with: apt install ./build/kvtd_<version>_<arch>.deb
set -euo pipefail
source "$(dirname "$0")/lib.sh"
kvtd_prepare
cpack -G DEB --config "$KVTD_BUILD_DIR/CPackConfig.cmake" -B "$KVTD_BUILD_DIR" > /dev/null
rm -rf "$KVTD_BUILD_DIR/_CPack_Packages"
ls "$KVTD_BUILD_DIR"/kvtd_*.deb
