"""The FastDeploy adapter driven with the call sequences of FastDeploy's engine (seeds 000/001):
transfer tasks as tuples, done signals as tuples, per-rank ready signals."""

from __future__ import annotations

import enum

import pytest
import torch

import kvtd.fastdeploy as fd
from kvtd.fastdeploy import CacheStatus, KvtdCacheQueue, ReadStorageTask, SwapFailed, WriteStorageTask
from test_session import fill_random, snapshot


class FastDeployCacheStatus(enum.Enum):
    """Stands for FastDeploy's own enum: other values, same names."""

    SWAP2CPU = 7
    SWAP2GPU = 8
    STORAGE2GPU = 9
    GPU2STORAGE = 10


def test_ready_signals_then_swap_out_and_back_in(cluster):
    c = cluster()
    q = KvtdCacheQueue(c.session)
    assert list(q.cache_ready_signal.value) == [0, 0]  # not published yet: nobody attached
    s = c.ready()
    assert list(q.cache_ready_signal.value) == [1, 1]
    assert list(q.swap_space_ready_signal.value) == [1, 1]
    g = c.geometry
    fill_random(s, g)
    before = snapshot(s, g, [3, 4])
    # The engine's eviction: (event_type, transfer_task_id, swap_node_ids, gpu_block_ids, cpu_block_ids).
    q.put_transfer_task((FastDeployCacheStatus.SWAP2CPU, "t1", [101, 102], [3, 4], [0, 1]))
    done = q.get_transfer_done_signal(timeout=30)
    assert done == [(FastDeployCacheStatus.SWAP2CPU, "t1", [101, 102], [3, 4], [0, 1])]
    fill_random(s, g, seed=9)
    q.put_transfer_task((FastDeployCacheStatus.SWAP2GPU, "t2", [101, 102], [5, 6], [0, 1]))
    assert q.get_transfer_done_signal(timeout=30) == [(FastDeployCacheStatus.SWAP2GPU, "t2", [101, 102], [5, 6], [0, 1])]
    after = snapshot(s, g, [5, 6])
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert q.empty()


def test_many_tasks_in_flight_all_reported_once(cluster):
    c = cluster()
    c.ready()
    q = KvtdCacheQueue(c.session)
    for i in range(8):
        q.put_transfer_task((CacheStatus.SWAP2CPU, i, [i], [i], [i]))
    done = q.wait_all(timeout=30)
    assert sorted(d[1] for d in done) == list(range(8))
    assert q.get_transfer_done_signal() == []


def test_storage_write_then_partial_read_reports_loaded_blocks(cluster, tmp_path):
    c = cluster(extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "store")])
    s = c.ready()
    g = c.geometry
    fill_random(s, g)
    before = snapshot(s, g, [1, 2])
    q = KvtdCacheQueue(s)
    q.put_transfer_task((CacheStatus.GPU2STORAGE, WriteStorageTask("w1", ["h1", "h2"], [1, 2])))
    assert q.get_transfer_done_signal(timeout=30) == [(CacheStatus.GPU2STORAGE, "w1", ["h1", "h2"], [1, 2])]
    # A request whose prefix is h1, h2 and a block never stored: the first two are loaded.
    q.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask("r1", ["h1", "h2", "h3"], [20, 21, 22])))
    assert q.get_transfer_done_signal(timeout=30) == [(CacheStatus.STORAGE2GPU, "r1", ["h1", "h2", "h3"], [20, 21])]
    after = snapshot(s, g, [20, 21])
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_failed_swap_is_never_reported_done(cluster):
    c = cluster()
    c.ready()
    q = KvtdCacheQueue(c.session)
    q.put_transfer_task((CacheStatus.SWAP2CPU, "ok", [1], [1], [1]))
    q.put_transfer_task((CacheStatus.SWAP2GPU, "bad", [9], [9], [23]))  # host block 23 holds nothing
    reported = []
    with pytest.raises(SwapFailed) as e:
        for _ in range(200):
            reported += q.get_transfer_done_signal(timeout=0.1)
    assert [r[1] for r in reported] == ["ok"]
    assert e.value.fd_task[1] == "bad" and e.value.result.status_name == "host_tier_lost"
    # "record": the failure is kept, never returned as done.
    q2 = KvtdCacheQueue(c.session, on_swap_failure="record")
    q2.put_transfer_task((CacheStatus.SWAP2GPU, "bad2", [9], [9], [22]))
    assert q2.wait_all(timeout=30) == []
    assert q2.failures[0][0][1] == "bad2"


def test_malformed_transfer_tasks_are_refused():
    class Dummy:
        geometry = None

    q = KvtdCacheQueue.__new__(KvtdCacheQueue)
    q.session = Dummy()
    with pytest.raises(ValueError, match="unknown transfer event type"):
        KvtdCacheQueue.put_transfer_task(q, ("SWAP2NOWHERE", 1, [], [], []))
    with pytest.raises(ValueError, match="5\\) fields|got 4 fields"):
        KvtdCacheQueue.put_transfer_task(q, (CacheStatus.SWAP2CPU, 1, [], []))
    with pytest.raises(ValueError, match="gpu block ids"):
        KvtdCacheQueue.put_transfer_task(q, (CacheStatus.SWAP2CPU, 1, [], [1, 2], [1]))


def test_kv_cache_status_clearing_then_updating_like_fastdeploy(cluster):
    c = cluster()
    s = c.ready()
    q = KvtdCacheQueue(s)
    assert q.check_cache_status() is fd.KVCacheStatus.NORMAL  # nothing to do
    q.kv_cache_status_signal.value[0] = fd.KVCacheStatus.CLEARING
    assert q.check_cache_status(weight_version=3) is fd.KVCacheStatus.CLEARED
    assert list(q.cache_ready_signal.value) == [0] * c.geometry.num_ranks
    assert list(q.swap_space_ready_signal.value) == [1] * c.geometry.num_ranks
    s.create_host_device_tensors()  # the engine's new tensors
    q.kv_cache_status_signal.value[0] = fd.KVCacheStatus.UPDATING
    assert q.check_cache_status() is fd.KVCacheStatus.NORMAL
    assert list(q.cache_ready_signal.value) == [1] * c.geometry.num_ranks
    q.put_transfer_task((fd.CacheStatus.SWAP2CPU, 1, [0], [2], [3]))
    done = q.wait_all(timeout=30)
    assert [t[:2] for t in done] == [(fd.CacheStatus.SWAP2CPU, 1)]
