"""A hybrid model's pools through sglang v0.5.18's own HybridCacheController, against real daemons,
with sglang's own HiCacheFile (its v2 calls, hicache_storage.py:602-718) as the oracle in the same
flow: the same backups and prefetches through both must give the same hit counts and the same
bytes in every pool.

The controller runs unmodified (sglang_hybrid.py lists what is stood in for): it registers the
HostPoolGroup (register_mem_pool_host, then register_mem_host_pool_v2 per pool:
hybrid_cache_controller.py:154-170), asks batch_exists_v2 with the pool transfers (:586-610),
loads the KV pages by batch_get_v1 and then the other pools by batch_get_v2 with the trailing keys
re-aligned to the hit (:640-659, :764-782), and backs up the other pools by batch_set_v2 before the
KV pool by batch_set_v1 (:661-696).
"""

from __future__ import annotations

import uuid

import pytest

import kvtd.testing

import sglang_harness
import sglang_hybrid as sh
from test_sglang_engine import PAGE, device_pool, extra_config, host_pool, same

pytestmark = pytest.mark.skipif(sglang_harness.sglang_source() is None, reason=sglang_harness.skip_reason())

PAGES = 6


def store_flags(path):
    return ["--storage-backend", "file", "--storage-path", str(path), "--model-id", "sgl"]


class HybridRank:
    """One scheduler of a Qwen3-Next-shaped model (full attention KV beside Mamba state), a
    gpt-oss-shaped one (KV beside a sliding window), a DeepSeek-V3.2-shaped one (an MLA latent
    beside its indexer keys, which take the latent's host indices) or a model with a speculative
    draft pool in its group (PoolName.DRAFT, the KV pool's pages): its pools, its
    HybridCacheController with `backend`, and for kvtd its daemon."""

    def __init__(self, backend, tmp_path, sidecar="mamba", window_pages=2):
        _, _, _, _, self.hs = sh.import_hybrid()
        P = self.hs.PoolName
        self.derived = sidecar in ("indexer", "draft")
        if sidecar == "indexer":
            self.kv_dev = sh.mla_device_pool()
            self.kv = sglang_harness.mla_host_pool_class()(self.kv_dev, 2.0, PAGE, "page_first")
        else:
            self.kv_dev = device_pool(layers=2)
            self.kv = host_pool("page_first", self.kv_dev)
        if sidecar == "indexer":
            self.side_dev = sh.IndexerDevicePool(self.kv_dev.layer_num)
            self.side = sh.indexer_host_pool(self.side_dev, self.kv)
            self.side_name, self.side_keys = P.INDEXER, 0
        elif sidecar == "draft":  # a speculative draft model's KV: one layer, the target's pages
            self.side_dev = device_pool(layers=1)
            self.side = host_pool("page_first", self.side_dev)
            self.side_name, self.side_keys = P.DRAFT, 0
        elif sidecar == "mamba":
            self.side_dev = sh.MambaDevicePool()
            self.side = sh.mamba_host_pool(self.side_dev)
            self.side_name, self.side_keys = P.MAMBA, 1
        else:
            self.side_dev = device_pool(layers=1)
            self.side = host_pool("page_first", self.side_dev)
            self.side_name, self.side_keys = P.SWA, window_pages
        group = sh.pool_group([(P.KV, self.kv, self.kv_dev), (self.side_name, self.side, self.side_dev)])
        extra = None
        if backend == "dynamic":
            extra = extra_config(f"hyb{uuid.uuid4().hex[:6]}")
            extra["kvtd_swa_window_tokens"] = window_pages * PAGE
        self.daemons = None
        self.cc = sh.controller(group, self.kv_dev, extra, backend=backend)
        self.sched = sh.HybridScheduler(self.cc)
        try:
            b = self.cc.storage_backend
            if backend == "dynamic":
                self.daemons = kvtd.testing.Daemons(None, b._suffix, b._hybrid.groups, ranks=[0],
                                                    extra=store_flags(tmp_path / "store")).start()
                b._session.wait_ready(30)
        except BaseException:
            self.close()
            raise

    def side_buffers(self):
        if self.side_name == self.hs.PoolName.MAMBA:
            return [self.side.temporal_buffer, *self.side.conv_buffer]
        if self.side_name == self.hs.PoolName.INDEXER:
            return [self.side.index_k_with_scale_buffer]
        return [self.side.kv_buffer]

    def transfer(self, keys, host_indices=None):
        """The side pool's PoolTransfer as the radix cache hands it over: trailing keys with host
        indices of its own, or (the indexer) every page, indices and keys taken from the KV pool."""
        if self.derived:
            return self.hs.PoolTransfer(name=self.side_name, hit_policy=self.hs.PoolHitPolicy.ALL_PAGES,
                                        indices_from_pool=self.hs.PoolName.KV)
        return self.hs.PoolTransfer(name=self.side_name, keys=list(keys), host_indices=host_indices,
                                    hit_policy=self.hs.PoolHitPolicy.TRAILING_PAGES)

    def side_units(self, n_keys):
        return n_keys * self.side.page_size

    def close(self):
        self.sched.stop()
        if self.daemons is not None:
            self.daemons.stop()


def scenario(rank):
    """Two backups (3 pages with the side pool's pages at their end, then all 6 with theirs at
    the end), every pool zeroed, then three prefetches: the whole prefix, 5 pages (the side pool's
    pages at 5 were never written: the hit falls back to 3 and the side keys re-align), and a
    prefix none of whose pages were stored. Returns what each prefetch hit and loaded."""
    sh.fill_random(rank.kv.kv_buffer, 1)
    for i, b in enumerate(rank.side_buffers()):
        sh.fill_random(b, 2 + i)
    tokens = list(range(1000, 1000 + PAGES * PAGE))
    keys = rank.sched.keys(tokens)
    kv_idx = rank.kv.alloc(len(tokens))
    n = rank.side_keys
    step = rank.side.page_size
    original_kv = [rank.kv.get_data_page(int(kv_idx[i])).clone() for i in range(0, len(tokens), PAGE)]
    if rank.derived:  # every page's indexer keys (or draft KV), at the KV pool's host indices
        side_a = side_b = None
        original_side = {k: rank.side.get_data_page(int(kv_idx[j * PAGE])).clone() for j, k in enumerate(keys)}
    else:
        side_a, side_b = rank.side.alloc(rank.side_units(n)), rank.side.alloc(rank.side_units(n))
        original_side = {k: rank.side.get_data_page(int(idx[j * step])).clone()
                         for idx, last in ((side_a, 3), (side_b, PAGES))
                         for j, k in enumerate(keys[last - n:last])}
    a = rank.sched.backup(kv_idx[:3 * PAGE], tokens[:3 * PAGE], [rank.transfer(keys[3 - n:3], side_a)])
    if rank.derived:  # the indexer's (draft's) pages 3..5 are stored with the KV pool's
        n = 0
    b = rank.sched.backup(kv_idx, tokens, [rank.transfer(keys[PAGES - n:], side_b)])
    backed = (a.completed_tokens, b.completed_tokens)
    rank.kv.kv_buffer.zero_()
    for buf in rank.side_buffers():
        buf.zero_()
    out = {"backed": backed}
    for name, count in (("whole", PAGES), ("five", 5), ("none", 0)):
        asked = tokens[:count * PAGE] if count else list(range(5000, 5000 + 4 * PAGE))
        asked_keys = rank.sched.keys(asked)
        op = rank.sched.prefetch(name, asked, [rank.transfer(asked_keys[len(asked_keys) - n:])])
        hit = op.storage_hit_count
        loaded = {"hit": hit, "kv": [], "side": [], "side_ok": None}
        if hit:
            rank.sched.load(op)
            done = op.completed_tokens
            host = op.host_indices
            loaded["kv"] = [same(rank.kv.get_data_page(int(host[i])), original_kv[i // PAGE])
                            for i in range(0, done, PAGE)]
            t = op.pool_transfers[0]
            loaded["side_keys"] = list(t.keys)
            loaded["side_ok"] = op.pool_storage_result.extra_pool_hit_pages.get(t.name)
            loaded["side"] = [same(rank.side.get_data_page(int(t.host_indices[j * step])), original_side[k])
                              if k in original_side else False for j, k in enumerate(t.keys)]
        out[name] = loaded
    return out


@pytest.mark.parametrize("sidecar", ["mamba", "swa", "indexer", "draft"])
def test_a_hybrid_models_pools_load_back_as_sglangs_own_file_backend_loads_them(tmp_path, monkeypatch, sidecar):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache_file"))
    results = {}
    for backend in ("dynamic", "file"):
        rank = HybridRank(backend, tmp_path, sidecar)
        try:
            results[backend] = scenario(rank)
        finally:
            rank.close()
    kvtd_run, oracle = results["dynamic"], results["file"]
    assert kvtd_run["backed"] == (3 * PAGE, PAGES * PAGE)
    assert kvtd_run["whole"]["hit"] == PAGES * PAGE
    # The trailing pools' pages at page 5 were never stored: the hit falls back to page 3. The
    # indexer's are every page's.
    assert kvtd_run["five"]["hit"] == (5 if sidecar in ("indexer", "draft") else 3) * PAGE
    assert kvtd_run["none"]["hit"] == 0
    for name in ("whole", "five"):
        got = kvtd_run[name]
        assert got["kv"] and all(got["kv"]), f"{name}: every KV page loaded byte for byte"
        assert got["side"] and all(got["side"]), f"{name}: the {sidecar} pages of {got['side_keys']} loaded"
    assert kvtd_run == oracle
