"""vLLM's own source for tests: main 017e9f44 in $KVTD_VLLM_SRC, else ../shared/reference/vllm beside
the checkout, else /work/shared/reference/vllm (see its PROVENANCE: what imports on Debian's torch
1.13 and with which stand-ins).

Stand-ins, only for what cannot load here (PROVENANCE, "Import check"): vllm.logger (init_logger,
whose logger has warning_once/info_once), vllm.utils.math_utils (round_up, round_down, cdiv), and
modules the offloading code imports only for type names or engine plumbing it does not run here
(vllm.config, vllm.platforms, vllm.forward_context, vllm.v1.request, ...): those hand out an empty
class for any name they are asked for, except the few the offloading scheduler calls, which do
what the engine's own do for a full-attention model (_engine_stand_ins, each cited). No logic of
the vendored offloading code is replaced.
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from pathlib import Path
from typing import Optional

import vllm_kv_cache_specs
from reference_source import reference_source, stand_in_module


def vllm_source() -> Optional[Path]:
    return reference_source("KVTD_VLLM_SRC", "vllm", "vllm/v1/kv_offload/base.py")


def skip_reason() -> str:
    return ("vLLM's source is not here: set KVTD_VLLM_SRC to a checkout of vLLM main 017e9f44, or place it at "
            "../shared/reference/vllm beside this checkout")


class _Logger(logging.LoggerAdapter):
    def warning_once(self, msg, *args, **kw):
        self.warning(msg, *args, **kw)

    def info_once(self, msg, *args, **kw):
        self.info(msg, *args, **kw)

    def debug_once(self, msg, *args, **kw):
        self.debug(msg, *args, **kw)


def _names_module(name: str) -> types.ModuleType:
    """A module that hands out an empty class for every name imported from it (for type
    annotations and isinstance checks of engine parts these tests do not run)."""
    m = stand_in_module(name)
    made = {}

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in made:
            made[attr] = type(attr, (), {"__module__": name})
        return made[attr]

    m.__getattr__ = __getattr__
    m.__path__ = []  # importable as a package too
    return m


_TYPE_ONLY_MODULES = [
    "vllm.config", "vllm.config.kv_events", "vllm.platforms", "vllm.forward_context", "vllm.v1.request",
    "vllm.v1.outputs", "vllm.v1.kv_cache_interface", "vllm.v1.core", "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_manager", "vllm.v1.core.sched", "vllm.v1.core.sched.output", "vllm.v1.attention",
    "vllm.v1.attention.backend", "vllm.triton_utils", "vllm.utils.torch_utils",
    "vllm.distributed.device_communicators", "vllm.distributed.device_communicators.shm_broadcast",
    "vllm.distributed.kv_transfer.kv_connector.utils", "vllm.config.kv_transfer", "vllm.utils.func_utils",
    "vllm.distributed.kv_transfer.kv_connector.base",
    "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector",
]


class _Struct:
    """msgspec.Struct's stand-in (msgspec is not in Debian 12): accepts the class keywords vLLM's
    event structs use (array_like=, omit_defaults=, gc=, tag=), and builds an instance from its
    fields by keyword, defaults filled in from the class (what msgspec does; no encoding)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__()

    def __init__(self, **fields):
        names = [n for c in reversed(type(self).__mro__) for n in getattr(c, "__annotations__", {})]
        for n in names:
            if n in fields:
                setattr(self, n, fields.pop(n))
            elif not hasattr(self, n):
                raise TypeError(f"{type(self).__name__} needs {n}")
        if fields:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(fields)}")


class RequestStatus(enum.Enum):
    """vllm.v1.request.RequestStatus's members the offloading scheduler compares with (its
    is_finished() is the Request stand-in's; vllm/v1/request.py is not vendored)."""
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


def yield_req_data(scheduler_output):
    """kv_connector/utils.py's yield_req_data (not vendored): (req_id, new block id groups,
    preempted) for the step's new requests, then its cached ones."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.block_ids, False
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, blocks in zip(cached.req_ids, cached.new_block_ids):
        yield req_id, blocks, req_id in cached.resumed_req_ids


class _SpecKind(enum.Enum):
    FULL_ATTENTION = "full_attention"


def _engine_stand_ins():
    """Names the offloading scheduler imports from engine modules that are not vendored, each
    doing what the engine's does for a full-attention model: the request status, the scheduler
    output's walk, the KV-event spec kind (v1/kv_cache_interface.py) and block hashes as bytes
    (v1/core/kv_cache_utils.py: BlockHash is bytes; events carry it unconverted by default)."""
    sys.modules["vllm.v1.request"].RequestStatus = RequestStatus
    sys.modules["vllm.distributed.kv_transfer.kv_connector.utils"].yield_req_data = yield_req_data
    kci = sys.modules["vllm.v1.kv_cache_interface"]
    vllm_kv_cache_specs.install(kci)  # the specs and KVCacheConfig vLLM's worker registration reads
    kci.get_kv_cache_spec_kind = lambda spec: _SpecKind.FULL_ATTENTION
    kci.get_kv_cache_spec_sliding_window = lambda spec: None
    kcu = sys.modules["vllm.v1.core.kv_cache_utils"]
    kcu.BlockHash = bytes
    kcu.maybe_convert_block_hash = lambda h: h


def _stand_ins():
    if "vllm.logger" in sys.modules:
        return
    if "msgspec" not in sys.modules:
        stand_in_module("msgspec", Struct=_Struct, field=lambda *a, **k: None)
    stand_in_module("vllm.logger", init_logger=lambda name: _Logger(logging.getLogger(name), {}))
    stand_in_module("vllm.utils")
    sys.modules["vllm.utils"].__path__ = []
    stand_in_module("vllm.utils.math_utils", round_up=lambda x, m: (x + m - 1) // m * m,
                    round_down=lambda x, m: x // m * m, cdiv=lambda a, b: -(-a // b))
    for name in _TYPE_ONLY_MODULES:
        if name not in sys.modules:
            _names_module(name)
    _engine_stand_ins()


def import_vllm():
    """Puts vLLM's tree first on sys.path with the stand-ins in place; returns its path."""
    src = vllm_source()
    if src is None:
        raise RuntimeError(skip_reason())
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    _stand_ins()
    return src
