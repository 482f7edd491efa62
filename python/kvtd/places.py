"""Where a daemon finds a tensor: the one way every adapter names engine memory to kvtd.

Three kinds of place, each a 64-byte handle plus a byte offset, as the session's C ABI takes them
(kvtd_register_tensor):
- GPU memory: the CUDA IPC handle of the allocation holding the tensor (kvtd.tensors), and the
  tensor's offset in it.
- A /dev/shm object (kvtd's host backend, FastDeploy's host cache): the object's name.
- A memfd of this process (sglang's shm host-pool allocator): "/proc/<pid>/fd/<fd>"; the daemon
  maps it only if this process holds it open read-write and it is shared memory.
Every place is read from this process's own /proc/self/maps, never assumed from a pointer.
"""

from __future__ import annotations

import os
from typing import Optional

HANDLE_BYTES = 64
SHM_DIR = "/dev/shm/"


def mapping_of(address: int):
    """(path, inode, offset of `address` in the file) of the file mapped at `address` in this
    process (from /proc/self/maps: start-end perms offset dev inode path); path is "" for an
    anonymous mapping. ValueError when nothing is mapped there."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) < 5:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                path = parts[5].strip() if len(parts) == 6 else ""
                return path, int(parts[4]), address - start + int(parts[2], 16)
    raise ValueError(f"address {address:#x} is not mapped")


def shm_file_of(address: int):
    """(path, offset) of the live /dev/shm object mapped at `address` in this process."""
    path, _, offset = mapping_of(address)
    if path.endswith(" (deleted)") or not path.startswith(SHM_DIR):
        raise ValueError(f"address {address:#x} is not in a live shared-memory object ({path!r})")
    return path, offset


def _handle(text: str) -> bytes:
    raw = text.encode()
    if len(raw) >= HANDLE_BYTES:
        raise ValueError(f"{text!r} is {len(raw)} bytes: a place's name must be under {HANDLE_BYTES}")
    return raw.ljust(HANDLE_BYTES, b"\0")


def shm_place(address: int):
    """(handle, offset) of `address` in its /dev/shm object: the object's name."""
    path, offset = shm_file_of(address)
    return _handle(path[len(SHM_DIR):]), offset


def memfd_place(fd: int, address: int):
    """(handle, offset) of `address` in the memfd `fd` of this process: "/proc/<pid>/fd/<fd>",
    checked against /proc/self/maps (the mapping at `address` is that file, by inode)."""
    _, inode, offset = mapping_of(address)
    if inode != os.fstat(fd).st_ino:
        raise ValueError(f"the buffer at {address:#x} is not mapped from fd {fd}")
    return _handle(f"/proc/{os.getpid()}/fd/{fd}"), offset


def device_of(tensor) -> Optional[int]:
    """The CUDA device ordinal of a paddle or torch tensor, or None for host memory."""
    place = getattr(tensor, "place", None)
    if place is not None and hasattr(place, "is_gpu_place"):
        return int(place.gpu_device_id()) if place.is_gpu_place() else None
    if getattr(tensor, "is_cuda", False):
        return int(tensor.device.index)
    return None


def tensor_location(tensor):
    """(handle, byte offset, nbytes, device ordinal or -1) a daemon opens a torch or paddle tensor
    by: its allocation's CUDA IPC handle for GPU memory, its /dev/shm object's name otherwise."""
    from .tensors import allocation_handle

    nbytes = int(tensor.numel()) * int(tensor.element_size())
    ptr = int(tensor.data_ptr())
    device = device_of(tensor)
    if device is not None:
        handle, offset = allocation_handle(ptr, nbytes, device)
        return handle, offset, nbytes, device
    handle, offset = shm_place(ptr)
    return handle, offset, nbytes, -1
