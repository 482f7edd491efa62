#!/usr/bin/env bash
# ReadmeLayoutNamesEveryModule: the layout table (docs/development.md) listed neither control/ nor
# metrics/. Every folder of the tree with a CMakeLists.txt (a module) must be in it, as `folder/`.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
table=$(sed -n '/^## Layout/,/^## /p' "$root/docs/development.md")
missing=0
while IFS= read -r cml; do
  dir=$(dirname "${cml#"$root"/}")
  case "$dir" in .|tests|tests/*|python|systemd|tools/*|client/engine|daemon/endpoint|daemon/ctl) continue ;; esac
  if ! grep -q "\`$dir/\`" <<<"$table"; then
    echo "[FAIL] the layout table of docs/development.md does not name $dir/"
    missing=$((missing + 1))
  fi
done < <(find "$root" -name CMakeLists.txt -not -path "*/build*" -not -path "*/.git/*" | sort)
[ "$missing" = 0 ] && echo "[ OK ] ReadmeLayoutNamesEveryModule"
exit "$missing"
