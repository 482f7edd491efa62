"""A vLLM worker's canonical KV tensors as kvtd's layout: one geometry, or cache groups when the
tensors' pages differ in size.

vLLM hands a worker's offloading spec CanonicalKVCaches (vllm/v1/kv_offload/base.py): tensors of
(num_blocks, page bytes), each a layer's K or V (FlashAttention's split), a layer's MLA latent, a
Mamba state's page, or one cross-layer slab, and per KV cache group the refs into them. Every
tensor has vLLM's num_blocks rows and a block id names row b of each (offloading/worker.py:
68-240); a block id belongs to one KV cache group at a time, so moving row b of every tensor moves
that group's bytes and only bytes no other block holds. kvtd moves exactly that: each tensor is a
layer of kvtd's, and a block of vLLM's is that block of every layer.

When every tensor's page has one size (vLLM pads a hybrid model's groups to one page,
MambaSpec.page_size_padded) that is one geometry. When pages differ (layers of one type but
different widths, vLLM's UniformTypeKVCacheSpecs, each its own tensor), the tensors of each page
size are one cache group of kvtd's (kvtd/proto/cache_groups.h), every group with vLLM's block
count and the host tier's; a block is then that block of every group. A group is declared a
full-attention group (an MLA latent with vLLM's replicated layout): vLLM's spec does not say which
attention kind a tensor serves (OffloadingConfig carries tokens per block and layer names), and a
swap moves whole blocks of every kind alike; the storage tier, whose rules depend on the kind, is
refused over groups (spec.py).

What kvtd must know is declared, never inferred from the tensor count: the layout is per rank
unless vLLM says every worker's bytes are identical (OffloadingConfig.replicated_layout: a
pure-MLA, TP-only deployment), and `dtype` is the cache's element type
(OffloadingConfig.model.dtype), which vLLM's byte-typed tensors do not carry.
"""

from __future__ import annotations

from typing import List, Union

from ...cache_groups import CacheGroup, CacheGroups
from ...geometry import Geometry, KvIdentity, kv_dtype_name


def _rows(kv_caches) -> List[int]:
    tensors = [t.tensor for t in kv_caches.tensors]
    if not tensors:
        raise ValueError("vLLM handed kvtd no KV cache tensors")
    num_blocks = int(tensors[0].shape[0])
    row = [int(t.numel()) * int(t.element_size()) // max(1, int(t.shape[0])) for t in tensors]
    for i, t in enumerate(tensors):
        if int(t.shape[0]) != num_blocks or not t.is_contiguous() or row[i] * num_blocks != int(t.numel()) * int(
                t.element_size()):
            raise ValueError(f"canonical KV tensor {i} is {tuple(t.shape)}: kvtd needs every tensor contiguous with "
                             f"vLLM's {num_blocks} blocks")
    return row


def geometry_of(kv_caches, world_size: int, host_blocks: int, *, replicated: bool = False, dtype: str = "",
                block_tokens: int = 16) -> Union[Geometry, CacheGroups]:
    """kvtd's layout of a worker's canonical tensors, tensor i kvtd's layer i (key only; slot 0
    of its group's layer with groups): a Geometry when every page has one size, else CacheGroups,
    one per page size in order of first appearance. `block_tokens`: tokens per GPU block."""
    row = _rows(kv_caches)
    num_blocks = int(kv_caches.tensors[0].tensor.shape[0])
    name = kv_dtype_name(dtype) if dtype else ""
    if len(set(row)) == 1:
        identity = KvIdentity(layout="replicated" if replicated else "per_rank", dtype=name)
        return Geometry(num_ranks=world_size, num_layers=len(row), key_shape=(num_blocks, 1, 1, row[0]),
                        value_shape=None, dtype="uint8", num_host_blocks=host_blocks, identity=identity)
    sizes = list(dict.fromkeys(row))
    groups = [CacheGroup("mla_latent" if replicated else "full_attention",
                         [i for i, r in enumerate(row) if r == size], [(1, (1, 1, size))], device_blocks=num_blocks,
                         host_blocks=host_blocks, block_tokens=block_tokens) for size in sizes]
    out = CacheGroups(num_ranks=world_size, page_tokens=block_tokens, groups=groups,
                      identity=KvIdentity(layout="", dtype=name))
    out.check()
    return out


def block_ids(layout, blocks: List[int], host: bool) -> List[int]:
    """The ids a swap names for vLLM's `blocks`: themselves with one geometry; with cache groups,
    each block in every group's id space (kvtd/proto/group_slots.h), group after group."""
    if isinstance(layout, Geometry):
        return list(blocks)
    out: List[int] = []
    for g in range(len(layout.groups)):
        out += layout.host_ids(g, blocks) if host else layout.device_ids(g, blocks)
    return out


def bytes_per_block(layout) -> int:
    """Bytes a swap moves per vLLM block: every tensor's page."""
    if isinstance(layout, Geometry):
        return layout.block_bytes("key") * layout.num_layers
    return sum(block for block, _ in layout.sizes())
