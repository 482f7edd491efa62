"""A hybrid model (full attention beside a sliding window and a Mamba state: gpt-oss's and
Qwen3-Next's groups in one) served through vLLM's own OffloadingConnectorScheduler, with its
per-group lookups (offloading/scheduler.py:697-868: a prefix for full attention, the window's run
of hits for a sliding window, one chunk for a Mamba state), its per-group load (:993-1101) and
store jobs, over kvtd's worker and a real daemon; the KV registered by vLLM's own
register_kv_caches, two tensors each shared by one layer of each group (KVCacheTensor.shared_by),
the Mamba page padded to the attention page.

A second request of the same prompt loads what vLLM's manager found for each group: every chunk
of the full-attention group, the window's chunks of the sliding-window group and the last chunk's
state of the Mamba group (vLLM's null block before them); every loaded block, checked as the load
completes (before the model recomputes the last token), equal to what the model wrote for that
chunk and group.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch


import vllm_engine
import vllm_harness
import vllm_hybrid_engine
import vllm_registration
from test_vllm_engine import HEAD_SIZE, HEADS, extra_config, vllm_modules

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())

BLOCKS, PAGE = 64, 2 * vllm_engine.TOKENS_PER_BLOCK * HEADS * HEAD_SIZE * 2  # K and V, bfloat16
WINDOW = 2 * vllm_engine.TOKENS_PER_BLOCK  # tokens
GROUPS = (("f0", "f1"), ("s0", "s1"), ("m0", "m1"))  # full attention, sliding window, Mamba
TENSORS = (("f0", "s0", "m0"), ("f1", "s1", "m1"))  # KVCacheTensor.shared_by: one layer of each group
MAMBA_SHAPES, MAMBA_DTYPES = ((3, 100), (7, 64)), (torch.float32, torch.bfloat16)  # 2096 bytes, padded


def kv_cache_config():
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                            MambaSpec, SlidingWindowSpec)
    attention = dict(block_size=vllm_engine.TOKENS_PER_BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                     dtype=torch.bfloat16)
    specs = (FullAttentionSpec(**attention), SlidingWindowSpec(sliding_window=WINDOW, **attention),
             MambaSpec(block_size=vllm_engine.TOKENS_PER_BLOCK, shapes=MAMBA_SHAPES, dtypes=MAMBA_DTYPES,
                       page_size_padded=PAGE))
    return KVCacheConfig(num_blocks=BLOCKS,
                         kv_cache_tensors=[KVCacheTensor(size=BLOCKS * PAGE, shared_by=list(t)) for t in TENSORS],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=list(g), kv_cache_spec=s)
                                          for g, s in zip(GROUPS, specs)])


def offloading_config(extra):
    return vllm_registration.one_rank_offloading_config(extra, GROUPS, len(TENSORS) * PAGE, engine_id="kvtdswa")


class SharedRank:
    """One worker: two shared KV tensors, each layer's FlashAttention view of them registered by
    vLLM's own register_kv_caches, kvtd's worker and its daemon. A block is row b of both."""

    def __init__(self, extra):
        self.rank, self.block_bytes = 0, len(TENSORS) * PAGE
        self.path = f"/dev/shm/kvtd_vllm_swa_{uuid.uuid4().hex[:8]}"
        buffer = torch.from_file(self.path, shared=True, size=len(TENSORS) * BLOCKS * PAGE, dtype=torch.int8)
        self.rows = [buffer[i * BLOCKS * PAGE:(i + 1) * BLOCKS * PAGE].view(BLOCKS, PAGE) for i in range(len(TENSORS))]
        layers = {}
        for rows, (full, window, mamba) in zip(self.rows, TENSORS):
            for n in (full, window):
                layers[n] = vllm_registration.attention_layer(rows, HEADS, HEAD_SIZE)
            layers[mamba] = rows.view(-1)  # a Mamba layer's state: the tensor's int8 bytes
        self.daemons = None
        try:
            vllm_modules()
            self.spec, self.connector, self.daemons = vllm_registration.start_worker(
                offloading_config(extra), kv_cache_config(), layers, HEADS)
        except BaseException:
            self.close()
            raise

    def write_block(self, b, data):
        for i, rows in enumerate(self.rows):
            rows[b].copy_(data[i * PAGE:(i + 1) * PAGE])

    def block(self, b):
        return torch.cat([rows[b].clone() for rows in self.rows])

    def close(self):
        if self.daemons is not None:
            self.daemons.stop()
        if os.path.exists(self.path):
            os.unlink(self.path)


def test_a_hybrid_model_hits_per_group_as_vllms_scheduler_counts_them_and_loads_each_groups_bytes():
    extra = extra_config(host_blocks=48)
    rank = SharedRank(extra)
    try:
        _, _, factory, _, _ = vllm_modules()
        scheduler_spec = factory.OffloadingSpecFactory.create_spec(offloading_config(extra))
        engine = vllm_hybrid_engine.HybridEngine(scheduler_spec, [rank], BLOCKS, kv_cache_config())
        loads = []
        submit = rank.connector.worker.submit_load
        rank.connector.worker.submit_load = lambda j, src, dst: loads.append(list(dst.group_sizes)) or submit(j, src, dst)
        prompt = list(range(6 * vllm_engine.TOKENS_PER_BLOCK))
        checked = []

        def check(req, groups, hit):  # the loaded blocks, before the model rewrites the last one
            hit_blocks = -(-hit // vllm_engine.TOKENS_PER_BLOCK)
            for g, blocks in enumerate(groups):
                for i in range(hit_blocks):
                    if blocks[i].is_null:
                        assert g > 0 and i < hit_blocks - engine.windows[g], f"group {g} chunk {i} got no block"
                        continue
                    want = engine.group_bytes(rank, req.block_hashes[i], g)
                    assert torch.equal(rank.block(blocks[i].block_id), want), f"group {g} chunk {i}"
                    checked.append((g, i))

        engine.on_loaded = check
        assert engine.serve(vllm_engine.Request("first", prompt)) == 0
        hit = engine.serve(vllm_engine.Request("again", prompt))
        # vLLM keeps the last token to compute (a sliding-window model needs its logits): the hit
        # ends in the sixth block.
        assert hit == 6 * vllm_engine.TOKENS_PER_BLOCK - 1, hit
        window = WINDOW // vllm_engine.TOKENS_PER_BLOCK
        assert loads == [[6, window, 1]], f"blocks loaded per group: {loads}"
        assert sorted(checked) == sorted([(0, i) for i in range(6)] + [(1, 4), (1, 5), (2, 5)]), checked
    finally:
        rank.close()
