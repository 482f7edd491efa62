"""FastDeploy cache manager v1's own code, loaded for tests (run in a process of its own: the v0
harness loads another copy of the `fastdeploy` package).

Loaded unmodified from the reference (upstream develop c1b7c083, ../shared/reference/fastdeploy-v1,
see its PROVENANCE): fastdeploy/cache_manager/v1/ whole (CacheManager on the engine side,
CacheController, LayerDoneCounter, RadixTree, block pools on the worker side). Then
kvtd.fastdeploy_v1.install() runs, as its FastDeploy plugin does in every FastDeploy process.

Replaced by stand-ins because they cannot load here (none of them is cache logic):
* paddle: `full` allocates the "GPU" tensor in a /dev/shm object (kvtd's host backend opens
  device tensors by shared-memory name), as a torch tensor; get_default_dtype, empty_cache,
  is_compiled_with_cuda. No GPU here: with one, paddle's own tensors are registered by their
  CUDA IPC handle (kvtd.places.tensor_location).
* paddleformers.utils.log.logger and fastdeploy.utils.get_logger: loggers.
* fastdeploy.cache_manager.ops: the custom ops (cuda_host_alloc, swap_cache_*), built from CUDA
  sources; each raises if called, which proves kvtd replaced every use.
* The FDConfig: the fields v1 reads (cache_manager.py:69-80, cache_controller.py:77-93,
  transfer_manager.py:77-83), with CacheConfig.get_cache_bytes taken from config.py's source.
* The attention backend's get_kv_cache_shape: [blocks, kv_heads, block_size, head_dim], as
  FastDeploy's append attention backend returns it.
* Request: the fields v1 reads (engine/request.py:163-167, 243-271).
"""

from __future__ import annotations

import ast
import logging
import mmap
import os
import types
import uuid
from pathlib import Path
from typing import List, Optional

from reference_source import reference_source
from reference_source import stand_in_module as _module


def source() -> Optional[Path]:
    return reference_source("KVTD_FASTDEPLOY_V1_SRC", "fastdeploy-v1", "fastdeploy/cache_manager/v1/cache_controller.py")


def skip_reason() -> str:
    return ("FastDeploy v1's source is not here: set KVTD_FASTDEPLOY_V1_SRC to a FastDeploy checkout with "
            "fastdeploy/cache_manager/v1 (upstream develop c1b7c083), or place it at ../shared/reference/fastdeploy-v1")


class ShmDevice:
    """paddle.full's stand-in memory: one /dev/shm object per tensor, unlinked by close()."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:8]
        self.names: List[str] = []
        self.maps = []

    def full(self, shape, fill_value=0, dtype="float32"):
        import torch

        dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
              "float32": torch.float32}[str(dtype)]
        count = 1
        for d in shape:
            count *= int(d)
        nbytes = max(count * torch.empty((), dtype=dt).element_size(), 1)
        name = f"kvtdfdv1_{self.tag}_{len(self.names)}"
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            m = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.names.append(name)
        self.maps.append(m)
        t = torch.frombuffer(m, dtype=dt, count=count).view(*[int(d) for d in shape])
        if fill_value:
            t.fill_(fill_value)
        return t

    def close(self) -> None:
        for name in self.names:
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        self.names.clear()


class CudaDevice:
    """paddle.full's stand-in on a GPU (KVTD_FDV1_DEVICE=cuda, scripts/gpu-check.sh): torch CUDA
    tensors on the current device, which kvtd registers by their allocation's CUDA IPC handle, as
    it does paddle's."""

    def full(self, shape, fill_value=0, dtype="float32"):
        import torch

        dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
              "float32": torch.float32}[str(dtype)]
        return torch.full([int(d) for d in shape], fill_value, dtype=dt, device=f"cuda:{torch.cuda.current_device()}")

    def close(self) -> None:
        pass


def on_gpu() -> bool:
    return os.environ.get("KVTD_FDV1_DEVICE") == "cuda"


def make_device():
    """Where the "GPU" tensors live: shared memory for kvtd's host backend, or a real GPU."""
    return CudaDevice() if on_gpu() else ShmDevice()


def daemon_flags() -> List[str]:
    return ["--device-backend", "cuda"] if on_gpu() else []


def _package(name: str, path: Path) -> None:
    m = _module(name)
    m.__path__ = [str(path)]


def _not_here(op):
    def call(*a, **k):
        raise AssertionError(f"FastDeploy's custom op {op} was called: kvtd must replace every use of it")
    return call


def _get_cache_bytes(config_py: Path):
    tree = ast.parse(config_py.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_cache_bytes":
            node.decorator_list = []
            ns = {}
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(config_py), "exec"), ns)
            return ns["get_cache_bytes"]
    raise AssertionError(f"no get_cache_bytes in {config_py}")


def load(device, install: bool = True):
    """Imports FastDeploy's v1 package with the stand-ins, then installs kvtd (as its plugin does
    with KVTD_FASTDEPLOY_V1=1). Returns the package."""
    src = source()
    assert src is not None, skip_reason()
    logger = logging.getLogger("fastdeploy")
    _module("paddle", full=device.full, zeros=lambda shape, dtype="float32": device.full(shape, 0, dtype),
            get_default_dtype=lambda: "float32", is_compiled_with_cuda=lambda: False,
            device=types.SimpleNamespace(cuda=types.SimpleNamespace(empty_cache=lambda: None)))
    _module("paddleformers")
    _module("paddleformers.utils")
    _module("paddleformers.utils.log", logger=logger)
    _package("fastdeploy", src / "fastdeploy")
    _module("fastdeploy.utils", get_logger=lambda name, *a, **k: logging.getLogger(f"fastdeploy.{name}"))
    _package("fastdeploy.cache_manager", src / "fastdeploy" / "cache_manager")
    _module("fastdeploy.cache_manager.ops", **{op: _not_here(op) for op in (
        "cuda_host_alloc", "cuda_host_free", "swap_cache_per_layer", "swap_cache_per_layer_async",
        "swap_cache_all_layers")})
    import fastdeploy.cache_manager.v1 as v1  # noqa: E402

    from kvtd import fastdeploy_v1

    if install:
        fastdeploy_v1.install()
    v1.get_cache_bytes = _get_cache_bytes(src / "fastdeploy" / "config.py")
    return v1


def fd_config(v1, *, tp: int, layers: int, gpu_blocks: int, cpu_blocks: int, kv_heads: int, block_size: int,
              head_dim: int, write_policy: str = "write_back", port: int = 0, fp8: bool = False):
    """fp8: block_wise_fp8, as FastDeploy configures it (uint8 cache, float32 scales per token)."""
    ns = types.SimpleNamespace
    cache = ns(total_block_num=gpu_blocks, num_cpu_blocks=cpu_blocks, block_size=block_size, enable_prefix_caching=True,
               write_policy=write_policy, write_through_threshold=1, kvcache_storage_backend=None,
               cache_dtype="block_wise_fp8" if fp8 else "bfloat16", get_cache_bytes=v1.get_cache_bytes)
    return ns(cache_config=cache,
              model_config=ns(num_hidden_layers=layers, dtype="bfloat16"),
              quant_config=ns(kv_cache_quant_type="block_wise_fp8" if fp8 else None),
              parallel_config=ns(tensor_parallel_size=tp, engine_worker_queue_port=port),
              speculative_config=ns(num_extra_cache_layer=0),
              shape=(kv_heads, block_size, head_dim))


class AttentionBackend:
    def __init__(self, config):
        self.heads, self.block_size, self.head_dim = config.shape

    def get_kv_cache_shape(self, max_num_blocks, kv_cache_quant_type=None):
        shape = [max_num_blocks, self.heads, self.block_size, self.head_dim]
        return shape, list(shape)


class Request:
    """engine/request.py's fields that v1 reads (request.py:163-167, 243-271)."""

    def __init__(self, request_id: str, prompt_hashes: List[str]):
        self.request_id = request_id
        self.prompt_hashes = prompt_hashes
        self.block_tables: List[int] = []
        self._match_result = None
        self.cache_swap_metadata = []
        self.cache_evict_metadata = []

    @property
    def match_result(self):
        return self._match_result
