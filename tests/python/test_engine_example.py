"""examples/engine.py end to end against real daemons: its own byte check must pass."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def run_engine(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "engine.py"), *args], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_engine_loop_reloads_layer_by_layer_and_checks_every_byte():
    out = run_engine("--requests", "150", "--session", f"py_engine_{os.getpid()}")
    assert "byte check: OK" in out
    reloads = int(out.split("host reloads ")[1].split(",")[0])
    assert reloads > 0, out  # the LRU really evicted and reloaded


def test_engine_loop_with_a_file_store_reads_dropped_blocks_back(tmp_path):
    out = run_engine("--requests", "150", "--host-blocks", "40", "--storage-path", str(tmp_path / "store"),
                     "--session", f"py_engine_st_{os.getpid()}")
    assert "byte check: OK" in out
    assert int(out.split("storage reads ")[1].split(",")[0]) > 0, out
