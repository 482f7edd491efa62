"""CUDA tensors registered by the driver's handle of their allocation plus their offset, through
the stand-in (cudasim) as the CUDA driver and runtime, with real `--device-backend cuda` daemons
of the stand-in build opening the handles.

Runs where KVTD_CUDASIM_LIBRARY names the stand-in's shared library (the `gpu`-labelled ctest
of a -DKVTD_CUDA_SIM=ON build sets it, with KVTD_CUDA_DRIVER pointing at the same library and
KVTD_BINARY at that build's daemon); skipped elsewhere.

What the old code did, and why this test exists: it took torch's
`UntypedStorage._share_cuda_()` handle and passed it on. torch >= 2.4 returns 66 bytes there (a
version byte, a type byte, then the 64-byte cudaIpcMemHandle_t: c10/cuda/CUDACachingAllocator.cpp,
`shareIpcHandle`), which the session refused, and the old test hid it behind a fake returning 64.
Here nothing of torch's sharing is faked: the tensor stand-in only has what every torch CUDA
tensor has (data_ptr, numel, element_size, device), and the handle comes from the driver calls
the library really makes. CUDA names an interior pointer's allocation by its base, and so does
the stand-in now (cudasim_test), so a wrong offset would open the wrong bytes here too.
"""

import ctypes
import os
import threading

import pytest

import kvtd
import kvtd.testing
from conftest import small_geometry

SIM = os.environ.get("KVTD_CUDASIM_LIBRARY")
pytestmark = pytest.mark.skipif(not SIM, reason="needs the CUDA stand-in (KVTD_CUDASIM_LIBRARY; gpu-labelled ctest)")

H2D, D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


def _cuda():
    lib = ctypes.CDLL(SIM)
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    return lib


class _Device:
    def __init__(self, index):
        self.index = index


class _CudaTensor:
    """Device memory at `ptr` seen as a contiguous tensor: the attributes kvtd reads of a torch
    CUDA tensor, nothing of torch's IPC sharing."""

    is_cuda = True

    def __init__(self, ptr, nbytes, element_size=2):
        self._ptr, self._nbytes, self._es = ptr, nbytes, element_size
        self.device = _Device(0)

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._nbytes // self._es

    def element_size(self):
        return self._es


def test_an_interior_tensor_is_its_allocations_handle_plus_its_offset():
    from kvtd.tensors import cuda_ipc_handle

    cuda = _cuda()
    base = ctypes.c_void_p()
    assert cuda.cudaMalloc(ctypes.byref(base), 1 << 20) == 0
    expected = ctypes.create_string_buffer(64)
    assert cuda.cudaIpcGetMemHandle(expected, base) == 0
    handle, offset, nbytes, device = cuda_ipc_handle(_CudaTensor(base.value + 12288, 4096))
    assert len(handle) == 64 and handle == expected.raw
    assert (offset, nbytes, device) == (12288, 4096, 0)
    with pytest.raises(ValueError, match="past the end of its allocation"):
        cuda_ipc_handle(_CudaTensor(base.value + (1 << 20) - 1024, 4096))
    host = ctypes.create_string_buffer(64)
    with pytest.raises(ValueError, match="not device memory"):
        cuda_ipc_handle(_CudaTensor(ctypes.addressof(host), 64))


def test_a_tensor_registered_from_a_thread_that_made_no_cuda_call_gets_its_handle():
    """FastDeploy v1 registers its workers' tensors on its transfer threads, which made no CUDA
    call: on the H100 (2026-11-28) cuMemGetAddressRange failed there with CUresult 201
    (CUDA_ERROR_INVALID_CONTEXT), because the driver API, unlike the runtime, needs a current
    context. The stand-in now has that rule (cudasim/src/contexts.cpp); the library makes the
    tensor's device's primary context current for its driver calls and leaves the thread as it
    found it."""
    from kvtd.tensors import _driver, cuda_ipc_handle

    cuda = _cuda()
    base = ctypes.c_void_p()
    assert cuda.cudaMalloc(ctypes.byref(base), 1 << 20) == 0
    expected = ctypes.create_string_buffer(64)
    assert cuda.cudaIpcGetMemHandle(expected, base) == 0
    out = {}

    def fresh_thread():
        lib = _driver()
        before = ctypes.c_void_p()
        assert lib.cuCtxGetCurrent(ctypes.byref(before)) == 0
        base_out, size = ctypes.c_uint64(), ctypes.c_size_t()
        out["bare"] = lib.cuMemGetAddressRange_v2(ctypes.byref(base_out), ctypes.byref(size), ctypes.c_uint64(base.value))
        try:
            out["got"] = cuda_ipc_handle(_CudaTensor(base.value + 8192, 4096))
        except Exception as e:  # reported below, with what the thread had
            out["error"] = e
        after = ctypes.c_void_p()
        assert lib.cuCtxGetCurrent(ctypes.byref(after)) == 0
        out["current"] = (before.value, after.value)

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join(30)
    assert out["bare"] == 201, "the stand-in must refuse a driver call on a thread with no context"
    assert "error" not in out, out.get("error")
    handle, offset, nbytes, device = out["got"]
    assert handle == expected.raw and (offset, nbytes, device) == (8192, 4096, 0)
    assert out["current"] == (None, None), "the thread is left with no current context, as it was"


def test_cuda_daemons_swap_tensors_registered_by_the_driver_handle():
    """Every layer's key and value tensor is a slice of one device allocation (as an engine's
    caching allocator hands them out); two CUDA daemons of the stand-in build open the handles,
    swap blocks out and back, and the bytes come back where they were."""
    cuda = _cuda()
    g = small_geometry(ranks=1)
    per_tensor = g.block_bytes("key") * g.key_shape[0]
    tensors = [(layer, kind) for layer in range(g.num_layers) for kind in ("key", "value")]
    base = ctypes.c_void_p()
    assert cuda.cudaMalloc(ctypes.byref(base), 4096 + per_tensor * len(tensors)) == 0
    at = {t: base.value + 4096 + i * per_tensor for i, t in enumerate(tensors)}
    pattern = bytes((i * 7 + 3) % 251 for i in range(per_tensor))
    for ptr in at.values():
        assert cuda.cudaMemcpy(ptr, pattern, per_tensor, H2D) == 0
    suffix = f"py_cudahandles_{os.getpid()}_{threading.get_ident()}"
    with kvtd.Session(suffix, g) as s:
        for (layer, kind), ptr in at.items():
            s.register_torch_tensor(0, layer, kind, _CudaTensor(ptr, per_tensor))
        s.publish()
        with kvtd.testing.Daemons(os.environ.get("KVTD_BINARY"), suffix, g, extra=["--device-backend", "cuda"]) as d:
            try:
                s.wait_ready(30)
                assert s.wait(s.swap_to_host([3, 7, 8, 9], [0, 1, 2, 3])).ok
                zeros = bytes(per_tensor)
                for ptr in at.values():
                    assert cuda.cudaMemcpy(ptr, zeros, per_tensor, H2D) == 0
                assert s.wait(s.swap_to_device([0, 1, 2, 3], [3, 7, 8, 9])).ok
            except Exception:
                print(d.logs())
                raise
    block = g.block_bytes("key")
    for (layer, kind), ptr in at.items():
        got = ctypes.create_string_buffer(per_tensor)
        assert cuda.cudaMemcpy(got, ptr, per_tensor, D2H) == 0
        for b in range(g.key_shape[0]):
            want = pattern[b * block:(b + 1) * block] if b in (3, 7, 8, 9) else bytes(block)
            assert got.raw[b * block:(b + 1) * block] == want, f"layer {layer} {kind} block {b}"
