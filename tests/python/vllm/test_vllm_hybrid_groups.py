"""A hybrid model's KV cache groups through vLLM's own registration and kvtd's worker.

vLLM's hybrid allocator gives every KV cache group one page size (it pads a Mamba state's page,
MambaSpec.page_size_padded, to the attention page) and lets one layer of each group share each
KVCacheTensor (KVCacheTensor.shared_by); a block id belongs to one group at a time, so row b of
every tensor is that group's block. vLLM's register_kv_caches (offloading/worker.py:68-240) turns
that into one (blocks, page) tensor per KVCacheTensor and per-group refs. kvtd moves row b of every
tensor for a block id: the bytes of whichever group owns it. Here, with vLLM's manager assigning
host blocks to keys of three groups (full attention, sliding window, Mamba state: OffloadKey
carries the group, base.py:29-31), a store and a load into other GPU blocks, byte for byte per
group and layer, the Mamba state through its own (int8, padded) view, and no other block touched.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch


import vllm_engine
import vllm_harness
import vllm_registration
from test_vllm_engine import HEADS, HEAD_SIZE, extra_config, vllm_modules

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())

BLOCKS, PAGE = 24, 4096  # attention page: K and V of 16 tokens x 4 heads x 16 dims, bfloat16
MAMBA_SHAPES, MAMBA_DTYPES = ((3, 100), (7, 64)), (torch.float32, torch.bfloat16)  # 1200 + 896 bytes
GROUPS = (("l0", "l3"), ("l1", "l4"), ("l2", "l5"))  # full attention, sliding window, Mamba
TENSORS = (("l0", "l1", "l2"), ("l3", "l4", "l5"))  # KVCacheTensor.shared_by: one layer of each group


def specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    attention = dict(block_size=vllm_engine.TOKENS_PER_BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                     dtype=torch.bfloat16)
    return (FullAttentionSpec(**attention), SlidingWindowSpec(sliding_window=32, **attention),
            MambaSpec(block_size=vllm_engine.TOKENS_PER_BLOCK, shapes=MAMBA_SHAPES, dtypes=MAMBA_DTYPES,
                      page_size_padded=PAGE))


def kv_cache_config():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    return KVCacheConfig(num_blocks=BLOCKS,
                         kv_cache_tensors=[KVCacheTensor(size=BLOCKS * PAGE, shared_by=list(t)) for t in TENSORS],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=list(g), kv_cache_spec=s)
                                          for g, s in zip(GROUPS, specs())])


def offloading_config(extra):
    return vllm_registration.one_rank_offloading_config(extra, GROUPS, len(TENSORS) * PAGE)


class HybridRank:
    """One worker of a hybrid model: two shared KV tensors in shared memory (the host backend's
    GPU), each layer's view of them as vLLM's model runner hands it to register_kv_caches
    (attention: (blocks, 2, block_size, heads, head_size) bfloat16, blocks outermost; Mamba: the
    tensor's int8 bytes), vLLM's OffloadingConnectorWorker over kvtd's worker, and its daemon."""

    def __init__(self):
        self.path = f"/dev/shm/kvtd_vllm_hybrid_{uuid.uuid4().hex[:8]}"
        buffer = torch.from_file(self.path, shared=True, size=len(TENSORS) * BLOCKS * PAGE, dtype=torch.int8)
        self.rows = [buffer[i * BLOCKS * PAGE:(i + 1) * BLOCKS * PAGE].view(BLOCKS, PAGE) for i in range(len(TENSORS))]
        self.layers = {}
        for rows, names in zip(self.rows, TENSORS):
            full, window, mamba = names
            for n in (full, window):
                self.layers[n] = vllm_registration.attention_layer(rows, HEADS, HEAD_SIZE)
            self.layers[mamba] = rows.view(-1)
        self.daemons = None
        try:
            vllm_modules()
            self.spec, self.connector, self.daemons = vllm_registration.start_worker(
                offloading_config(extra_config(host_blocks=16)), kv_cache_config(), self.layers, HEADS)
            self.worker = self.connector.worker
        except BaseException:
            self.close()
            raise

    def run(self, job_id, submit):
        assert submit(job_id)
        self.worker.wait({job_id})
        done = {r.job_id: r.success for r in self.worker.get_finished()}
        assert done == {job_id: True}, done

    def close(self):
        if self.daemons is not None:
            self.daemons.stop()
        if os.path.exists(self.path):
            os.unlink(self.path)


def mamba_state(rank, layer, block):
    """The Mamba layer's state of a block, its real bytes (the page's padding left out)."""
    used = sum(torch.tensor([], dtype=d).element_size() * s[0] * s[1] for s, d in zip(MAMBA_SHAPES, MAMBA_DTYPES))
    return rank.layers[layer].view(BLOCKS, PAGE)[block, :used].clone()


def same_bits(a, b):
    """Bit for bit (random bytes read as bfloat16 hold NaNs, which never compare equal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_hybrid_models_groups_round_trip_per_group_and_layer_through_vllms_registration():
    base, _, _, _, _ = vllm_modules()
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    rank = HybridRank()
    try:
        w = rank.worker
        assert w._geometry.num_layers == len(TENSORS), "one kvtd layer per shared KV tensor"
        g = torch.Generator().manual_seed(5)
        for rows in rank.rows:
            rows.copy_(torch.randint(-128, 128, rows.shape, generator=g, dtype=torch.int8))
        before = [r.clone() for r in rank.rows]
        # Blocks as vLLM's block pool hands them out: full attention 2 and 3, the window 5, the
        # Mamba state 8; loaded back for a new request into 10, 11 / 12 / 13.
        stored, loaded, sizes = [2, 3, 5, 8], [10, 11, 12, 13], [2, 1, 1]
        want_full = {n: rank.layers[n][[2, 3]].clone() for n in GROUPS[0]}
        want_window = {n: rank.layers[n][[5]].clone() for n in GROUPS[1]}
        want_mamba = {n: mamba_state(rank, n, 8) for n in GROUPS[2]}
        hashes = [bytes([i]) * 32 for i in range(4)]
        keys = [base.make_offload_key(h, grp) for h, grp in zip(hashes, [0, 0, 1, 2])]
        manager = rank.spec.get_manager()
        out = manager.prepare_store(keys, None)
        rank.run(1, lambda j: w.submit_store(j, base.GPULoadStoreSpec(stored, sizes, [0, 0, 0]), out.store_spec))
        manager.complete_store(keys, None)
        for rows in rank.rows:  # the engine reuses the blocks
            rows[stored] = 0
        host = list(manager.prepare_load(keys, None).block_ids)
        assert host == list(out.store_spec.block_ids)
        rank.run(2, lambda j: w.submit_load(j, CPULoadStoreSpec(host), base.GPULoadStoreSpec(loaded, sizes, [0, 0, 0])))
        for n, want in want_full.items():
            assert same_bits(rank.layers[n][[10, 11]], want), f"full attention layer {n}"
        for n, want in want_window.items():
            assert same_bits(rank.layers[n][[12]], want), f"sliding-window layer {n}"
        for n, want in want_mamba.items():
            assert torch.equal(mamba_state(rank, n, 13), want), f"Mamba layer {n}'s state"
        untouched = [b for b in range(BLOCKS) if b not in stored + loaded]
        for rows, old in zip(rank.rows, before):
            assert torch.equal(rows[untouched], old[untouched]), "a block no job named changed"
    finally:
        rank.close()


# Layers of one type but different widths (vLLM's UniformTypeKVCacheSpecs: one group, a spec per
# layer, each layer its own tensor of its own page size, kv_cache_interface.py; registered by
# offloading/worker.py:92-103): "w0" with 4 KV heads (4096-byte pages), "w1" and "w2" with 2 (2048).
WIDE = (("w0", 4), ("w1", 2), ("w2", 2))


def uniform_type_config():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, UniformTypeKVCacheSpecs
    per_layer = {n: vllm_registration.attention_spec(h, HEAD_SIZE) for n, h in WIDE}
    return KVCacheConfig(num_blocks=BLOCKS,
                         kv_cache_tensors=[KVCacheTensor(size=BLOCKS * s.page_size_bytes, shared_by=[n])
                                           for n, s in per_layer.items()],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=[n for n, _ in WIDE],
                                                           kv_cache_spec=UniformTypeKVCacheSpecs(
                                                               block_size=vllm_engine.TOKENS_PER_BLOCK,
                                                               kv_cache_specs=per_layer))])


class WidthsRank:
    """One worker whose layers' pages differ in size, registered by vLLM's own register_kv_caches."""

    def __init__(self, **extra):
        self.path = f"/dev/shm/kvtd_vllm_widths_{uuid.uuid4().hex[:8]}"
        pages = [2 * vllm_engine.TOKENS_PER_BLOCK * h * HEAD_SIZE * 2 for _, h in WIDE]
        buffer = torch.from_file(self.path, shared=True, size=BLOCKS * sum(pages), dtype=torch.int8)
        self.rows, at = [], 0
        for page in pages:
            self.rows.append(buffer[at:at + BLOCKS * page].view(BLOCKS, page))
            at += BLOCKS * page
        self.layers = {n: vllm_registration.attention_layer(r, h, HEAD_SIZE) for (n, h), r in zip(WIDE, self.rows)}
        self.daemons = None
        try:
            vllm_modules()
            offloading = vllm_registration.one_rank_offloading_config(extra_config(host_blocks=16, **extra),
                                                                      [[n for n, _ in WIDE]], sum(pages))
            self.spec, self.connector, self.daemons = vllm_registration.start_worker(
                offloading, uniform_type_config(), self.layers, HEADS)
            self.worker = self.connector.worker
        except BaseException:
            self.close()
            raise

    run = HybridRank.run

    def close(self):
        if self.daemons is not None:
            self.daemons.stop()
        if os.path.exists(self.path):
            os.unlink(self.path)


def test_layers_whose_pages_differ_in_size_are_cache_groups_and_round_trip_byte_for_byte():
    """Before, the worker refused tensors of different page sizes at start ("not yet: groups of
    different page sizes"); now each page size is a cache group of kvtd's."""
    base, _, _, _, _ = vllm_modules()
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    rank = WidthsRank()
    try:
        w = rank.worker
        assert [len(g.layers) for g in w._geometry.groups] == [1, 2], "one group per page size"
        g = torch.Generator().manual_seed(9)
        for rows in rank.rows:
            rows.copy_(torch.randint(-128, 128, rows.shape, generator=g, dtype=torch.int8))
        before = [r.clone() for r in rank.rows]
        stored, loaded = [2, 3, 5], [10, 11, 12]
        want = [r[stored].clone() for r in rank.rows]
        keys = [base.make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
        manager = rank.spec.get_manager()
        out = manager.prepare_store(keys, None)
        rank.run(1, lambda j: w.submit_store(j, base.GPULoadStoreSpec(stored, [3], [0]), out.store_spec))
        manager.complete_store(keys, None)
        for rows in rank.rows:
            rows[stored] = 0
        host = list(manager.prepare_load(keys, None).block_ids)
        rank.run(2, lambda j: w.submit_load(j, CPULoadStoreSpec(host), base.GPULoadStoreSpec(loaded, [3], [0])))
        untouched = [b for b in range(BLOCKS) if b not in stored + loaded]
        for (name, _), rows, old, bytes_ in zip(WIDE, rank.rows, before, want):
            assert torch.equal(rows[loaded], bytes_), f"layer {name}: the loaded blocks"
            assert torch.equal(rows[untouched], old[untouched]), f"layer {name}: a block no job named changed"
    finally:
        rank.close()


def test_the_storage_tier_over_pages_of_different_sizes_is_refused_at_start_naming_it():
    with pytest.raises(ValueError, match="kvtd_storage"):
        WidthsRank(kvtd_storage=True)
