"""KvtdCacheQueue's own contract, against real daemons (test_fastdeploy_engine.py drives it with
FastDeploy's engine code). The shapes are FastDeploy's (inter_communicator/engine_cache_queue.py
at upstream develop c1b7c083): get_transfer_done_signal() takes no argument and returns one tuple
or None (prefix_cache_manager.py recv_data_transfer_result reads data[0]); a STORAGE2GPU result
comes once per rank (ibid., it counts tensor_parallel_size of them)."""

from __future__ import annotations

import enum
import time
import uuid

import pytest

import kvtd

from kvtd.engines.fastdeploy import signals as fds
from kvtd.fastdeploy import KvtdCacheQueue
from test_session import fill_random, snapshot


class CacheStatus(enum.Enum):
    """FastDeploy's enum (cache_manager/cache_data.py): the adapter hands the caller's own
    members back."""

    GPU = 0
    SWAP2CPU = 1
    SWAP2GPU = 2
    CPU = 3
    GPU2STORAGE = 4
    STORAGE2GPU = 5
    CTRL = -1


class Task:
    def __init__(self, task_id, keys, gpu_block_ids, timeout=30.0):
        self.task_id, self.keys, self.gpu_block_ids, self.timeout = task_id, keys, gpu_block_ids, timeout


def results(q, n, timeout=30.0):
    out, end = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < end, f"only {len(out)} of {n} results after {timeout} s"
        r = q.get_transfer_done_signal()
        if r is None:
            time.sleep(0.001)
        else:
            assert isinstance(r, tuple), f"a result is one tuple, got {type(r).__name__}"
            out.append(r)
    return out


def test_one_tuple_or_none_and_the_bytes_come_back(cluster):
    c = cluster()
    s = c.ready()
    q = KvtdCacheQueue(s, monitor=False)
    assert q.get_transfer_done_signal() is None and q.result_queue_empty()
    fill_random(s, c.geometry)
    before = snapshot(s, c.geometry, [3, 4])
    q.put_transfer_task((CacheStatus.SWAP2CPU, "t1", [101, 102], [3, 4], [0, 1]))
    assert results(q, 1) == [(CacheStatus.SWAP2CPU, "t1", [101, 102], [3, 4], [0, 1])]
    fill_random(s, c.geometry, seed=9)
    q.put_transfer_task((CacheStatus.SWAP2GPU, "t2", [101, 102], [5, 6], [0, 1]))
    assert results(q, 1) == [(CacheStatus.SWAP2GPU, "t2", [101, 102], [5, 6], [0, 1])]
    after = snapshot(s, c.geometry, [5, 6])
    assert all(after[k].equal(before[k]) for k in before)
    assert q.get_transfer_done_signal() is None and q.result_queue_empty()


def test_storage_read_is_reported_once_per_rank_write_once(cluster, tmp_path):
    c = cluster(extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--model-id", "t"])
    s = c.ready()
    fill_random(s, c.geometry)
    q = KvtdCacheQueue(s, monitor=False)
    q.put_transfer_task((CacheStatus.GPU2STORAGE, Task("w1", ["h1", "h2"], [1, 2])))
    assert results(q, 1) == [(CacheStatus.GPU2STORAGE, "w1", ["h1", "h2"], [1, 2])]
    q.put_transfer_task((CacheStatus.STORAGE2GPU, Task("r1", ["h1", "h2", "h3"], [20, 21, 22])))
    got = results(q, c.geometry.num_ranks)
    assert got == [(CacheStatus.STORAGE2GPU, "r1", ["h1", "h2", "h3"], [20, 21])] * c.geometry.num_ranks
    assert q.get_transfer_done_signal() is None


def test_a_failed_swap_is_logged_never_reported_and_never_raised(cluster, caplog):
    c = cluster()
    s = c.ready()
    q = KvtdCacheQueue(s, monitor=False)
    q.put_transfer_task((CacheStatus.SWAP2GPU, "bad", [9], [9], [23]))  # host block 23 holds nothing
    q.put_transfer_task((CacheStatus.SWAP2CPU, "ok", [1], [1], [1]))
    assert [r[1] for r in results(q, 1)] == ["ok"]
    end = time.monotonic() + 30
    while not q.failures:
        assert time.monotonic() < end
        assert q.get_transfer_done_signal() is None
    assert q.failures[0][0][1] == "bad" and q.failures[0][1].status_name == "host_tier_lost"
    assert "host_tier_lost" in caplog.text
    assert q.result_queue_empty()


def test_a_task_the_daemons_cannot_take_is_a_failure_not_an_exception():
    """Published, but no daemon of it runs: kvtd refuses the task (not ready) at submit. (It ran
    beside daemons waiting for the session, which on a loaded CI machine attached before the put:
    the task reached them and failed otherwise, storage_unavailable.)"""
    from conftest import small_geometry

    with kvtd.Session(f"py_fd_refused_{uuid.uuid4().hex[:8]}", small_geometry()) as s:
        s.create_host_device_tensors()
        q = KvtdCacheQueue(s, monitor=False)
        s.publish()
        q.put_transfer_task((CacheStatus.GPU2STORAGE, Task("w", ["k"], [1])))
        # Refused write: answered with no blocks written (FastDeploy's engine waits for the answer).
        assert results(q, 1) == [(CacheStatus.GPU2STORAGE, "w", ["k"], [])]
        assert q.failures and q.failures[0][1].status_name in ("NotReady", "not_ready")
        q.close()


def test_malformed_transfer_tasks_are_refused_naming_the_problem(cluster):
    c = cluster()
    q = KvtdCacheQueue(c.ready(), monitor=False)
    with pytest.raises(ValueError, match="unknown transfer event type"):
        q.put_transfer_task(("SWAP2NOWHERE", 1, [], [], []))
    with pytest.raises(ValueError, match="got 4 fields"):
        q.put_transfer_task((CacheStatus.SWAP2CPU, 1, [], []))
    with pytest.raises(ValueError, match="gpu block ids"):
        q.put_transfer_task((CacheStatus.SWAP2CPU, 1, [], [1, 2], [1]))
    with pytest.raises(ValueError, match="2 keys for 1 gpu block ids"):
        q.put_transfer_task((CacheStatus.STORAGE2GPU, Task("r", ["a", "b"], [1])))


class Ctrl:
    def __init__(self, method):
        self.request_id, self.method = f"{method}-{uuid.uuid4().hex[:4]}", method

    def get_method(self):
        return self.method


def test_ctrl_tasks_are_answered_for_every_rank_and_pause_drops_transfers(cluster):
    c = cluster()
    s = c.ready()
    answers = []
    q = KvtdCacheQueue(s, monitor=False, control_responder=lambda r, req, code, msg: answers.append((r, req.method, code)))

    def ctrl(method):
        q.put_transfer_task((CacheStatus.CTRL, Ctrl(method)))
        end = time.monotonic() + 30
        while sum(1 for a in answers if a[1] == method) < c.geometry.num_ranks:
            assert time.monotonic() < end, answers
            time.sleep(0.005)
        return sorted(a for a in answers if a[1] == method)

    assert ctrl("pause") == [(0, "pause", 200), (1, "pause", 200)]
    q.put_transfer_task((CacheStatus.SWAP2CPU, "while-paused", [1], [1], [1]))  # dropped, as FastDeploy does
    assert q.result_queue_empty()
    assert ctrl("resume") == [(0, "resume", 200), (1, "resume", 200)]
    assert ctrl("bogus") == [(0, "bogus", 400), (1, "bogus", 400)]


def test_kv_cache_status_ints_in_fastdeploys_shared_memory_signal(cluster):
    c = cluster()
    s = c.ready()
    port = f"kvtdtest{uuid.uuid4().hex[:6]}"
    sigs = {n: fds.create_signal(n, port, k) for n, k in
            (("kv_cache_status", 1), ("cache_ready_signal", 2), ("cache_transfer_inited_signal", 2),
             ("swap_space_ready_signal", 2), ("cache_task_inflight", 2), ("cache_task_is_paused", 1))}
    q = KvtdCacheQueue(s, signal_suffix=port)
    try:
        end = time.monotonic() + 30
        while list(sigs["cache_transfer_inited_signal"].value) != [1, 1]:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert list(sigs["swap_space_ready_signal"].value) == [1, 1]
        sigs["cache_ready_signal"].value[:] = 1
        sigs["kv_cache_status"].value[0] = fds.CLEARING
        while sigs["kv_cache_status"].value[0] != fds.CLEARED:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert list(sigs["cache_ready_signal"].value) == [0, 0] and s.cache_cleared
        s.create_host_device_tensors()  # the engine's new tensors
        sigs["cache_ready_signal"].value[:] = 1
        sigs["kv_cache_status"].value[0] = fds.UPDATING
        while sigs["kv_cache_status"].value[0] != fds.NORMAL:
            assert time.monotonic() < end
            time.sleep(0.01)
        q.put_transfer_task((CacheStatus.SWAP2CPU, 1, [0], [2], [3]))
        assert results(q, 1)[0][:2] == (CacheStatus.SWAP2CPU, 1)
    finally:
        q.close()
        for sig in sigs.values():
            sig.clear()


class _BlockingSession:
    """Stands in for the daemons' session (this test is about the queue's threads, not bytes): a
    swap's submission blocks until `release` is set, and a submitted task completes at once."""

    class geometry:  # noqa: N801 - the attributes KvtdCacheQueue reads
        num_ranks = 1
        num_host_blocks = 4

    weight_version = 0

    def __init__(self):
        import threading
        self.entered, self.release = threading.Event(), threading.Event()
        self.submitted_at = None

    def swap_to_host(self, gpu_ids, cpu_ids):
        self.entered.set()
        assert self.release.wait(10)
        self.submitted_at = time.monotonic()
        return 7

    def poll(self, task_id, check=False):
        from kvtd.session import TaskResult
        return TaskResult(task_id, 0, "ok", -1, 1, 0, 0)


def test_a_put_racing_pause_is_drained_before_pause_returns():
    """Trust: a put that read "not paused" just before pause() was submitted after pause's drain had
    looked (fastdeploy.py read _paused outside any lock): FastDeploy was told the manager was paused
    while a swap still went to the daemons. Fails on that code (pause returned first)."""
    import threading
    s = _BlockingSession()
    q = KvtdCacheQueue(s, monitor=False, drain_timeout=10)
    put = threading.Thread(target=q.put_transfer_task, args=((CacheStatus.SWAP2CPU, "racing", [1], [1], [1]),))
    put.start()
    assert s.entered.wait(10)
    paused_at = []
    pause = threading.Thread(target=lambda: (q.pause(), paused_at.append(time.monotonic())))
    pause.start()
    time.sleep(0.2)  # pause() now runs beside the put still submitting
    s.release.set()
    put.join(10)
    pause.join(10)
    assert paused_at and s.submitted_at is not None
    assert s.submitted_at < paused_at[0], "pause() returned before a put it raced had submitted its swap"
    assert q.get_transfer_done_signal() == (CacheStatus.SWAP2CPU, "racing", [1], [1], [1])
