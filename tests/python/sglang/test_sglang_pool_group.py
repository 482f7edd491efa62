"""A hybrid model's pool group is served where kvtd can serve every pool, and refused at start,
naming the real reason, where it cannot (python/kvtd/engines/sglang/pools.py): an SWA pool whose
window the extra config does not give, a pool kind kvtd does not know (DeepSeek-V4's compressed
pools), a group whose KV pool is not there, a pool outside sglang's shm allocator. The old backend
refused every group, naming the v2 calls it did not implement."""

from __future__ import annotations

import uuid

import pytest
import torch

import sglang_harness

pytestmark = pytest.mark.skipif(sglang_harness.sglang_source() is None, reason=sglang_harness.skip_reason())

PAGE = 4


def pool(allocator="shm"):
    cls = sglang_harness.mha_host_pool_class()
    return cls(sglang_harness.DevicePool(torch.bfloat16, 64, 3, 2, 8), 2.0, PAGE, "page_first", allocator)


def registered(names_and_pools, **extra_keys):
    """register_mem_pool_host of a HostPoolGroup of `names_and_pools` (the first the anchor), as
    HybridCacheController's parent calls it (hybrid_cache_controller.py:154-170)."""
    HostPoolGroup, PoolEntry = sglang_harness.import_host_pool_group()
    group = HostPoolGroup([PoolEntry(name=name, host_pool=p, device_pool=None, layer_mapper=lambda layer: layer,
                                     is_primary_index_anchor=i == 0) for i, (name, p) in enumerate(names_and_pools)])
    extra = {"backend_name": "kvtd", "module_path": "kvtd.sglang", "class_name": "KvtdHiCacheStorage",
             "interface_v1": 1, "allocator": "shm", "kvtd_session": f"sgl{uuid.uuid4().hex[:8]}", **extra_keys}
    backend = sglang_harness.backend_factory().create_backend("dynamic", sglang_harness.storage_config(0, 1, extra),
                                                              None)
    try:
        backend.register_mem_pool_host(group)
        return backend._hybrid
    finally:
        backend.close()


def test_a_sliding_window_pool_is_served_with_its_window_and_refused_without_it():
    hs = sglang_harness.import_hicache_storage()
    P = hs.PoolName
    plan = registered([(P.KV, pool()), (P.SWA, pool())], kvtd_swa_window_tokens=3 * PAGE)
    assert [g.kind for g in plan.groups.groups] == ["full_attention", "sliding_window"]
    assert plan.groups.groups[1].window_tokens == 3 * PAGE and plan.pools["swa"].trailing == 3
    with pytest.raises(ValueError, match="kvtd_swa_window_tokens"):
        registered([(P.KV, pool()), (P.SWA, pool())])


def test_pools_kvtd_cannot_serve_are_refused_by_name():
    hs = sglang_harness.import_hicache_storage()
    P = hs.PoolName
    with pytest.raises(ValueError, match=r"pool 'deepseek_v4_c4'.*not one kvtd serves"):
        registered([(P.KV, pool()), (P.DEEPSEEK_V4_C4, pool())])
    with pytest.raises(ValueError, match="no KV pool"):
        registered([(P.SWA, pool())], kvtd_swa_window_tokens=PAGE)
    with pytest.raises(ValueError, match="host pool 'swa' in ordinary memory"):
        registered([(P.KV, pool()), (P.SWA, pool(allocator="default"))], kvtd_swa_window_tokens=PAGE)
