"""FastDeploy's own engine code drives real kvtd daemons, wired as docs/engines/fastdeploy.md says.

FastDeploy's PrefixCacheManager (upstream develop c1b7c083, loaded by fastdeploy_harness with
the launch_cache_manager diff of docs/engines/fastdeploy.md applied) launches the kvtd daemons with its own command line,
builds the KvtdCacheQueue, and runs its own logic: eviction under GPU pressure swaps blocks to the
host tier, a re-match swaps them back, finished requests are written to the file store and later
prefetched from it, the prefix tree is reset, weights are updated through kv_cache_status, and
the engine pauses and resumes the transfer manager with CTRL tasks on its own EngineCacheQueue.
FastDeploy's GPU worker is the stand-in of fastdeploy_harness (its tensors on kvtd's host
backend, published by FastDeploy's names). Every KV byte is checked on every rank; every wait is
bounded.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

import fastdeploy_harness as fh

pytestmark = pytest.mark.skipif(fh.fastdeploy_source() is None, reason=fh.skip_reason())

BINARY = os.environ.get("KVTD_BINARY") or str(fh.ROOT / "build" / "daemon" / "kvtd")


def wait_for(cond, what: str, timeout: float = 30.0, logs=lambda: ""):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs()}")
        time.sleep(0.01)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def bounded(fn, what: str, timeout: float = 30.0, logs=lambda: ""):
    """Runs one of FastDeploy's blocking calls (they wait without a deadline: sync_swap_task,
    wait_prefetch_storage_task, wait_write_storage_task) on a thread, failing after `timeout`."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"FastDeploy's {what} did not return within {timeout} s\n{logs()}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


class Deployment:
    """FastDeploy's engine process (its signals, its EngineCacheQueue server, its prefix cache
    manager) with kvtd daemons launched by FastDeploy's launch_cache_manager."""

    def __init__(self, work: Path, g: fh.Geometry, storage=None, model_dir: str = None):
        self.pcm_mod = fh.load(work)
        from fastdeploy.inter_communicator import EngineCacheQueue, IPCSignal

        import numpy as np

        self.g = g
        base = 20000 + (os.getpid() * 7 + uuid.uuid4().int) % 30000
        self.port, self.cache_queue_port = base, base + 1
        self.device_ids = [100 + (base + r) % 900 for r in range(g.tp)]
        self.log_dir = work / "log"
        self.log_dir.mkdir(exist_ok=True)
        os.environ.update({"FD_LOG_DIR": str(self.log_dir), "KVTD_BINARY": BINARY, "KVTD_DEVICE_BACKEND": "host",
                           "FILE_BACKEND_STORAGE_DIR": str(work / "store")})
        # What FastDeploy's engine creates before launching its cache managers (engine.py,
        # common_engine.py): the signals, and the EngineCacheQueue server.
        self.signals = {}
        for name, n in (("cache_ready_signal", g.tp), ("swap_space_ready_signal", g.tp), ("prefix_tree_status", 1),
                        ("cache_transfer_inited_signal", g.tp), ("kv_cache_status", 1)):
            self.signals[name] = IPCSignal(name=name, array=np.zeros([n], dtype=np.int32), dtype=np.int32,
                                           suffix=self.port, create=True)
        self.engine_queue = EngineCacheQueue(address=f"/dev/shm/fd_task_queue_{self.cache_queue_port}.sock",
                                             authkey=b"cache_queue_service", is_server=True, num_client=g.tp,
                                             client_id=0, local_data_parallel_size=1)
        model = model_dir or str(work / "ERNIE-test")
        os.makedirs(model, exist_ok=True)
        self.config = fh.fd_config(g, storage=storage, cache_queue_port=self.cache_queue_port, model_path=model)
        self.pcm = self.pcm_mod.PrefixCacheManager(self.config, g.tp, "mixed", 0)
        self.worker = fh.WorkerStandIn(g, self.device_ids, self.port)
        self.procs = []

    def logs(self) -> str:
        out = []
        for d in self.device_ids:
            p = self.log_dir / f"cache_manager_{d}.log"
            if p.exists():
                out.append(f"--- {p.name} ---\n" + p.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def launch(self, worker_delay: float = 0.2):
        """launch_cache_manager as FastDeploy's engine calls it; the worker publishes its cache
        meanwhile, as FastDeploy's worker process does."""
        # With a storage backend FastDeploy passes --create_cache_tensor: the daemons make the cache
        # and the worker maps it; else the worker makes it and the daemons map it.
        if self.config.cache_config.kvcache_storage_backend:
            start_worker = lambda: [self.worker.attach(r) for r in range(self.g.tp)]  # noqa: E731
        else:
            start_worker = lambda: [self.worker.publish(r) for r in range(self.g.tp)]  # noqa: E731
        worker = threading.Timer(worker_delay, start_worker)
        worker.start()
        done = {}

        def run():
            done["procs"] = self.pcm.launch_cache_manager(self.config.cache_config, self.g.tp, self.device_ids,
                                                          "127.0.0.1", self.port, self.port, False)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        if "procs" not in done:
            raise AssertionError("launch_cache_manager did not return within 60 s\n" + self.logs())
        self.procs = done["procs"]
        worker.join(30)
        return self

    def close(self):
        q = getattr(self.pcm, "cache_task_queue", None)
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(15))
            except Exception:
                os.killpg(p.pid, signal.SIGKILL)
                codes.append(p.wait())
            # The shell goes first; the daemon in its group (setsid) is still finishing its tasks.
            end = time.monotonic() + 15
            while group_alive(p.pid) and time.monotonic() < end:
                time.sleep(0.01)
            if group_alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
                codes.append("killed")
        if q is not None and hasattr(q, "close"):
            q.close()
            q.session.close()
        self.worker.unpublish()
        for s in self.signals.values():
            s.clear()
        self.engine_queue.manager.shutdown()
        return codes

    # -- a request's life, through FastDeploy's own methods -----------------------------------
    def new_request(self, tokens):
        return fh.Request(f"req-{uuid.uuid4().hex[:6]}", tokens)

    def prefill(self, req, seed: int):
        """Match, allocate, 'compute' (the worker writes the KV), record in the tree, finish."""
        bs = self.g.block_size
        common, matched, _ = self.call(lambda: self.pcm.request_match_blocks(req, bs), "request_match_blocks")
        need = (len(req.prompt_token_ids) + bs - 1) // bs - len(common)
        req.block_tables = list(common) + self.pcm.allocate_gpu_blocks(need)
        self.worker.fill(req.block_tables[len(common):], seed)
        self.pcm.update_cache_blocks(req, bs, len(req.prompt_token_ids))
        return common, matched

    def swap_round_trip(self, first_token: int, seed: int):
        """A two-block request computed, finished, evicted to the host tier under GPU pressure,
        its GPU blocks reused, then matched again: its KV must come back byte for byte."""
        n = 2 * self.g.block_size
        a = self.new_request(tokens(n, start=first_token))
        self.prefill(a, seed=seed)
        kv = self.worker.blocks(a.block_tables[:2])
        self.pcm.release_block_ids(a)
        self.evict(2)
        self.worker.fill(range(self.g.blocks), seed=seed + 1000)
        common, _ = self.prefill(self.new_request(tokens(n, start=first_token) + [1]), seed=seed + 1)
        assert self.worker.blocks(common[:2]) == kv, "KV bytes differ after the round trip"

    def call(self, fn, what: str):
        return bounded(fn, what, logs=self.logs)

    def evict(self, n: int):
        """GPU pressure: FastDeploy frees n GPU blocks, swapping them to the host tier."""
        self.call(lambda: self.pcm.free_block_ids(n), "free_block_ids")


@pytest.fixture
def deployment(tmp_path):
    made = []

    def make(**kw):
        d = Deployment(tmp_path, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        codes = d.close()
        # FastDeploy starts each daemon through `sh -c` (its command sets variables and redirects):
        # the shell dies of the group's SIGTERM; the daemon must finish its tasks and stop cleanly.
        assert all(c in (0, -signal.SIGTERM) for c in codes), f"exit codes {codes}\n{d.logs()}"
        for dev in d.device_ids:
            log = (d.log_dir / f"cache_manager_{dev}.log").read_text(errors="replace")
            assert log.rstrip().endswith("stopped"), f"kvtd on device {dev} did not stop cleanly\n{log[-3000:]}"


def tokens(n, start=1):
    return list(range(start, start + n))


@pytest.mark.parametrize("tp", [1, 2])
def test_swap_out_under_gpu_pressure_and_back_on_a_rematch(deployment, tp):
    d = deployment(g=fh.Geometry(tp=tp)).launch()
    g = d.g
    a = d.new_request(tokens(3 * g.block_size + 2))
    d.prefill(a, seed=1)
    full = a.block_tables[:3]
    kv = d.worker.blocks(full)
    d.pcm.release_block_ids(a)
    # GPU pressure: FastDeploy evicts A's blocks to the host tier (SWAP2CPU through kvtd) ...
    d.evict(3)
    wait_for(lambda: len(d.pcm.cpu_free_block_list) == g.cpu_blocks - 3, "the eviction to reach the host tier",
             logs=d.logs)
    # ... other requests overwrite every GPU block ...
    d.worker.fill(range(g.blocks), seed=99)
    # ... and a request with the same prefix matches the host copies: SWAP2GPU into new blocks.
    b = d.new_request(tokens(3 * g.block_size + 2))
    common, matched = d.prefill(b, seed=2)
    assert matched == 3 * g.block_size and len(common) == 3
    assert d.worker.blocks(common) == {k: v for k, v in kv.items()}, "KV bytes differ after the round trip"
    assert d.pcm.cache_task_queue.failures == []


@pytest.mark.parametrize("tp", [1, 2])
def test_storage_write_then_prefetch_on_every_rank(deployment, tp):
    d = deployment(g=fh.Geometry(tp=tp, cpu_blocks=0), storage="file").launch()
    g = d.g
    a = d.new_request(tokens(4 * g.block_size, start=7))
    d.prefill(a, seed=3)
    kv = d.worker.blocks(a.block_tables[:4])
    d.call(lambda: d.pcm.write_cache_to_storage(a), "write_cache_to_storage")  # GPU2STORAGE, synchronous
    d.pcm.release_block_ids(a)
    d.pcm.reset()  # a fresh prefix tree: nothing on the GPU matches any more
    d.worker.fill(range(g.blocks), seed=98)
    b = d.new_request(tokens(4 * g.block_size, start=7) + [1])
    common, matched = d.prefill(b, seed=4)  # STORAGE2GPU: one result per rank, the shortest kept
    assert matched == 4 * g.block_size and len(common) == 4
    assert d.worker.blocks(common) == kv, "KV bytes differ after the storage round trip"
    assert "published them by FastDeploy's names for its worker" in d.logs()  # --create_cache_tensor


def put_ctrl(d, method: str):
    req = fh.ControlRequest(request_id=f"{method}-{uuid.uuid4().hex[:6]}", method=method)
    d.engine_queue.put_transfer_task((d.pcm_mod.CacheStatus.CTRL, req))  # as common_engine.py does
    names = [f"ctrl_c2e_rank{r}_{d.cache_queue_port}" for r in range(d.g.tp)]

    def answered():
        return all(any(x.request_id == req.request_id for x in fh.FMQ_PUTS.get(n, [])) for n in names)

    wait_for(answered, f"every rank's ControlResponse to {method}", logs=d.logs)
    return [next(x for x in fh.FMQ_PUTS[n] if x.request_id == req.request_id) for n in names]


def test_ctrl_pause_resume_and_the_prefix_tree_reset(deployment):
    d = deployment(g=fh.Geometry(tp=2)).launch()
    sig = d.pcm
    assert [r.error_code for r in put_ctrl(d, "pause")] == [200, 200]
    wait_for(lambda: sig.cache_task_is_paused_signal.value[0] == 1 and sum(sig.cache_task_inflight_signal.value) == 0,
             "the paused, drained transfer manager")
    # FastDeploy's RL reset of the prefix tree (clear_prefix_cache thread, reset(wait_for_tasks_done)).
    a = d.new_request(tokens(2 * d.g.block_size))
    d.prefill(a, seed=5)
    d.signals["prefix_tree_status"].value[0] = -1  # PrefixTreeStatus.CLEARING
    wait_for(lambda: d.signals["prefix_tree_status"].value[0] == -2, "the prefix tree reset")
    assert len(d.pcm.gpu_free_block_list) == d.g.blocks
    d.signals["prefix_tree_status"].value[0] = 0
    assert [r.error_code for r in put_ctrl(d, "resume")] == [200, 200]
    wait_for(lambda: sum(sig.cache_task_inflight_signal.value) == 2, "the resumed transfer manager")
    assert [r.error_code for r in put_ctrl(d, "no_such_method")] == [400, 400]


def test_rl_weight_update_through_kv_cache_status(deployment):
    d = deployment(g=fh.Geometry(tp=2)).launch()
    status, ready = d.signals["kv_cache_status"], d.signals["cache_ready_signal"]
    put_ctrl(d, "pause")
    status.value[0] = -1  # KVCacheStatus.CLEARING: the trainer is about to replace the weights
    wait_for(lambda: status.value[0] == -2, "CLEARED", logs=d.logs)
    assert list(ready.value) == [0, 0]  # every daemon released the worker's tensors
    d.worker.unpublish()  # the worker frees its cache and makes a new one
    for r in range(d.g.tp):
        d.worker.publish(r)
    status.value[0] = 1  # KVCacheStatus.UPDATING
    wait_for(lambda: status.value[0] == 0, "NORMAL", logs=d.logs)
    put_ctrl(d, "resume")
    d.swap_round_trip(first_token=50, seed=6)  # on the worker's new tensors


def test_a_failed_swap_is_never_reported_and_the_engine_keeps_working(deployment):
    d = deployment(g=fh.Geometry(tp=2)).launch()
    q = d.pcm.cache_task_queue
    cs = d.pcm_mod.CacheStatus
    q.put_transfer_task((cs.SWAP2GPU, "bad", [0], [5], [9]))  # host block 9 holds nothing
    wait_for(lambda: q.failures, "the failure to be recorded", logs=d.logs)
    assert q.failures[0][0][1] == "bad" and q.failures[0][1].status_name == "host_tier_lost"
    d.swap_round_trip(first_token=80, seed=8)  # FastDeploy's result thread survived the failure


def test_rl_weight_update_when_the_daemons_make_the_cache(deployment):
    """With a storage backend the daemons own the cache (--create_cache_tensor): the worker
    releases it first, the daemons free it and make a new one on UPDATING."""
    d = deployment(g=fh.Geometry(tp=2, cpu_blocks=0), storage="file").launch()
    status, ready = d.signals["kv_cache_status"], d.signals["cache_ready_signal"]
    put_ctrl(d, "pause")
    status.value[0] = -1  # CLEARING
    for r in range(d.g.tp):
        d.worker.release(r)
    wait_for(lambda: status.value[0] == -2, "CLEARED", logs=d.logs)
    status.value[0] = 1  # UPDATING: the daemons make new tensors, the worker maps them
    wait_for(lambda: status.value[0] == 0, "NORMAL", logs=d.logs)
    assert list(ready.value) == [1, 1]
    for r in range(d.g.tp):
        d.worker.attach(r)
    put_ctrl(d, "resume")
    a = d.new_request(tokens(3 * d.g.block_size, start=30))
    d.prefill(a, seed=10)
    kv = d.worker.blocks(a.block_tables[:3])
    d.call(lambda: d.pcm.write_cache_to_storage(a), "write_cache_to_storage")
    d.pcm.release_block_ids(a)
    d.pcm.reset()
    d.worker.fill(range(d.g.blocks), seed=95)
    common, matched = d.prefill(d.new_request(tokens(3 * d.g.block_size, start=30) + [2]), seed=11)
    assert matched == 3 * d.g.block_size and d.worker.blocks(common) == kv


def test_update_weights_changes_the_key_prefix_so_old_kv_is_never_loaded(deployment, tmp_path):
    """FastDeploy's RL flow names the weights in <model>/version.yaml; its manager re-reads the
    prefix on update_weights (and resume, and after a weight update), and so does kvtd."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP1-20261124-aaaa\n")
    d = deployment(g=fh.Geometry(tp=2, cpu_blocks=0), storage="file", model_dir=str(model)).launch()
    a = d.new_request(tokens(2 * d.g.block_size, start=60))
    d.prefill(a, seed=12)
    d.call(lambda: d.pcm.write_cache_to_storage(a), "write_cache_to_storage")
    d.pcm.release_block_ids(a)
    d.pcm.reset()
    _, matched = d.prefill(d.new_request(tokens(2 * d.g.block_size, start=60) + [1]), seed=13)
    assert matched == 2 * d.g.block_size  # stored under step 1, found under step 1
    d.pcm.reset()
    (model / "version.yaml").write_text("version: RL-STEP2-20261124-bbbb\n")  # the trainer's new weights
    assert [r.error_code for r in put_ctrl(d, "update_weights")] == [200, 200]
    _, matched = d.prefill(d.new_request(tokens(2 * d.g.block_size, start=60) + [2]), seed=14)
    assert matched == 0, "KV stored under the old weights was loaded after update_weights"
    assert "RL-STEP2" in d.logs() and "RL-STEP1" in d.logs()
