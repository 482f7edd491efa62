"""kvtd as sglang's HiCache L3 backend, loaded and called by sglang v0.5.18's own code.

sglang's StorageBackendFactory loads `kvtd.sglang` from the extra config ("dynamic": module_path,
class_name; it checks issubclass(HiCacheStorage): storage/backend_factory.py:22-41, 114-150); the
host pool is sglang's own HostKVCache base over its own ShmHostTensorAllocator (a memfd:
pool_host/common.py:30-55, storage/mmap/mmap_allocator.py:139-202), with a subclass standing in for
the torch-2-only MHATokenToKVPoolHost that keeps its buffer dims and page views
(sglang_harness.mha_host_pool_class). The backend is then called as HiCacheController calls a
zero-copy ("interface_v1") backend: register_mem_pool_host once (cache_controller.py:496-498),
batch_exists on a batch of page keys (:1073), batch_get_v1(keys, host_indices) with page_size
token indices per key (:963-978, :1002-1020), all(batch_set_v1(...)) for a backup (:1145-1148).

The oracle is sglang's own HiCacheFile, called as the controller calls a non-v1 backend:
batch_set of get_data_page per key (:1137-1143), batch_exists, and batch_get into dummy pages then
set_from_flat_data_page (:980-1000). The same pages through both must give the same hit counts
and the same bytes in the host pool.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import types
import uuid
from pathlib import Path

import pytest
import torch

import kvtd
import kvtd.testing

import sglang_harness

pytestmark = pytest.mark.skipif(sglang_harness.sglang_source() is None, reason=sglang_harness.skip_reason())

ROOT = Path(__file__).resolve().parents[3]
PAGE = 4
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def extra_config(session):
    return {"backend_name": "kvtd", "module_path": "kvtd.sglang", "class_name": "KvtdHiCacheStorage",
            "interface_v1": 1, "allocator": "shm", "kvtd_session": session, "kvtd_timeout_s": 2}


def device_pool(layers=3, heads=2, head_dim=8, tokens=64):
    return sglang_harness.DevicePool(torch.bfloat16, tokens, layers, heads, head_dim)


def host_pool(layout, dev=None):
    cls = sglang_harness.mha_host_pool_class()
    return cls(dev or device_pool(), 2.0, PAGE, layout)


def fill_random(pool, seed):
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.int16)
    raw.copy_(torch.randint(-32768, 32767, raw.shape, generator=g, dtype=torch.int16))


def same(a, b):
    """Bit for bit (random bf16 bits hold NaNs, which torch.equal never finds equal)."""
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def indices(pages):
    """The host indices sglang passes for these pages: page_size token indices each."""
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


class Rank:
    """One sglang scheduler's storage side: its config, host pool, kvtd backend made by sglang's
    factory, and its daemon (file store at `store`)."""

    def __init__(self, tmp_path, layout, session, tp_rank=0, tp_size=1, store=None, start_daemon=True, pp=(0, 1),
                 metrics=False):
        self.config = sglang_harness.storage_config(tp_rank, tp_size, extra_config(session), pp=pp, metrics=metrics)
        self.pool = host_pool(layout)
        self.backend = sglang_harness.backend_factory().create_backend("dynamic", self.config, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.store = store or (tmp_path / "store")
        self.daemons = None
        if start_daemon:
            self.start()

    def start(self):
        b = self.backend
        self.daemons = kvtd.testing.Daemons(None, b._suffix, b._plan.geometry, ranks=[b._rank],
                                            extra=["--storage-backend", "file", "--storage-path", str(self.store),
                                                   "--model-id", "sgl"]).start()
        b._session.wait_ready(30)

    def close(self):
        if self.daemons is not None:
            self.daemons.stop()
        self.backend.close()


@pytest.fixture
def session_name():
    return f"sgl{uuid.uuid4().hex[:8]}"


def test_the_factory_loads_kvtd_as_an_hicache_storage_and_refuses_a_copying_config(tmp_path, session_name):
    hs = sglang_harness.import_hicache_storage()
    from kvtd.sglang import KvtdHiCacheStorage

    r = Rank(tmp_path, "layer_first", session_name, start_daemon=False)
    try:
        assert isinstance(r.backend, KvtdHiCacheStorage) and isinstance(r.backend, hs.HiCacheStorage)
    finally:
        r.close()
    copying = dict(extra_config(session_name + "x"), interface_v1=0)
    with pytest.raises(ValueError, match="interface_v1"):
        sglang_harness.backend_factory().create_backend(
            "dynamic", sglang_harness.storage_config(0, 1, copying), None)
    # A host pool outside shared memory ("allocator" not "shm"): refused at registration, by name.
    b = sglang_harness.backend_factory().create_backend(
        "dynamic", sglang_harness.storage_config(0, 1, extra_config(session_name + "y")), None)
    cls = sglang_harness.mha_host_pool_class()
    plain = cls(sglang_harness.DevicePool(torch.bfloat16, 64, 3, 2, 8), 2.0, PAGE, "layer_first",
                allocator_type="default")
    with pytest.raises(ValueError, match='"allocator": "shm"'):
        b.register_mem_pool_host(plain)


def test_an_extra_config_from_a_file_asking_for_shm_is_told_why_its_pool_is_not_shared(tmp_path, session_name):
    """sglang accepts the extra config as @file (hiradix_cache.py:697-717) but picks the host
    pool's allocator from the flag's text parsed as inline JSON only (pool_host/common.py:102-117):
    from a file, "allocator": "shm" never reaches it and the pool is ordinary memory. kvtd told
    that user to set what they had set; it names the cause now. Fails on the old code."""
    conf = tmp_path / "extra.json"
    conf.write_text(json.dumps(extra_config(session_name)))
    hs = sglang_harness.import_hicache_storage()
    from sglang.srt.mem_cache.pool_host.common import get_allocator_type

    args = types.SimpleNamespace(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=f"@{conf}")
    allocator = get_allocator_type(args)  # sglang's own choice for this flag
    assert allocator == "dynamic"
    b = sglang_harness.backend_factory().create_backend(
        "dynamic", hs.HiCacheStorageConfig(**{**vars(sglang_harness.storage_config(0, 1, None)),
                                             "extra_config": json.loads(conf.read_text())}), None)
    cls = sglang_harness.mha_host_pool_class()
    pool = cls(sglang_harness.DevicePool(torch.bfloat16, 64, 3, 2, 8), 2.0, PAGE, "layer_first", allocator_type=allocator)
    with pytest.raises(ValueError, match="inline"):
        b.register_mem_pool_host(pool)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_hit_query_and_load_match_sglangs_own_file_backend(tmp_path, session_name, layout):
    hs = sglang_harness.import_hicache_storage()
    r = Rank(tmp_path, layout, session_name)
    oracle_pool = host_pool(layout)
    oracle = hs.HiCacheFile(sglang_harness.storage_config(0, 1, None), file_path=str(tmp_path / "hicache"))
    try:
        fill_random(r.pool, 1)
        oracle_pool.kv_buffer.copy_(r.pool.kv_buffer)
        written = [3, 5, 6, 9, 10, 11]
        keys = [f"k{p}" for p in written]
        original = {p: r.pool.get_data_page(p * PAGE).clone() for p in written}
        # Backup, as the controller's backup thread does for each backend kind.
        assert all(r.backend.batch_set_v1(keys, indices(written)))
        assert oracle.batch_set(keys, [oracle_pool.get_data_page(p * PAGE) for p in written])
        # Hit query: a batch whose fourth key was never stored.
        query = keys[:3] + ["never"] + keys[3:]
        assert r.backend.batch_exists(query) == oracle.batch_exists(query) == 3
        assert r.backend.batch_exists(keys) == oracle.batch_exists(keys) == len(keys)
        # Load into other pages, both pools wiped first.
        r.pool.kv_buffer.zero_()
        oracle_pool.kv_buffer.zero_()
        targets = [20, 2, 14, 27, 8, 1]
        got = r.backend.batch_get_v1(keys, indices(targets))
        assert got == [True] * len(keys)
        data = oracle.batch_get(keys, [oracle_pool.get_dummy_flat_data_page() for _ in keys])
        for t, page in zip(targets, data):
            oracle_pool.set_from_flat_data_page(t * PAGE, page)
        for p, t in zip(written, targets):
            assert same(r.pool.get_data_page(t * PAGE), original[p]), f"page {p} loaded into {t}"
        assert same(r.pool.kv_buffer, oracle_pool.kv_buffer), "kvtd and HiCacheFile loaded different bytes"
        # A load whose third key is missing: the leading two arrive, as sglang stops at the first miss.
        assert r.backend.batch_get_v1(keys[:2] + ["never"], indices([30, 31, 32])) == [True, True, False]
    finally:
        r.close()


def test_a_weight_update_misses_where_sglangs_file_backend_still_hits(tmp_path, session_name):
    hs = sglang_harness.import_hicache_storage()
    r = Rank(tmp_path, "page_first", session_name)
    oracle = hs.HiCacheFile(sglang_harness.storage_config(0, 1, None), file_path=str(tmp_path / "hicache"))
    try:
        fill_random(r.pool, 2)
        keys = ["a", "b"]
        assert all(r.backend.batch_set_v1(keys, indices([1, 2])))
        assert oracle.batch_set(keys, [r.pool.get_data_page(p * PAGE) for p in (1, 2)])
        assert r.backend.batch_exists(keys) == 2
        r.backend.clear()  # sglang's /clear_hicache_storage_backend after new weights
        assert r.backend.batch_exists(keys) == 0, "KV of the old weights must not hit"
        assert r.backend.batch_get_v1(keys, indices([3, 4])) == [False, False]
        assert oracle.batch_exists(keys) == 2, "sglang's own file backend still hits (sgl-project/sglang#26792)"
        stats = r.backend.kvtd_stats()
        assert stats["clears"] == 1 and stats["weight_version"] == 1
    finally:
        r.close()


def test_with_metrics_on_sglangs_collector_takes_every_round_of_stats(tmp_path, session_name):
    """--enable-metrics: the scheduler hands get_stats() to sglang's StorageMetricsCollector every
    event round (hiradix_cache.py:1547-1550), which asserts isinstance(..., StorageMetrics)
    (observability/metrics_collector.py:1931-1935). kvtd returned a dict of its own counters: the
    first round failed the assertion. It returns sglang's StorageMetrics now, the loads' and
    stores' pages and GB/s since the last round, as sglang's own backends do (kvtd's counters:
    kvtd_stats())."""
    import functools

    import prometheus_client

    StorageMetricsCollector = sglang_harness.import_metrics_collector().StorageMetricsCollector
    registry = prometheus_client.CollectorRegistry()

    class Collector(StorageMetricsCollector):  # sglang's collector, on a registry of this test's
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)
        _histogram_cls = functools.partial(prometheus_client.Histogram, registry=registry)

    labels = {"tp_rank": "0"}
    collector = Collector(labels=labels)
    r = Rank(tmp_path, "page_first", session_name, metrics=True)
    try:
        fill_random(r.pool, 5)
        assert all(r.backend.batch_set_v1(["a", "b", "c"], indices([1, 2, 3])))
        assert all(r.backend.batch_get_v1(["a", "b"], indices([4, 5])))
        collector.log_storage_metrics(r.backend.get_stats())
        collector.log_storage_metrics(r.backend.get_stats())  # a round with nothing new adds nothing
        value = functools.partial(registry.get_sample_value, labels=labels)
        assert value("sglang:backup_pgs_count") == 1 and value("sglang:backup_pgs_sum") == 3
        assert value("sglang:prefetch_pgs_count") == 1 and value("sglang:prefetch_pgs_sum") == 2
        assert value("sglang:prefetch_bandwidth_sum") > 0 and value("sglang:backup_bandwidth_sum") > 0
        assert r.backend.kvtd_stats()["pages_stored"] == 3
    finally:
        r.close()
    quiet = Rank(tmp_path, "page_first", session_name + "q", start_daemon=False)
    try:
        assert quiet.backend.get_stats() is None, "without metrics: sglang's base answer, nothing kept"
    finally:
        quiet.close()


def test_page_data_in_the_copying_calls_never_loads_over_a_page_in_use(tmp_path, session_name):
    """sglang's draft (speculative) path calls the page-copying interface: batch_get(keys, dummy
    pages) and batch_set(keys, data pages) (cache_controller.py:1191-1214). kvtd read the dummy
    page's values as host indices: zeros named page 0, and a key the store holds was loaded over
    page 0, a page in use, reported as a hit. Page data is never read as indices now: those calls
    miss (and store nothing), and the pool is untouched. Fails on the old code."""
    r = Rank(tmp_path, "page_first", session_name)
    try:
        fill_random(r.pool, 9)
        assert all(r.backend.batch_set_v1(["k.draft"], indices([1])))
        before = r.pool.get_data_page(0).clone()
        dummy = [r.pool.get_dummy_flat_data_page()]
        assert r.backend.batch_get(["k.draft"], dummy) == [None]
        assert same(r.pool.get_data_page(0), before), "page 0 was overwritten"
        assert r.backend.batch_set(["x.draft"], [r.pool.get_data_page(2 * PAGE)]) is False
        assert r.backend.batch_exists(["x.draft"]) == 0
    finally:
        r.close()


def test_two_dp_attention_groups_on_one_node_each_make_their_own_session(tmp_path, session_name, monkeypatch):
    """With DP attention sglang gives a backend the rank inside its attention group as tp_rank
    (cache_controller.py:609-612), and every group counts from 0: two groups on one node both made
    `<kvtd_session>_r0`, and the second server failed to start (its session name was taken). The
    group is read as the controller reads it (sglang.srt.layers.dp_attention, cache_controller.py:
    36-38; that module is not vendored: a stand-in answers its two calls) and named in the session
    (`_dp<group>`), never in the stored objects (the groups serve one model's pages). Fails on
    the old code."""
    from reference_source import stand_in_module

    group = {"rank": 0}
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.dp_attention", None)
    stand_in_module("sglang.srt.layers.dp_attention", is_dp_attention_enabled=lambda: True,
                    get_attention_dp_rank=lambda: group["rank"])
    made = []
    try:
        for g in (0, 1):
            group["rank"] = g
            made.append(Rank(tmp_path, "page_first", session_name, start_daemon=False))
        assert [r.backend._suffix for r in made] == [f"{session_name}_dp0_r0", f"{session_name}_dp1_r0"]
    finally:
        for r in made:
            r.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_k_and_v_of_different_head_dims_store_and_load_every_byte(tmp_path, session_name, layout):
    """Models whose V head dim differs from K's (MiMo-V2) get sglang's AsymmetricMHATokenToKVPoolHost:
    `kv_buffer` is (k_buffer, v_buffer), two memfds (mha.py:1009-1125). kvtd read
    kv_buffer.data_ptr() and failed at registration with an AttributeError. K and V are now two
    tensors of their own widths, each registered from its own memfd: pages stored from one place
    load into another byte for byte. Fails on the old code."""
    cls = sglang_harness.asymmetric_host_pool_class()
    pool = cls(sglang_harness.DevicePool(torch.bfloat16, 64, 3, 2, 16, v_head_dim=8), 2.0, PAGE, layout)
    config = sglang_harness.storage_config(0, 1, extra_config(session_name))
    backend = sglang_harness.backend_factory().create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    daemons = kvtd.testing.Daemons(None, backend._suffix, backend._plan.geometry, ranks=[0],
                                   extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "store"),
                                          "--model-id", "sgl"]).start()
    try:
        backend._session.wait_ready(30)
        g = torch.Generator().manual_seed(3)
        for buf in pool.kv_buffer:
            raw = buf.view(torch.int16)
            raw.copy_(torch.randint(-32768, 32767, raw.shape, generator=g, dtype=torch.int16))
        assert all(backend.batch_set_v1(["a", "b"], indices([1, 2])))
        assert backend.batch_get_v1(["a", "b"], indices([5, 6])) == [True, True]
        for src, dst in ((1, 5), (2, 6)):
            assert same(pool.k_page(dst), pool.k_page(src)) and same(pool.v_page(dst), pool.v_page(src))
        geometry = backend._plan.geometry
        assert geometry.block_bytes("key") == 2 * geometry.block_bytes("value")  # head dims 16 and 8
    finally:
        daemons.stop()
        backend.close()


class _SlowVersionSession:
    """Wraps the rank's real session: the first set_weight_version waits for `release`, so a second
    clear runs while the first is between its count and its write (this test is about the backend's
    threads; the daemons' session only records what it is told)."""

    def __init__(self, real):
        import threading
        self.real, self.entered, self.release, self.told = real, threading.Event(), threading.Event(), []

    def set_weight_version(self, v):
        if not self.told:
            self.told.append(None)
            self.entered.set()
            assert self.release.wait(10)
        self.told.append(v)
        self.real.set_weight_version(v)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_two_clears_at_once_are_two_weight_versions_and_the_session_keeps_the_last(tmp_path, session_name):
    """Trust: clear() did `_weight_version += 1` outside any lock, then told the session; a second
    clear while the first was telling it left the session at version 1 with the backend at 2 (KV
    stored before the second clear would load). Fails on that code."""
    import threading
    r = Rank(tmp_path, "page_first", session_name, start_daemon=False)
    real = r.backend._session
    slow = _SlowVersionSession(real)
    r.backend._session = slow
    try:
        first = threading.Thread(target=r.backend.clear)
        first.start()
        assert slow.entered.wait(10)
        second = threading.Thread(target=r.backend.clear)
        second.start()
        time.sleep(0.2)  # the second clear runs beside the first
        slow.release.set()
        first.join(10)
        second.join(10)
        stats = r.backend.kvtd_stats()
        assert stats["clears"] == 2 and stats["weight_version"] == 2
        assert slow.told[-1] == 2 and real.weight_version == 2, f"the session was told {slow.told[1:]}"
    finally:
        r.backend._session = real
        r.close()


def test_a_killed_daemon_gives_misses_and_failed_sets_never_an_exception_or_a_hang(tmp_path, session_name):
    r = Rank(tmp_path, "layer_first", session_name)
    try:
        fill_random(r.pool, 3)
        assert all(r.backend.batch_set_v1(["x", "y"], indices([1, 2])))
        before = r.pool.kv_buffer.clone()
        r.daemons.procs[0].send_signal(signal.SIGKILL)
        r.daemons.procs[0].wait()
        start = time.monotonic()
        assert r.backend.batch_exists(["x", "y"]) == 0
        assert r.backend.batch_get_v1(["x", "y"], indices([5, 6])) == [False, False]
        assert r.backend.batch_set_v1(["z"], indices([7])) == [False]
        assert not r.backend.exists("x")
        took = time.monotonic() - start
        # Bounded by the daemon's liveness (its heartbeat, --engine-timeout) and kvtd_timeout_s (2 s).
        assert took < 10, f"calls against a dead daemon took {took:.1f} s"
        assert same(r.pool.kv_buffer, before), "nothing may be written into the pool by a failed load"
        assert r.backend.kvtd_stats()["calls_failed"] >= 3
        # The daemon restarts (systemd's Restart=on-failure): the store still holds what was set.
        r.daemons.kill_and_restart(0)
        r.backend._session.wait_ready(30)
        assert r.backend.batch_exists(["x", "y"]) == 2
        assert r.backend.batch_get_v1(["x", "y"], indices([5, 6])) == [True, True]
        assert same(r.pool.get_data_page(5 * PAGE), before[:, :, 1 * PAGE:2 * PAGE].flatten())
    finally:
        r.close()


def test_two_scheduler_processes_two_daemons_store_and_load_their_own_slices(tmp_path, session_name):
    """TP 2 as sglang runs it: one process per rank, each with its backend, session and daemon.
    Rank 1 backs up one page fewer, so the ranks' hit counts differ; sglang's MIN of them (done
    here as its all_reduce does) is what both load, and each rank gets its own slice back."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "sglang_rank.py"), str(r), "2", session_name,
                               str(store), str(4 - r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env) for r in range(2)]
    try:
        first = [json.loads(p.stdout.readline() or "{}") for p in procs]
        assert [f.get("hits") for f in first] == [4, 3] and all(f.get("set_ok") for f in first), first
        agreed = min(f["hits"] for f in first)
        for p in procs:
            p.stdin.write(f"{agreed}\n")
            p.stdin.flush()
        second = [json.loads(p.stdout.readline() or "{}") for p in procs]
        assert all(s.get("loaded") == [True] * agreed and s.get("same") for s in second), second
        assert [p.wait(60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_is_written_by_rank_0_and_read_by_every_rank(tmp_path, session_name, layout):
    """MLA's latent is the same on every rank: sglang backs it up from TP rank 0 only
    (cache_controller.py:485-490, backup_skip) and every rank loads it. kvtd stores it as one copy
    (no TP size in its namespace), so rank 1 of the same deployment finds and loads what rank 0
    stored, byte for byte, and HiCacheFile (which drops the rank from MLA names,
    hicache_storage.py:381-382) agrees."""
    hs = sglang_harness.import_hicache_storage()
    cls = sglang_harness.mla_host_pool_class()
    dev = sglang_harness.MLADevicePool(torch.bfloat16, 64, 3, 16, 8)
    ranks = []
    oracle = hs.HiCacheFile(sglang_harness.storage_config(0, 2, None, mla=True), file_path=str(tmp_path / "hicache"))
    try:
        for rank in range(2):
            config = sglang_harness.storage_config(rank, 2, extra_config(session_name), mla=True)
            pool = cls(dev, 2.0, PAGE, layout)
            backend = sglang_harness.backend_factory().create_backend("dynamic", config, pool)
            backend.register_mem_pool_host(pool)
            d = kvtd.testing.Daemons(None, backend._suffix, backend._plan.geometry, ranks=[rank],
                                     extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "store"),
                                            "--model-id", "sgl"]).start()
            backend._session.wait_ready(30)
            ranks.append((pool, backend, d))
        (pool0, b0, _), (pool1, b1, _) = ranks
        fill_random(pool0, 7)
        keys, written = ["m1", "m2", "m3"], [2, 5, 7]
        original = {p: pool0.get_data_page(p * PAGE).clone() for p in written}
        assert all(b0.batch_set_v1(keys, indices(written)))  # rank 1 skips the backup, as sglang does
        assert oracle.batch_set(keys, [pool0.get_data_page(p * PAGE) for p in written])
        assert b0.batch_exists(keys) == b1.batch_exists(keys) == oracle.batch_exists(keys) == 3
        assert b1.batch_get_v1(keys, indices([9, 10, 11])) == [True] * 3
        for p, t in zip(written, [9, 10, 11]):
            assert same(pool1.get_data_page(t * PAGE), original[p]), f"rank 1 page {t}"
    finally:
        for _, backend, d in ranks:
            d.stop()
            backend.close()


def test_a_daemon_killed_mid_load_ends_the_call_with_misses_and_writes_nothing(tmp_path, session_name):
    """The daemon is frozen (SIGSTOP) before a load, so the load is submitted and waiting when
    the daemon is SIGKILLed, as in a crash mid-prefetch. The call, made from a thread as
    sglang's prefetch-io thread makes it (cache_controller.py:1025-1040), returns misses within
    its bound and raises nothing; the pages it named are untouched."""
    import threading

    r = Rank(tmp_path, "page_head", session_name)
    try:
        fill_random(r.pool, 4)
        keys = ["q1", "q2", "q3"]
        assert all(r.backend.batch_set_v1(keys, indices([1, 2, 3])))
        r.pool.kv_buffer[:, 10:13].fill_(0)  # page_head: dim 1 is the page
        before = r.pool.kv_buffer.clone()
        daemon = r.daemons.procs[0]
        daemon.send_signal(signal.SIGSTOP)
        out = {}

        def prefetch_io():
            try:
                out["got"] = r.backend.batch_get_v1(keys, indices([10, 11, 12]))
            except BaseException as e:  # the test fails below if anything escapes
                out["raised"] = e

        t = threading.Thread(target=prefetch_io)
        start = time.monotonic()
        t.start()
        time.sleep(0.5)
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        t.join(30)
        took = time.monotonic() - start
        assert not t.is_alive(), "the load hung after its daemon died"
        assert "raised" not in out, out.get("raised")
        assert out["got"] == [False] * 3
        assert took < 15, f"the load took {took:.1f} s to give up"
        assert same(r.pool.kv_buffer, before), "a page was written by a load that was reported failed"
    finally:
        r.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_sglangs_hicache_controller_backs_up_and_prefetches_through_kvtd_as_through_hicache_file(
        tmp_path, session_name, layout, monkeypatch):
    """sglang's own HiCacheController (sglang_controller.py: its storage threads, its factory
    call, its page functions) with kvtd attached, then with HiCacheFile attached: a backup of six
    pages, a prefetch of those six pages and two never stored, the load into freshly allocated
    host pages. Both give the same agreed hit count, the same completed tokens and the same bytes."""
    import sglang_controller as sc

    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))
    tokens = list(range(1000, 1000 + 6 * PAGE))
    asked = tokens + list(range(5000, 5000 + 2 * PAGE))
    seen = {}
    for backend in ("dynamic", "file"):
        dev = device_pool()
        pool = host_pool(layout, dev)
        cc = sc.controller(pool, dev, backend=backend, extra=extra_config(session_name) if backend == "dynamic" else None)
        sched = sc.Scheduler(cc)
        daemons = None
        try:
            # kvtd is called zero-copy (cache_controller.py:517-525), HiCacheFile through pages.
            zero_copy = cc.page_get_func == cc._page_get_zero_copy and cc.page_set_func == cc._page_set_zero_copy
            assert zero_copy == (backend == "dynamic")
            if backend == "dynamic":
                b = cc.storage_backend
                daemons = kvtd.testing.Daemons(None, b._suffix, b._plan.geometry, ranks=[0],
                                               extra=["--storage-backend", "file", "--storage-path",
                                                      str(tmp_path / "store"), "--model-id", "sgl"]).start()
                b._session.wait_ready(30)
            fill_random(pool, 11)
            written = pool.alloc(len(tokens))
            pages = [int(written[i]) for i in range(0, len(tokens), PAGE)]
            original = [pool.get_data_page(p).clone() for p in pages]
            assert sched.backup(written, tokens) == len(tokens)
            pool.kv_buffer.zero_()
            op = sched.prefetch_hits("req", asked)
            loaded, done = sched.load(op)
            got = [pool.get_data_page(int(loaded[i])).clone() for i in range(0, done, PAGE)]
            assert all(same(g, o) for g, o in zip(got, original)), f"{backend}: loaded pages differ from the backup"
            seen[backend] = (op.storage_hit_count, done, torch.cat(got))
        finally:
            sched.stop()
            if daemons is not None:
                daemons.stop()
    assert seen["dynamic"][:2] == seen["file"][:2] == (len(tokens), len(tokens))
    assert same(seen["dynamic"][2], seen["file"][2])


def test_two_scheduler_processes_agree_the_hit_count_through_sglangs_own_all_reduce(tmp_path, session_name):
    """TP 2 with sglang's own HiCacheController in each scheduler process, a gloo group between
    them: rank 0 backs up six pages, rank 1 five; the controllers' MIN all-reduce makes five the
    hit count of both, and each loads its own five pages byte for byte through its daemon."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    init = tmp_path / "gloo_init"
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "sglang_rank_controller.py"), str(r), session_name,
                               str(tmp_path / "store"), str(init), str(6 - r)], stdout=subprocess.PIPE, text=True,
                              env=env) for r in range(2)]
    try:
        out = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
        assert [o["backed"] for o in out] == [6 * PAGE, 5 * PAGE], out
        assert [o["hits"] for o in out] == [5 * PAGE, 5 * PAGE], out
        assert [o["done"] for o in out] == [5 * PAGE, 5 * PAGE] and all(o["same"] for o in out), out
        assert [p.returncode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_sglangs_storage_threads_live_on_through_a_daemon_killed_mid_prefetch(tmp_path, session_name):
    """With sglang's own HiCacheController: after a backup and an agreed hit count, the daemon is
    frozen (SIGSTOP) so the prefetch-io thread's load is in flight, then SIGKILLed. The load ends
    with nothing completed and the operation terminated, as sglang handles a failed page
    (cache_controller.py:963-978, 1016-1023), the pages it was given stay as they were, the
    controller's prefetch, prefetch-io and backup threads are all alive (an exception would have
    ended them for the life of the process), the next prefetch finds no hit and the next backup
    completes nothing; once the daemon is back the same prefetch loads every page."""
    import threading

    import sglang_controller as sc

    dev = device_pool()
    pool = host_pool("page_first_direct", dev)
    cc = sc.controller(pool, dev, extra=extra_config(session_name))
    sched = sc.Scheduler(cc)
    b = cc.storage_backend
    d = kvtd.testing.Daemons(None, b._suffix, b._plan.geometry, ranks=[0],
                             extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "store"),
                                    "--model-id", "sgl"]).start()
    try:
        b._session.wait_ready(30)
        fill_random(pool, 12)
        tokens = list(range(1000, 1000 + 4 * PAGE))
        written = pool.alloc(len(tokens))
        assert sched.backup(written, tokens) == len(tokens)
        op = sched.prefetch_hits("mid-load", tokens)
        assert op.storage_hit_count == len(tokens)
        before = pool.kv_buffer.clone()
        d.procs[0].send_signal(signal.SIGSTOP)
        out = {}
        loader = threading.Thread(target=lambda: out.update(result=sched.load(op)))
        loader.start()
        time.sleep(0.5)
        d.procs[0].send_signal(signal.SIGKILL)
        d.procs[0].wait()
        loader.join(30)
        assert not loader.is_alive(), "the prefetch did not end after its daemon died"
        assert out["result"][1] == 0 and op.is_terminated()
        assert same(pool.kv_buffer, before), "a page was written by a load that failed"
        assert sched.prefetch_hits("after-kill", tokens).storage_hit_count == 0
        more = pool.alloc(2 * PAGE)
        assert sched.backup(more, list(range(7000, 7000 + 2 * PAGE))) == 0
        threads = [cc.prefetch_thread, cc.backup_thread, cc.prefetch_io_aux_thread]
        assert all(t.is_alive() for t in threads), "a storage thread of sglang died"
        d.kill_and_restart(0)
        b._session.wait_ready(30)
        op = sched.prefetch_hits("after-restart", tokens)
        assert op.storage_hit_count == len(tokens)
        assert sched.load(op)[1] == len(tokens)
    finally:
        sched.stop()
        d.stop()


def test_a_page_stored_from_one_layout_never_loads_into_anothers_pages(tmp_path, session_name):
    """page_first and page_first_direct pages hold the same bytes in another order
    ([token][layer]... against [layer][token]...). HiCacheFile names a file by key, model and TP
    rank only (hicache_storage.py:378-384), so a server restarted with the other layout loads the
    old file into its pages in the wrong order; kvtd's namespace holds the layout's shape, so the
    same keys miss there."""
    hs = sglang_harness.import_hicache_storage()
    first = Rank(tmp_path, "page_first", session_name)
    oracle = hs.HiCacheFile(sglang_harness.storage_config(0, 1, None), file_path=str(tmp_path / "hicache"))
    try:
        fill_random(first.pool, 21)
        assert all(first.backend.batch_set_v1(["s1", "s2"], indices([1, 2])))
        assert oracle.batch_set(["s1", "s2"], [first.pool.get_data_page(p * PAGE) for p in (1, 2)])
    finally:
        first.close()
    direct = Rank(tmp_path, "page_first_direct", session_name + "d", store=tmp_path / "store")
    try:
        assert direct.backend.batch_exists(["s1", "s2"]) == 0
        assert direct.backend.batch_get_v1(["s1", "s2"], indices([3, 4])) == [False, False]
        assert oracle.batch_exists(["s1", "s2"]) == 2, "HiCacheFile would load them into the other layout"
    finally:
        direct.close()


def test_a_daemon_maps_the_memory_of_its_own_engine_only(tmp_path, session_name):
    """A tensor may name a process's own memory (/proc/<pid>/fd/<fd>) only if that process made
    the session: a daemon running with more rights than its engine (root under systemd) must not
    map another process's memory on the engine's word. Here the session names pid 1's stdin."""
    g = kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(4, 1, 4, 8), value_shape=(4, 1, 4, 8))
    nbytes = g.block_bytes("key") * 4
    with kvtd.Session(session_name, g) as s:
        for kind in ("key", "value"):
            s.register_tensor(0, 0, kind, b"/proc/1/fd/0".ljust(64, b"\0"), 0, nbytes)
        s.publish()
        with kvtd.testing.Daemons(None, session_name, g) as d:
            with pytest.raises(Exception):
                s.wait_ready(3)
            deadline = time.monotonic() + 10
            while "not the memory of the engine" not in d.logs() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert f"not the memory of the engine that made the session (pid {os.getpid()})" in d.logs(), d.logs()


def _refused_memory(session_name, path, says):
    """A session whose tensors name `path` (the engine's own /proc/<pid>/fd/<fd>): its daemon never
    gets ready and its log says `says`."""
    g = kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(4, 1, 4, 8), value_shape=(4, 1, 4, 8))
    nbytes = g.block_bytes("key") * 4
    with kvtd.Session(session_name, g) as s:
        for kind in ("key", "value"):
            s.register_tensor(0, 0, kind, path.encode().ljust(64, b"\0"), 0 if kind == "key" else nbytes, nbytes)
        s.publish()
        with kvtd.testing.Daemons(None, session_name, g) as d:
            with pytest.raises(Exception):
                s.wait_ready(3)
            deadline = time.monotonic() + 10
            while says not in d.logs() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert says in d.logs(), d.logs()


@pytest.mark.parametrize("case", ["read_only", "disk_file"])
def test_a_daemon_maps_only_what_the_engine_may_write_and_only_memory(tmp_path, session_name, case):
    """Trust round 4: the daemon reopened /proc/<pid>/fd/<fd> with its own rights (root under
    systemd), so a memfd the engine held read-only came back writable, and any file the engine held
    (a disk file: someone's data) was mapped as KV. Now the engine's own open mode must be
    read-write (its fdinfo) and the file shared memory (a memfd or tmpfs)."""
    size = 4096
    if case == "read_only":
        mem = os.memfd_create("kvtd_test_ro")
        os.ftruncate(mem, size)
        fd = os.open(f"/proc/self/fd/{mem}", os.O_RDONLY)  # the same memfd, held read-only
        says = "is open read-only in the engine"
    else:
        fd = os.open(tmp_path / "disk_file", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        says = "is not shared memory"
    try:
        _refused_memory(session_name, f"/proc/{os.getpid()}/fd/{fd}", says)
    finally:
        os.close(fd)
        if case == "read_only":
            os.close(mem)


@pytest.mark.parametrize("mla", [False, True])
def test_a_pipeline_stage_never_finds_or_loads_another_stages_layers(tmp_path, session_name, mla):
    """Trust round 4: two pipeline stages of one model (equal depth, so equal shapes) on two nodes
    share a store. Session and object names carried only the TP rank: stage 1's batch_exists
    answered 2 where HiCacheFile answers 0 (it names files by PP rank, hicache_storage.py:382-388)
    and its batch_get_v1 loaded stage 0's layers into its pool. Each stage is now a namespace of
    its own (KvIdentity pp_rank/pp_size), MHA and MLA alike (an MLA latent drops the TP rank from
    its names, never the stage)."""
    hs = sglang_harness.import_hicache_storage()
    stages = []
    try:
        for stage in range(2):
            node = f"{session_name}n{stage}"  # each stage on a node of its own: its own /dev/shm, one store
            config = sglang_harness.storage_config(0, 1, extra_config(node), mla=mla, pp=(stage, 2))
            if mla:
                dev = sglang_harness.MLADevicePool(torch.bfloat16, 64, 3, 16, 8)
                pool = sglang_harness.mla_host_pool_class()(dev, 2.0, PAGE, "page_first")
            else:
                pool = host_pool("page_first")
            backend = sglang_harness.backend_factory().create_backend("dynamic", config, pool)
            backend.register_mem_pool_host(pool)
            assert backend._suffix == f"{node}_pp{stage}_r0"
            d = kvtd.testing.Daemons(None, backend._suffix, backend._plan.geometry, ranks=[0],
                                     extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "store"),
                                            "--model-id", "sgl"]).start()
            stages.append((pool, backend, d, config))
            backend._session.wait_ready(30)
        (pool0, b0, _, c0), (pool1, b1, _, c1) = stages
        oracles = [hs.HiCacheFile(c, file_path=str(tmp_path / "hicache")) for c in (c0, c1)]
        fill_random(pool0, 5)
        pool1.kv_buffer.zero_()
        keys = ["p1", "p2"]
        assert all(b0.batch_set_v1(keys, indices([1, 2])))
        assert oracles[0].batch_set(keys, [pool0.get_data_page(p * PAGE) for p in (1, 2)])
        assert b0.batch_exists(keys) == oracles[0].batch_exists(keys) == 2
        assert b1.batch_exists(keys) == oracles[1].batch_exists(keys) == 0
        assert b1.batch_get_v1(keys, indices([3, 4])) == [False, False]
        assert not pool1.kv_buffer.view(torch.int16).any(), "stage 1's pool got stage 0's bytes"
    finally:
        for _, backend, d, _ in stages:
            d.stop()
            backend.close()


def test_every_one_byte_dtype_is_a_namespace_of_its_own():
    """sglang's fp8 pools (e4m3, e5m2) move as uint8 bytes; their dtype names still differ in the
    identity the session declares and the daemon's namespace takes (kvtd/proto/kv_identity.h)."""
    from kvtd.engines.sglang.layout import plan_pool
    plans = {name: plan_pool(layout="page_first", mla=False, layer_num=2, size=16, page_size=4, token_width=8,
                             dtype_name=name, itemsize=1, tp_size=1, buffer_bytes=2 * 2 * 16 * 8)
             for name in ("float8_e4m3fn", "float8_e5m2", "uint8")}
    assert {p.geometry.dtype for p in plans.values()} == {"uint8"}
    assert [p.geometry.identity.dtype for p in plans.values()] == ["float8_e4m3fn", "float8_e5m2", "uint8"]
    flags = plans["float8_e5m2"].geometry.daemon_flags()
    assert flags[flags.index("--kv-dtype") + 1] == "float8_e5m2" and flags[flags.index("--kv-layout") + 1] == "per_rank"
