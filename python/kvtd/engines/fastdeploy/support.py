"""FastDeploy's facts the adapter (fastdeploy.py) works from: the RL key prefix of a model
directory and the weight version kvtd derives from it, the kvtd geometry of FastDeploy's cache,
and the CTRL answer FastDeploy's engine waits for."""

from __future__ import annotations

import os

from ...geometry import KvIdentity
from ...session import Geometry


def key_prefix_of(model_path: str) -> str:
    """FastDeploy's RL key prefix of a model directory (cache_transfer_manager.py
    get_key_prefix_from_version): version.yaml's `version` cut to its first two dash-separated
    parts; "" without the file. The daemon reads it the same way (config::fastdeploy_key_prefix)."""
    path = os.path.join(model_path, "version.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return ""
    for line in lines:
        if line.startswith("version:"):
            v = line[len("version:"):].strip()
            if len(v) >= 2 and v[0] in "'\"" and v[-1] == v[0]:
                v = v[1:-1]
            return "-".join(v.split("-", 2)[:2])
    raise ValueError(f"{path} has no 'version: <RL-STEP..>' line")


def weight_version_of(prefix: str) -> int:
    """A weight version every instance derives alike from the same prefix (FNV-1a, 64 bits), so
    instances that share a store share keys; 0 for no prefix."""
    if not prefix:
        return 0
    h = 0xCBF29CE484222325
    for b in prefix.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def geometry_from_fastdeploy(cache_config, tensor_parallel_size, key_cache_shape, val_cache_shape,
                             speculative_config=None, default_dtype: str = "bfloat16") -> Geometry:
    """The kvtd geometry of FastDeploy's cache, as its launch flags describe it (the daemons
    derive theirs from the same flags: config/src/daemon_config.cpp)."""
    key = [int(v) for v in key_cache_shape]
    val = [int(v) for v in val_cache_shape] if val_cache_shape else None
    if len(key) == 3:
        key = key + [1]
    if val is not None and len(val) == 3:
        val = val + [1]
    extra_layers, extra_blocks = 0, 0
    if speculative_config is not None:
        extra_layers = int(getattr(speculative_config, "num_extra_cache_layer", 0) or 0)
        ratio = float(getattr(speculative_config, "num_gpu_block_expand_ratio", 1) or 1)
        extra_blocks = int(key[0] * ratio) if extra_layers else 0
    layers = int(cache_config.model_cfg.num_hidden_layers)
    return Geometry(num_ranks=int(tensor_parallel_size), num_layers=layers + extra_layers, key_shape=key,
                    value_shape=val, num_host_blocks=int(cache_config.num_cpu_blocks),
                    dtype=str(cache_config.cache_dtype), scale_bytes=4 if str(default_dtype) == "float32" else 2,
                    num_extra_layers=extra_layers, extra_device_blocks=extra_blocks,
                    # FastDeploy's own reading, declared: no value cache is an MLA latent (its
                    # GPU worker makes no value cache then; see docs/engines/fastdeploy.md,
                    # 'Upstream behaviour relied on'), as its launch line tells the daemons.
                    identity=KvIdentity(layout="per_rank" if val is not None else "replicated"))


class FmqControlResponder:
    """Answers a CTRL task the way FastDeploy's engine waits for it: one ControlResponse per rank
    on FMQ queue ctrl_c2e_rank<tp_rank + tp_size * dp>_<cache_queue_port>
    (cache_transfer_manager.py _init_control and control_task; engine/common_engine.py
    _wait_for_control_responses). FastDeploy's FMQ and ControlResponse are imported when first
    needed: they exist wherever FastDeploy's engine runs."""

    def __init__(self, cache_queue_port, tp_size: int, dp_rank: int = 0):
        self.port, self.tp_size, self.dp_rank = cache_queue_port, tp_size, dp_rank
        self._queues = {}

    def __call__(self, rank: int, request, code: int, message: str) -> None:
        import asyncio

        from fastdeploy.engine.request import ControlResponse
        from fastdeploy.inter_communicator.fmq import FMQ

        name = f"ctrl_c2e_rank{rank + self.tp_size * self.dp_rank}_{self.port}"
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = FMQ().queue(name, "producer")
        asyncio.run(q.put(ControlResponse(request.request_id, code, message)))
