"""Where sglang's host KV pool keeps each page, as kvtd's geometry and tensors.

sglang keeps one rank's host pool in one buffer, `kv_buffer`, whose dims depend on `layout`
(init_kv_buffer of its MHA and MLA host pools; the sglang code this module relies on is listed in
docs/engines/sglang.md, 'Upstream behaviour relied on'). Its zero-copy backends move a page as
the pieces `get_page_buffer_meta` names: with `layer_first`, one piece per layer and K/V of
`page_size` tokens; with `page_first`, `page_first_direct` and `page_head`, one piece for K and
one for V of every layer's `page_size` tokens, V `layer_num * size` tokens after K. This module
describes the same pieces to kvtd: a piece is one block of one registered tensor, so a page is
block `first token // page_size` of every tensor, and a daemon reads and writes those bytes in
place.

kvtd sees a piece's bytes in the order sglang keeps them, declared as kvtd's (heads, block size,
head dim) outermost first: [token][layer][head][dim] for page_first, [layer][token][head][dim] for
page_first_direct, [head][token][layer][dim] for page_head, [token][head][dim] per layer for
layer_first. So every layout has a shape, hence a storage namespace, of its own: an object stored
from one layout is never loaded into another's pages, which sglang's own HiCacheFile would do (its
file names carry the model and TP rank, not the layout). Only page_head has real heads outermost;
a daemon must not store the others by head (`--storage-object-heads`).

Pure: takes the pool's attributes, imports neither sglang nor torch.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from ...geometry import Geometry, KvIdentity, kv_dtype_name

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_DTYPES = {2: ("bfloat16", "float16"), 1: ("uint8",)}


@dataclasses.dataclass(frozen=True)
class PoolPiece:
    """One registered tensor: (layer, kind) of kvtd's geometry at `offset` bytes into the pool's
    buffer `buffer` (0; 1 for V of a pool whose K and V are two buffers), `nbytes` long (every
    page's piece of it, page by page)."""

    layer: int
    kind: str
    offset: int
    nbytes: int
    buffer: int = 0


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    geometry: Geometry
    pieces: List[PoolPiece]
    page_size: int
    pages: int
    buffer_bytes: int


def _kvtd_dtype(dtype_name: str, itemsize: int) -> str:
    """kvtd's dtype for sglang's: bf16 and fp16 by name, one-byte types (fp8, uint8) as uint8."""
    if itemsize == 2 and dtype_name in ("bfloat16", "float16"):
        return dtype_name
    if itemsize == 1:
        return "uint8"
    raise ValueError(f"sglang host pool dtype {dtype_name} ({itemsize} bytes) is not one kvtd stores "
                     "(bfloat16, float16, or a one-byte type)")


def plan_pool(*, layout: str, mla: bool, layer_num: int, size: int, page_size: int, token_width: int,
              dtype_name: str, itemsize: int, tp_size: int, buffer_bytes: int, head_dim: int = 0,
              pp: tuple = (0, 1), cp: tuple = (0, 1), value_width: int = 0, value_buffer_bytes: int = 0) -> PoolPlan:
    """kvtd's geometry and tensors for one rank's sglang host pool. `token_width`: elements of
    one token in one layer (MHA: head_num * head_dim; MLA: kv_cache_dim); `head_dim` (MHA
    page_head: its pieces are heads outermost); `size`: tokens (a multiple of page_size: sglang
    aligns it up); `buffer_bytes`: the buffer's length, checked against what the layout needs.
    `pp`, `cp`: (rank, size) of the pipeline stage and attention context-parallel slice the pool
    holds. The geometry declares its identity (KvIdentity): MLA
    replicated, MHA per rank, the pool's own dtype by name (one-byte dtypes move as uint8 but
    e4m3 and e5m2 never share a namespace), the stage and the slice. Raises ValueError naming the
    first problem. `value_width` > 0: K and V are two buffers, V's token `value_width` elements
    wide (sglang's AsymmetricMHATokenToKVPoolHost: head_dim != v_head_dim, as MiMo-V2;
    `value_buffer_bytes` is V's buffer's length)."""
    if value_width > 0:
        return _plan_two_buffers(layout=layout, layer_num=layer_num, size=size, page_size=page_size,
                                 widths=(token_width, value_width), dtype_name=dtype_name, itemsize=itemsize,
                                 tp_size=tp_size, buffers=(buffer_bytes, value_buffer_bytes), pp=pp, cp=cp)
    if layout not in LAYOUTS or (mla and layout == "page_head"):
        allowed = [x for x in LAYOUTS if not (mla and x == "page_head")]
        raise ValueError(f"sglang host pool layout {layout!r} is not one kvtd reads in place ({', '.join(allowed)})")
    for name, v in (("layer_num", layer_num), ("size", size), ("page_size", page_size),
                    ("token_width", token_width), ("tp_size", tp_size)):
        if int(v) <= 0:
            raise ValueError(f"sglang host pool {name} is {v}: must be positive")
    if layout == "page_head" and (head_dim <= 0 or token_width % head_dim):
        raise ValueError(f"sglang page_head pool: head_dim {head_dim} does not divide a token's {token_width} elements")
    if size % page_size:
        raise ValueError(f"sglang host pool size {size} is not a multiple of its page size {page_size}")
    dtype = _kvtd_dtype(dtype_name, itemsize)
    pages = size // page_size
    token_bytes = token_width * itemsize  # one token of one layer of one tensor
    tensors = 1 if mla else 2
    need = tensors * layer_num * size * token_bytes
    if buffer_bytes < need:
        raise ValueError(f"sglang host pool buffer holds {buffer_bytes} bytes; its layout needs {need}")
    kinds = ["key"] if mla else ["key", "value"]
    pieces: List[PoolPiece] = []
    if layout == "layer_first":  # dims (2, L, size, ...) or MLA (L, size, ...): [token][head][dim] per layer
        layers, shape = layer_num, (pages, 1, page_size, token_width)
        for t, kind in enumerate(kinds):
            for layer in range(layer_num):
                pieces.append(PoolPiece(layer, kind, ((t * layer_num + layer) * size) * token_bytes,
                                        size * token_bytes))
    else:  # a page of every layer is one piece of each tensor; V starts layer_num * size tokens in
        layers = 1
        # The piece's inner order, outermost first, as kvtd's (heads, block size, head dim): each
        # layout a shape of its own, so a layout's objects are never loaded into another's pages.
        heads = token_width // head_dim if layout == "page_head" else 1
        shape = {"page_first": (pages, 1, page_size, layer_num * token_width),       # [token][layer][head][dim]
                 "page_first_direct": (pages, layer_num, page_size, token_width),   # [layer][token][head][dim]
                 "page_head": (pages, heads, page_size, layer_num * head_dim),      # [head][token][layer][dim]
                 }[layout]
        for t, kind in enumerate(kinds):
            pieces.append(PoolPiece(0, kind, t * layer_num * size * token_bytes, layer_num * size * token_bytes))
    g = Geometry(num_ranks=tp_size, num_layers=layers, key_shape=shape, value_shape=None if mla else shape,
                 dtype=dtype, identity=_identity(mla, dtype_name, pp, cp))
    return PoolPlan(g, pieces, page_size, pages, buffer_bytes)


def _identity(mla: bool, dtype_name: str, pp: tuple, cp: tuple) -> KvIdentity:
    return KvIdentity(layout="replicated" if mla else "per_rank", dtype=kv_dtype_name(dtype_name),
                      pp_rank=int(pp[0]), pp_size=int(pp[1]), cp_rank=int(cp[0]), cp_size=int(cp[1]))


def _plan_two_buffers(*, layout: str, layer_num: int, size: int, page_size: int, widths: tuple, dtype_name: str,
                      itemsize: int, tp_size: int, buffers: tuple, pp: tuple, cp: tuple) -> PoolPlan:
    """K and V in two buffers of their own widths: sglang allows page_first ([token][layer][head]
    [dim]) and page_first_direct ([page][layer][token][head][dim]) only. A page is one piece of
    each buffer; K's and V's shapes differ in their last dimension."""
    if layout not in ("page_first", "page_first_direct"):
        raise ValueError(f"sglang host pool with K and V of different head dims: layout {layout!r} is not one "
                         "sglang makes for it (page_first, page_first_direct)")
    for name, v in (("layer_num", layer_num), ("size", size), ("page_size", page_size), ("tp_size", tp_size),
                    ("key token width", widths[0]), ("value token width", widths[1])):
        if int(v) <= 0:
            raise ValueError(f"sglang host pool {name} is {v}: must be positive")
    if size % page_size:
        raise ValueError(f"sglang host pool size {size} is not a multiple of its page size {page_size}")
    pages = size // page_size
    shapes, pieces = [], []
    for i, (kind, width) in enumerate(zip(("key", "value"), widths)):
        need = layer_num * size * width * itemsize
        if buffers[i] < need:
            raise ValueError(f"sglang host pool {kind} buffer holds {buffers[i]} bytes; its layout needs {need}")
        shapes.append((pages, 1, page_size, layer_num * width) if layout == "page_first"
                      else (pages, layer_num, page_size, width))
        pieces.append(PoolPiece(0, kind, 0, need, buffer=i))
    g = Geometry(num_ranks=tp_size, num_layers=1, key_shape=shapes[0], value_shape=shapes[1],
                 dtype=_kvtd_dtype(dtype_name, itemsize), identity=_identity(False, dtype_name, pp, cp))
    return PoolPlan(g, pieces, page_size, pages, buffers[0] + buffers[1])


_INDEX_DTYPES = ("torch.int64", "torch.int32")


def pages_of(host_indices, count: int, page_size: int) -> Optional[List[int]]:
    """The host pool page of each of `count` keys, from the token indices sglang passes
    (its HiCacheController's page transfer: `page_size` per key, each run the page's tokens in
    order), or None if they are not whole pages' token indices. A tensor must be of an index
    dtype: sglang's page-copying calls (its draft-pool path) pass page data in the same argument,
    and data read as indices would load a page over one in use."""
    dtype = getattr(host_indices, "dtype", None)
    if dtype is not None and str(dtype) not in _INDEX_DTYPES:
        return None
    if len(host_indices) < count * page_size:
        return None
    # One conversion of the whole batch (indexing a tensor element by element costs a microsecond
    # each: a batch of 128 pages of 64 tokens is 8192 of them, on every load and store).
    values = host_indices[:count * page_size]
    values = values.tolist() if hasattr(values, "tolist") else [int(x) for x in values]
    out = []
    for i in range(count):
        first = values[i * page_size]
        if first % page_size or first < 0 or values[i * page_size:(i + 1) * page_size] != list(
                range(first, first + page_size)):
            return None
        out.append(first // page_size)
    return out
