#!/usr/bin/env bash
# ctest deploy_test: what deploy/ ships for operators is valid and speaks kvtd's metrics.
# - the Prometheus alert rules pass `promtool check rules` and their unit tests
#   (`promtool test rules`: each alert fires when it should and not before);
# - the Grafana dashboard is JSON whose every query parses as PromQL (promtool checks each as a
#   recording rule, with the dashboard's $instance variable filled in);
# - every kvtd_* metric the rules and the dashboard read is one the daemon exports
#   (metrics/src/*.cpp render them).
# Exit 77 (skipped) without promtool (Debian: prometheus).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
command -v promtool >/dev/null || { echo "promtool is not installed (apt-get install prometheus)"; exit 77; }
python=${KVTD_PYTHON:-/usr/bin/python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cd "$root/deploy/prometheus"
promtool check rules kvtd-alerts.yml
promtool test rules kvtd-alerts.test.yml

# The dashboard's queries as recording rules: promtool parses each one.
"$python" - "$root/deploy/grafana/kvtd-dashboard.json" "$work/dashboard-rules.yml" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
assert exprs, "the dashboard has no queries"
assert d.get("uid") and d.get("title"), "the dashboard needs a uid and a title"
with open(sys.argv[2], "w") as out:
    out.write("groups:\n  - name: dashboard\n    rules:\n")
    for i, e in enumerate(exprs):
        e = e.replace("$instance", ".*")
        out.write(f"      - record: dashboard_query_{i}\n        expr: {json.dumps(e)}\n")
print(f"dashboard: {len(d['panels'])} panels, {len(exprs)} queries")
PY
promtool check rules "$work/dashboard-rules.yml"

# Every kvtd_* name read must be exported (histograms by their base name).
grep -ohE 'kvtd_[a-z_]+' "$root"/metrics/src/*.cpp | sort -u >"$work/exported"
grep -ohE 'kvtd_[a-z_]+' "$root/deploy/prometheus/kvtd-alerts.yml" "$root/deploy/grafana/kvtd-dashboard.json" |
  sed -E 's/_(bucket|sum|count)$//' | grep -vE '^kvtd_(overview|dashboard)$' | sort -u >"$work/read"
missing=$(comm -23 "$work/read" "$work/exported")
if [ -n "$missing" ]; then
  echo "deploy/ reads metrics the daemon does not export: $missing" >&2
  exit 1
fi
echo "deploy: rules, their tests, the dashboard and $(wc -l <"$work/read") metric names checked"
