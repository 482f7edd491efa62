"""A hybrid model's sglang host pools as one kvtd session of cache groups.

sglang serves hybrid models (Qwen3-Next: KV beside Mamba state; gpt-oss: KV beside a sliding
window; DeepSeek-V3.2: an MLA latent beside its indexer keys) with a HostPoolGroup of host pools,
one PoolEntry per pool (memory_pool_host.py:968-1030), moved by HybridCacheController: the KV pool
through the v1 calls (batch_get_v1 / batch_set_v1), every other pool through batch_get_v2 /
batch_set_v2 with a PoolTransfer naming it (hybrid_cache_controller.py:640-696). Here each pool is
one cache group of one session (kvtd/proto/cache_groups.h), so one daemon per rank serves them
all and each pool's objects are a namespace of their own in the store:

  KV (PoolName.KV), DRAFT       full attention, or an MLA latent (the pool's layout as layout.py
                                describes it: its layers and K / V pieces)
  SWA                           a sliding window of `window_tokens` (the model's; the pool does
                                not carry it)
  MAMBA                         a state group: one slot per index, each of temporal and conv
                                buffers one tensor of the slot (MambaPoolHost: page-first only,
                                pool_host/mamba.py:55-58, dims (size, layers, 1, *shape), :153-177)
  INDEXER                       an indexer group on the MLA latent's layers (DSAIndexerPoolHost,
                                memory_pool_host.py:1087-1215: its layout follows the latent's)

A pool of any other kind (DeepSeek-V4's compressed pools, a logical anchor without KV) is refused
by name. Pure: reads the pools' attributes; imports neither sglang nor torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ...cache_groups import CacheGroup, CacheGroups
from ...geometry import KvIdentity, kv_dtype_name
from .layout import PoolPlan


@dataclasses.dataclass(frozen=True)
class GroupPiece:
    """One registered tensor: registry slot `slot` of `layer` (its group's tensors in the order
    CacheGroups.slots gives: the attention group's, then an indexer's), `nbytes` at `offset` into
    `buffer`, a tensor of host pool `host` (whose allocator holds the buffer's memfd)."""

    layer: int
    slot: int
    buffer: object
    offset: int
    nbytes: int
    host: object = None


def pool_name(name) -> str:
    """sglang's PoolName (a str enum) or its text, as the text ("kv", "mamba", ...)."""
    return str(getattr(name, "value", name))


@dataclasses.dataclass(frozen=True)
class PoolSlot:
    """Where sglang's pool `name` sits in the session: its cache group, the host indices sglang
    passes per key (`index_unit`: the page size; 1 for a state pool's slots), its blocks, and
    the keys a load of it must name together for its group's rule to cover each of them (0:
    any number; see HybridPlan.read_chunks)."""

    name: str
    group: int
    index_unit: int
    blocks: int
    trailing: int


@dataclasses.dataclass(frozen=True)
class HybridPlan:
    groups: CacheGroups
    pieces: List[GroupPiece]
    pools: Dict[str, PoolSlot]
    page_size: int
    page_bytes: int  # the KV pool's bytes of one page (metrics)

    def blocks(self, pool: str, blocks: Sequence[Optional[int]]) -> List[List[Optional[int]]]:
        """A storage task's per-group block lists naming `pool`'s `blocks` and no other group's."""
        g = self.pools[pool].group
        return [list(blocks) if i == g else [None] * len(blocks) for i in range(len(self.groups.groups))]

    def read_chunks(self, pool: str, count: int) -> List[Tuple[int, int]]:
        """How a load of `count` keys of `pool` is split so every key it names is loaded: a
        trailing group (window, state) loads only the pages its rule needs before a load's end,
        so its keys go in runs no longer than that; a block group takes them all at once."""
        step = self.pools[pool].trailing or count
        return [(i, min(count, i + step)) for i in range(0, count, max(1, step))]


def _kv_group(plan: PoolPlan, kind: str, layer_base: int, itemsize: int, window_tokens: int = 0):
    g = plan.geometry
    tensors = [(itemsize, tuple(int(v) for v in g.key_shape[1:]))]
    if g.value_shape is not None:
        tensors.append((itemsize, tuple(int(v) for v in g.value_shape[1:])))
    return CacheGroup(kind, list(range(layer_base, layer_base + g.num_layers)), tensors, device_blocks=plan.pages,
                      block_tokens=plan.page_size, window_tokens=window_tokens)


def _kv_pieces(plan: PoolPlan, buffers: Sequence[object], layer_base: int) -> List[GroupPiece]:
    slot = {"key": 0, "value": 1}
    return [GroupPiece(layer_base + p.layer, slot[p.kind], buffers[p.buffer], p.offset, p.nbytes) for p in plan.pieces]


def _mamba(host, layer: int) -> Tuple[CacheGroup, List[GroupPiece]]:
    """MambaPoolHost: temporal then conv buffers, each (size, layers, 1, *shape), a slot's bytes
    of every layer contiguous; a conv-only model's empty temporal buffer is left out, as sglang's
    own zero-copy path leaves it (mamba.py:560-580)."""
    if host.layout not in ("page_first", "page_first_direct"):
        raise ValueError(f"sglang Mamba host pool layout {host.layout!r}: kvtd reads page-first Mamba pools")
    buffers = [b for b in [host.temporal_buffer, *host.conv_buffer] if int(b.numel()) > 0]
    if not 1 <= len(buffers) <= 4:
        raise ValueError(f"sglang Mamba host pool has {len(buffers)} state buffers; kvtd serves 1 to 4 per slot")
    slots, layers = int(host.size), int(host.num_mamba_layers)
    tensors, pieces = [], []
    for t, b in enumerate(buffers):
        item = int(b.element_size())
        per_slot = int(b.numel()) // slots
        if per_slot * slots != int(b.numel()) or per_slot % layers:
            raise ValueError(f"sglang Mamba host pool buffer {t} holds {int(b.numel())} elements, not {slots} slots "
                             f"of {layers} layers")
        tensors.append((item, (layers, per_slot // layers)))
        pieces.append(GroupPiece(layer, t, b, 0, int(b.numel()) * item))
    return CacheGroup("state", [layer], tensors, device_blocks=slots, block_tokens=0), pieces


def _indexer(host, kv: CacheGroup, kv_layout: str) -> Tuple[CacheGroup, List[GroupPiece]]:
    """DSAIndexerPoolHost's one buffer: layer-first (layers, pages, stride) or page-first (pages,
    layers, 1, stride); its layers are the latent's, so the latent must be laid out alike."""
    buf = host.index_k_with_scale_buffer
    item, layers = int(buf.element_size()), int(host.layer_num)
    stride, pages = int(host.indexer_page_stride_size), int(host.indexer_page_num)
    if int(buf.numel()) != layers * pages * stride:
        raise ValueError(f"sglang indexer host pool buffer holds {int(buf.numel())} elements, not {layers} layers of "
                         f"{pages} pages of {stride}")
    if host.layout == "layer_first":
        if kv_layout != "layer_first" or len(kv.layers) != layers:
            raise ValueError(f"sglang indexer host pool: layer-first with {layers} layers beside a {kv_layout} latent "
                             f"of {len(kv.layers)}; kvtd needs both laid out alike")
        tensors = [(item, (stride,))]
        pieces = [GroupPiece(layer, 0, buf, i * pages * stride * item, pages * stride * item)
                  for i, layer in enumerate(kv.layers)]
    elif host.layout in ("page_first", "page_first_direct"):
        if kv_layout == "layer_first" or len(kv.layers) != 1:
            raise ValueError(f"sglang indexer host pool: {host.layout} beside a {kv_layout} latent; kvtd needs both "
                             "laid out alike")
        tensors = [(item, (layers, stride))]
        pieces = [GroupPiece(kv.layers[0], 0, buf, 0, layers * pages * stride * item)]
    else:
        raise ValueError(f"sglang indexer host pool layout {host.layout!r} is not one kvtd reads")
    return CacheGroup("indexer", list(kv.layers), tensors, device_blocks=pages, block_tokens=kv.block_tokens), pieces


def plan_group(entries: Sequence[Tuple[str, object]], *, tp_size: int, mla: bool, kv_plan: Callable,
               kv_buffers: Callable, pp: tuple = (0, 1), cp: tuple = (0, 1), window_tokens: int = 0) -> HybridPlan:
    """The session for a HostPoolGroup's `entries`, (pool name, host pool) with the KV pool
    first. `kv_plan(host, mla)` is layout.py's PoolPlan of an MHA / MLA pool and
    `kv_buffers(host)` its buffers (backend.plan_for / pool_buffers); `window_tokens` the
    sliding window of an SWA pool. Raises ValueError naming the first pool kvtd cannot serve."""
    if not entries or entries[0][0] != "kv":
        raise ValueError("sglang's pool group has no KV pool first (a logical anchor without KV, as DeepSeek-V4 "
                         "uses, is not served by kvtd)")
    groups: List[CacheGroup] = []
    pieces: List[Tuple[int, object, GroupPiece]] = []  # (group, host, piece whose slot is the group's tensor)
    pools: Dict[str, PoolSlot] = {}
    kv_host = entries[0][1]
    page = int(kv_host.page_size)
    next_layer = 0
    kv_group = None
    page_bytes = 0
    for name, host in entries:
        if name in pools:
            raise ValueError(f"sglang's pool group names pool {name!r} twice")
        trailing = 0
        if name in ("kv", "draft", "swa", "draft_swa"):
            latent = mla and name in ("kv", "draft")
            plan = kv_plan(host, latent)
            if int(host.page_size) != page:
                raise ValueError(f"sglang pool {name!r} has pages of {host.page_size} tokens, the KV pool {page}: kvtd "
                                 "keys every pool's pages by the same page")
            kind = "mla_latent" if latent else "full_attention"
            window = 0
            if name in ("swa", "draft_swa"):
                if window_tokens <= 0:
                    raise ValueError('sglang\'s pool group has a sliding-window pool: give its window in tokens as '
                                     '"kvtd_swa_window_tokens" in the extra config (the model\'s sliding window)')
                kind, window = "sliding_window", int(window_tokens)
                trailing = max(1, math.ceil(window / page))
            buffers = kv_buffers(host)
            group = _kv_group(plan, kind, next_layer, int(buffers[0].element_size()), window)
            more = _kv_pieces(plan, buffers, next_layer)
            if name == "kv":
                kv_group, kv_layout = group, host.layout
                page_bytes = plan.buffer_bytes // max(1, plan.pages)
        elif name == "mamba":
            group, more = _mamba(host, next_layer)
            trailing = 1
        elif name == "indexer":  # on the latent's layers
            if kv_group is None or kv_group.kind != "mla_latent":
                raise ValueError("sglang's indexer pool needs the KV pool to be an MLA latent")
            group, more = _indexer(host, kv_group, kv_layout)
        else:
            raise ValueError(f"sglang host pool {name!r} ({type(host).__name__}) is not one kvtd serves (KV, draft, SWA, "
                             "Mamba state, DSA indexer)")
        pieces += [(len(groups), host, p) for p in more]
        next_layer = max(next_layer, max(group.layers) + 1)
        pools[name] = PoolSlot(name, len(groups), 1 if name == "mamba" else page, group.device_blocks, trailing)
        groups.append(group)
    dtype = str(getattr(kv_host, "dtype", "")).replace("torch.", "")
    identity = KvIdentity(layout="", dtype=kv_dtype_name(dtype) if dtype else "", pp_rank=int(pp[0]),
                          pp_size=int(pp[1]), cp_rank=int(cp[0]), cp_size=int(cp[1]))
    out = CacheGroups(num_ranks=tp_size, page_tokens=page, groups=groups, identity=identity)
    out.check()
    placed = [dataclasses.replace(p, slot=out.slots(p.layer).index((g, p.slot)), host=host) for g, host, p in pieces]
    return HybridPlan(out, placed, pools, page, page_bytes)
