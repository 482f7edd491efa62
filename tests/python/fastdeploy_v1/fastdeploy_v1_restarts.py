"""FastDeploy v1 scenarios where something restarts: the daemon between an eviction and the load,
the worker (its process SIGKILLed, a new one beside the same daemon). Run by
fastdeploy_v1_scenarios.py, whose helpers they use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import torch

import fastdeploy_v1_harness as fh
from fastdeploy_v1_scenarios import (BLOCK_SIZE, HEAD_DIM, HEADS, LAYERS, Deployment, finished, hashes, kv_bytes, kv_of)
from kvtd import Geometry
from kvtd.testing import Daemons

SCENARIOS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastdeploy_v1_scenarios.py")


def host_tier_survives_a_daemon_restart(tp: int) -> None:
    """Blocks evicted, then every rank's daemon SIGKILLed and restarted (systemd's
    Restart=on-failure): the load after it brings back every byte from the pool the new daemon
    mapped again (FastDeploy's own host cache is private memory of its worker)."""
    d = Deployment(tp, gpu_blocks=8, cpu_blocks=16)
    try:
        a = d.schedule("a", hashes("a", 6))
        d.step([a])
        b = d.schedule("b", hashes("b", 8))
        evict, _ = d.step([b])
        assert evict is not None and evict.success, evict
        sessions = [c.transfer_manager._ready_session() for c in d.controllers]
        for daemons, s in zip(d.daemons, sessions):
            daemons.kill_and_restart(0, s)
        deadline = time.monotonic() + 30
        for s in sessions:
            while s.rank_ready(0) != 3:
                assert time.monotonic() < deadline, "the restarted daemon did not attach within 30 s"
                time.sleep(0.02)
        a2 = d.schedule("a2", hashes("a", 6) + hashes("c", 1))
        _, swap = d.step([a2])
        assert swap is not None and len(swap.src_block_ids) == 6 and finished(swap).success, swap
    except BaseException:
        print(d.logs(), file=sys.stderr)
        raise
    finally:
        d.close()


def _worker(suffix_prefix: str, gpu_blocks: int, cpu_blocks: int):
    """One FastDeploy worker of rank 0: its controller, its device tensors (ShmDevice)."""
    os.environ["KVTD_FDV1_SESSION"] = suffix_prefix
    device = fh.make_device()
    v1 = fh.load(device)
    cfg = fh.fd_config(v1, tp=1, layers=LAYERS, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, kv_heads=HEADS,
                       block_size=BLOCK_SIZE, head_dim=HEAD_DIM)
    c = v1.CacheController(cfg, local_rank=0, device_id=0)
    c.initialize_kv_cache(fh.AttentionBackend(cfg), gpu_blocks)
    return device, c


def worker_that_dies_after_evicting(tp: int) -> None:
    """The first worker: writes KV into device blocks 0..5, evicts them to host blocks 10..15
    through its controller, then dies by SIGKILL (nothing orderly runs)."""
    device, c = _worker(os.environ["KVTD_TEST_PREFIX"], 8, 16)
    for layer in range(LAYERS):
        for kind in (0, 1):
            view = kv_bytes(c, layer, kind)
            for b in range(6):
                view[b].copy_(kv_of(f"w{b}", 0, layer, kind, view.shape[1]))
    from fastdeploy.cache_manager.v1.metadata import CacheSwapMetadata

    meta = CacheSwapMetadata(src_block_ids=list(range(6)), dst_block_ids=list(range(10, 16)))
    c.submit_swap_tasks(meta, None)
    c._wait_for_pending_evict_counters()
    assert finished(meta).success, meta.error_message
    print(f"evicted {c.transfer_manager._ready_session().generation:016x}", flush=True)
    device.close()  # the device memory goes with the worker
    os.kill(os.getpid(), 9)


def _another_engine_sweeps(dead_suffix: str, dead_pool: str, g: Geometry) -> None:
    """Another engine on the machine creates a session while the worker is dead, its pool an hour
    old (mmap writes do not refresh a pool's time, so a long-lived one always is): its create
    sweeps what dead engines left. The dead worker's segment goes; the pool its daemon keeps must
    not (CI once lost it this way: the restarted worker then found nothing to take over)."""
    hour_ago = time.time() - 3600
    os.utime(dead_pool, (hour_ago, hour_ago))
    from kvtd import Session

    with Session(f"{dead_suffix}_other", g):
        pass
    assert not os.path.exists(f"/dev/shm/kvtd_{os.getuid()}_{dead_suffix}"), "the dead session was not swept"
    assert os.path.exists(dead_pool), "another engine's sweep removed the pool the daemon keeps"


def host_tier_survives_a_worker_restart(tp: int, adopt: bool = True) -> None:
    """The daemon outlives the worker. The first worker evicts blocks and dies (SIGKILL); another
    engine's session sweeps meanwhile; the engine's CacheManager still names those host blocks,
    so the restarted worker loads them: every byte comes back from the pool the daemon kept and
    its session took over. With KVTD_FDV1_ADOPT_HOST_TIER=0 the daemon drops the kept pool, the
    new session starts with an empty host tier and the load fails, reporting no layer."""
    prefix = f"fdv1w_{uuid.uuid4().hex[:8]}"
    shape = (8, HEADS, BLOCK_SIZE, HEAD_DIM)
    g = Geometry(num_ranks=1, num_layers=LAYERS, key_shape=shape, value_shape=shape, num_host_blocks=16)
    daemons = Daemons(None, f"{prefix}_r0", g, fh.daemon_flags()).start()
    try:
        env = dict(os.environ, KVTD_TEST_PREFIX=prefix)
        first = subprocess.run([sys.executable, SCENARIOS_FILE, "worker_that_dies_after_evicting", "1"], env=env,
                               capture_output=True, text=True, timeout=90)
        assert first.returncode == -9 and "evicted" in first.stdout, (first.returncode, first.stdout, first.stderr)
        dead_generation = first.stdout.split("evicted ")[1].split()[0]
        dead_pool = f"/dev/shm/kvtd_{os.getuid()}_{dead_generation}_host0"
        _another_engine_sweeps(f"{prefix}_r0", dead_pool, g)
        if not adopt:
            os.environ["KVTD_FDV1_ADOPT_HOST_TIER"] = "0"
        device, c = _worker(prefix, 8, 16)
        try:
            tm = c.transfer_manager
            done = []
            ok = tm.load_layers_to_device_async(list(range(LAYERS)), list(range(10, 16)), [7, 6, 5, 4, 3, 2], done.append)
            stats = tm.get_stats()
            assert not os.path.exists(dead_pool), "the kept pool is neither taken over nor dropped"
            if not adopt:
                assert not ok and done == [] and not stats["kvtd_host_tier_taken_over"], (ok, done, stats)
                assert any("host_tier_lost" in f for f in tm.failures), list(tm.failures)
                return
            assert ok and done == list(range(LAYERS)), (ok, done, list(tm.failures))
            assert stats["kvtd_host_tier_taken_over"], stats
            for layer in range(LAYERS):
                for kind in (0, 1):
                    view = kv_bytes(c, layer, kind)
                    for b, dst in zip(range(6), [7, 6, 5, 4, 3, 2]):
                        if not torch.equal(view[dst], kv_of(f"w{b}", 0, layer, kind, view.shape[1]).to(view.device)):
                            raise AssertionError(f"layer {layer} kind {kind}: device block {dst} is not host block "
                                                 f"{10 + b}'s KV from the first worker")
        finally:
            c.transfer_manager.close()
            device.close()
    except BaseException:
        print(daemons.logs(), file=sys.stderr)
        raise
    finally:
        daemons.stop()


def host_tier_not_adopted_when_switched_off(tp: int) -> None:
    host_tier_survives_a_worker_restart(tp, adopt=False)


SCENARIOS = {"host_tier_survives_a_daemon_restart": host_tier_survives_a_daemon_restart,
             "worker_that_dies_after_evicting": worker_that_dies_after_evicting,
             "host_tier_survives_a_worker_restart": host_tier_survives_a_worker_restart,
             "host_tier_not_adopted_when_switched_off": host_tier_not_adopted_when_switched_off}
