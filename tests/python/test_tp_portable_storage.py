"""Stored KV shared across tensor-parallel sizes, against real daemons and their real file store:
written by a TP-2 deployment, read by TP-4 and TP-1 ones, every byte compared head by head.

A head-split cache stored by head (--storage-object-heads N, kvtd/proto/object_slices.h) is named
by global KV head, so any TP size whose heads per rank N divides finds and loads it; stored by
rank (the default) it is only this TP size's. A replicated (MLA) cache is one copy rank 0 writes
and every rank of any TP size reads. Heads are a block's outermost dimension on every engine
kvtd serves (FastDeploy's [blocks, kv_heads, block_size, head_dim], cache_transfer_manager.py;
sglang's and vLLM's per-rank caches hold the rank's heads, head = rank * heads_per_rank + h)."""

from __future__ import annotations

import json
import os
import subprocess

import torch

import kvtd

HEADS = 8  # the model's KV heads (Llama-3.1-8B: num_key_value_heads 8)
LAYERS = 3


def geometry(tp, mla=False):
    per_rank = 1 if mla else HEADS // tp
    shape = (32, per_rank, 4, 8 if not mla else 36)
    return kvtd.Geometry(num_ranks=tp, num_layers=LAYERS, key_shape=shape, value_shape=None if mla else shape,
                         num_host_blocks=8)


def kinds(mla):
    return ("key",) if mla else ("key", "value")


def heads_of(s, g, blocks, mla=False):
    """{(layer, kind): [len(blocks), global heads, bytes per head]} assembled from every rank."""
    out = {}
    for layer in range(LAYERS):
        for k in kinds(mla):
            per_rank = [s.host_tensor(r, layer, k, dtype=torch.uint8)[blocks].view(len(blocks), g.key_shape[1], -1)
                        for r in range(g.num_ranks)]
            out[(layer, k)] = per_rank[0].clone() if mla else torch.cat(per_rank, dim=1)
    return out


def fill(s, g, seed):
    gen = torch.Generator().manual_seed(seed)
    for r in range(g.num_ranks):
        for layer in range(LAYERS):
            for k in ("key", "value") if g.value_shape is not None else ("key",):
                t = s.host_tensor(r, layer, k, dtype=torch.uint8)
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def storage_status(c):
    """Each rank's `kvtd ctl status` storage section."""
    out = subprocess.run([os.environ["KVTD_BINARY"], "ctl", "--session", c.suffix, "--json", "status"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [r["result"]["storage"] for r in json.loads(out.stdout)]


def store_flags(store, *more):
    return ["--storage-backend", "file", "--storage-path", str(store), "--model-id", "tp", *more]


def test_kv_written_at_tp2_loads_at_tp4_and_tp1_byte_for_byte(cluster, tmp_path):
    store = tmp_path / "store"
    by_head = store_flags(store, "--storage-object-heads", "2")
    keys = [f"p{i}" for i in range(5)]
    w = cluster(geometry(2), by_head)
    s2 = w.ready()
    fill(s2, w.geometry, seed=7)
    assert s2.wait(s2.storage_write(keys, [0, 1, 2, 3, 4])).ok
    written = heads_of(s2, w.geometry, [0, 1, 2, 3, 4])

    namespaces = {st["layout_fingerprint"] for st in storage_status(w)}
    assert [st["objects_per_block"] for st in storage_status(w)] == [2, 2]
    for tp in (4, 1):
        r = cluster(geometry(tp), by_head)
        s = r.ready()
        status = storage_status(r)
        assert all(st["objects"] == "by_head" and st["heads_per_object"] == 2 for st in status)
        namespaces |= {st["layout_fingerprint"] for st in status}
        assert s.wait(s.storage_query(keys)).blocks_done == 5, f"TP {tp} finds every key"
        res = s.wait(s.storage_read(keys, [20, 21, 22, 23, 24]))
        assert res.blocks_done == 5, f"TP {tp}"
        loaded = heads_of(s, r.geometry, [20, 21, 22, 23, 24])
        for where, want in written.items():
            assert torch.equal(loaded[where], want), f"TP {tp}: layer/kind {where} differs"

    assert len(namespaces) == 1, f"one namespace for every TP size, `kvtd ctl status` shows {namespaces}"

    # Stored by rank, objects belong to their TP size: a TP-4 deployment finds none of TP 2's.
    by_rank = store_flags(tmp_path / "by_rank")
    w2 = cluster(geometry(2), by_rank)
    s = w2.ready()
    fill(s, w2.geometry, seed=8)
    assert s.wait(s.storage_write(keys, [0, 1, 2, 3, 4])).ok
    c4 = cluster(geometry(4), by_rank)
    r4 = c4.ready()
    assert r4.wait(r4.storage_query(keys)).blocks_done == 0
    assert storage_status(w2)[0]["layout_fingerprint"] != storage_status(c4)[0]["layout_fingerprint"]


def test_a_replicated_cache_written_once_loads_at_any_tp(cluster, tmp_path):
    store = tmp_path / "store"
    keys = [f"m{i}" for i in range(4)]
    w = cluster(geometry(2, mla=True), store_flags(store))
    s2 = w.ready()
    fill(s2, w.geometry, seed=9)
    for r in range(1, 2):  # every rank holds the same latent
        for layer in range(LAYERS):
            s2.host_tensor(r, layer, "key", dtype=torch.uint8).copy_(s2.host_tensor(0, layer, "key", dtype=torch.uint8))
    assert s2.wait(s2.storage_write(keys, [0, 1, 2, 3])).ok
    objects = [f for _, _, files in __import__("os").walk(store) for f in files if f.endswith(".kvo")]
    assert len(objects) == 4, "rank 0 writes the one copy"
    written = heads_of(s2, w.geometry, [0, 1, 2, 3], mla=True)
    r = cluster(geometry(4, mla=True), store_flags(store))
    s4 = r.ready()
    assert s4.wait(s4.storage_read(keys, [5, 6, 7, 8])).blocks_done == 4
    for rank in range(4):
        for layer in range(LAYERS):
            got = s4.host_tensor(rank, layer, "key", dtype=torch.uint8)[[5, 6, 7, 8]].view(4, 1, -1)
            assert torch.equal(got, written[(layer, "key")]), f"rank {rank} layer {layer}"


def test_object_heads_that_do_not_divide_a_ranks_heads_are_refused_by_name(tmp_path):
    import subprocess

    import kvtd.testing

    args = kvtd.testing.daemon_args(kvtd.testing.find_binary(), "never", 0, geometry(4),
                                    store_flags(tmp_path, "--storage-object-heads", "4"))
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "--storage-object-heads 4 does not divide this rank's 2 KV heads" in out.stderr + out.stdout


def test_heads_on_several_ranks_are_written_once_and_read_by_each(cluster, tmp_path):
    """2 KV heads at TP 4: ranks 0-1 hold head 0, ranks 2-3 head 1 (vLLM and sglang give rank r head
    r / (ranks / heads)). By rank and by head alike, the first rank of a head writes it, every
    rank holding it reads it, and by head a TP-2 deployment loads the same objects."""
    keys = [f"g{i}" for i in range(3)]

    def replicated_heads(tp):
        return kvtd.Geometry(num_ranks=tp, num_layers=LAYERS, key_shape=(32, 1, 4, 8), value_shape=(32, 1, 4, 8),
                             num_host_blocks=8)

    for mode, store in (("by rank", tmp_path / "r"), ("by head", tmp_path / "h")):
        more = ["--storage-kv-heads", "2"] + (["--storage-object-heads", "1"] if mode == "by head" else [])
        w = cluster(replicated_heads(4), store_flags(store, *more))
        s = w.ready()
        fill(s, w.geometry, seed=11)
        for r in (1, 3):  # a head's ranks hold the same bytes, as in a real engine
            for layer in range(LAYERS):
                for k in ("key", "value"):
                    s.host_tensor(r, layer, k, dtype=torch.uint8).copy_(s.host_tensor(r - 1, layer, k, dtype=torch.uint8))
        assert s.wait(s.storage_write(keys, [0, 1, 2])).ok
        objects = [f for _, _, files in __import__("os").walk(store) for f in files if f.endswith(".kvo")]
        assert len(objects) == 2 * len(keys), f"{mode}: one copy of each head"
        want = {(r, layer, k): s.host_tensor(r, layer, k, dtype=torch.uint8)[[0, 1, 2]].clone()
                for r in range(4) for layer in range(LAYERS) for k in ("key", "value")}
        for r in range(4):
            for layer in range(LAYERS):
                for k in ("key", "value"):
                    s.host_tensor(r, layer, k, dtype=torch.uint8)[[9, 10, 11]] = 0
        assert s.wait(s.storage_read(keys, [9, 10, 11])).blocks_done == 3, mode
        for (r, layer, k), v in want.items():
            assert torch.equal(s.host_tensor(r, layer, k, dtype=torch.uint8)[[9, 10, 11]], v), (mode, r, layer, k)
        if mode == "by head":
            r2 = cluster(replicated_heads(2), store_flags(store, "--storage-object-heads", "1"))
            s2 = r2.ready()
            assert s2.wait(s2.storage_read(keys, [4, 5, 6])).blocks_done == 3
            for layer in range(LAYERS):
                for k in ("key", "value"):
                    for rank2, rank4 in ((0, 0), (1, 2)):
                        got = s2.host_tensor(rank2, layer, k, dtype=torch.uint8)[[4, 5, 6]]
                        assert torch.equal(got, want[(rank4, layer, k)]), (rank2, layer, k)
