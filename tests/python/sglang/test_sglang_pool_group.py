"""A hybrid model's host pools reach a storage backend as sglang's HostPoolGroup: HybridCacheController
(hybrid_cache/hybrid_cache_controller.py:154-170) attaches the backend with its parent's
register_mem_pool_host(the group), then registers each pool through the v2 API. kvtd.sglang does
not serve the v2 calls yet; it refused the group naming "allocator": "shm" and an @file extra
config (a group has no memfd of its own), which was not the reason. It names the reason now: the
pools, and the calls it does not implement. Fails on the old code (its message named the @file)."""

from __future__ import annotations

import uuid

import pytest
import torch

import sglang_harness

pytestmark = pytest.mark.skipif(sglang_harness.sglang_source() is None, reason=sglang_harness.skip_reason())

PAGE = 4


def test_a_hybrid_models_pool_group_is_refused_naming_the_v2_calls():
    hs = sglang_harness.import_hicache_storage()
    HostPoolGroup, PoolEntry = sglang_harness.import_host_pool_group()
    cls = sglang_harness.mha_host_pool_class()
    pools = [cls(sglang_harness.DevicePool(torch.bfloat16, 64, 3, 2, 8), 2.0, PAGE, "layer_first") for _ in range(2)]
    group = HostPoolGroup([PoolEntry(name=hs.PoolName.KV, host_pool=pools[0], device_pool=None,
                                     layer_mapper=lambda layer: layer, is_primary_index_anchor=True),
                           PoolEntry(name=hs.PoolName.SWA, host_pool=pools[1], device_pool=None,
                                     layer_mapper=lambda layer: layer)])
    extra = {"backend_name": "kvtd", "module_path": "kvtd.sglang", "class_name": "KvtdHiCacheStorage",
             "interface_v1": 1, "allocator": "shm", "kvtd_session": f"sgl{uuid.uuid4().hex[:8]}"}
    backend = sglang_harness.backend_factory().create_backend("dynamic", sglang_harness.storage_config(0, 1, extra),
                                                              None)
    try:
        with pytest.raises(ValueError, match=r"pool group \(kv, swa\).*HybridCacheController.*batch_get_v2"):
            backend.register_mem_pool_host(group)
    finally:
        backend.close()
