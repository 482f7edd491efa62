"""`kvtd ctl storage gc` against real daemons and their real file store: a store
filled across two weight versions, collected, the old objects' bytes gone from the disk and the
current ones still loading byte for byte; routers told (KV events); a dry run and a bad request."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import kvtd
import kvtd.control

from conftest import small_geometry


def fill(s, g, seed):
    gen = torch.Generator().manual_seed(seed)
    for r in range(g.num_ranks):
        for layer in range(g.num_layers):
            for k in ("key", "value"):
                t = s.host_tensor(r, layer, k, dtype=torch.uint8)
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def blocks_of(s, g, blocks):
    return {(r, layer, k): s.host_tensor(r, layer, k, dtype=torch.uint8)[blocks].clone()
            for r in range(g.num_ranks) for layer in range(g.num_layers) for k in ("key", "value")}


def store_bytes(root):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files if f.endswith(".kvo"))


def ctl(c, *args):
    out = subprocess.run([os.environ["KVTD_BINARY"], "ctl", "--session", c.suffix, "--json", *args],
                         capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout, out.stderr


def test_gc_removes_the_old_weight_version_and_the_current_one_still_loads(cluster, tmp_path):
    store = tmp_path / "store"
    c = cluster(extra=["--storage-backend", "file", "--storage-path", str(store), "--model-id", "gc"])
    s = c.ready()
    g = c.geometry
    fill(s, g, seed=1)
    old_keys = [f"old{i}" for i in range(6)]
    assert s.wait(s.storage_write(old_keys, list(range(6)))).ok
    s.set_weight_version(2)
    fill(s, g, seed=2)
    new_keys = [f"new{i}" for i in range(4)]
    assert s.wait(s.storage_write(new_keys, list(range(4)))).ok
    expected = blocks_of(s, g, [0, 1, 2, 3])
    before = store_bytes(store)
    per_object = before // (10 * g.num_ranks)

    # The engine's own call (kvtd.control, over the same control sockets) for the dry run.
    reports = kvtd.control.storage_gc(c.suffix, 2, dry_run=True)
    assert [r["rank"] for r in reports] == list(range(g.num_ranks))
    assert all(r["removed"] == 6 * g.num_ranks and r["dry_run"] for r in reports)
    assert store_bytes(store) == before

    code, out, err = ctl(c, "storage", "gc", "--keep-weight-version", "2")
    assert code == 0, err
    replies = json.loads(out)
    assert len(replies) == g.num_ranks
    # Both daemons walk the shared root: together they removed every old object, once.
    assert sum(r["result"]["removed"] for r in replies) == 6 * g.num_ranks
    assert all(r["result"]["complete"] and r["result"]["failed"] == 0 for r in replies)
    assert store_bytes(store) == before - 6 * g.num_ranks * per_object

    # The current version's objects still load, byte for byte; the old ones are gone.
    assert s.wait(s.storage_query(new_keys)).blocks_done == 4
    assert s.wait(s.storage_read(new_keys, [10, 11, 12, 13])).blocks_done == 4
    after = blocks_of(s, g, [10, 11, 12, 13])
    assert all(torch.equal(after[k], expected[k]) for k in expected)
    s.set_weight_version(1)
    assert s.wait(s.storage_query(old_keys)).blocks_done == 0


def test_gc_refuses_a_request_without_the_version_to_keep(cluster, tmp_path):
    c = cluster(extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "s"), "--model-id", "gc"])
    c.ready()
    code, _, err = ctl(c, "storage", "gc")
    assert code == 2 and "--keep-weight-version" in err
    code, _, err = ctl(c, "storage", "sweep", "--keep-weight-version", "1")
    assert code == 2 and "gc" in err


def test_gc_without_a_store_says_so(cluster):
    c = cluster()
    c.ready()
    code, _, err = ctl(c, "storage", "gc", "--keep-weight-version", "1")
    assert code == 1 and "no storage tier" in err
    with pytest.raises(kvtd.KvtdError, match="no storage tier"):
        kvtd.control.storage_gc(c.suffix, 1)
    with pytest.raises(kvtd.KvtdError, match="no daemon of session"):
        kvtd.control.storage_gc(c.suffix + "-none", 1)
