"""kvtd: the engine side of the KV-cache transfer daemon, for Python engines.

Sessions, tasks and results over libkvtd_client.so (ctypes; waits release the GIL): session.py
for the API, cache_groups.py for hybrid models' caches, places.py for naming a tensor to a daemon.
The engines' adapters are under engines/ (FastDeploy v0 and cache manager v1, sglang's HiCache,
vLLM's KV offloading), each loaded by its engine under the names kvtd.fastdeploy,
kvtd.fastdeploy_v1, kvtd.sglang and kvtd.vllm (docs/engines/<engine>.md).
"""

from . import _native
from .errors import (CacheCleared, CacheControlFailed, Closed, InUse, InvalidArgument, KvtdError, NotReady, RingFull,
                     SystemFailure, TaskFailed, Timeout, UnknownTask, WrongProcess)
from .session import (CANCEL, KEY, KEY_SCALE, PREFETCH, STORAGE_QUERY, STORAGE_READ, STORAGE_WRITE, SWAP_TO_DEVICE,
                      SWAP_TO_HOST, VALUE, VALUE_SCALE, Geometry, Session, TaskResult, now_ns)
from .geometry import KvIdentity

__version__ = _native.lib.kvtd_version().decode()  # the one version (kvtd/base/version.h)

__all__ = [
    "Geometry", "KvIdentity", "Session", "TaskResult", "now_ns",
    "KvtdError", "InvalidArgument", "Timeout", "RingFull", "NotReady", "UnknownTask", "InUse", "SystemFailure",
    "TaskFailed", "CacheCleared", "CacheControlFailed", "Closed", "WrongProcess",
    "SWAP_TO_HOST", "SWAP_TO_DEVICE", "STORAGE_QUERY", "STORAGE_READ", "STORAGE_WRITE", "PREFETCH", "CANCEL",
    "KEY", "VALUE", "KEY_SCALE", "VALUE_SCALE",
]
