"""Tensors from torch.

A CUDA tensor is registered by the IPC handle of the allocation that holds it plus the byte
offset of the tensor inside it: torch's caching allocator sub-allocates, so a handle alone would
name the wrong bytes. The handle comes from the CUDA driver itself through ctypes
(`cuMemGetAddressRange` for the allocation's base and size, `cuIpcGetMemHandle` on the base),
not from torch's `UntypedStorage._share_cuda_()`, for two reasons read in torch's source
(c10/cuda/CUDACachingAllocator.cpp, `shareIpcHandle`, torch >= 2.4): it returns a 66-byte
handle (a version byte, a type byte, then the 64-byte cudaIpcMemHandle_t), and it takes a
reference that only a torch receiver releases, so the engine's KV memory would stay reserved in
torch's IPC limbo after the cache is freed. The driver's allocation size also lets the library
check that the tensor lies inside the allocation before any daemon copies into it.

Expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) map memory with the
virtual-memory API, which legacy IPC handles cannot name: such tensors are refused naming the
setting.

CPU tensors for the host backend live in shared memory made by the session
(Session.create_host_device_tensors); Session.host_tensor() maps them into torch without a copy.
"""

from __future__ import annotations

import os
from typing import Optional


def torch_dtype(geometry, kind: int):
    import torch

    if kind in (2, 3):  # scales: the engine's default dtype
        return torch.float32 if geometry.scale_bytes == 4 else torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
            "block_wise_fp8": torch.uint8}[geometry.dtype]


def pci_bus_id(device: int) -> Optional[str]:
    """The PCI address ("0000:3b:00.0") of CUDA device `device` as torch reports it, or None
    where this torch does not say. Daemons match GPUs by it (ordinals differ per process under
    CUDA_VISIBLE_DEVICES)."""
    import torch

    try:
        props = torch.cuda.get_device_properties(device)
    except (AssertionError, RuntimeError):  # a torch without CUDA
        return None
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


_driver_lib = None


def _driver():
    """libcuda through ctypes ($KVTD_CUDA_DRIVER names another library: tests use the stand-in)."""
    global _driver_lib
    if _driver_lib is None:
        import ctypes

        lib = ctypes.CDLL(os.environ.get("KVTD_CUDA_DRIVER", "libcuda.so.1"))
        lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuIpcGetMemHandle.restype = ctypes.c_int
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        for name, args in (("cuInit", [ctypes.c_uint]), ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                           ("cuCtxGetCurrent", [ctypes.POINTER(ctypes.c_void_p)]),
                           ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRelease_v2", [ctypes.c_int]),
                           ("cuCtxPushCurrent_v2", [ctypes.c_void_p]),
                           ("cuCtxPopCurrent_v2", [ctypes.POINTER(ctypes.c_void_p)])):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = args
        _driver_lib = lib
    return _driver_lib


class _PrimaryContext:
    """Makes device `device`'s primary context (the one torch and the CUDA runtime use) current
    for the driver calls below when the calling thread has none, and undoes it after.

    The driver API needs a current context where the runtime makes one lazily: on the H100
    (2026-11-28) FastDeploy v1's transfer threads registered torch tensors on threads that had
    made no CUDA call, and cuMemGetAddressRange failed with CUresult 201
    (CUDA_ERROR_INVALID_CONTEXT) for memory that was the device's."""

    def __init__(self, lib, device: Optional[int]):
        self._lib, self._device, self._pushed, self._retained = lib, device, False, None

    def __enter__(self):
        import ctypes

        current = ctypes.c_void_p()
        if self._device is None or self._lib.cuCtxGetCurrent(ctypes.byref(current)) != 0 or current.value:
            return self
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        for rc, what in ((lambda: self._lib.cuInit(0), "cuInit"),
                         (lambda: self._lib.cuDeviceGet(ctypes.byref(dev), self._device), "cuDeviceGet"),
                         (lambda: self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")):
            code = rc()
            if code != 0:
                raise ValueError(f"{what} for CUDA device {self._device} failed with CUresult {code}: this thread "
                                 "has no current CUDA context and the device's primary one cannot be made current")
        self._retained = dev.value
        code = self._lib.cuCtxPushCurrent_v2(ctx)
        if code != 0:
            self._lib.cuDevicePrimaryCtxRelease_v2(self._retained)
            raise ValueError(f"cuCtxPushCurrent of CUDA device {self._device}'s primary context failed with "
                             f"CUresult {code}")
        self._pushed = True
        return self

    def __exit__(self, *exc):
        import ctypes

        if self._pushed:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        if self._retained is not None:
            self._lib.cuDevicePrimaryCtxRelease_v2(self._retained)
        return False


def allocation_handle(ptr: int, nbytes: int, device: Optional[int] = None):
    """(64-byte cudaIpcMemHandle_t of the allocation holding device address `ptr`, byte offset of
    `ptr` in it), checked that `nbytes` from `ptr` stay inside the allocation. `device`: the CUDA
    ordinal the memory is on, whose primary context is made current when this thread has none."""
    with _PrimaryContext(_driver(), device):
        return _allocation_handle(ptr, nbytes)


def _allocation_handle(ptr: int, nbytes: int):
    import ctypes

    lib = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise ValueError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}: not device memory of "
                         "this process's current CUDA context" + (" (the thread has no current context)" if rc == 201 else ""))
    offset = ptr - base.value
    if offset + nbytes > size.value:
        raise ValueError(f"the tensor ({nbytes} bytes at offset {offset}) runs past the end of its "
                         f"allocation ({size.value} bytes)")
    handle = ctypes.create_string_buffer(64)
    rc = lib.cuIpcGetMemHandle(handle, base)
    if rc != 0:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        hint = (" PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, whose memory legacy CUDA IPC "
                "handles cannot name: run the engine without it" if "expandable_segments:true" in
                conf.replace(" ", "").lower() else
                " (memory from cuMemCreate/expandable segments or a pool cannot be shared by a legacy "
                "IPC handle)")
        raise ValueError(f"cuIpcGetMemHandle failed with CUresult {rc}.{hint}")
    return handle.raw, offset


def cuda_ipc_handle(tensor):
    """(64-byte handle of the allocation, byte offset of the tensor in it, tensor bytes, device
    ordinal) of a contiguous CUDA tensor."""
    if not tensor.is_cuda:
        raise ValueError("register_torch_tensor needs a CUDA tensor; the host backend uses "
                         "create_host_device_tensors() and host_tensor()")
    if not tensor.is_contiguous():
        raise ValueError("a KV cache tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    device = tensor.device.index
    handle, offset = allocation_handle(int(tensor.data_ptr()), nbytes, None if device is None else int(device))
    return handle, offset, nbytes, int(tensor.device.index)
