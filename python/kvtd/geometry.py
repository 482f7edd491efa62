"""The KV cache's geometry as the engine describes it. Its rules (shapes, sizes, what a valid
geometry is) live in the C++ library and are asked of it (kvtd_tensor_shape, kvtd_geometry_check),
never re-derived here."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
from typing import List, Optional, Sequence

from . import _native as n

_ERR_LEN = 1024

DTYPES = {"bfloat16": 1, "float16": 2, "uint8": 3, "block_wise_fp8": 4}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

KEY, VALUE, KEY_SCALE, VALUE_SCALE = 0, 1, 2, 3
_KIND_NAMES = {"key": KEY, "value": VALUE, "key_scale": KEY_SCALE, "value_scale": VALUE_SCALE}



def kind_code(kind) -> int:
    if isinstance(kind, str):
        if kind not in _KIND_NAMES:
            raise ValueError(f"tensor kind {kind!r} is not one of {sorted(_KIND_NAMES)}")
        return _KIND_NAMES[kind]
    return int(kind)


KV_LAYOUTS = {"": 0, "per_rank": 1, "replicated": 2}


@dataclasses.dataclass(frozen=True)
class KvIdentity:
    """What the KV is beyond its shape (kvtd/proto/kv_identity.h). layout: "per_rank" (each rank
    its own bytes: its heads, a cross-layer slab), "replicated" (an MLA latent, the same bytes on
    every rank) or "" (undeclared: a cache without a value tensor is read as an MLA latent, as in
    FastDeploy's launch line; cache groups declare theirs by kind). dtype: the engine's element
    type by its own name ("bfloat16", "float8_e4m3fn"). The pipeline stage and context-parallel
    slice of the rank's KV. The session carries it and each daemon is started with the same
    (daemon_flags); the dtype and stage enter the storage namespace, so deployments that differ
    in any never read each other's objects."""

    layout: str = ""
    dtype: str = ""
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self):
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"kv layout {self.layout!r} is not one of per_rank, replicated")
        if self.dtype and not (len(self.dtype) < 16 and all("0" <= c <= "9" or c == "_" or "a" <= c <= "z"
                                                               for c in self.dtype)):
            raise ValueError(f"kv dtype {self.dtype!r} must be 1-15 of [a-z0-9_]")
        for what, rank, size in (("pp", self.pp_rank, self.pp_size), ("cp", self.cp_rank, self.cp_size)):
            if not 1 <= size <= 1024 or not 0 <= rank < size:
                raise ValueError(f"{what} rank {rank} is not a rank of {what} size {size}")

    def daemon_flags(self) -> List[str]:
        flags = ["--kv-layout", self.layout] if self.layout else []
        if self.dtype:
            flags += ["--kv-dtype", self.dtype]
        if self.pp_size > 1:
            flags += ["--pp-rank", str(self.pp_rank), "--pp-size", str(self.pp_size)]
        if self.cp_size > 1:
            flags += ["--cp-rank", str(self.cp_rank), "--cp-size", str(self.cp_size)]
        return flags

    def to_native(self) -> n.KvIdentity:
        return n.KvIdentity(KV_LAYOUTS[self.layout], self.dtype.encode(), self.pp_rank, self.pp_size, self.cp_rank,
                            self.cp_size)


def kv_dtype_name(dtype) -> str:
    """The name a torch dtype (or an engine's string naming one) goes by in a KvIdentity:
    "bfloat16", "float8_e4m3fn", ... (torch's own, without "torch."). One that is not 1-15 of
    [a-z0-9_] (a long engine-specific name) becomes its first 6 such characters, "_" and 8 hex
    digits of its SHA-256: stable, and distinct per name."""
    name = str(dtype).replace("torch.", "").lower()
    if name and len(name) < 16 and all("0" <= c <= "9" or c == "_" or "a" <= c <= "z" for c in name):
        return name
    kept = "".join(c if ("0" <= c <= "9" or "a" <= c <= "z") else "_" for c in name)[:6]
    return f"{kept}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The KV cache every rank holds. Shapes are (blocks, kv_heads, block_size, head_dim), or
    3-D (blocks, kv_heads, block_size). `num_layers` counts every layer with a cache, the
    `num_extra_layers` MTP layers at the end included; those have `extra_device_blocks` blocks.
    block_wise_fp8 adds key/value scale tensors of `scale_bytes` (2 or 4) per token. `identity`:
    what the KV is beyond its shape (KvIdentity); the session declares it and daemon_flags gives
    it to the daemon. Engine adapters always declare the layout."""

    num_ranks: int
    num_layers: int
    key_shape: Sequence[int]
    num_host_blocks: int = 0
    dtype: str = "bfloat16"
    value_shape: Optional[Sequence[int]] = None
    scale_bytes: int = 2
    num_extra_layers: int = 0
    extra_device_blocks: int = 0
    identity: Optional[KvIdentity] = None

    def daemon_flags(self) -> List[str]:
        """The flags that give a daemon this geometry (its rank, session and backend are the caller's)."""
        flags = ["--mp-num", str(self.num_ranks), "--num-layers", str(self.num_layers - self.num_extra_layers),
                 "--num-host-blocks", str(self.num_host_blocks),
                 "--key-cache-shape", ",".join(str(int(v)) for v in self.key_shape), "--cache-dtype", self.dtype]
        if self.value_shape is not None:
            flags += ["--value-cache-shape", ",".join(str(int(v)) for v in self.value_shape)]
        if self.num_extra_layers:
            flags += ["--num-extra-layers", str(self.num_extra_layers),
                      "--extra-device-blocks", str(self.extra_device_blocks)]
        if self.dtype == "block_wise_fp8" and self.scale_bytes == 4:
            flags += ["--default-dtype", "float32"]
        if self.identity is not None:
            flags += self.identity.daemon_flags()
        return flags

    def to_native(self) -> n.Geometry:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        g = n.Geometry()
        g.num_ranks = self.num_ranks
        g.num_layers = self.num_layers
        g.dtype = DTYPES[self.dtype]
        g.num_host_blocks = self.num_host_blocks
        for name, shape in (("key_shape", self.key_shape), ("value_shape", self.value_shape)):
            if shape is None:
                continue
            if len(shape) not in (3, 4):
                raise ValueError(f"{name} {tuple(shape)} must have 3 or 4 dimensions")
            full = list(shape) + [1] * (4 - len(shape))
            getattr(g, name)[:] = full
        g.scale_bytes = self.scale_bytes if self.dtype == "block_wise_fp8" else 0
        g.num_extra_layers = self.num_extra_layers
        g.extra_device_blocks = self.extra_device_blocks
        return g

    def check(self) -> None:
        """Raises ValueError naming the first problem unless a session would accept this geometry
        (the library's one validation, kvtd_geometry_check)."""
        err = ctypes.create_string_buffer(_ERR_LEN)
        if n.lib.kvtd_geometry_check(ctypes.byref(self.to_native()), err, _ERR_LEN) != 0:
            raise ValueError(f"geometry: {err.value.decode()}")

    def _tensor(self, layer: int, kind):
        """(shape, block_bytes, bytes) of one tensor, from the library (kvtd_tensor_shape): the
        geometry's rules live in one place and are not re-derived here. shape is () when the
        geometry has no such tensor."""
        shape = (ctypes.c_int64 * 4)()
        ndim, block_bytes, nbytes = ctypes.c_uint32(), ctypes.c_uint64(), ctypes.c_uint64()
        err = ctypes.create_string_buffer(_ERR_LEN)
        if n.lib.kvtd_tensor_shape(ctypes.byref(self.to_native()), layer, kind_code(kind), shape, ctypes.byref(ndim),
                                   ctypes.byref(block_bytes), ctypes.byref(nbytes), err, _ERR_LEN) != 0:
            raise ValueError(err.value.decode())
        return tuple(shape[:ndim.value]), block_bytes.value, nbytes.value

    def has_tensor(self, kind) -> bool:
        return bool(self._tensor(0, kind)[0])

    def device_blocks(self, layer: int) -> int:
        return self._tensor(layer, KEY)[0][0]

    def tensor_shape(self, layer: int, kind) -> tuple:
        """Shape of one device tensor (the scale tensors drop head_dim). A cache described in 3-D
        keeps 3 dimensions (the library pads a 4th of 1)."""
        k = kind_code(kind)
        shape = self._tensor(layer, k)[0]
        given = self.key_shape if k in (KEY, KEY_SCALE) else self.value_shape
        if k in (KEY, VALUE) and given is not None and len(given) == 3:
            return shape[:3]
        return shape

    def element_bytes(self, kind) -> int:
        shape, block_bytes, _ = self._tensor(0, kind)
        per = 1
        for d in shape[1:]:
            per *= int(d)
        return block_bytes // per if per else 0

    def block_bytes(self, kind) -> int:
        """Bytes of one block of one layer of `kind` (0 if the geometry has no such tensor)."""
        return self._tensor(0, kind)[1]
