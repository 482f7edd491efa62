#!/usr/bin/env bash
# Two engines (groups "alpha" and "beta", two ranks each) on one host, each
# daemon started by the very command line of the installed kvtd@.service with its instance name
# (%i), its environment files and config directory put in a temporary directory instead of
# /etc/kvtd and /var/log/kvtd. Each engine (kvtd-loadgen) verifies every byte of its swaps through
# its own two daemons while the other group runs; each group logs to its own files; the devices
# are chosen per instance (device-base + rank, or KVTD_DEVICE_ID from the env file); SIGTERM
# stops all four with exit 0. Also the installed units pass `systemd-analyze verify` for both
# forms of instance and for a group target with its members drop-in.
# Usage: check_groups.sh <install-prefix> <loadgen binary>
set -euo pipefail
prefix=$1 loadgen=$2
unit="$prefix/lib/systemd/system/kvtd@.service"
work=$(mktemp -d /tmp/kvtd-groups.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
etc="$work/etc" logs="$work/log"
mkdir -p "$etc" "$logs"

exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
[ -n "$exec_start" ] || { echo "no ExecStart in $unit" >&2; exit 1; }
case "$exec_start" in
  *"--instance %i --config-dir /etc/kvtd"*) ;;
  *) echo "the unit does not run --instance %i --config-dir /etc/kvtd: $exec_start" >&2; exit 1 ;;
esac
defaults=$(sed -n 's/^Environment=\(KVTD_[A-Z_]*=.*\)$/\1/p' "$unit")
env_files=$(sed -n 's/^EnvironmentFile=-//p' "$unit")

for g in alpha beta; do
  cat > "$etc/$g.toml" <<TOML
mp-num = 2
num-layers = 4
num-host-blocks = 32
cache-dtype = "bfloat16"
key-cache-shape = "64,2,16,64"
value-cache-shape = "64,2,16,64"
session = "grp${g}$$"
device-backend = "host"
device-base = $([ $g = alpha ] && echo 0 || echo 2)
log-level = "info"
TOML
done
# beta's rank 1 names its own device and an extra flag in its env file, as an operator would.
printf 'KVTD_DEVICE_ID=6\nKVTD_EXTRA_FLAGS=--log-summary-period 0\n' > "$etc/beta-1.env"

# One instance the way systemd starts it: defaults, then each env file that exists, then the
# ExecStart line with %i replaced; ${VAR} and $VAR expand as systemd expands them here (one
# word; split on whitespace).
start_instance() {
  local instance=$1 cmd
  cmd=${exec_start//%i/$instance}
  cmd=${cmd//\/etc\/kvtd/$etc}
  cmd=${cmd//\/var\/log\/kvtd/$logs}
  cmd=$(echo "$cmd" | sed "s|^[^ ]*/kvtd |$prefix/bin/kvtd |")
  (
    eval "export $defaults"
    for f in $env_files; do
      f=${f//%i/$instance}
      f=${f//\/etc\/kvtd/$etc}
      [ -f "$f" ] || continue
      # systemd's EnvironmentFile: KEY=VALUE, the value is the rest of the line.
      while IFS= read -r line; do
        case "$line" in [A-Za-z_]*=*) export "${line%%=*}=${line#*=}" ;; esac
      done < "$f"
    done
    eval "exec $cmd"
  ) 2> "$work/stderr.$instance" &
  pids+=($!)
}

echo "== four daemons: kvtd@alpha-0 kvtd@alpha-1 kvtd@beta-0 kvtd@beta-1"
for i in alpha-0 alpha-1 beta-0 beta-1; do start_instance $i; done

echo "== both engines at once, every byte verified"
for g in alpha beta; do
  "$loadgen" --session "grp${g}$$" --ranks 2 --layers 4 --kv-heads 2 --block-size 16 --head-dim 64 \
    --device-blocks 64 --host-blocks 32 --mode verify --iterations 20 --blocks-per-task 4 \
    --ready-timeout 30 > "$work/loadgen.$g" 2>&1 &
  engines+=($!)
done
for i in 0 1; do
  if ! wait "${engines[$i]}"; then
    cat "$work/loadgen.alpha" "$work/loadgen.beta" "$work"/stderr.* >&2
    exit 1
  fi
done
tail -n 1 "$work/loadgen.alpha" "$work/loadgen.beta"

echo "== SIGTERM: all four exit 0"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()

echo "== one log file per instance, each naming its group, rank and device"
for i in alpha-0:0:0 alpha-1:1:1 beta-0:0:2 beta-1:1:6; do
  IFS=: read -r inst rank device <<< "$i"
  log="$logs/kvtd_${inst%-*}_dp0_rank$rank.log"
  [ -f "$log" ] || { echo "missing $log; have: $(ls "$logs")" >&2; exit 1; }
  grep -q "kvtd group ${inst%-*} rank $rank/2 device $device " "$log" ||
    { echo "$log does not name device $device:" >&2; head -n 5 "$log" >&2; exit 1; }
  echo "$inst: $(basename "$log"), device $device"
done

echo "== systemd-analyze verify: kvtd@0, kvtd@alpha-1, kvtd-group@alpha.target with its members"
if command -v systemd-analyze > /dev/null; then
  units="$work/units"
  mkdir -p "$units/kvtd-group@alpha.target.d"
  sed "s|^ExecStart=[^ ]*/kvtd |ExecStart=$prefix/bin/kvtd |" "$unit" > "$units/kvtd@.service"
  cp "$prefix/lib/systemd/system/kvtd.target" "$prefix/lib/systemd/system/kvtd-group@.target" "$units/"
  sed 's/llama/alpha/g; s/ kvtd@alpha-2.service kvtd@alpha-3.service//g' \
    "$prefix/share/doc/kvtd/group-members.conf.example" > "$units/kvtd-group@alpha.target.d/members.conf"
  if ! out=$(cd "$units" && SYSTEMD_UNIT_PATH="$units:" systemd-analyze verify \
      kvtd@0.service kvtd@alpha-1.service kvtd-group@alpha.target 2>&1) || [ -n "$out" ]; then
    echo "systemd-analyze verify complained:" >&2
    echo "$out" >&2
    exit 1
  fi
  grep -q "PropagatesStopTo=kvtd@alpha-0.service kvtd@alpha-1.service" "$units/kvtd-group@alpha.target.d/members.conf"
  echo "units verified"
else
  echo "(systemd-analyze not installed: skipped)"
fi
echo "groups OK"
