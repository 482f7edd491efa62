"""FastDeploy's own engine code, loaded beside kvtd for tests.

FastDeploy's engine side (fastdeploy/cache_manager/prefix_cache_manager.py and what it imports:
envs, cache_data, cache_tasks, cache_metrics, inter_communicator's IPCSignal and EngineCacheQueue)
is run unmodified, except for the diff of launch_cache_manager in docs/engines/fastdeploy.md
(docs/fastdeploy/launch_cache_manager.diff), applied here with patch(1) to a copy, so the tests
prove that diff. The source is $KVTD_FASTDEPLOY_SRC, else ../shared/reference/fastdeploy beside the
checkout, else /work/shared/reference/fastdeploy (upstream develop c1b7c083: see its PROVENANCE);
without one the tests skip and say why.

Replaced by plain stand-ins, because they need paddle or are not in the reference copy (none of them
is FastDeploy's cache logic):
fastdeploy.utils (loggers; get_hash_str is taken out of utils.py by its source), fastdeploy.config
(a type name), fastdeploy.engine.request (Request, ControlRequest, ControlResponse: plain records),
fastdeploy.cache_manager.ops (get_all_visible_devices), fastdeploy.metrics.metrics (gauges that
count nothing), fastdeploy.trace.trace_logger, the ZeroMQ/worker queue modules
inter_communicator/__init__.py imports but the manager never uses, fastdeploy.inter_communicator.fmq
(FMQ: records each control response put), and the attention backend's get_kv_cache_shape
(model_executor: [blocks, kv_heads, block_size, head_dim], as FastDeploy's append attention
backend returns it).

WorkerStandIn plays FastDeploy's GPU worker on kvtd's host backend: one shared-memory "device"
tensor per layer and kind, published under FastDeploy's names with set_data_ipc's struct layout
(the handle bytes hold the object's name, as kvtd's host backend reads handles), then
cache_ready_signal[rank] = 1, as gpu_model_runner.py initialize_kv_cache does.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import types
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from kvtd.engines.fastdeploy import signals as fds
from reference_source import reference_source
from reference_source import stand_in_module as _module

ROOT = Path(__file__).resolve().parents[3]
DIFF = ROOT / "docs" / "fastdeploy" / "launch_cache_manager.diff"


def fastdeploy_source() -> Optional[Path]:
    return reference_source("KVTD_FASTDEPLOY_SRC", "fastdeploy", "fastdeploy/cache_manager/prefix_cache_manager.py")


def skip_reason() -> str:
    return ("FastDeploy's source is not here: set KVTD_FASTDEPLOY_SRC to a checkout of FastDeploy (upstream "
            "develop c1b7c083 or newer), or place it at ../shared/reference/fastdeploy beside this checkout")


class _Gauge:
    def __getattr__(self, name):
        return lambda *a, **k: None


class _Metrics:
    def __getattr__(self, name):
        return _Gauge()


@dataclasses.dataclass
class ControlRequest:
    request_id: str
    method: str
    args: dict = dataclasses.field(default_factory=dict)

    def get_method(self) -> str:
        return self.method


@dataclasses.dataclass
class ControlResponse:
    request_id: str
    error_code: int = 200
    error_message: str = ""


class Request:
    """The fields of FastDeploy's Request the prefix cache manager reads."""

    def __init__(self, request_id: str, prompt_token_ids: List[int]):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: List[int] = []
        self.block_tables: List[int] = []
        self.multimodal_inputs = None
        self.num_cached_blocks = 0
        self.user = ""

    @property
    def num_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


FMQ_PUTS: Dict[str, list] = {}


class _FmqQueue:
    def __init__(self, name):
        self.name = name

    async def put(self, item):
        FMQ_PUTS.setdefault(self.name, []).append(item)


class FMQ:
    def queue(self, name, role):
        assert role == "producer"
        return _FmqQueue(name)


def _hash_function(utils_py: Path):
    """get_hash_str from FastDeploy's utils.py, by its source (the module imports paddle)."""
    tree = ast.parse(utils_py.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_hash_str")
    ns: dict = {}
    exec("import hashlib, pickle\nfrom typing import Any, List, Optional\n" + ast.unparse(fn), ns)
    return ns["get_hash_str"]


_LOADED: Dict[str, types.ModuleType] = {}


class AttentionBackend:
    def __init__(self, config, kv_num_heads, num_heads, head_dim, encoder_block_shape_q, decoder_block_shape_q):
        self.shape_args = (kv_num_heads, config.cache_config.block_size, head_dim)

    def get_kv_cache_shape(self, max_num_blocks, kv_cache_quant_type=None):
        heads, block_size, head_dim = self.shape_args
        shape = [max_num_blocks, heads, block_size, head_dim]
        return shape, list(shape)


def load(work: Path) -> types.ModuleType:
    """Imports FastDeploy's prefix_cache_manager with the launch diff applied (once per process)."""
    if "pcm" in _LOADED:
        return _LOADED["pcm"]
    src = fastdeploy_source()
    assert src is not None, skip_reason()
    copy = work / "fastdeploy_src"
    shutil.copytree(src / "fastdeploy", copy / "fastdeploy")
    out = subprocess.run(["patch", "-p1", "--forward", "-i", str(DIFF)], cwd=copy, capture_output=True, text=True)
    assert out.returncode == 0, f"the diff of docs/engines/fastdeploy.md does not apply to {src}:\n{out.stdout}{out.stderr}"

    get_hash_str = _hash_function(src / "fastdeploy" / "utils.py")
    logger = logging.getLogger("fastdeploy")
    _module("fastdeploy.utils", get_logger=lambda name, *a, **k: logging.getLogger(f"fastdeploy.{name}"),
            llm_logger=logger, console_logger=logger, get_hash_str=get_hash_str)
    _module("fastdeploy.config", FDConfig=object)
    _module("fastdeploy.engine.request", Request=Request, ControlRequest=ControlRequest, ControlResponse=ControlResponse)
    _module("fastdeploy.cache_manager.ops", get_all_visible_devices=lambda: "CUDA_VISIBLE_DEVICES=0,1")
    _module("fastdeploy.metrics.metrics", main_process_metrics=_Metrics())
    _module("fastdeploy.trace.trace_logger", print=lambda *a, **k: None)
    _module("fastdeploy.inter_communicator.engine_worker_queue", EngineWorkerQueue=object)
    _module("fastdeploy.inter_communicator.zmq_client", ZmqIpcClient=object)
    _module("fastdeploy.inter_communicator.zmq_server", ZmqIpcServer=object, ZmqTcpServer=object)
    _module("fastdeploy.inter_communicator.fmq", FMQ=FMQ)
    _module("fastdeploy.model_executor.layers.attention", get_attention_backend=lambda: AttentionBackend)
    sys.path.insert(0, str(copy))
    import fastdeploy.cache_manager.prefix_cache_manager as pcm  # noqa: E402

    _LOADED["pcm"] = pcm
    return pcm


@dataclasses.dataclass
class Geometry:
    tp: int = 2
    layers: int = 2
    blocks: int = 24
    kv_heads: int = 2
    block_size: int = 4
    head_dim: int = 8
    cpu_blocks: int = 16
    dtype: str = "bfloat16"

    @property
    def block_bytes(self) -> int:
        return self.kv_heads * self.block_size * self.head_dim * 2


def fd_config(g: Geometry, *, storage: Optional[str], cache_queue_port: int, model_path: str):
    """The FDConfig fields prefix_cache_manager.py reads, with FastDeploy's meanings."""
    ns = types.SimpleNamespace
    model_cfg = ns(num_hidden_layers=g.layers)
    cache = ns(total_block_num=g.blocks, prefill_kvcache_block_num=g.blocks, num_cpu_blocks=g.cpu_blocks,
               kvcache_storage_backend=storage, write_policy="write_through", bytes_per_token_per_layer=1024,
               model_cfg=model_cfg, cache_dtype=g.dtype, local_cache_queue_port=cache_queue_port,
               cache_transfer_protocol="ipc", local_rdma_comm_ports=None, enable_prefix_caching=True,
               block_size=g.block_size, enable_output_caching=False)
    spec = ns(num_extra_cache_layer=0, num_gpu_block_expand_ratio=1, to_json_string=lambda: "{}")
    return ns(cache_config=cache, speculative_config=spec, parallel_config=ns(tensor_parallel_size=g.tp),
              model_config=ns(num_attention_heads=g.kv_heads * g.tp, num_key_value_heads=g.kv_heads * g.tp,
                              head_dim=g.head_dim, dtype="bfloat16", max_model_len=4096, model=model_path),
              quant_config=None)


class WorkerStandIn:
    """FastDeploy's GPU worker on kvtd's host backend (see the module docstring)."""

    def __init__(self, g: Geometry, device_ids: List[int], port):
        self.g, self.device_ids, self.port = g, device_ids, port
        self.tag = uuid.uuid4().hex[:8]
        self.arrays: Dict[tuple, np.ndarray] = {}
        self.names: List[str] = []
        self._maps = []

    def publish(self, rank: int) -> None:
        g = self.g
        nbytes = g.blocks * g.block_bytes
        for layer in range(g.layers):
            for kind in ("key", "value"):
                obj = f"kvtdfdw_{self.tag}_{kind}{layer}_r{rank}"
                fd = os.open(f"/dev/shm/{obj}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, nbytes)
                os.close(fd)
                arr = np.memmap(f"/dev/shm/{obj}", dtype=np.uint8, mode="r+", shape=(g.blocks, g.block_bytes))
                self.arrays[(rank, layer, kind)] = arr
                self.names.append(obj)
                name = fds.tensor_name(kind, layer, rank, self.device_ids[rank])
                fds.publish_tensor_name(name, obj.encode())
                self.names.append(name)
        ready = fds.Signal("cache_ready_signal", self.port, g.tp)
        ready.value[rank] = 1

    def attach(self, rank: int, timeout: float = 30.0) -> None:
        """FastDeploy's worker when the transfer manager makes the cache (--create_cache_tensor,
        FastDeploy with a storage backend): wait for cache_ready_signal[rank] == 1, then map every
        tensor by name (share_external_data: the handle at offset 0)."""
        import time

        g = self.g
        ready = fds.Signal("cache_ready_signal", self.port, g.tp)
        end = time.monotonic() + timeout
        while ready.value[rank] != 1:
            assert time.monotonic() < end, f"the daemons made no cache for rank {rank} within {timeout} s"
            time.sleep(0.01)
        for layer in range(g.layers):
            for kind in ("key", "value"):
                name = fds.tensor_name(kind, layer, rank, self.device_ids[rank])
                # The host backend's handle is an object name.
                obj = fds.read_tensor_name(name).split(b"\0", 1)[0].decode()
                arr = np.memmap(f"/dev/shm/{obj}", dtype=np.uint8, mode="r+", shape=(g.blocks, g.block_bytes))
                self.arrays[(rank, layer, kind)] = arr

    def release(self, rank: int) -> None:
        """FastDeploy's worker before a weight update, on a cache it did not make: drop its
        mappings (unset_data_ipc, close only) and say so with cache_ready_signal[rank] = 0."""
        for key in [k for k in self.arrays if k[0] == rank]:
            del self.arrays[key]
        fds.Signal("cache_ready_signal", self.port, self.g.tp).value[rank] = 0

    def fill(self, block_ids, seed: int) -> None:
        """The model's forward pass writing KV into these blocks on every rank."""
        rng = np.random.default_rng(seed)
        for arr in self.arrays.values():
            for b in block_ids:
                arr[b] = rng.integers(0, 256, self.g.block_bytes, dtype=np.uint8)

    def blocks(self, block_ids) -> Dict[tuple, bytes]:
        return {k: b"".join(bytes(arr[b]) for b in block_ids) for k, arr in self.arrays.items()}

    def unpublish(self) -> None:
        for n in self.names:
            try:
                os.unlink(f"/dev/shm/{n}")
            except FileNotFoundError:
                pass
        self.arrays.clear()
        self.names.clear()
