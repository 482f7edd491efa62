"""Tensors from torch.

CUDA tensors are registered by the IPC handle of the allocation that holds them plus the byte
offset of the tensor inside it: torch's caching allocator sub-allocates, so a handle alone would
name the wrong bytes. That is exactly what torch's own CUDA storage sharing exports
(`UntypedStorage._share_cuda_()`: device, handle, storage size, storage offset, ...). This path is
compiled and documented; no machine of this project has a GPU, so it has not run.

CPU tensors for the host backend live in shared memory made by the session
(Session.create_host_device_tensors); Session.host_tensor() maps them into torch without a copy.
"""

from __future__ import annotations

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


def cuda_ipc_handle(tensor):
    """(handle bytes, byte offset in the allocation, tensor bytes, device ordinal) of a
    contiguous CUDA tensor."""
    if not tensor.is_cuda:
        raise ValueError("register_torch_tensor needs a CUDA tensor; the host backend uses "
                         "create_host_device_tensors() and host_tensor()")
    if not tensor.is_contiguous():
        raise ValueError("a KV cache tensor must be contiguous")
    storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()._untyped()
    shared = storage._share_cuda_()
    device, handle, _storage_bytes, storage_offset = shared[0], shared[1], shared[2], shared[3]
    offset = int(storage_offset) + tensor.storage_offset() * tensor.element_size()
    nbytes = tensor.numel() * tensor.element_size()
    return bytes(handle), offset, nbytes, int(device)
