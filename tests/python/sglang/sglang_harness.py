"""sglang's own source for tests: v0.5.18 in $KVTD_SGLANG_SRC, else ../shared/reference/sglang beside
the checkout, else /work/shared/reference/sglang (see its PROVENANCE: hicache_storage.py imports on
Debian's torch 1.13 with nothing replaced; HiCacheFile's evictor needs one helper of the
unvendored sglang.srt.utils, below)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Optional

from reference_source import reference_source

def sglang_source() -> Optional[Path]:
    return reference_source("KVTD_SGLANG_SRC", "sglang", "python/sglang/srt/mem_cache/hicache_storage.py")


def skip_reason() -> str:
    return ("sglang's source is not here: set KVTD_SGLANG_SRC to a checkout of sglang v0.5.18, or place it at "
            "../shared/reference/sglang beside this checkout")


def _stand_in_for_unvendored_utils():
    """sglang.srt.utils is not vendored (PROVENANCE); HiCacheFile's evictor imports one helper from it,
    human_readable_int, to parse its optional size limit (lru_file_evictor.py:34-53). The tests set
    no limit, so the stand-in parses plain integers only and refuses anything else."""
    if "sglang.srt.utils" in sys.modules:
        return
    utils = types.ModuleType("sglang.srt.utils")
    common = types.ModuleType("sglang.srt.utils.common")

    def human_readable_int(text):
        return int(text)

    common.human_readable_int = human_readable_int
    utils.common = common
    sys.modules["sglang.srt.utils"] = utils
    sys.modules["sglang.srt.utils.common"] = common


def import_hicache_storage():
    """sglang.srt.mem_cache.hicache_storage, loaded from the reference tree unmodified."""
    src = sglang_source()
    if src is None:
        raise RuntimeError(skip_reason())
    path = str(src / "python")
    if path not in sys.path:
        sys.path.insert(0, path)
    _stand_in_for_unvendored_utils()
    import sglang.srt.mem_cache.hicache_storage as hs  # noqa: E402
    return hs


def import_metrics_collector():
    """sglang's observability/metrics_collector.py, loaded unmodified (PROVENANCE): StorageMetrics
    and StorageMetricsCollector, where get_stats() goes with --enable-metrics. Stand-ins only for
    what it imports from outside the vendored tree, each a name the storage collector never uses:
    DisaggregationMode, ForwardMode and ServerArgs (other collectors' types), get_bool_env_var (one
    test-only flag read at import); utils/gauge_histogram.py is vendored and loaded by its path,
    since sglang.srt.utils is itself a stand-in here."""
    import enum
    import importlib.util
    import os

    from reference_source import stand_in_module

    import_hicache_storage()
    utils = sys.modules["sglang.srt.utils"]
    if not hasattr(utils, "get_bool_env_var"):
        utils.get_bool_env_var = lambda name, default="false": os.environ.get(name, default).lower() in ("1", "true")
    name = "sglang.srt.utils.gauge_histogram"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, sglang_source() / "python/sglang/srt/utils/gauge_histogram.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        utils.gauge_histogram = module
    for package in ("sglang.srt.disaggregation", "sglang.srt.model_executor"):
        if package not in sys.modules:
            stand_in_module(package)
    if "sglang.srt.disaggregation.utils" not in sys.modules:
        stand_in_module("sglang.srt.disaggregation.utils", DisaggregationMode=enum.Enum("DisaggregationMode", "NULL"))
        stand_in_module("sglang.srt.model_executor.forward_batch_info", ForwardMode=enum.Enum("ForwardMode", "EXTEND"))
        stand_in_module("sglang.srt.server_args", ServerArgs=type("ServerArgs", (), {}))
    import sglang.srt.observability.metrics_collector as mc  # noqa: E402
    return mc


def _stand_in_for_host_pool_imports():
    """What pool_host/base.py imports beyond the vendored tree (PROVENANCE): sglang.srt.utils'
    device probes (a CPU machine: every one False) and memory_pool's KVCache (the device pool's
    base; the host pool only reads attributes of the device pool it is given)."""
    from reference_source import stand_in_module

    _stand_in_for_unvendored_utils()
    utils = sys.modules["sglang.srt.utils"]
    for probe in ("is_cuda", "is_hip", "is_npu", "is_xpu", "is_mps"):
        setattr(utils, probe, lambda: False)
    if "sglang.srt.mem_cache.memory_pool" not in sys.modules:
        stand_in_module("sglang.srt.mem_cache.memory_pool", KVCache=type("KVCache", (), {}))


def import_host_pool():
    """(HostKVCache, ALLOC_MEMORY_FUNCS) from sglang's pool_host, loaded unmodified."""
    import_hicache_storage()
    _stand_in_for_host_pool_imports()
    from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS  # noqa: E402
    return HostKVCache, ALLOC_MEMORY_FUNCS


def import_host_pool_group():
    """(HostPoolGroup, PoolEntry) from sglang's memory_pool_host, loaded unmodified. Stand-ins for
    what it imports and cannot load here (PROVENANCE): the JIT kernels of sglang.kernels.ops.kvcache
    (each raises if called: no test moves pages with them) and memory_pool's DSATokenToKVPool (a
    name for isinstance checks)."""
    from reference_source import stand_in_module

    import_host_pool()

    def kernel(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"{name}: sglang's JIT kernel does not run here")
        return refuse

    for module, names in (("sglang.kernels", ()), ("sglang.kernels.ops", ()), ("sglang.kernels.ops.kvcache", ()),
                          ("sglang.kernels.ops.kvcache.hicache",
                           ("can_use_write_back_jit_kernel", "transfer_hicache_all_layer_mla_staged_lf_pf")),
                          ("sglang.kernels.ops.kvcache.hisparse", ("transfer_cache_dsv4_mla",))):
        if module not in sys.modules:
            m = stand_in_module(module, **{n: kernel(n) for n in names})
            m.__path__ = []
    pool = sys.modules["sglang.srt.mem_cache.memory_pool"]
    if not hasattr(pool, "DSATokenToKVPool"):
        pool.DSATokenToKVPool = type("DSATokenToKVPool", (), {})
    from sglang.srt.mem_cache.memory_pool_host import HostPoolGroup, PoolEntry  # noqa: E402
    return HostPoolGroup, PoolEntry


class DevicePool:
    """The attributes of sglang's MHA device pool (memory_pool.MHATokenToKVPool) the host pool
    reads: its dtype, token count, layers and heads."""

    def __init__(self, dtype, size, layer_num, head_num, head_dim, v_head_dim=None):
        self.store_dtype, self.dtype, self.size = dtype, dtype, size
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.start_layer, self.end_layer = 0, layer_num
        self.device = "cpu"


class _PageViews:
    """What both pool stand-ins do alike over their own `_page_view(first token)`: the flat page
    sglang's page path reads and writes, and no device transfers (no device here)."""

    def get_data_page(self, index, flat=True):
        v = self._page_view(index)
        return v.flatten() if flat else v

    def set_from_flat_data_page(self, index, data_page):
        v = self._page_view(index)
        v.copy_(data_page.reshape(v.shape))

    def load_to_device_per_layer(self, *a, **k):
        raise NotImplementedError("no device here")

    def backup_from_device_all_layer(self, *a, **k):
        raise NotImplementedError("no device here")


def mha_host_pool_class():
    """A HostKVCache subclass standing in for MHATokenToKVPoolHost (mha.py), which needs torch >=
    2.3: the same buffer dims per layout (mha.py:159-183), allocated through sglang's own
    ALLOC_MEMORY_FUNCS and allocator (so "shm" is a memfd), and the same page views
    (get_data_page, get_dummy_flat_data_page, set_from_flat_data_page: mha.py:501-555) that
    sglang's generic page path uses. dtype.itemsize (torch 2.1) is element_size() here."""
    HostKVCache, alloc_funcs = import_host_pool()
    import torch

    class MHAHostPool(_PageViews, HostKVCache):
        def __init__(self, device_pool, host_to_device_ratio, page_size, layout, allocator_type="shm"):
            self.target_layer_num = device_pool.layer_num
            self.mtp_draft_device_pools = ()
            super().__init__(device_pool, host_to_device_ratio, 0, page_size, layout, False, "cpu", allocator_type)

        def get_size_per_token(self):
            self.head_num, self.head_dim = self.device_pool.head_num, self.device_pool.head_dim
            self.layer_num = self.target_layer_num
            return self.head_num * self.head_dim * self.layer_num * torch.empty([], dtype=self.dtype).element_size() * 2

        def init_kv_buffer(self):
            per_token = (self.head_num, self.head_dim)
            dims = {"layer_first": (2, self.layer_num, self.size) + per_token,
                    "page_first": (2, self.size, self.layer_num) + per_token,
                    "page_first_direct": (2, self.page_num, self.layer_num, self.page_size) + per_token,
                    "page_head": (2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim),
                    }[self.layout]
            return alloc_funcs[self.device_pool.device](dims, dtype=self.dtype, device=self.device, pin_memory=False,
                                                       allocator=self.allocator)

        def _page_view(self, index):
            if self.layout == "layer_first":
                return self.kv_buffer[:, :, index:index + self.page_size]
            if self.layout == "page_first":
                return self.kv_buffer[:, index:index + self.page_size]
            page = index // self.page_size
            return self.kv_buffer[:, page:page + 1]

        def get_dummy_flat_data_page(self):
            return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype)

    return MHAHostPool


def asymmetric_host_pool_class():
    """A HostKVCache subclass standing in for AsymmetricMHATokenToKVPoolHost (mha.py:1009-1125,
    torch >= 2.3 like its base): K and V of different head dims in two buffers, each allocated
    through sglang's own ALLOC_MEMORY_FUNCS and allocator (so "shm" makes one memfd per buffer),
    with mha.py's dims for page_first and page_first_direct (:1080-1103). sglang has no flat page
    for it (:1142): `k_page` and `v_page` are the test's views of one page of each."""
    HostKVCache, alloc_funcs = import_host_pool()
    import torch

    class AsymmetricHostPool(_PageViews, HostKVCache):
        def __init__(self, device_pool, host_to_device_ratio, page_size, layout, allocator_type="shm"):
            self.target_layer_num = device_pool.layer_num
            self.mtp_draft_device_pools = ()
            super().__init__(device_pool, host_to_device_ratio, 0, page_size, layout, False, "cpu", allocator_type)

        def get_size_per_token(self):
            d = self.device_pool
            self.head_num, self.head_dim, self.v_head_dim = d.head_num, d.head_dim, d.v_head_dim
            self.layer_num = self.target_layer_num
            item = torch.empty([], dtype=self.dtype).element_size()
            return (self.head_dim + self.v_head_dim) * self.head_num * self.layer_num * item

        def init_kv_buffer(self):
            def dims(dim):
                if self.layout == "page_first":
                    return (self.size, self.layer_num, self.head_num, dim)
                if self.layout == "page_first_direct":
                    return (self.page_num, self.layer_num, self.page_size, self.head_num, dim)
                raise ValueError(f"Unsupported layout for models with head_dim != v_head_dim: {self.layout}")

            alloc = alloc_funcs[self.device_pool.device]
            return tuple(alloc(dims(d), dtype=self.dtype, device=self.device, pin_memory=False, allocator=self.allocator)
                         for d in (self.head_dim, self.v_head_dim))

        def _page(self, buf, page):
            if self.layout == "page_first":
                return buf[page * self.page_size:(page + 1) * self.page_size]
            return buf[page:page + 1]

        def get_data_page(self, index, flat=True):
            raise NotImplementedError("no flat page for K and V of different head dims (mha.py:1142)")

        get_dummy_flat_data_page = set_from_flat_data_page = get_data_page

        def k_page(self, page):
            return self._page(self.kv_buffer[0], page)

        def v_page(self, page):
            return self._page(self.kv_buffer[1], page)

    return AsymmetricHostPool


def storage_config(tp_rank, tp_size, extra, mla=False, model="kvtd-test/model", pp=(0, 1), cp=(0, 1), metrics=False):
    hs = import_hicache_storage()
    return hs.HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=cp[0],
                                   attn_cp_size=cp[1], is_mla_model=mla, enable_storage_metrics=metrics,
                                   is_page_first_layout=False, model_name=model, extra_config=extra)


def backend_factory():
    import_hicache_storage()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
    return StorageBackendFactory


class MLADevicePool:
    """The attributes of sglang's MLA device pool (memory_pool.MLATokenToKVPool) the host pool
    reads (mla.py:125-133)."""

    def __init__(self, dtype, size, layer_num, kv_lora_rank, qk_rope_head_dim):
        self.store_dtype, self.dtype, self.size, self.layer_num = dtype, dtype, size, layer_num
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.start_layer, self.end_layer = 0, layer_num
        self.device = "cpu"


def mla_host_pool_class():
    """A HostKVCache subclass standing in for MLATokenToKVPoolHost (mla.py, torch >= 2.3): one
    latent per token and layer, buffer dims per layout (mla.py:138-160) and page views
    (mla.py:524-581)."""
    HostKVCache, alloc_funcs = import_host_pool()
    import torch

    class MLAHostPool(_PageViews, HostKVCache):
        def __init__(self, device_pool, host_to_device_ratio, page_size, layout, allocator_type="shm"):
            self.target_layer_num = device_pool.layer_num
            self.mtp_draft_device_pools = ()
            super().__init__(device_pool, host_to_device_ratio, 0, page_size, layout, False, "cpu", allocator_type)

        def get_size_per_token(self):
            self.layer_num = self.target_layer_num
            self.kv_cache_dim = self.device_pool.kv_lora_rank + self.device_pool.qk_rope_head_dim
            return self.kv_cache_dim * torch.empty([], dtype=self.dtype).element_size() * self.layer_num

        def init_kv_buffer(self):
            dims = {"layer_first": (self.layer_num, self.size, 1, self.kv_cache_dim),
                    "page_first": (self.size, self.layer_num, 1, self.kv_cache_dim),
                    "page_first_direct": (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim),
                    }[self.layout]
            return alloc_funcs[self.device_pool.device](dims, dtype=self.dtype, device=self.device, pin_memory=False,
                                                       allocator=self.allocator)

        def _page_view(self, index):
            if self.layout == "layer_first":
                return self.kv_buffer[:, index:index + self.page_size]
            if self.layout == "page_first":
                return self.kv_buffer[index:index + self.page_size]
            page = index // self.page_size
            return self.kv_buffer[page:page + 1]

        def get_dummy_flat_data_page(self):
            return torch.zeros(self.layer_num * self.page_size * self.kv_cache_dim, dtype=self.dtype)

    return MLAHostPool
