"""kvtd as FastDeploy cache manager v1's transfer path, proven with FastDeploy's own v1 code.

Each scenario of fastdeploy_v1_scenarios.py runs in a process of its own (FastDeploy's package
there is the v1 reference; the v0 harness in this process loads another copy), under a watchdog:
a hang fails the test after WATCHDOG_S. FastDeploy's CacheManager schedules, its CacheController
per rank swaps through kvtd.fastdeploy_v1 against real daemons (host backend), every KV byte is
compared per layer on every rank.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import fastdeploy_v1_harness as fh

pytestmark = pytest.mark.skipif(fh.source() is None, reason=fh.skip_reason())

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WATCHDOG_S = 120


@functools.lru_cache(maxsize=None)
def dist_info_dir() -> Path:
    """Where kvtd's dist-info (FastDeploy finds the plugin's entry point in it) is: the one the build
    made from python/dist-info (ctest sets KVTD_DIST_INFO_DIR), else one made here from the same
    templates as the build makes it (a run by hand)."""
    if os.environ.get("KVTD_DIST_INFO_DIR"):
        return Path(os.environ["KVTD_DIST_INFO_DIR"])
    import kvtd

    tmp = Path(tempfile.mkdtemp(prefix="kvtd_dist_info_"))
    made = tmp / f"kvtd-{kvtd.__version__}.dist-info"
    made.mkdir(parents=True, exist_ok=True)
    src = ROOT / "python" / "dist-info"
    (made / "METADATA").write_text((src / "METADATA.in").read_text().replace("@PROJECT_VERSION@", kvtd.__version__))
    (made / "entry_points.txt").write_text((src / "entry_points.txt").read_text())
    return tmp


def run(scenario: str, tp: int) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(dist_info_dir()), str(HERE), str(HERE.parent),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("KVTD_BINARY", str(ROOT / "build" / "daemon" / "kvtd"))
    try:
        out = subprocess.run([sys.executable, str(HERE / "fastdeploy_v1_scenarios.py"), scenario, str(tp)],
                             env=env, capture_output=True, text=True, timeout=WATCHDOG_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario} (tp {tp}) hung for {WATCHDOG_S} s\n{e.stdout}\n{e.stderr}")
    assert out.returncode == 0 and out.stdout.rstrip().endswith("ok"), \
        f"{scenario} (tp {tp}) exit {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-8000:]}"
    return out.stdout


@pytest.mark.parametrize("tp", [1, 2])
def test_fastdeploys_scheduler_evicts_under_pressure_and_swaps_back_every_byte(tp):
    run("evict_and_swap_back", tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_block_wise_fp8_caches_and_their_scales_swap_back_every_byte(tp):
    run("fp8_evict_and_swap_back", tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_host_tier_survives_a_daemon_restart_between_eviction_and_load(tp):
    run("host_tier_survives_a_daemon_restart", tp)


def test_the_host_tier_survives_a_worker_restart_beside_the_same_daemon():
    run("host_tier_survives_a_worker_restart", 1)


def test_without_adoption_a_restarted_workers_load_of_the_old_host_blocks_fails_reporting_no_layer():
    run("host_tier_not_adopted_when_switched_off", 1)


def test_four_callers_at_once_each_get_their_own_bytes_back():
    run("four_callers_at_once", 1)


def test_a_daemon_started_late_serves_the_worker_that_waited_for_it():
    run("daemon_starts_late", 1)


def test_a_failed_eviction_answers_at_once_and_its_host_blocks_never_load():
    run("failed_eviction_answers_at_once", 1)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_daemon_killed_mid_load_fails_the_load_and_reports_no_later_layer(tp):
    out = run("daemon_killed_mid_load", tp)
    assert "reported" in out and "of 32 layers before the failure" in out, out


@pytest.mark.parametrize("tp", [1, 2])
def test_a_local_rank_at_least_the_tp_size_finds_its_tensors(tp):
    run("local_rank_beyond_tp", tp)


def test_fastdeploys_plugin_loader_installs_kvtd_only_when_switched_on():
    run("plugin_entry_point", 1)


def test_fastdeploys_own_transfer_manager_unit_tests_pass_against_kvtds_and_the_process_exits_cleanly():
    out = run("fastdeploy_unit_tests", 1)
    assert "Ran 27 tests" in out, out
