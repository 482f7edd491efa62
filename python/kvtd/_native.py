"""ctypes bindings of libkvtd_client.so (client/include/kvtd/kvtd_client.h).

The library is found, in this order, at:
  1. $KVTD_CLIENT_LIBRARY (a path to the .so),
  2. the lib directory of the prefix this package was installed into,
  3. an in-tree build: <repo>/build/client (so `PYTHONPATH=python` works from a checkout),
  4. the dynamic loader's search path (ldconfig, LD_LIBRARY_PATH).

ctypes.CDLL releases the GIL for the duration of every foreign call, so a thread blocked in
kvtd_wait / kvtd_wait_layer never stops the engine's other Python threads.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

ABI_VERSION = 1
SONAME = f"libkvtd_client.so.{ABI_VERSION}"

# Error codes (KVTD_E_*).
OK = 0
E_INVALID = 1
E_TIMEOUT = 2
E_RING_FULL = 3
E_NOT_READY = 4
E_UNKNOWN_TASK = 5
E_IN_USE = 6
E_SYSTEM = 7
E_TASK_FAILED = 8
E_PENDING = 9
E_NO_EVENT = 10
E_CACHE_CLEARED = 11
E_CLOSED = 12
E_WRONG_PROCESS = 13

CLEAR_DROP_HOST_TIER = 1 << 0
CLEAR_SET_WEIGHT_VERSION = 1 << 1

# kvtd_task.flags
STORAGE_HOST_BLOCKS = 1 << 0
STORAGE_EVICT_BACKUP = 1 << 1
TASK_LAYERWISE = 1 << 2

READY_CACHE = 1 << 0
READY_HOST_POOL = 1 << 1
READY_HOST_TIER_TAKEN_OVER = 1 << 2

LAYER_DONE = 0
LAYER_ENQUEUED = 1

HANDLE_BYTES = 64


class Geometry(ctypes.Structure):
    _fields_ = [
        ("num_ranks", ctypes.c_uint32),
        ("num_layers", ctypes.c_uint32),
        ("dtype", ctypes.c_uint32),
        ("num_host_blocks", ctypes.c_uint32),
        ("key_shape", ctypes.c_int64 * 4),
        ("value_shape", ctypes.c_int64 * 4),
        ("scale_bytes", ctypes.c_uint32),
        ("num_extra_layers", ctypes.c_uint32),
        ("extra_device_blocks", ctypes.c_int64),
    ]


class GroupTensor(ctypes.Structure):
    _fields_ = [("element_bytes", ctypes.c_uint32), ("ndim", ctypes.c_uint32), ("dims", ctypes.c_int64 * 3)]


class CacheGroup(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("num_tensors", ctypes.c_uint32),
        ("block_tokens", ctypes.c_uint32),
        ("window_tokens", ctypes.c_uint32),
        ("device_blocks", ctypes.c_int64),
        ("host_blocks", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("layers", ctypes.c_uint64 * 8),
        ("tensors", GroupTensor * 4),
    ]


MAX_GROUPS = 8


class CacheGroups(ctypes.Structure):
    _fields_ = [
        ("num_ranks", ctypes.c_uint32),
        ("num_groups", ctypes.c_uint32),
        ("page_tokens", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("groups", CacheGroup * MAX_GROUPS),
    ]


class KvIdentity(ctypes.Structure):
    _fields_ = [("layout", ctypes.c_uint32), ("dtype", ctypes.c_char * 16), ("pp_rank", ctypes.c_uint16),
                ("pp_size", ctypes.c_uint16), ("cp_rank", ctypes.c_uint16), ("cp_size", ctypes.c_uint16)]


class SessionOptions(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint32), ("only_rank", ctypes.c_uint32), ("kv_identity", KvIdentity)]


class ForecastWaits(ctypes.Structure):
    _fields_ = [("waits", ctypes.c_uint64), ("before_window", ctypes.c_uint64), ("in_window", ctypes.c_uint64),
                ("after_window", ctypes.c_uint64)]


SESSION_ADOPT_HOST_TIER = 1 << 0
SESSION_ONLY_RANK = 1 << 1
SESSION_NO_COMPLETION_FORECAST = 1 << 2
SESSION_KV_IDENTITY = 1 << 3


class Completion(ctypes.Structure):
    _fields_ = [
        ("task_id", ctypes.c_uint64),
        ("status", ctypes.c_int32),
        ("failed_rank", ctypes.c_int32),
        ("blocks_done", ctypes.c_uint64),
        ("latency_ns", ctypes.c_int64),
        ("blocks_skipped", ctypes.c_uint64),
    ]


class Task(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
        ("src", ctypes.POINTER(ctypes.c_int32)),
        ("dst", ctypes.POINTER(ctypes.c_int32)),
        ("n", ctypes.c_size_t),
        ("keys", ctypes.POINTER(ctypes.c_char_p)),
        ("blocks", ctypes.POINTER(ctypes.c_int32)),
        ("num_keys", ctypes.c_size_t),
        ("min_hits", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("cancel_task_id", ctypes.c_uint64),
        ("after_task_id", ctypes.c_uint64),
        ("deadline_ns", ctypes.c_int64),
        ("submit_timeout_ms", ctypes.c_int64),
    ]


assert ctypes.sizeof(Geometry) == 96
assert ctypes.sizeof(Task) == 96
assert ctypes.sizeof(Completion) == 40


def _candidates():
    env = os.environ.get("KVTD_CLIENT_LIBRARY")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    # Installed: <prefix>/lib/python3/dist-packages/kvtd or <prefix>/lib/python3.X/site-packages/kvtd.
    for parent in here.parents:
        if parent.name == "lib":
            yield parent / SONAME
            break
    # In-tree: <repo>/python/kvtd -> <repo>/build/client.
    yield here.parent.parent / "build" / "client" / SONAME


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            return ctypes.CDLL(str(path))
    try:
        return ctypes.CDLL(SONAME)
    except OSError as e:
        tried.append(f"{SONAME} on the loader path ({e})")
    raise ImportError(
        "kvtd: cannot find the client library; build it (scripts/demo.sh or cmake --build build) "
        "or set KVTD_CLIENT_LIBRARY. Tried: " + "; ".join(tried)
    )


lib = _load()

_c = ctypes
_sess = _c.c_void_p
_err = (_c.c_char_p, _c.c_size_t)


def _sig(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


_sig("kvtd_client_abi", _c.c_int)
_sig("kvtd_status_name", _c.c_char_p, _c.c_int32)
_sig("kvtd_error_name", _c.c_char_p, _c.c_int)
_sig("kvtd_now_ns", _c.c_int64)
_sig("kvtd_version", _c.c_char_p)
_sig("kvtd_geometry_check", _c.c_int, _c.POINTER(Geometry), *_err)
_sig("kvtd_tensor_shape", _c.c_int, _c.POINTER(Geometry), _c.c_uint32, _c.c_uint32, _c.POINTER(_c.c_int64),
     _c.POINTER(_c.c_uint32), _c.POINTER(_c.c_uint64), _c.POINTER(_c.c_uint64), *_err)
_sig("kvtd_groups_check", _c.c_int, _c.POINTER(CacheGroups), *_err)
_sig("kvtd_groups_of_geometry", _c.c_int, _c.POINTER(Geometry), _c.c_int, _c.POINTER(CacheGroups), *_err)
_sig("kvtd_group_sizes", _c.c_int, _c.POINTER(CacheGroups), _c.POINTER(_c.c_uint64), _c.POINTER(_c.c_uint64), *_err)
_sig("kvtd_group_hits", _c.c_int, _c.POINTER(CacheGroups), _c.c_uint32, _c.POINTER(_c.c_uint8),
     _c.POINTER(_c.c_uint32), _c.POINTER(_c.c_uint32), *_err)
_sig("kvtd_group_spec", _c.c_int, _c.POINTER(CacheGroups), _c.c_uint32, _c.c_char_p, _c.c_size_t, *_err)
_sig("kvtd_session_create", _c.c_int, _c.c_char_p, _c.POINTER(Geometry), _c.POINTER(_sess), *_err)
_sig("kvtd_session_create_groups", _c.c_int, _c.c_char_p, _c.POINTER(CacheGroups), _c.POINTER(_sess), *_err)
_sig("kvtd_session_create_groups_with", _c.c_int, _c.c_char_p, _c.POINTER(CacheGroups), _c.POINTER(SessionOptions),
     _c.POINTER(_sess), *_err)
_sig("kvtd_session_create_adopting", _c.c_int, _c.c_char_p, _c.POINTER(Geometry), _c.POINTER(_sess), *_err)
_sig("kvtd_session_create_with", _c.c_int, _c.c_char_p, _c.POINTER(Geometry), _c.POINTER(SessionOptions),
     _c.POINTER(_sess), *_err)
_sig("kvtd_session_destroy", None, _sess)
_sig("kvtd_session_geometry", _c.c_int, _sess, _c.POINTER(Geometry))
_sig("kvtd_register_tensor", _c.c_int, _sess, _c.c_uint32, _c.c_uint32, _c.c_uint32, _c.c_int32,
     _c.POINTER(_c.c_uint8), _c.c_uint64, _c.c_uint64, *_err)
_sig("kvtd_register_tensor_on", _c.c_int, _sess, _c.c_uint32, _c.c_uint32, _c.c_uint32, _c.c_int32, _c.c_char_p,
     _c.POINTER(_c.c_uint8), _c.c_uint64, _c.c_uint64, *_err)
_sig("kvtd_create_host_device_tensors", _c.c_int, _sess, *_err)
_sig("kvtd_host_device_tensor", _c.c_void_p, _sess, _c.c_uint32, _c.c_uint32, _c.c_uint32, _c.POINTER(_c.c_uint64))
_sig("kvtd_publish", _c.c_int, _sess, *_err)
_sig("kvtd_wait_ready", _c.c_int, _sess, _c.c_int64, *_err)
_sig("kvtd_submit_task", _c.c_int, _sess, _c.POINTER(Task), _c.POINTER(_c.c_uint64), *_err)
_sig("kvtd_submit_task_after_events", _c.c_int, _sess, _c.POINTER(Task), _c.c_char_p, _c.c_size_t,
     _c.POINTER(_c.c_uint64), *_err)
_sig("kvtd_set_weight_version", _c.c_int, _sess, _c.c_uint64)
_sig("kvtd_weight_version", _c.c_uint64, _sess)
_sig("kvtd_session_name", _c.c_char_p, _sess)
_sig("kvtd_session_generation", _c.c_uint64, _sess)
_sig("kvtd_wait", _c.c_int, _sess, _c.c_uint64, _c.c_int64, _c.POINTER(Completion), *_err)
_sig("kvtd_poll", _c.c_int, _sess, _c.c_uint64, _c.POINTER(Completion), *_err)
_sig("kvtd_wait_layer", _c.c_int, _sess, _c.c_uint64, _c.c_uint32, _c.c_int64, _c.c_int, *_err)
_sig("kvtd_layer_event_handle", _c.c_int, _sess, _c.c_uint32, _c.c_uint32, _c.POINTER(_c.c_uint8))
_sig("kvtd_layer_event", _c.c_int, _sess, _c.c_uint32, _c.c_uint32, _c.POINTER(_c.c_uint8), _c.POINTER(_c.c_uint32))
_sig("kvtd_rank_alive", _c.c_int, _sess, _c.c_uint32)
_sig("kvtd_rank_ready", _c.c_uint32, _sess, _c.c_uint32)
_sig("kvtd_in_flight", _c.c_size_t, _sess)
_sig("kvtd_session_forecast_waits", _c.c_int, _sess, _c.POINTER(ForecastWaits), *_err)
_sig("kvtd_clear_caches", _c.c_int, _sess, _c.c_uint32, _c.c_uint64, _c.c_int64, *_err)
_sig("kvtd_restore_caches", _c.c_int, _sess, _c.c_int64, *_err)
_sig("kvtd_cache_cleared", _c.c_int, _sess)
_sig("kvtd_free_host_device_tensors", _c.c_int, _sess, *_err)

if lib.kvtd_client_abi() != ABI_VERSION:
    raise ImportError(f"kvtd: {SONAME} reports ABI {lib.kvtd_client_abi()}, this module speaks {ABI_VERSION}")


def status_name(status: int) -> str:
    return lib.kvtd_status_name(status).decode()


def error_name(code: int) -> str:
    return lib.kvtd_error_name(code).decode()
