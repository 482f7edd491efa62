"""Storage tasks of sessions whose cache is cache groups, served by real daemons (host backend,
file store): the geometries of four real models (kvtd.models; configs cited in test_models.py)
stored and loaded back, every byte of every group compared, and the loadable prefix by the groups'
rules (kvtd/proto/group_hits.h) answered across ranks, gaps in a group included.

A task names one block per key and group, group-major, -1 (None in Python) where a group has
none (daemon/storage/group_agreement.cpp). Each group's objects are a namespace of their own in
the store (its layout fingerprint, `kvtd ctl status` cache_groups[].layout_fingerprint).
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess

import numpy as np
import pytest

import kvtd
from kvtd import models

from test_cache_group_sessions import MODELS, blocks_of, views
from test_models import DEEPSEEK_V32

N = 4  # keys (pages) per task


def storage_flags(tmp_path):
    return ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--model-id", "m",
            "--storage-staging-mib", "64"]


def trailing(groups, g):
    """Pages before a prefix's end group g needs (0: every page), as kvtd/proto/group_hits.h says."""
    c = groups.groups[g]
    if c.kind == "state":
        return 1
    if c.kind == "sliding_window":
        return max(1, math.ceil(c.window_tokens / groups.page_tokens))
    return 0


def fill(s, groups, seed):
    rng = np.random.default_rng(seed)
    for r in range(groups.num_ranks):
        for layer in range(max(max(g.layers) for g in groups.groups) + 1):
            for slot in range(len(groups.slots(layer))):
                a = s.host_array(r, layer, slot)
                a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)


def zero(s, groups):
    for r in range(groups.num_ranks):
        for g in range(len(groups.groups)):
            for v in views(s, groups, r, g):
                v[3][:] = 0


def written_ids(groups):
    """Per group, the block each key is stored from: every page of a block group; a state group's
    state saved only at keys 1 and N-1 (a gap at the others, as an engine saves it at some points)."""
    out = []
    for c in groups.groups:
        if c.kind == "state":
            out.append([None, 0, None, 1])
        else:
            out.append(list(range(N)))
    return out


def read_ids(groups):
    """Per group, where each key is loaded: other blocks than it was stored from."""
    out = []
    for c in groups.groups:
        if c.kind == "state":
            out.append([2, 3, 0, 1][:N] if c.device_blocks >= 4 else [None] * (N - 1) + [c.device_blocks - 1])
        else:
            out.append([c.device_blocks - 1 - i for i in range(N)])
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_groups_pages_are_stored_and_only_what_each_rule_needs_loads_back(cluster, tmp_path, name):
    groups = MODELS[name]()
    c = cluster(groups, storage_flags(tmp_path))
    s = c.ready()
    fill(s, groups, 3)
    keys = [f"{name}-p{i}" for i in range(N)]
    wrote = written_ids(groups)
    before = {(r, g): [blocks_of(v, [b for b in wrote[g] if b is not None]) for v in views(s, groups, r, g)]
              for r in range(groups.num_ranks) for g in range(len(groups.groups))}
    assert s.wait(s.storage_write(keys, wrote)).blocks_done == N
    # Written again: every key is stored whole on every rank, nothing to write.
    again = s.wait(s.storage_write(keys, wrote))
    assert (again.blocks_done, again.blocks_skipped) == (0, N)
    assert s.wait(s.storage_query(keys)).blocks_done == N
    # The state saved at key 1 ends a 2-page prefix; none at key 2 ends a 3-page one.
    has_state = any(g.kind == "state" for g in groups.groups)
    assert s.wait(s.storage_query(keys[:3])).blocks_done == (2 if has_state else 3)
    zero(s, groups)
    back = read_ids(groups)
    assert s.wait(s.storage_read(keys, back)).blocks_done == N
    # Each group's bytes, counted by what moved (kvtd ctl status; /metrics the same counters).
    sizes = groups.sizes()
    for r, rank in enumerate(status(c)):
        for g, got in enumerate(rank["cache_groups"]):
            stored = sum(b is not None for b in wrote[g])
            loaded = N if trailing(groups, g) == 0 else min(N, trailing(groups, g))
            writes = r == 0 or got["stored"] == "by_rank"  # a replicated group: rank 0 writes
            assert got["storage_bytes_written"] == (stored * sizes[g][0] if writes else 0), (r, g, got)
            assert got["storage_bytes_read"] == loaded * sizes[g][0], (r, g, got)
    for r in range(groups.num_ranks):
        for g in range(len(groups.groups)):
            need = trailing(groups, g)
            stored = [i for i, b in enumerate(wrote[g]) if b is not None]
            loaded = [i for i in range(N) if need == 0 or i >= N - need]
            for v, want in zip(views(s, groups, r, g), before[(r, g)]):
                for i in range(N):
                    if back[g][i] is None:
                        continue
                    got = blocks_of(v, [back[g][i]])[0]
                    if i in loaded:
                        assert np.array_equal(got, want[stored.index(i)]), f"rank {r} group {g} layer {v[0]} key {i}"
                    else:  # outside the rule: never read, so never written
                        assert not got.any(), f"rank {r} group {g} layer {v[0]} key {i} was loaded"


def test_a_load_that_names_no_block_where_a_rule_needs_one_stops_before_that_point(cluster, tmp_path):
    groups = MODELS["qwen3-next-80b"]()  # full attention beside per-request state, 4 ranks
    c = cluster(groups, storage_flags(tmp_path))
    s = c.ready()
    fill(s, groups, 5)
    keys = [f"q{i}" for i in range(N)]
    state = next(i for i, g in enumerate(groups.groups) if g.kind == "state")
    wrote = [[0, 1, 2, 3]] * len(groups.groups)
    assert s.wait(s.storage_write(keys, wrote)).blocks_done == N
    back = [[4, 5, 6, 7] if g != state else [2, None, 3, None] for g in range(len(groups.groups))]
    # The state of keys 1 and 3 has nowhere to go: the longest loadable prefix ends after key 2.
    assert s.wait(s.storage_read(keys, back)).blocks_done == 3


def test_a_load_naming_one_group_only_loads_that_group_by_its_rule_alone(cluster, tmp_path):
    """sglang's hybrid controller loads the KV pool (batch_get_v1), then the state pool at the
    keys it chose (batch_get_v2), as two calls: a load that names no block of a group leaves
    that group out (daemon/storage/group_agreement.cpp). Before, the left-out state group's rule
    failed at every point and the KV load loaded nothing."""
    groups = MODELS["qwen3-next-80b"]()  # full attention beside per-request state, 4 ranks
    c = cluster(groups, storage_flags(tmp_path))
    s = c.ready()
    fill(s, groups, 11)
    keys = [f"o{i}" for i in range(N)]
    state = next(i for i, g in enumerate(groups.groups) if g.kind == "state")
    full = 1 - state
    assert s.wait(s.storage_write(keys, [[0, 1, 2, 3]] * 2)).blocks_done == N
    before = {(r, g): [blocks_of(v, [0, 1, 2, 3]) for v in views(s, groups, r, g)]
              for r in range(groups.num_ranks) for g in (full, state)}
    zero(s, groups)
    kv_only = [None, None]
    kv_only[full], kv_only[state] = [4, 5, 6, 7], [None] * N
    assert s.wait(s.storage_read(keys, kv_only)).blocks_done == N
    state_only = [None, None]
    state_only[full], state_only[state] = [None] * N, [None, None, None, 2]
    assert s.wait(s.storage_read(keys, state_only)).blocks_done == N
    for r in range(groups.num_ranks):
        for v, want in zip(views(s, groups, r, full), before[(r, full)]):
            assert np.array_equal(blocks_of(v, [4, 5, 6, 7]), want), f"rank {r} layer {v[0]}: KV pages"
        for v, want in zip(views(s, groups, r, state), before[(r, state)]):
            assert np.array_equal(blocks_of(v, [2])[0], want[3]), f"rank {r} layer {v[0]}: the state at key 3"
            others = blocks_of(v, [b for b in range(groups.groups[state].device_blocks) if b != 2])
            assert not np.any(others), f"rank {r} layer {v[0]}: a state slot no load named was written"


def status(c):
    """`kvtd ctl --json status` of every rank."""
    ctl = [os.environ.get("KVTD_BINARY", kvtd.testing.find_binary()), "ctl", "--session", c.suffix]
    out = subprocess.run(ctl + ["--json", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [r["result"] for r in json.loads(out.stdout)]


def test_ctl_status_prints_a_group_sessions_store_readably(cluster, tmp_path):
    """`kvtd ctl status` (the readable form) of a daemon of cache groups with a store: its storage
    has no single layout fingerprint (one per group, on the groups' lines). It aborted on the
    missing field (nlohmann type_error.302, exit 134) before."""
    groups = MODELS["qwen3-next-80b"]()
    c = cluster(groups, storage_flags(tmp_path))
    c.ready()
    ctl = [os.environ.get("KVTD_BINARY", kvtd.testing.find_binary()), "ctl", "--session", c.suffix, "status"]
    out = subprocess.run(ctl, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "by_cache_group" in out.stdout and "group 1" in out.stdout, out.stdout


def group_dirs(c, tmp_path):
    rank0 = status(c)[0]
    assert rank0["storage"]["objects"] == "by_cache_group"
    return [str(tmp_path / "store" / "m" / g["layout_fingerprint"]) for g in rank0["cache_groups"]]


def stored_everything(cluster, tmp_path, name, prefix):
    """A session of `name`'s groups with a file store, blocks 0..N-1 of both groups stored as keys
    <prefix>0..: (groups, cluster, session, keys)."""
    groups = MODELS[name]()
    c = cluster(groups, storage_flags(tmp_path))
    s = c.ready()
    fill(s, groups, 9)
    keys = [f"{prefix}{i}" for i in range(N)]
    assert s.wait(s.storage_write(keys, [list(range(N))] * 2)).blocks_done == N
    return groups, c, s, keys


def test_the_ranks_agree_on_the_min_of_their_loadable_prefixes(cluster, tmp_path):
    # Sliding window (128 tokens: 8 pages) beside full attention, TP 2.
    groups, c, s, keys = stored_everything(cluster, tmp_path, "gpt-oss-20b", "w")
    window = next(i for i, g in enumerate(groups.groups) if g.kind == "sliding_window")
    victim = glob.glob(os.path.join(group_dirs(c, tmp_path)[window], "*", "w1.*r1.kvo"))
    assert len(victim) == 1
    os.remove(victim[0])
    # Rank 1 can load 1 page (w0), rank 0 all 4: the MIN, 1, holds on both and loads.
    assert s.wait(s.storage_query(keys)).blocks_done == 1
    assert s.wait(s.storage_read(keys, [[7, 6, 5, 4]] * 2)).blocks_done == 1


def test_a_rank_whose_state_is_missing_at_the_agreed_point_loads_nothing_and_the_merge_is_zero(cluster, tmp_path):
    """The ranks agree on the MIN of their loadable prefixes in one round; a trailing rule need not
    hold on a rank at a smaller point. Rank 0 lost the state of s3 (it can load 3 pages), rank 1
    that of s2 (it can load 4, but not 3): rank 1 loads nothing, so the merged answer is 0 blocks,
    never 3 pages whose state rank 1 does not have (daemon/storage/group_agreement.cpp)."""
    # Per-request state beside full attention, TP 4.
    groups, c, s, keys = stored_everything(cluster, tmp_path, "qwen3-next-80b", "s")
    state = next(i for i, g in enumerate(groups.groups) if g.kind == "state")
    for rank, key in ((0, "s3"), (1, "s2")):
        victim = glob.glob(os.path.join(group_dirs(c, tmp_path)[state], "*", f"{key}.*r{rank}.kvo"))
        assert len(victim) == 1
        os.remove(victim[0])
    assert s.wait(s.storage_query(keys)).blocks_done == 3  # the MIN of 3 and 4 (and 4, 4)
    zero(s, groups)
    full = 1 - state
    back = [None, None]
    back[full], back[state] = [4, 5, 6, 7], [0, 1, 2, 3]
    assert s.wait(s.storage_read(keys, back)).blocks_done == 0
    # Asked for the 2 pages every rank can load, every rank loads them.
    assert s.wait(s.storage_read(keys[:2], [b[:2] for b in back])).blocks_done == 2


def test_a_group_sessions_storage_task_with_the_wrong_block_count_is_refused_naming_the_layout(cluster, tmp_path):
    groups = MODELS["gpt-oss-20b"]()
    c = cluster(groups, storage_flags(tmp_path))
    s = c.ready()
    with pytest.raises(ValueError, match=r"2 keys for 2 blocks \(2 cache groups"):
        s.storage_write(["a", "b"], [0, 1])
    with pytest.raises(ValueError, match="cache group 1: device block 99 is outside"):
        s.storage_write(["a"], [[0], [99]])
    with pytest.raises(ValueError, match="differ in length"):
        s.storage_write(["a"], [[0], [1, 2]])
    # The daemon checks each group's ids too (a caller of the C ABI passes them flat).
    (db0, _), (db1, _) = groups.id_bases()
    with pytest.raises(kvtd.TaskFailed, match=r"cache group 0, key 0\) is outside"):
        s.wait(s.storage_write(["a"], [db1, db1]))
    assert s.wait(s.storage_write(["a"], [db0, db1])).blocks_done == 1


@pytest.mark.parametrize("reader_tp", [1, 4])
def test_deepseek_v32_stored_at_tp2_loads_byte_exact_at_another_tp(cluster, tmp_path, reader_tp):
    """Stored KV shared across TP sizes: DeepSeek-V3.2's MLA latent and the indexer beside it are
    the same bytes on every rank (proto::group_replicated), so rank 0 stores them once, in a
    namespace without the TP size, and every rank of any TP size loads them."""
    flags = storage_flags(tmp_path)
    writer_groups = models.mla_with_indexer(DEEPSEEK_V32, 2, device_blocks=8, host_blocks=4)
    w = cluster(writer_groups, flags).ready()
    fill(w, writer_groups, 21)
    keys = [f"ds{i}" for i in range(N)]
    assert w.wait(w.storage_write(keys, [list(range(N))] * 2)).blocks_done == N
    stored = {g: [blocks_of(v, list(range(N))) for v in views(w, writer_groups, 0, g)] for g in range(2)}
    reader_groups = models.mla_with_indexer(DEEPSEEK_V32, reader_tp, device_blocks=8, host_blocks=4)
    r = cluster(reader_groups, flags).ready()
    assert r.wait(r.storage_query(keys)).blocks_done == N
    assert r.wait(r.storage_read(keys, [[7, 6, 5, 4]] * 2)).blocks_done == N
    for rank in range(reader_tp):
        for g in range(2):
            for v, want in zip(views(r, reader_groups, rank, g), stored[g]):
                assert np.array_equal(blocks_of(v, [7, 6, 5, 4]), want), f"rank {rank} group {g} layer {v[0]}"


def test_host_blocks_of_every_group_are_stored_and_prefetched_back(cluster, tmp_path):
    """KVTD_STORAGE_HOST_BLOCKS in a group session: each group's host pool is written from and
    prefetched into, its blocks valid only once loaded; a swap brings them to the device."""
    groups = MODELS["gpt-oss-20b"]()
    c = cluster(groups, storage_flags(tmp_path))
    s = c.ready()
    fill(s, groups, 17)
    keys = [f"h{i}" for i in range(N)]
    out_dev = [groups.device_ids(g, range(N)) for g in range(2)]
    out_host = [groups.host_ids(g, range(N)) for g in range(2)]
    assert s.wait(s.swap_to_host(out_dev[0] + out_dev[1], out_host[0] + out_host[1])).blocks_done == 2 * N
    before = {(r, g): [blocks_of(v, list(range(N))) for v in views(s, groups, r, g)]
              for r in range(groups.num_ranks) for g in range(2)}
    assert s.wait(s.storage_write(keys, [list(range(N))] * 2, host_blocks=True)).blocks_done == N
    # A host block of this session that holds nothing is refused, naming its group.
    with pytest.raises(kvtd.TaskFailed, match="host block 11 of cache group 1 holds no data"):
        s.wait(s.storage_write(["x"], [[0], [11]], host_blocks=True))
    back = [[N + i for i in range(N)]] * 2
    assert s.wait(s.prefetch(keys, back, min_hits=N)).blocks_done == N
    zero(s, groups)
    dev_back = [groups.device_ids(g, [7 - i for i in range(N)]) for g in range(2)]
    host_back = [groups.host_ids(g, back[g]) for g in range(2)]
    assert s.wait(s.swap_to_device(host_back[0] + host_back[1], dev_back[0] + dev_back[1])).blocks_done == 2 * N
    for r in range(groups.num_ranks):
        for g in range(2):
            for v, want in zip(views(s, groups, r, g), before[(r, g)]):
                assert np.array_equal(blocks_of(v, [7 - i for i in range(N)]), want), f"rank {r} group {g} layer {v[0]}"


def test_a_group_sessions_writes_are_told_as_kv_events_one_per_key(cluster, tmp_path):
    """Rank 0 publishes what the store holds (--kv-events-endpoint, vLLM's layout: test_kv_events.py);
    a group session's key is one event whatever its groups, its block size the page's tokens."""
    from test_kv_events import Subscriber, events_of
    endpoint = f"ipc://{tmp_path}/events.sock"
    groups = MODELS["gpt-oss-20b"]()
    c = cluster(groups, storage_flags(tmp_path) + ["--kv-events-endpoint", endpoint])
    s = c.ready()
    sub = Subscriber(endpoint)
    try:
        assert s.wait(s.storage_write(["2001", "2002"], [[0, 1], [0, 1]])).blocks_done == 2
        got = sub.batches(lambda b: len(events_of(b)) >= 1)
        stored = events_of(got)[0]
        assert (stored["type"], stored["block_hashes"], stored["block_size"]) == ("BlockStored", [2001, 2002],
                                                                                 groups.page_tokens)
    finally:
        sub.close()
