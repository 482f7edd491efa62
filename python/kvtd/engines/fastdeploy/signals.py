"""FastDeploy's shared-memory names, seen from kvtd's side.

IPCSignals. FastDeploy's processes share small int32 numpy arrays through POSIX shared memory
named "<name>.<engine_worker_queue_port>" (fastdeploy/inter_communicator/ipc_signal.py, IPCSignal:
SharedMemory(name=name + f".{suffix}") viewed as np.ndarray(shape, int32)). The engine creates
them; the cache transfer manager attaches (create=False) and writes its rank's entry. kvtd does
the same through a numpy memmap of /dev/shm/<name>.<suffix>, not multiprocessing's SharedMemory:
before Python 3.13 a process that merely attaches a SharedMemory registers it with the resource
tracker, which unlinks the engine's object when that process exits (bpo-38119).

Tensor names. FastDeploy's GPU worker publishes each KV cache tensor with set_data_ipc
(custom_ops/gpu_ops/set_data_ipc.cu): a shared-memory object holding
struct shmStruct { size_t nprocesses; cudaIpcMemHandle_t memHandle; } (cuda_multiprocess.h,
72 bytes on x86-64) named key_caches_<layer>_rank<rank>.device<device> (value_caches_,
key_cache_scales_, value_cache_scales_; worker/gpu_model_runner.py initialize_kv_cache). kvtd's
daemon opens them (daemon/process/fastdeploy_ipc.h); publish_tensor_name() writes one, for a test
"worker" on the host backend, whose handle bytes hold a shared-memory object name.

Thread-safety: a Signal is a view of shared memory; element reads and writes are single int32
accesses, as FastDeploy's own are.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Optional

import numpy as np

SHM_DIR = "/dev/shm"

# FastDeploy's KVCacheStatus / PrefixTreeStatus (fastdeploy/inter_communicator/ipc_signal_const.py).
NORMAL, UPDATING, CLEARING, CLEARED = 0, 1, -1, -2

SHM_STRUCT_BYTES = 8 + 64  # size_t nprocesses; cudaIpcMemHandle_t memHandle
_KIND_PREFIX = {"key": "key_caches_", "value": "value_caches_", "key_scale": "key_cache_scales_",
                "value_scale": "value_cache_scales_"}


def signal_path(name: str, suffix) -> str:
    return os.path.join(SHM_DIR, f"{name}.{suffix}")


class Signal:
    """An existing FastDeploy IPCSignal of `length` int32 values, mapped read-write (`.value` is
    the numpy view, like IPCSignal.value)."""

    def __init__(self, name: str, suffix, length: int):
        self.name = f"{name}.{suffix}"
        self.path = signal_path(name, suffix)
        size = os.path.getsize(self.path)
        if size < 4 * length:
            raise ValueError(f"FastDeploy signal {self.path} holds {size} bytes; {4 * length} expected "
                             f"({length} int32)")
        self.value = np.memmap(self.path, dtype=np.int32, mode="r+", shape=(length,))

    @staticmethod
    def open(name: str, suffix, length: int) -> Optional["Signal"]:
        """The signal, or None while FastDeploy's engine has not created it."""
        try:
            return Signal(name, suffix, length)
        except FileNotFoundError:
            return None

    def clear(self) -> None:
        """What IPCSignal.clear() does: unmap and unlink (shutdown)."""
        self.value = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def create_signal(name: str, suffix, length: int) -> Signal:
    """Creates a zeroed signal as FastDeploy's engine does (for tests and tools that stand in for
    the engine); an existing one is replaced, as IPCSignal(create=True) does."""
    path = signal_path(name, suffix)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, 4 * length)
    finally:
        os.close(fd)
    return Signal(name, suffix, length)


def tensor_name(kind: str, layer: int, rank: int, device_id: int) -> str:
    """The name FastDeploy's worker publishes a cache tensor under."""
    return f"{_KIND_PREFIX[kind]}{layer}_rank{rank}.device{device_id}"


def publish_tensor_name(name: str, handle: bytes) -> None:
    """Writes a set_data_ipc object: nprocesses = 0, then the 64 handle bytes."""
    if len(handle) > 64:
        raise ValueError(f"a handle has at most 64 bytes, got {len(handle)}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, SHM_STRUCT_BYTES)
        with mmap.mmap(fd, SHM_STRUCT_BYTES) as m:
            m[:] = struct.pack("<Q", 0) + handle.ljust(64, b"\0")
    finally:
        os.close(fd)


def read_tensor_name(name: str) -> bytes:
    """The 64 handle bytes of a set_data_ipc object (what share_external_data opens)."""
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        raw = f.read()
    if len(raw) != SHM_STRUCT_BYTES:
        raise ValueError(f"{name} holds {len(raw)} bytes; set_data_ipc writes {SHM_STRUCT_BYTES}")
    return raw[8:]


def unlink_tensor_name(name: str) -> None:
    """What unset_data_ipc(..., unlink_shm=True) does to the name."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
