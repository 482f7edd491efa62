"""A KV cache as cache groups: the caches hybrid models keep side by side (sliding window beside
full attention, Mamba / linear-attention state beside attention, an indexer beside an MLA latent).
The rules (what is valid, sizes, how much of a prefix can be loaded) live in the C++ library
(kvtd/proto/cache_groups.h, group_hits.h) and are asked of it, never re-derived here."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from . import _native as n
from .geometry import Geometry, KvIdentity

_ERR_LEN = 1024

KINDS = {"full_attention": 1, "mla_latent": 2, "sliding_window": 3, "state": 4, "indexer": 5}
_KIND_NAMES = {v: k for k, v in KINDS.items()}


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """One group: `layers` (layer ids), its `tensors` per layer as (element_bytes, dims of one
    block or state slot), tokens per block (0 for a state group), a sliding window's tokens, and
    its device and host block counts."""

    kind: str
    layers: Sequence[int]
    tensors: Sequence[Tuple[int, Sequence[int]]]
    device_blocks: int
    host_blocks: int = 0
    block_tokens: int = 0
    window_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class CacheGroups:
    """`identity`: the KV's dtype, pipeline stage and context-parallel slice (KvIdentity, its
    layout left "": each group's kind declares it); the session declares it, daemon_flags gives it
    to the daemon."""
    num_ranks: int
    page_tokens: int
    groups: Sequence[CacheGroup]
    identity: Optional[KvIdentity] = None

    def to_native(self) -> n.CacheGroups:
        out = n.CacheGroups()
        out.num_ranks, out.page_tokens, out.num_groups = self.num_ranks, self.page_tokens, len(self.groups)
        if len(self.groups) > n.MAX_GROUPS:
            raise ValueError(f"cache groups: {len(self.groups)} groups, at most {n.MAX_GROUPS}")
        for i, g in enumerate(self.groups):
            c = out.groups[i]
            if g.kind not in KINDS:
                raise ValueError(f"cache group {i}: kind {g.kind!r} is not one of {sorted(KINDS)}")
            if len(g.tensors) > 4:
                raise ValueError(f"cache group {i}: {len(g.tensors)} tensors per layer, at most 4")
            c.kind, c.num_tensors = KINDS[g.kind], len(g.tensors)
            c.block_tokens, c.window_tokens = g.block_tokens, g.window_tokens
            c.device_blocks, c.host_blocks = g.device_blocks, g.host_blocks
            for layer in g.layers:
                if not 0 <= layer < 512:
                    raise ValueError(f"cache group {i}: layer {layer} is outside [0, 512)")
                c.layers[layer // 64] |= 1 << (layer % 64)
            for t, (element_bytes, dims) in enumerate(g.tensors):
                if not 1 <= len(dims) <= 3:
                    raise ValueError(f"cache group {i}: tensor {t} has {len(dims)} dims, 1 to 3")
                c.tensors[t].element_bytes, c.tensors[t].ndim = element_bytes, len(dims)
                c.tensors[t].dims[:len(dims)] = list(dims)
        return out

    @staticmethod
    def from_native(c: n.CacheGroups) -> "CacheGroups":
        groups = []
        for i in range(c.num_groups):
            g = c.groups[i]
            layers = [l for l in range(512) if (g.layers[l // 64] >> (l % 64)) & 1]
            tensors = [(g.tensors[t].element_bytes, tuple(g.tensors[t].dims[:g.tensors[t].ndim]))
                       for t in range(g.num_tensors)]
            groups.append(CacheGroup(_KIND_NAMES.get(g.kind, "invalid"), layers, tensors, g.device_blocks,
                                     g.host_blocks, g.block_tokens, g.window_tokens))
        return CacheGroups(c.num_ranks, c.page_tokens, groups)

    @staticmethod
    def of_geometry(geometry: Geometry, mla: bool = False) -> "CacheGroups":
        """A single-shape geometry as groups; MLA is declared by the caller, never inferred."""
        out, err = n.CacheGroups(), ctypes.create_string_buffer(_ERR_LEN)
        if n.lib.kvtd_groups_of_geometry(ctypes.byref(geometry.to_native()), int(mla), ctypes.byref(out), err,
                                         _ERR_LEN) != 0:
            raise ValueError(f"geometry: {err.value.decode()}")
        return CacheGroups.from_native(out)

    def check(self) -> None:
        """Raises ValueError naming the first problem (the library's one validation)."""
        err = ctypes.create_string_buffer(_ERR_LEN)
        if n.lib.kvtd_groups_check(ctypes.byref(self.to_native()), err, _ERR_LEN) != 0:
            raise ValueError(f"cache groups: {err.value.decode()}")

    def sizes(self) -> List[Tuple[int, int]]:
        """Per group: (bytes of one block across its layers and tensors, its host pool bytes)."""
        block, pool = (ctypes.c_uint64 * n.MAX_GROUPS)(), (ctypes.c_uint64 * n.MAX_GROUPS)()
        err = ctypes.create_string_buffer(_ERR_LEN)
        if n.lib.kvtd_group_sizes(ctypes.byref(self.to_native()), block, pool, err, _ERR_LEN) != 0:
            raise ValueError(f"cache groups: {err.value.decode()}")
        return [(block[i], pool[i]) for i in range(len(self.groups))]

    def loadable_prefix(self, present: Sequence[Sequence[bool]]) -> Tuple[int, List[int]]:
        """(pages, per-group answers): the longest prefix where every group's rule holds, given
        present[g][k] (group g's object of key k is stored). Every row has one entry per key."""
        num_keys = len(present[0]) if present else 0
        if len(present) != len(self.groups) or any(len(row) != num_keys for row in present):
            raise ValueError("present needs one row per group, each with one entry per key")
        flat = (ctypes.c_uint8 * max(1, num_keys * len(self.groups)))(*[1 if v else 0 for row in present for v in row])
        pages, per = ctypes.c_uint32(), (ctypes.c_uint32 * n.MAX_GROUPS)()
        err = ctypes.create_string_buffer(_ERR_LEN)
        if n.lib.kvtd_group_hits(ctypes.byref(self.to_native()), num_keys, flat, ctypes.byref(pages), per, err,
                                 _ERR_LEN) != 0:
            raise ValueError(f"cache groups: {err.value.decode()}")
        return pages.value, list(per[:len(self.groups)])

    def spec(self, group: int) -> str:
        """Group `group` as the daemon's --cache-group text (the library's one encoder)."""
        out, err = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(_ERR_LEN)
        if n.lib.kvtd_group_spec(ctypes.byref(self.to_native()), group, out, len(out), err, _ERR_LEN) != 0:
            raise ValueError(f"cache groups: {err.value.decode()}")
        return out.value.decode()

    def daemon_flags(self) -> List[str]:
        """The flags that give a daemon these groups: --cache-group once per group."""
        flags: List[str] = []
        for i in range(len(self.groups)):
            flags += ["--cache-group", self.spec(i)]
        if self.identity is not None:
            flags += self.identity.daemon_flags()
        return flags

    def id_bases(self) -> List[Tuple[int, int]]:
        """Per group: its first (device, host) block id in a task's id space, where the groups'
        blocks sit side by side in group order (kvtd/proto/group_slots.h)."""
        out, device, host = [], 0, 0
        for g in self.groups:
            out.append((device, host))
            device, host = device + g.device_blocks, host + g.host_blocks
        return out

    def device_ids(self, group: int, blocks: Sequence[int]) -> List[int]:
        """Group `group`'s device blocks as a task names them (its base added); checked in range."""
        return self._ids(group, blocks, 0, self.groups[group].device_blocks, "device")

    def host_ids(self, group: int, blocks: Sequence[int]) -> List[int]:
        """Group `group`'s host blocks as a task names them (its base added); checked in range."""
        return self._ids(group, blocks, 1, self.groups[group].host_blocks, "host")

    def storage_blocks(self, per_group: Sequence[Sequence[Optional[int]]], host: bool = False) -> List[int]:
        """A storage task's blocks in a group session: `per_group[g][k]` is group g's own block
        (device, or host with host=True) of key k, None where the group has none (a state saved
        only at some keys, a window's early pages). Flattened group-major in the task's id space,
        None as -1: what kvtd_task.blocks holds."""
        if len(per_group) != len(self.groups):
            raise ValueError(f"{len(per_group)} block lists for {len(self.groups)} cache groups")
        keys = {len(b) for b in per_group}
        if len(keys) > 1:
            raise ValueError(f"the groups' block lists differ in length ({sorted(keys)}): one entry per key")
        out: List[int] = []
        for g, blocks in enumerate(per_group):
            side, count = (1, self.groups[g].host_blocks) if host else (0, self.groups[g].device_blocks)
            named = iter(self._ids(g, [b for b in blocks if b is not None], side, count, "host" if host else "device"))
            out += [-1 if b is None else next(named) for b in blocks]
        return out

    def _ids(self, group, blocks, side, count, what):
        base = self.id_bases()[group][side]
        for b in blocks:
            if not 0 <= b < count:
                raise ValueError(f"cache group {group}: {what} block {b} is outside [0, {count})")
        return [base + b for b in blocks]

    def slots(self, layer: int) -> List[Tuple[int, int]]:
        """(group, tensor) of each registry slot of `layer`: its attention group's tensors, then
        its indexer group's (kvtd/proto/group_slots.h)."""
        out = []
        for indexer in (False, True):
            for i, g in enumerate(self.groups):
                if layer in g.layers and (g.kind == "indexer") == indexer:
                    out += [(i, t) for t in range(len(g.tensors))]
        return out

    def by_kind(self) -> Dict[str, List[int]]:
        out: Dict[str, List[int]] = {}
        for i, g in enumerate(self.groups):
            out.setdefault(g.kind, []).append(i)
        return out
