"""What a vLLM worker hands its offloading connector when it registers its KV cache, for the tests
and tools/bench/vllm_offload.py: FlashAttention-shaped layers over a worker's raw KV bytes, their
spec, the VllmConfig fields vLLM's registration reads, and the attention backend's two answers the
cross-layer registration asks. The registration itself (offloading/worker.py:68-290) is vLLM's.
"""

from __future__ import annotations

import types

import torch

TOKENS_PER_BLOCK = 16


class FlashAttentionStandIn:
    """The two class methods of an attention backend vLLM's register_cross_layers_kv_cache asks
    (worker.py:248-258), answering as FlashAttention's NHD layout does (vllm/v1/attention/backends/
    flash_attn.py, not vendored): a layer's cache is (2, num_blocks, block_size, heads, head_size),
    and the cross-layer tensor's physical order puts the blocks first, (num_blocks, layers, 2, ...)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return (2, 0, 1, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


def torch_2_untyped_storage():
    """Tensor.untyped_storage() is torch 2's; Debian's torch 1.13 spells it storage().untyped().
    vLLM's registration calls it (worker.py:117, 265); nothing else of it is replaced."""
    if not hasattr(torch.Tensor, "untyped_storage"):
        torch.Tensor.untyped_storage = lambda self: self.storage().untyped()


def attention_spec(heads, head_size):
    """A layer's spec as vLLM's FlashAttention layers declare it (FullAttentionSpec: a page holds
    the block's K and V, bfloat16)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=TOKENS_PER_BLOCK, num_kv_heads=heads, head_size=head_size,
                             dtype=torch.bfloat16)


def attention_layer(rows, heads, head_size):
    """A layer's KV cache as FlashAttention allocates it, (blocks, 2, block_size, heads, head_size)
    bfloat16 with the blocks outermost, over `rows`, one (blocks, page) int8 row per block."""
    return rows.view(torch.bfloat16).view(rows.shape[0], 2, TOKENS_PER_BLOCK, heads, head_size)


def worker_vllm_config(rank, world, heads):
    """What vLLM's derive_canonical_mappings reads of the VllmConfig (canonical_mapping.py:409-426):
    a TP-only group of `world` ranks, every rank holding `heads` of the model's KV heads."""
    parallel = types.SimpleNamespace(tensor_parallel_size=world, prefill_context_parallel_size=1,
                                     decode_context_parallel_size=1, world_size=world, rank=rank,
                                     cp_kv_cache_interleave_size=1)
    model = types.SimpleNamespace(get_total_num_kv_heads=lambda: heads * world)
    return types.SimpleNamespace(parallel_config=parallel, model_config=model)


def one_rank_offloading_config(extra, groups, bytes_per_block, engine_id="kvtdhybrid"):
    """The OffloadingConfig vLLM builds for a TP-1 worker whose KV cache groups are `groups`
    (each a tuple of layer names, GPU blocks of TOKENS_PER_BLOCK tokens), `bytes_per_block`
    of KV per block (offloading/config.py). vLLM's modules must be importable (vllm_harness)."""
    from vllm.v1.kv_offload import config
    return config.OffloadingConfig(
        groups=tuple(config.OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK, layer_names=tuple(g))
                     for g in groups),
        worker_kv_bytes_per_block=bytes_per_block, enable_kv_cache_events=False, extra_config=extra,
        engine_id=engine_id, model=config.OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=1),
        parallel=config.OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                                 data_parallel_index=0, data_parallel_size=1,
                                                 data_parallel_rank_local=None, is_parallelism_agnostic=False))


def start_worker(offloading, kv_cache_config, layers, heads):
    """vLLM's OffloadingConnectorWorker over the spec vLLM's factory makes of `offloading`, the
    KV `layers` registered by vLLM's own register_kv_caches, and its rank's daemon, attached:
    (spec, connector, daemons). On failure nothing is left running."""
    import kvtd.testing
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import worker
    from vllm.v1.kv_offload import factory
    spec = factory.OffloadingSpecFactory.create_spec(offloading)
    torch_2_untyped_storage()
    connector = worker.OffloadingConnectorWorker(spec, worker_vllm_config(0, 1, heads), kv_cache_config)
    connector.register_kv_caches(layers)
    w = connector.worker
    daemons = kvtd.testing.Daemons(None, w.suffix, w._geometry, [], ranks=[0]).start()
    try:
        w._session.wait_ready(30)
    except BaseException:
        daemons.stop()
        raise
    return spec, connector, daemons
