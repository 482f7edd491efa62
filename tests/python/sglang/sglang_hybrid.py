"""sglang v0.5.18's HybridCacheController (mem_cache/hybrid_cache/hybrid_cache_controller.py), loaded
unmodified over a HostPoolGroup of sglang's own host pools, for tests that drive a storage backend
as sglang drives it for a hybrid model.

Stood in for (beyond sglang_controller.py's, PROVENANCE of the reference tree), never its logic:
- sglang.kernels.ops.kvcache.hicache: every JIT kernel name (mha.py imports a dozen at module
  level); each raises if called, and no test moves pages with one (no device here).
- memory_pool's MHATokenToKOnlyPool, MHATokenToKVPool and MambaPool: classes for the imports and
  isinstance checks of pool_host/mha.py and pool_host/mamba.py.
- torch.uint64 (torch 2.3): MambaPoolHost.__init__ keeps the device state's pointers in uint64
  tensors (pool_host/mamba.py:115-132), used only by its CUDA kernels; here int64 holds them.

The pools: the KV pool is sglang_harness's MHA stand-in (MHATokenToKVPoolHost is torch-2 code);
the Mamba pool is sglang's own MambaPoolHost over a device pool with sglang's state shapes
(mamba_cache.temporal: (layers, slots, *shape), conv: a list of the same); an SWA pool the MHA
stand-in over the sliding-window layers. Every pool uses sglang's shm allocator (memfds).

The scheduler side (the hybrid radix caches, not vendored) is played by HybridScheduler: it
passes each pool's keys and host indices in the PoolTransfers the way HybridCacheController reads
them (a Mamba state's one key at the end of the prefix, TRAILING_PAGES; an SWA pool's last pages).
"""

from __future__ import annotations

import sys
import threading
import time
import types

import torch

import sglang_controller as sc
import sglang_harness


def _refusing_kernels(module):
    def kernel(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"{name}: sglang's JIT kernel does not run here")
        return refuse
    module.__getattr__ = kernel


def import_hybrid():
    """(HybridCacheController, HostPoolGroup, PoolEntry, MambaPoolHost, hicache_storage)."""
    sc._stand_ins()
    group_cls, entry_cls = sglang_harness.import_host_pool_group()
    _refusing_kernels(sys.modules["sglang.kernels.ops.kvcache.hicache"])
    pool = sys.modules["sglang.srt.mem_cache.memory_pool"]
    for name in ("MHATokenToKOnlyPool", "MHATokenToKVPool", "MambaPool"):
        if not hasattr(pool, name):
            setattr(pool, name, type(name, (), {}))
    if not hasattr(torch, "uint64"):
        torch.uint64 = torch.int64
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
    hs = sglang_harness.import_hicache_storage()
    return HybridCacheController, group_cls, entry_cls, MambaPoolHost, hs


class MambaDevicePool:
    """What MambaPoolHost reads of sglang's MambaPool: layers, slots, device, and the state
    tensors (temporal (layers, slots + 1, *shape) float32; conv a list of bfloat16 ones)."""

    def __init__(self, layers=2, slots=8, temporal=(2, 4, 4), convs=((6, 3),)):
        self.num_mamba_layers, self.size, self.device = layers, slots, "cpu"
        self.mamba_cache = types.SimpleNamespace(
            temporal=torch.zeros((layers, slots + 1) + tuple(temporal), dtype=torch.float32),
            conv=[torch.zeros((layers, slots + 1) + tuple(c), dtype=torch.bfloat16) for c in convs])


def mamba_host_pool(dev=None, layout="page_first"):
    """sglang's own MambaPoolHost, but for get_size_per_token, which reads dtype.itemsize (torch
    2.1; mamba.py:271-277): the same sum with element_size()."""
    _, _, _, mamba_cls, _ = import_hybrid()

    class MambaHostPool(mamba_cls):
        def get_size_per_token(self):
            def size(dtype):
                return torch.empty([], dtype=dtype).element_size()
            conv = sum(e * size(self.conv_dtype) for e in self.conv_state_elem_sizes)
            return (conv + self.temporal_state_elem_size * size(self.temporal_dtype)) * self.num_mamba_layers

    return MambaHostPool(dev or MambaDevicePool(), 1.0, 0, pin_memory=False, device="cpu", allocator_type="shm",
                         layout=layout)


def mla_device_pool(layers=2, tokens=64):
    """sglang_harness's MLA device pool, an instance of the MLATokenToKVPool stand-in, so the
    controller sees an MLA model (is_mla_model: cache_controller.py:626)."""
    sc._stand_ins()

    class MLADevicePool(sc.MLATokenToKVPool, sglang_harness.MLADevicePool):
        pass

    return MLADevicePool(torch.bfloat16, tokens, layers, 16, 8)


class IndexerDevicePool:
    """What DSAIndexerPoolHost reads of sglang's DSATokenToKVPool (memory_pool_host.py:1092-1180):
    layers (not layer-sharded), the indexer head dim and quant block, its per-layer buffers."""

    def __init__(self, layers, index_head_dim=16, quant_block_size=8, tokens=64):
        self.store_dtype, self.device = torch.uint8, "cpu"
        self.layer_num, self.start_layer, self.end_layer, self.layer_shard_enabled = layers, 0, layers, False
        self.index_head_dim, self.quant_block_size = index_head_dim, quant_block_size
        self.index_k_with_scale_buffer = [torch.zeros(tokens, index_head_dim + 4 * (index_head_dim // quant_block_size),
                                                      dtype=torch.uint8) for _ in range(layers)]


class IndexerHostPool:
    """A stand-in for DSAIndexerPoolHost (memory_pool_host.py:1087-1500), whose __init__ reads
    dtype.itemsize (torch 2.1): its sizes (:1114-1131: a token's index_head_dim bytes plus a 4-byte
    scale per quant block, indexer_page_num one more than the anchor's pages), its one buffer's
    dims per layout (:1176-1215) made by sglang's own allocator (a memfd), and its page views
    (:1454-1490), which HiCacheFile's v2 path calls."""

    def __init__(self, device_pool, anchor_host, layout="page_first"):
        _, alloc_funcs = sglang_harness.import_host_pool()
        from sglang.srt.mem_cache.pool_host.common import get_allocator_from_storage  # noqa: E402
        self.device_pool, self.layout, self.device = device_pool, layout, "cpu"
        self.page_size, self.size, self.page_num = anchor_host.page_size, anchor_host.size, anchor_host.page_num
        self.layer_num = device_pool.layer_num
        self.allocator = get_allocator_from_storage("shm")
        per_token = device_pool.index_head_dim + device_pool.index_head_dim // device_pool.quant_block_size * 4
        self.indexer_page_stride_size = per_token * self.page_size
        self.indexer_page_num = (self.size + self.page_size + 1) // self.page_size
        self.can_use_write_back_jit = False
        dims = ((self.layer_num, self.indexer_page_num, self.indexer_page_stride_size) if layout == "layer_first"
                else (self.indexer_page_num, self.layer_num, 1, self.indexer_page_stride_size))
        self.index_k_with_scale_buffer = alloc_funcs["cpu"](dims, dtype=torch.uint8, device="cpu", pin_memory=False,
                                                            allocator=self.allocator)

    def _page(self, index):
        page = int(index) // self.page_size
        if self.layout == "layer_first":
            return self.index_k_with_scale_buffer[:, page:page + 1, :]
        return self.index_k_with_scale_buffer[page:page + 1]

    def get_data_page(self, index, flat=True):
        return self._page(index).flatten() if flat else self._page(index)

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.layer_num * self.indexer_page_stride_size, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page):
        view = self._page(index)
        view.copy_(data_page.reshape(view.shape))


def indexer_host_pool(dev, anchor, layout="page_first"):
    return IndexerHostPool(dev, anchor, layout)


def pool_group(pools):
    """sglang's HostPoolGroup of `pools`: [(PoolName, host pool, device pool)], the first the anchor."""
    _, group_cls, entry_cls, _, _ = import_hybrid()
    entries = [entry_cls(name=name, host_pool=host, device_pool=dev, layer_mapper=lambda i: i,
                         is_primary_index_anchor=i == 0) for i, (name, host, dev) in enumerate(pools)]
    return group_cls(entries)


def register_as_controller(backend, group):
    """register_mem_pool_host of the group, then register_mem_host_pool_v2 of each pool, as
    HybridCacheController.attach_storage_backend registers a backend (hybrid_cache_controller.py:
    154-170)."""
    backend.register_mem_pool_host(group)
    for e in group.entries:
        backend.register_mem_host_pool_v2(e.host_pool, e.name)


def kvtd_backend(group, store, *, model_id="sgl", timeout_s=30.0):
    """kvtd.sglang for `group`, made by sglang's own factory and registered as the controller
    registers it, with its rank's daemon over a file store at `store`, attached: (backend,
    daemons). On failure nothing is left running."""
    import uuid

    import kvtd.testing

    extra = {"backend_name": "kvtd", "module_path": "kvtd.sglang", "class_name": "KvtdHiCacheStorage",
             "interface_v1": 1, "allocator": "shm", "kvtd_session": f"sglh{uuid.uuid4().hex[:6]}",
             "kvtd_timeout_s": timeout_s}
    backend = sglang_harness.backend_factory().create_backend("dynamic", sglang_harness.storage_config(0, 1, extra),
                                                              group)
    daemons = None
    try:
        register_as_controller(backend, group)
        daemons = kvtd.testing.Daemons(None, backend._suffix, backend._hybrid.groups, ranks=[0],
                                       extra=["--storage-backend", "file", "--storage-path", str(store),
                                              "--model-id", model_id]).start()
        backend._session.wait_ready(60)
    except BaseException:
        if daemons is not None:
            daemons.stop()
        backend.close()
        raise
    return backend, daemons


def controller(group, kv_device_pool, extra, *, backend="dynamic", tp_rank=0, tp_size=1):
    """A HybridCacheController over `group` with storage `backend` attached at construction."""
    hybrid_cls, _, _, _, _ = import_hybrid()
    sc._parallel.__init__(tp_rank, tp_size)
    return hybrid_cls(sc.Allocator(sc.with_layer_counter(kv_device_pool)), group, group.page_size, None,
                      threading.Event(), storage_backend=backend, prefetch_threshold=group.page_size,
                      model_name="kvtd-test/hybrid", storage_backend_extra_config=dict(extra) if extra else None)


def fill_random(tensor, seed):
    g = torch.Generator().manual_seed(seed)
    flat = tensor.view(-1).view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))


class HybridScheduler:
    """The hybrid radix cache's storage duties for one HybridCacheController, the way it hands
    them over: write_storage / prefetch with extra_pools, the agreed hit from
    prefetch_hit_queue, host memory of every pool allocated, the operation to prefetch_buffer."""

    def __init__(self, cc):
        self.cc = cc
        self.page = cc.page_size

    def keys(self, tokens):
        return sc.get_hash_str(tokens, None, self.page)

    def backup(self, kv_host_indices, tokens, extra_pools, timeout=30.0):
        op_id = self.cc.write_storage(kv_host_indices, tokens, self.keys(tokens), extra_pools=extra_pools)
        return sc.next_from(self.cc.ack_backup_queue, lambda op: op.id == op_id, "the backup's ack", timeout)

    def prefetch(self, request_id, tokens, extra_pools, timeout=30.0):
        self.cc.prefetch(request_id, tokens, extra_pools=extra_pools)
        return sc.next_from(self.cc.prefetch_hit_queue, lambda op: op.request_id == request_id, "the hit count",
                            timeout)

    def load(self, op, timeout=30.0):
        """Host memory for the hit in every pool (each transfer's keys, `page_size` indices per
        key, one slot per key for a state pool), then the prefetch-io thread; returns when it is
        done (pool_transfers_done) or stopped."""
        pools = self.cc.mem_pool_host.entry_map
        op.host_indices = self.cc.mem_pool_host.anchor_entry.host_pool.alloc(op.storage_hit_count)
        for t in op.pool_transfers or []:
            if t.indices_from_pool is not None:  # the controller gives it its source's indices
                continue
            host = pools[t.name].host_pool
            t.host_indices = host.alloc(len(t.keys) * host.page_size)
            assert t.host_indices is not None, f"pool {t.name} is full"
        self.cc.prefetch_buffer.put(op)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if getattr(op, "pool_transfers_done", False) or op.is_terminated():
                break
            time.sleep(0.01)
        time.sleep(0.05)
        return op

    def stop(self):
        sc.Scheduler(self.cc).stop()
