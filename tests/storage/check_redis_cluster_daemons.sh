#!/usr/bin/env bash
# The shared tier across nodes, through the daemons. A real three-master Redis
# Cluster (redis-server in cluster mode, ports outside the ephemeral range, started and stopped
# here) behind two engines' daemons: engine A's two ranks write, engine B (another session, its
# own two daemons, as on another node) reads every byte back. A master killed during reads: the
# reads end with a clear error, never a hang; restarted (its append-only file brings its objects
# back), the same daemons read every byte again (slot map refreshed). And daemons started while
# the cluster is unreachable find it once it is up (cluster mode re-detected).
# Usage: check_redis_cluster_daemons.sh <kvtd> <kvtd-loadgen>
set -euo pipefail
kvtd=$1 loadgen=$2
command -v redis-server > /dev/null && command -v redis-cli > /dev/null || { echo "no redis-server: skipped"; exit 77; }
work=$(mktemp -d /tmp/kvtd-rcluster.XXXXXX)
pids=()
servers=()
cleanup() {
  for p in "${pids[@]}" "${servers[@]}"; do kill -KILL "$p" 2> /dev/null || true; done
  for p in "${pids[@]}" "${servers[@]}"; do wait "$p" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# Ports and their cluster bus ports (port + 10000) below Linux's ephemeral range (32768-60999): a
# bus port inside it can be taken by any outgoing connection (this script once failed on 27852,
# bus 37852). 22000-22732 here (bus <= 32732); the C++ tests' servers use 10000-21999.
base=$((22000 + ($$ % 37) * 20))
geometry=(--mp-num 2 --num-layers 4 --num-host-blocks 8 --key-cache-shape 96,2,16,64 --value-cache-shape 96,2,16,64)
lg=(--ranks 2 --layers 4 --kv-heads 2 --block-size 16 --head-dim 64 --device-blocks 96 --host-blocks 8
    --mode storage-verify --storage redis --storage-blocks 40 --key-prefix rc --task-timeout 20)

start_node() {  # port: a cluster node with an append-only file, so a restart keeps its objects
  local port=$1
  mkdir -p "$work/$port"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$work/$port" --cluster-enabled yes \
    --cluster-config-file "nodes-$port.conf" --cluster-node-timeout 2000 --appendonly yes --appendfsync always \
    --save "" --daemonize no --logfile "$work/$port/log" &
  servers[$port]=$!
  for _ in $(seq 100); do
    redis-cli -p "$port" ping > /dev/null 2>&1 && return 0
    kill -0 "${servers[$port]}" 2> /dev/null || break  # exited: its log says why (a port in use)
    sleep 0.05
  done
  echo "redis-server on $port did not start; its log:" >&2
  tail -n 5 "$work/$port/log" >&2 || true
  return 1
}
make_cluster() {  # first port
  local p=$1
  for i in 0 1 2; do start_node $((p + i)); done
  redis-cli --cluster create 127.0.0.1:$p 127.0.0.1:$((p + 1)) 127.0.0.1:$((p + 2)) --cluster-replicas 0 \
    --cluster-yes > "$work/create.$p" 2>&1 || { cat "$work/create.$p" >&2; return 1; }
  wait_ok "$p"
}
wait_ok() {  # every node of the cluster at $1 says cluster_state:ok
  for _ in $(seq 200); do
    local ok=0
    for i in 0 1 2; do redis-cli -p $(($1 + i)) cluster info 2> /dev/null | grep -q "cluster_state:ok" && ok=$((ok + 1)); done
    [ $ok -eq 3 ] && return 0
    sleep 0.1
  done
  echo "cluster at $1 not ok" >&2; return 1
}
start_daemons() {  # session endpoints
  local session=$1 endpoints=$2
  for r in 0 1; do
    "$kvtd" --rank $r "${geometry[@]}" --session "$session" --storage-backend redis --redis-endpoints "$endpoints" \
      --model-id rc --log-level info --log-dir "$work/logs-$session" 2> /dev/null &
    pids+=($!)
  done
}
spread() {  # the three masters of the cluster at $1 each hold some of the objects
  for i in 0 1 2; do
    [ "$(redis-cli -p $(($1 + i)) dbsize)" -gt 0 ] || { echo "master $(($1 + i)) holds no object" >&2; return 1; }
  done
}

echo "== a three-master cluster on 127.0.0.1:$base-$((base + 2))"
make_cluster "$base"
start_daemons "rcA$$" "127.0.0.1:$base"
start_daemons "rcB$$" "127.0.0.1:$((base + 1))"  # engine B's daemons know another node

echo "== engine A writes through its daemons; engine B reads every byte back through its own"
"$loadgen" --session "rcA$$" "${lg[@]}" --storage-phase write
spread "$base"
"$loadgen" --session "rcB$$" "${lg[@]}" --storage-phase read

echo "== a master killed during reads: a clear error, no hang"
victim=$((base + 2))
"$loadgen" --session "rcB$$" "${lg[@]}" --storage-phase read > "$work/during" 2>&1 &
reader=$!
sleep 0.05
kill -KILL "${servers[$victim]}"
wait "${servers[$victim]}" 2> /dev/null || true
unset "servers[$victim]"
code=0
timeout 90 bash -c "while kill -0 $reader 2>/dev/null; do sleep 0.1; done" || { echo "the read hung" >&2; exit 1; }
wait "$reader" || code=$?
echo "read during the kill: exit $code ($(tail -n 1 "$work/during"))"
sleep 3  # past --cluster-node-timeout: the cluster marks the master failed
code=0
timeout 90 "$loadgen" --session "rcB$$" "${lg[@]}" --storage-phase read > "$work/down" 2>&1 || code=$?
[ $code -ne 124 ] || { echo "a read while the master is down hung" >&2; exit 1; }
[ $code -ne 0 ] || { echo "a read succeeded with a third of the slots down" >&2; cat "$work/down" >&2; exit 1; }
grep -qE "storage_unavailable|storage_error" "$work/down" || { echo "no clear error:" >&2; cat "$work/down" >&2; exit 1; }
echo "read while down: $(grep -oE "(storage_unavailable|storage_error)[^\"]{0,120}" "$work/down" | head -n 1)"

echo "== the master restarted: the same daemons read every byte again"
start_node "$victim"
wait_ok "$base"
for attempt in 1 2 3 4 5; do
  if "$loadgen" --session "rcB$$" "${lg[@]}" --storage-phase read > "$work/after" 2>&1; then break; fi
  [ $attempt -lt 5 ] || { cat "$work/after" >&2; exit 1; }
  sleep 1  # the daemons' reconnect backoff
done
tail -n 1 "$work/after"

echo "== daemons started while their cluster is unreachable find it once it is up"
late=$((base + 10))
start_daemons "rcC$$" "127.0.0.1:$late,127.0.0.1:$((late + 1))"
sleep 1
make_cluster "$late"
for attempt in 1 2 3 4 5; do
  if "$loadgen" --session "rcC$$" "${lg[@]}" --storage-phase both > "$work/late" 2>&1; then break; fi
  [ $attempt -lt 5 ] || { cat "$work/late" >&2; exit 1; }
  sleep 1
done
tail -n 1 "$work/late"
spread "$late"  # cluster mode: standalone against one node would have met MOVED for two thirds

echo "== SIGTERM: every daemon exits 0"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
echo "redis cluster through the daemons OK"
