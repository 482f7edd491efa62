"""Sessions whose cache is cache groups, served by real daemons (host backend): the geometries of
four real models, built from their published config.json fields (kvtd.models; the configs are
cited in test_models.py), each swapped out and back in, every byte of every group's tensors
compared. Plus what a group session refuses, by name. Their storage tasks:
test_cache_group_storage.py.

The wire shape (kvtd/proto/group_slots.h): slot k of a layer holds its attention group's tensors,
then its indexer group's; a task names blocks in one id space, the groups' blocks side by side."""

from __future__ import annotations

import numpy as np
import pytest

import kvtd
from kvtd import models

from test_models import DEEPSEEK_V32, GPT_OSS_20B, LLAMA_31_8B, QWEN3_NEXT_80B

# Small block counts: the tensors stay a few MiB per rank while every layer and tensor is real.
MODELS = {
    "llama-3.1-8b": lambda: models.plain_attention(LLAMA_31_8B, 2, device_blocks=8, host_blocks=12),
    "gpt-oss-20b": lambda: models.sliding_and_full(GPT_OSS_20B, 2, device_blocks=8, host_blocks=12),
    "qwen3-next-80b": lambda: models.linear_and_full(QWEN3_NEXT_80B, 4, device_blocks=8, host_blocks=12,
                                                     state_slots=4, host_state_slots=6),
    "deepseek-v3.2": lambda: models.mla_with_indexer(DEEPSEEK_V32, 1, device_blocks=8, host_blocks=12),
}


def block_bytes(tensor):
    element_bytes, dims = tensor
    return element_bytes * int(np.prod(dims))


def views(s, groups, rank, group):
    """[(layer, slot, bytes per block, the device tensor as uint8)] of `group` on `rank`."""
    out = []
    for layer in groups.groups[group].layers:
        for slot, (g, t) in enumerate(groups.slots(layer)):
            if g == group:
                out.append((layer, slot, block_bytes(groups.groups[g].tensors[t]), s.host_array(rank, layer, slot)))
    return out


def blocks_of(view, ids):
    _, _, bb, a = view
    return np.stack([a[b * bb:(b + 1) * bb] for b in ids])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_groups_bytes_swap_out_and_back_in(cluster, name):
    groups = MODELS[name]()
    groups.check()
    c = cluster(groups)
    s = c.ready()
    rng = np.random.default_rng(7)
    for r in range(groups.num_ranks):
        for layer in range(max(max(g.layers) for g in groups.groups) + 1):
            for slot in range(len(groups.slots(layer))):
                a = s.host_array(r, layer, slot)
                a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
    bases = groups.id_bases()
    src, host, back = [], [], []  # device ids out, host ids, device ids back in: every group in one task
    for g, (db, hb) in zip(groups.groups, bases):
        n = min(3, g.device_blocks // 2, g.host_blocks)
        src += [db + i for i in range(n)]
        host += [hb + g.host_blocks - 1 - i for i in range(n)]
        back += [db + g.device_blocks - 1 - i for i in range(n)]
    before = {(r, i): [blocks_of(v, [x - bases[i][0] for x in src if groups_of(bases, groups, x) == i])
                       for v in views(s, groups, r, i)]
              for r in range(groups.num_ranks) for i in range(len(groups.groups))}
    out = s.wait(s.swap_to_host(src, host))
    assert out.blocks_done == len(src)
    for r in range(groups.num_ranks):  # the source blocks change after the swap-out: nothing reads them
        for i in range(len(groups.groups)):
            for v in views(s, groups, r, i):
                v[3][:v[2] * 3] = 0
    assert s.wait(s.swap_to_device(host, back)).blocks_done == len(src)
    for r in range(groups.num_ranks):
        for i in range(len(groups.groups)):
            came = [x - bases[i][0] for x in back if groups_of(bases, groups, x) == i]
            for v, want in zip(views(s, groups, r, i), before[(r, i)]):
                assert np.array_equal(blocks_of(v, came), want), f"rank {r} group {i} layer {v[0]} slot {v[1]}"


def groups_of(bases, groups, device_id):
    for i, (db, _) in enumerate(bases):
        if db <= device_id < db + groups.groups[i].device_blocks:
            return i
    return -1


def test_a_group_session_refuses_pairs_across_groups_by_name(cluster):
    groups = MODELS["gpt-oss-20b"]()
    c = cluster(groups)
    s = c.ready()
    (db0, hb0), (db1, hb1) = groups.id_bases()
    with pytest.raises(kvtd.TaskFailed, match="is in cache group 0.*is in cache group 1"):
        s.wait(s.swap_to_host([db0], [hb1]))
    # Storage tasks are served (test_cache_group_storage.py); without a store they say so.
    with pytest.raises(kvtd.TaskFailed, match="no storage backend is configured"):
        s.wait(s.storage_query(["k0"]))
    assert s.wait(s.swap_to_host([db1], [hb1])).blocks_done == 1  # the session still serves


def test_a_group_session_takes_completion_forecast_and_refuses_what_needs_one_geometry(cluster):
    groups = MODELS["gpt-oss-20b"]()
    c = cluster(groups, completion_forecast=False)
    s = c.ready()
    (db0, hb0), _ = groups.id_bases()
    for i in range(3):
        assert s.wait(s.swap_to_host([db0 + i], [hb0 + i])).blocks_done == 1
    assert s.forecast_waits()["waits"] == 0
    with pytest.raises(ValueError, match="not cache groups"):
        kvtd.Session("py_groups_adopt", groups=groups, adopt_host_tier=True)
    with pytest.raises(ValueError, match="only_rank 2 is not a rank of the 2-rank cache groups"):
        kvtd.Session("py_groups_rank", groups=groups, only_rank=2)


def test_one_ranks_group_session_is_served_by_that_ranks_daemon_alone(tmp_path):
    """An engine with one process per rank (vLLM's workers, sglang's schedulers) serving a hybrid
    model: each process a group session of its own rank (before: refused, "only_rank is for a
    session over one geometry"). Rank 1's session is served by rank 1's daemon alone; every
    group's bytes go out to its host blocks and come back, and a storage write and read of every
    group round-trips through a file store."""
    groups = MODELS["gpt-oss-20b"]()
    suffix = f"py_groups_r1_{tmp_path.name[-8:]}"
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--model-id", "m"]
    with kvtd.Session(suffix, groups=groups, only_rank=1) as s:
        s.create_host_device_tensors()
        with kvtd.testing.Daemons(None, suffix, groups, store, ranks=[1]):
            s.publish()
            s.wait_ready(30)
            rng = np.random.default_rng(11)
            layers = max(max(g.layers) for g in groups.groups) + 1
            arrays = [(layer, slot, s.host_array(1, layer, slot)) for layer in range(layers)
                      for slot in range(len(groups.slots(layer)))]
            for _, _, a in arrays:
                a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
            before = [a.copy() for _, _, a in arrays]
            bases = groups.id_bases()
            src = [db + i for db, _ in bases for i in range(2)]
            host = [hb + i for _, hb in bases for i in range(2)]
            assert s.wait(s.swap_to_host(src, host)).blocks_done == len(src)
            assert s.wait(s.storage_write(["k0", "k1"], [[0, 1] for _ in bases])).blocks_done == 2
            for _, _, a in arrays:
                a[:] = 0
            assert s.wait(s.swap_to_device(host, src)).blocks_done == len(src)
            back = [a.copy() for _, _, a in arrays]
            for _, _, a in arrays:
                a[:] = 0
            assert s.wait(s.storage_read(["k0", "k1"], [[0, 1] for _ in bases])).blocks_done == 2
            for (layer, slot, a), want, swapped in zip(arrays, before, back):
                for view in (swapped, a):  # by swap, then by storage
                    g, t = groups.slots(layer)[slot]
                    bb = block_bytes(groups.groups[g].tensors[t])
                    assert np.array_equal(view[:2 * bb], want[:2 * bb]), f"layer {layer} slot {slot}"


def test_a_daemon_whose_groups_differ_from_the_session_refuses_it_naming_the_group(tmp_path):
    groups = MODELS["gpt-oss-20b"]()
    other = models.sliding_and_full(GPT_OSS_20B, 2, device_blocks=9, host_blocks=12)
    suffix = f"py_groups_mismatch_{tmp_path.name[-8:]}"
    d = kvtd.testing.Daemons(None, suffix, other, ["--attach-timeout", "10"])
    with kvtd.Session(suffix, groups=groups) as s:
        s.create_host_device_tensors()
        s.publish()
        d.start()
        code = d.procs[0].wait(30)
        logs = d.logs()
        d.stop()
    assert code == 3, logs  # kExitSessionRefused
    assert "cache group 0 device blocks: session has 8, flags say 9" in logs, logs


def test_ctl_status_counts_each_groups_pool_and_swapped_bytes(cluster):
    import json
    import os
    import subprocess

    groups = MODELS["gpt-oss-20b"]()
    c = cluster(groups)
    s = c.ready()
    s.wait(s.swap_to_host(groups.device_ids(0, [0, 1, 2]) + groups.device_ids(1, [0, 1]),
                          groups.host_ids(0, [0, 1, 2]) + groups.host_ids(1, [0, 1])))
    s.wait(s.swap_to_device(groups.host_ids(1, [0]), groups.device_ids(1, [5])))
    with pytest.raises(ValueError, match="cache group 1: host block 12 is outside"):
        groups.host_ids(1, [12])
    (block0, pool0), (block1, pool1) = groups.sizes()
    ctl = [os.environ.get("KVTD_BINARY", kvtd.testing.find_binary()), "ctl", "--session", c.suffix]
    out = subprocess.run(ctl + ["--json", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for rank in (r["result"] for r in json.loads(out.stdout)):
        g0, g1 = rank["cache_groups"]
        assert (g0["kind"], g0["layers"], g0["window_tokens"]) == ("sliding_window", 12, 128)
        assert (g0["block_bytes"], g1["block_bytes"]) == (block0, block1)
        assert g0["host_pool_bytes"] >= pool0 and g1["host_pool_bytes"] >= pool1
        assert (g0["bytes_to_host"], g0["bytes_to_device"]) == (3 * block0, 0)
        assert (g1["bytes_to_host"], g1["bytes_to_device"]) == (2 * block1, block1)
        # The rank's totals count each group's blocks at their own size.
        assert rank["bytes"]["to_host"] == 3 * block0 + 2 * block1 and rank["bytes"]["to_device"] == block1
    text = subprocess.run(ctl + ["status"], capture_output=True, text=True, timeout=60).stdout
    assert "group 1 full_attention" in text, text


def test_every_groups_host_blocks_survive_a_daemon_crash_and_restart(cluster):
    """A daemon killed with SIGKILL and started again within the session re-maps each group's host
    pool (kvtd_<uid>_<generation>_host<r> and host<1000 + 8r + g>): blocks swapped out before the
    crash swap back in byte for byte."""
    groups = MODELS["qwen3-next-80b"]()  # a state group and a full-attention group, 4 ranks
    c = cluster(groups)
    s = c.ready()
    rng = np.random.default_rng(11)
    for r in range(groups.num_ranks):
        for layer in range(48):
            for slot in range(len(groups.slots(layer))):
                a = s.host_array(r, layer, slot)
                a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
    (d0, h0), (d1, h1) = groups.id_bases()
    src, host, back = [d0, d0 + 1, d1 + 2, d1 + 3], [h0 + 5, h0 + 4, h1 + 9, h1 + 8], [d0 + 3, d0 + 2, d1 + 6, d1 + 7]
    before = {(r, i): [blocks_of(v, [x - (d0, d1)[i] for x in src if groups_of(groups.id_bases(), groups, x) == i])
                       for v in views(s, groups, r, i)] for r in range(groups.num_ranks) for i in range(2)}
    s.wait(s.swap_to_host(src, host))
    c.daemons.kill_and_restart(2, s)
    s.wait_ready(30)
    assert s.wait(s.swap_to_device(host, back)).blocks_done == len(back)
    for r in range(groups.num_ranks):
        for i in range(2):
            came = [x - (d0, d1)[i] for x in back if groups_of(groups.id_bases(), groups, x) == i]
            for v, want in zip(views(s, groups, r, i), before[(r, i)]):
                assert np.array_equal(blocks_of(v, came), want), f"rank {r} group {i} layer {v[0]} slot {v[1]}"
    with open(c.daemons.log(2), errors="replace") as f:
        assert f.read().count("re-mapped from a previous daemon") == 2, c.daemons.logs()  # one pool per group


def test_a_layer_by_layer_load_of_several_groups_moves_every_layers_bytes(cluster):
    """The sliding and full-attention layers of gpt-oss interleave: the load goes through the
    session's layers in order, each group's tensors of the layer, and wait_layer(l) counts the
    session's layers. (That a layer is reported only after its copies returned is
    task_runner_test's AGroupSessionsLayerIsReportedOnlyOnceItsCopyReturned, with held copies.)"""
    groups = MODELS["gpt-oss-20b"]()
    c = cluster(groups)
    s = c.ready()
    rng = np.random.default_rng(5)
    for r in range(groups.num_ranks):
        for layer in range(24):
            for slot in range(2):
                a = s.host_array(r, layer, slot)
                a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
    (d0, h0), (d1, h1) = groups.id_bases()
    src, host, back = [d0 + 1, d1 + 1], [h0 + 2, h1 + 2], [d0 + 6, d1 + 6]
    want = {(r, layer, slot): s.host_array(r, layer, slot).reshape(8, -1)[1].copy()
            for r in range(2) for layer in range(24) for slot in range(2)}
    s.wait(s.swap_to_host(src, host))
    tid = s.swap_to_device(host, back, layerwise=True)
    for layer in range(24):
        s.wait_layer(tid, layer, 30)
        for r in range(2):
            for slot in range(2):
                assert np.array_equal(s.host_array(r, layer, slot).reshape(8, -1)[6], want[(r, layer, slot)]), \
                    f"layer {layer} reported before rank {r} slot {slot} was in place"
    assert s.wait(tid).blocks_done == 2


def test_a_weight_update_remaps_every_group_and_drop_host_tier_drops_each_groups_pool(cluster):
    """clear_caches / new tensors / restore_caches in a group session: each group's host blocks
    come back into the new tensors byte for byte; a clear that drops the host tier drops every
    group's pool (a swap-in of either group then fails host_tier_lost)."""
    groups = MODELS["deepseek-v3.2"]()
    c = cluster(groups)
    s = c.ready()
    rng = np.random.default_rng(3)
    for layer in range(61):
        for slot in range(2):
            a = s.host_array(0, layer, slot)
            a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
    (d0, h0), (d1, h1) = groups.id_bases()
    want = {(layer, slot): s.host_array(0, layer, slot).reshape(8, -1)[2].copy() for layer in range(61) for slot in (0, 1)}
    s.wait(s.swap_to_host([d0 + 2, d1 + 2], [h0 + 1, h1 + 1]))
    s.clear_caches(weight_version=2)
    s.free_host_device_tensors()
    s.create_host_device_tensors()  # new arenas, zero-filled
    s.restore_caches()
    s.wait(s.swap_to_device([h0 + 1, h1 + 1], [d0 + 5, d1 + 5]))
    for (layer, slot), block in want.items():
        assert np.array_equal(s.host_array(0, layer, slot).reshape(8, -1)[5], block), (layer, slot)
    s.clear_caches(drop_host_tier=True)
    s.restore_caches()
    for ids in ([h0 + 1], [h1 + 1]):  # the latent's pool and the indexer's
        r = s.wait(s.swap_to_device(ids, [d0 + 6] if ids[0] < h1 else [d1 + 6]), check=False)
        assert r.status_name == "host_tier_lost", r
