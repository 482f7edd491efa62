"""Several engine processes, one per TP rank (sglang's schedulers, vLLM's workers): each makes a
session serving its rank alone (Session(only_rank=r), a suffix per rank) beside that rank's
daemon (--rank r --mp-num n). What they store is exactly what one engine process driving every
rank stores: a two-rank session reads each rank's slice back byte for byte. A daemon of another
rank is refused by name.

Also runnable as a script: `test_rank_sessions.py rank_process <suffix> <rank> <keys...>` is one
rank's engine process (it fills its rank's blocks from the rank's seed, stores them, exits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

import kvtd
import kvtd.testing

from conftest import small_geometry

BLOCKS = [1, 4, 6]


def rank_bytes(g, rank: int, layer: int, kind: str, block_bytes: int) -> torch.Tensor:
    """What rank `rank`'s process writes into each of BLOCKS, per layer and kind (its seed only)."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * layer + (kind == "value"))
    return torch.randint(0, 256, (len(BLOCKS), block_bytes), dtype=torch.uint8, generator=gen)


def rank_process(suffix: str, rank: int, keys) -> None:
    g = small_geometry()
    s = kvtd.Session(suffix, g, only_rank=rank)
    try:
        s.create_host_device_tensors()
        for layer in range(g.num_layers):
            for kind in ("key", "value"):
                t = s.host_tensor(rank, layer, kind, dtype=torch.uint8)
                t[BLOCKS] = rank_bytes(g, rank, layer, kind, t.shape[1])
        s.publish()
        s.wait_ready(30)
        done = s.wait(s.storage_write(keys, BLOCKS))
        assert done.ok and done.blocks_done == len(keys), done
        # Its own rank's answer (sglang MIN-reduces these across its ranks itself).
        assert s.wait(s.storage_query(keys)).blocks_done == len(keys)
        print("stored", flush=True)
    finally:
        s.close()


def test_per_rank_processes_store_what_a_session_of_every_rank_reads_back(tmp_path):
    g = small_geometry()
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--model-id", "ranks"]
    base = f"py_ranks_{uuid.uuid4().hex[:8]}"
    keys = ["k0", "k1", "k2"]
    for r in range(g.num_ranks):
        with kvtd.testing.Daemons(None, f"{base}_r{r}", g, store, ranks=[r]) as d:
            out = subprocess.run([sys.executable, __file__, "rank_process", f"{base}_r{r}", str(r), *keys],
                                 capture_output=True, text=True, timeout=90, env=os.environ.copy())
            assert out.returncode == 0 and "stored" in out.stdout, (out.stdout, out.stderr, d.logs())
    # One object per rank and key: each process stored its own rank's slice, none overwrote another's.
    objects = [f for _, _, files in os.walk(tmp_path / "store") for f in files if f.endswith(".kvo")]
    assert len(objects) == g.num_ranks * len(keys), objects

    daemons = kvtd.testing.Daemons(None, f"{base}_all", g, store).start()
    s = kvtd.Session(f"{base}_all", g)
    try:
        s.create_host_device_tensors()
        s.publish()
        s.wait_ready(30)
        assert s.wait(s.storage_query(keys)).blocks_done == len(keys)
        dst = [10, 11, 12]
        done = s.wait(s.storage_read(keys, dst))
        assert done.ok and done.blocks_done == len(keys), done
        for r in range(g.num_ranks):
            for layer in range(g.num_layers):
                for kind in ("key", "value"):
                    t = s.host_tensor(r, layer, kind, dtype=torch.uint8)
                    want = rank_bytes(g, r, layer, kind, t.shape[1])
                    assert torch.equal(t[dst], want), f"rank {r} layer {layer} {kind}: not what rank {r}'s process stored"
    except BaseException:
        print(daemons.logs(), file=sys.stderr)
        raise
    finally:
        s.close()
        assert daemons.stop() == [0] * g.num_ranks


def test_a_daemon_of_another_rank_is_refused_naming_the_rank_it_serves():
    g = small_geometry()
    suffix = f"py_ranks_{uuid.uuid4().hex[:8]}_r0"
    s = kvtd.Session(suffix, g, only_rank=0)
    daemons = kvtd.testing.Daemons(None, suffix, g, ranks=[1])
    try:
        s.create_host_device_tensors()
        s.publish()
        daemons.start()
        code = daemons.procs[0].wait(30)
        log = daemons.logs()
        assert code != 0 and "serves rank 0 only" in log and "this daemon is rank 1" in log, (code, log)
    finally:
        daemons.stop()
        s.close()


def test_a_session_serving_one_rank_registers_and_waits_for_that_rank_alone():
    g = small_geometry()
    suffix = f"py_ranks_{uuid.uuid4().hex[:8]}_r1"
    with pytest.raises(ValueError, match="only_rank 2 is not a rank of the 2-rank geometry"):
        kvtd.Session(suffix, g, only_rank=2)
    s = kvtd.Session(suffix, g, only_rank=1)
    try:
        with pytest.raises(kvtd.KvtdError, match="serves rank 1 only"):
            s.register_tensor(0, 0, "key", bytes(64), 0, 1)
        s.create_host_device_tensors()  # rank 1's arena only
        assert s.host_tensor(1, 0, "key") is not None
        s.publish()  # complete with rank 1's tensors alone
        with kvtd.testing.Daemons(None, suffix, g, ranks=[1]) as d:
            try:
                s.wait_ready(30)
            except kvtd.KvtdError:
                raise AssertionError(d.logs())
            assert s.rank_ready(1) & kvtd._native.READY_HOST_POOL and not s.rank_alive(0)
            t = s.host_tensor(1, 0, "key", dtype=torch.uint8)
            t[2] = 7
            assert s.wait(s.swap_to_host([2], [5])).ok
    finally:
        s.close()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rank_process":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rank_process(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
