"""What kvtd.fastdeploy_v1 needs around its transfer manager: the session's name, the host
memory the controller asks for, FastDeploy's tensor names and the geometry they imply. See
kvtd/fastdeploy_v1.py for the whole picture."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading
from typing import Any, Dict

from ...geometry import KEY, KEY_SCALE, VALUE, VALUE_SCALE, Geometry, KvIdentity

SWITCH = "KVTD_FASTDEPLOY_V1"
_NAME = re.compile(r"^(key|value)_cache(s|_scales)_(\d+)_rank(\d+)\.device(\d+)$")
_KINDS = {("key", "s"): KEY, ("value", "s"): VALUE, ("key", "_scales"): KEY_SCALE, ("value", "_scales"): VALUE_SCALE}
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "uint8": "uint8"}


def session_suffix(config, local_rank: int) -> str:
    """The session of one worker rank: $KVTD_FDV1_SESSION (a prefix) or fdv1_<engine worker
    queue port>, then _r<local rank>. Its daemon runs with `--session` this and `--rank 0`."""
    prefix = os.environ.get("KVTD_FDV1_SESSION")
    if not prefix:
        port = getattr(config.parallel_config, "local_engine_worker_queue_port", None)
        if port is None:
            port = getattr(config.parallel_config, "engine_worker_queue_port", 0)
        if isinstance(port, (list, tuple)):
            port = port[0] if port else 0
        prefix = f"fdv1_{port}"
    return f"{prefix}_r{int(local_rank)}"


# -- host memory the controller asks for -------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_reserved: Dict[int, int] = {}
_reserved_lock = threading.Lock()
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0


def reserve_host(nbytes: int) -> int:
    """Stands in for cuda_host_alloc in the controller: address space with no access and no
    memory (the host blocks are in the daemon's pool), so a stray read faults at once instead
    of seeing stale bytes."""
    size = max(int(nbytes), 1)
    ptr = _libc.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if ptr in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(f"reserving {size} bytes of address space failed (errno {ctypes.get_errno()})")
    with _reserved_lock:
        _reserved[ptr] = size
    return ptr


def release_host(ptr: int) -> None:
    """Stands in for cuda_host_free: releases what reserve_host gave; refuses anything else."""
    with _reserved_lock:
        size = _reserved.pop(int(ptr), None)
    if size is None:
        raise ValueError(f"host pointer {int(ptr):#x} was not reserved by kvtd")
    _libc.munmap(ptr, size)


# -- tensors as FastDeploy hands them (paddle on a GPU, torch in tests) --------------------------
def _dtype_name(tensor) -> str:
    return str(tensor.dtype).rsplit(".", 1)[-1].lower()


def parse_names(cache_kvs_map: Dict[str, Any]) -> Dict[tuple, Any]:
    """{(layer, kind): value} from a map by the controller's names (device tensors, or host
    pointers); every name must be FastDeploy's and name one rank and one device."""
    out, ranks = {}, set()
    for name, tensor in cache_kvs_map.items():
        m = _NAME.match(name)
        if m is None:
            raise ValueError(f"cache tensor name {name!r} is not FastDeploy's "
                             "{key|value}_caches_<layer>_rank<r>.device<d> or ..._cache_scales_...")
        ranks.add((int(m.group(4)), int(m.group(5))))
        out[(int(m.group(3)), _KINDS[(m.group(1), m.group(2))])] = tensor
    if len(ranks) > 1:
        raise ValueError(f"cache tensors name several ranks or devices {sorted(ranks)}: one worker holds one")
    return out


def geometry_of(tensors: Dict[tuple, Any], num_layers: int, num_host_blocks: int) -> Geometry:
    """The one-rank session's geometry from the tensors themselves (shapes, dtypes)."""
    missing = [layer for layer in range(num_layers) if (layer, KEY) not in tensors]
    if missing:
        raise ValueError(f"no key cache tensor for layers {missing[:8]} of {num_layers}")
    key = tensors[(0, KEY)]
    value = tensors.get((0, VALUE))
    fp8 = (0, KEY_SCALE) in tensors
    dtype = "block_wise_fp8" if fp8 else _DTYPES.get(_dtype_name(key))
    if dtype is None:
        raise ValueError(f"cache dtype {key.dtype} is not one kvtd moves (bfloat16, float16, uint8, block_wise_fp8)")
    if fp8 and _dtype_name(key) != "uint8":
        raise ValueError(f"a block_wise_fp8 cache is uint8, got {key.dtype}")
    for (layer, kind), t in tensors.items():
        first = tensors.get((0, kind))
        if kind in (KEY, VALUE) and layer < num_layers and (first is None or list(t.shape) != list(first.shape)):
            raise ValueError(f"layer {layer} {'key' if kind == KEY else 'value'} cache has shape {list(t.shape)}, "
                             f"layer 0 {list(first.shape) if first is not None else 'none'}: one shape per kind")
    scale_bytes = int(tensors[(0, KEY_SCALE)].element_size()) if fp8 else 2
    return Geometry(num_ranks=1, num_layers=num_layers, key_shape=tuple(int(d) for d in key.shape),
                    value_shape=tuple(int(d) for d in value.shape) if value is not None else None,
                    num_host_blocks=num_host_blocks, dtype=dtype, scale_bytes=scale_bytes,
                    # One rank per session: no value cache is FastDeploy's MLA latent (its GPU
                    # worker makes no value cache then; see docs/engines/fastdeploy_v1.md,
                    # 'Upstream behaviour relied on'), declared rather than left to be inferred.
                    identity=KvIdentity(layout="per_rank" if value is not None else "replicated"))
