"""A drop-in for the engine side of FastDeploy's cache transfer manager.

FastDeploy's engine (PrefixCacheManager) talks to its per-rank cache transfer processes through
an EngineCacheQueue and two per-rank IPC signals:

  cache_task_queue.put_transfer_task((event_type, transfer_task_id, swap_node_ids,
                                      gpu_block_ids, cpu_block_ids))       # SWAP2CPU / SWAP2GPU
  cache_task_queue.put_transfer_task((event_type, read_or_write_storage_task))  # STORAGE2GPU / GPU2STORAGE
  cache_task_queue.get_transfer_done_signal()   -> results, in the tuples the manager sends back:
      swaps:   (event_type, transfer_task_id, swap_node_ids, gpu_block_ids, cpu_block_ids)
      storage: (event_type, task_id, keys, gpu_block_ids that now hold the KV)
  cache_ready_signal.value[rank] == 1          once the rank mapped the engine's cache
  swap_space_ready_signal.value[rank] == 1     once the rank's host (swap) space exists

KvtdCacheQueue has these call shapes and carries them out with kvtd tasks, so an engine switches
by replacing its queue and signal objects with `q`, `q.cache_ready_signal` and
`q.swap_space_ready_signal`. Event types are matched by name (`event_type.name`, or the string),
so FastDeploy's own CacheStatus enum works unchanged; CacheStatus below mirrors its names.

Failures. FastDeploy's tuples carry no status, and a swap reported done is trusted. So:
  * a failed SWAP2CPU/SWAP2GPU is never reported as done: get_transfer_done_signal() raises
    SwapFailed (carrying the FastDeploy tuple and the kvtd result) for it, once the results that
    completed with it were returned; the blocks it named must not be used
    (on_swap_failure="record" instead keeps it in `failures` and leaves the tuple out);
  * a failed or partial STORAGE2GPU reports the gpu blocks that were really loaded (a prefix;
    none on failure), which is what FastDeploy already does on a storage error;
  * a failed GPU2STORAGE is reported done (nothing the engine reads changed) and kept in
    `failures`.

Weight updates (RL). FastDeploy's trainer flips `kv_cache_status_signal.value[0]`: CLEARING (the
manager frees the caches and answers CLEARED), then UPDATING (it re-creates them and answers
NORMAL). check_cache_status() is one step of that loop done by kvtd: CLEARING -> clear_caches()
(every rank finished its tasks and closed its mappings) -> CLEARED; the engine then frees its
tensors, loads the new weights, registers the new tensors, sets UPDATING -> restore_caches() ->
NORMAL. Statuses are matched by name, so FastDeploy's KVCacheStatus works unchanged.

Thread-safety: put_transfer_task and get_transfer_done_signal may be called from different
threads (FastDeploy uses one thread for each).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from typing import Any, List, Optional, Sequence

from .errors import KvtdError
from .session import Session, TaskResult, now_ns


class CacheStatus(enum.Enum):
    """FastDeploy's transfer event types (only the names matter to this adapter)."""

    SWAP2CPU = "SWAP2CPU"
    SWAP2GPU = "SWAP2GPU"
    STORAGE2GPU = "STORAGE2GPU"
    GPU2STORAGE = "GPU2STORAGE"


class KVCacheStatus(enum.Enum):
    """FastDeploy's kv_cache_status values (only the names matter to this adapter)."""

    NORMAL = "NORMAL"
    CLEARING = "CLEARING"
    CLEARED = "CLEARED"
    UPDATING = "UPDATING"


class StatusSignal:
    """Looks like FastDeploy's kv_cache_status IPCSignal: `.value[0]` is the status."""

    def __init__(self, initial):
        self.value = [initial]


@dataclasses.dataclass
class ReadStorageTask:
    """FastDeploy's ReadStorageTask fields this adapter uses (its own objects work too)."""

    task_id: Any
    keys: Sequence[str]
    gpu_block_ids: Sequence[int]
    token_ids: Optional[Sequence[int]] = None
    start_read_block_idx: int = 0
    timeout: float = 30.0


@dataclasses.dataclass
class WriteStorageTask:
    task_id: Any
    keys: Sequence[str]
    gpu_block_ids: Sequence[int]
    token_ids: Optional[Sequence[int]] = None
    start_write_block_idx: int = 0
    timeout: float = 30.0


class SwapFailed(KvtdError):
    """A swap failed: `fd_task` is the FastDeploy tuple, `result` the kvtd TaskResult. Its
    destination blocks hold no valid KV."""

    def __init__(self, fd_task: tuple, result: TaskResult):
        super().__init__(f"{_name(fd_task[0])} {fd_task[1]} failed: {result.status_name} ({result.message})")
        self.fd_task = fd_task
        self.result = result


class ReadySignal:
    """Looks like FastDeploy's IPCSignal: `.value[rank]` is 1 while that rank is ready."""

    def __init__(self, session: Session, bit: int):
        self._session = session
        self._bit = bit

    @property
    def value(self):
        import numpy as np

        g = self._session.geometry
        return np.array([1 if self._session.rank_ready(r) & self._bit else 0 for r in range(g.num_ranks)],
                        dtype=np.int32)


def _name(event_type) -> str:
    return getattr(event_type, "name", None) or str(event_type)


@dataclasses.dataclass
class _Pending:
    kvtd_id: int
    kind: str
    fd_task: tuple


class KvtdCacheQueue:
    """The engine's cache task queue and ready signals, backed by a kvtd Session (published,
    daemons started by the caller, systemd or kvtd.testing.Daemons)."""

    def __init__(self, session: Session, *, on_swap_failure: str = "raise"):
        if on_swap_failure not in ("raise", "record"):
            raise ValueError("on_swap_failure must be 'raise' or 'record'")
        self.session = session
        self.on_swap_failure = on_swap_failure
        self.cache_ready_signal = ReadySignal(session, 1)
        self.swap_space_ready_signal = ReadySignal(session, 2)
        self.kv_cache_status_signal = StatusSignal(KVCacheStatus.NORMAL)
        self.failures: List[tuple] = []  # (fd_task, TaskResult) of tasks that failed
        self._pending: List[_Pending] = []  # put, not yet reported, in put order
        self._ready: List[tuple] = []       # completed, not yet handed out
        self._failed: List[SwapFailed] = []  # failed swaps to raise once _ready was handed out
        self._lock = threading.Lock()

    # -- weight updates ---------------------------------------------------------------------
    def check_cache_status(self, *, drop_host_tier: bool = False, weight_version: Optional[int] = None,
                           statuses=KVCacheStatus, timeout: float = 60.0):
        """One step of FastDeploy's clear/restore loop: CLEARING -> clear_caches() -> CLEARED,
        UPDATING -> restore_caches() -> NORMAL; other statuses are left alone. `statuses` is the
        enum to write back (FastDeploy's KVCacheStatus). drop_host_tier mirrors
        FD_ENABLE_SWAP_SPACE_CLEARING; weight_version is set once every rank released. A failure
        raises (CacheControlFailed naming the rank) and leaves the status unchanged. Returns the
        status after the step."""
        sig = self.kv_cache_status_signal
        name = _name(sig.value[0])
        if name == "CLEARING":
            self.session.clear_caches(drop_host_tier=drop_host_tier, weight_version=weight_version, timeout=timeout)
            sig.value[0] = statuses["CLEARED"] if isinstance(statuses, enum.EnumMeta) else statuses.CLEARED
        elif name == "UPDATING":
            self.session.restore_caches(timeout=timeout)
            sig.value[0] = statuses["NORMAL"] if isinstance(statuses, enum.EnumMeta) else statuses.NORMAL
        return sig.value[0]

    # -- engine -> transfer manager ---------------------------------------------------------
    def put_transfer_task(self, data) -> None:
        event_type = data[0]
        name = _name(event_type)
        s = self.session
        if name in ("SWAP2CPU", "SWAP2GPU"):
            if len(data) != 5:
                raise ValueError(f"{name} task must be (event_type, transfer_task_id, swap_node_ids, "
                                 f"gpu_block_ids, cpu_block_ids); got {len(data)} fields")
            _, transfer_id, swap_node_ids, gpu_ids, cpu_ids = data
            if len(gpu_ids) != len(cpu_ids):
                raise ValueError(f"{name} {transfer_id}: {len(gpu_ids)} gpu block ids for {len(cpu_ids)} cpu block ids")
            if name == "SWAP2CPU":
                tid = s.swap_to_host(gpu_ids, cpu_ids)
            else:
                tid = s.swap_to_device(cpu_ids, gpu_ids)
            pending = _Pending(tid, name, tuple(data))
        elif name in ("STORAGE2GPU", "GPU2STORAGE"):
            task = data[1]
            keys = [str(k) for k in task.keys]
            gpu_ids = list(task.gpu_block_ids)[: len(keys)]
            deadline = now_ns() + int(float(getattr(task, "timeout", 30.0) or 30.0) * 1e9)
            if name == "STORAGE2GPU":
                tid = s.storage_read(keys, gpu_ids, deadline_ns=deadline)
            else:
                tid = s.storage_write(keys, gpu_ids, deadline_ns=deadline)
            pending = _Pending(tid, name, (event_type, task.task_id, list(task.keys), gpu_ids))
        else:
            raise ValueError(f"unknown transfer event type {name!r}: expected SWAP2CPU, SWAP2GPU, STORAGE2GPU, "
                             "GPU2STORAGE")
        with self._lock:
            self._pending.append(pending)

    def empty(self) -> bool:
        """True when every task put was reported."""
        with self._lock:
            return not (self._pending or self._ready or self._failed)

    # -- transfer manager -> engine ---------------------------------------------------------
    def get_transfer_done_signal(self, timeout: float = 0.0) -> List[tuple]:
        """The FastDeploy result tuples of tasks that completed (in put order among those found
        done together); waits up to `timeout` seconds for at least one. A failed swap raises
        SwapFailed once the results that completed with it were returned."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                self._collect_locked()
                if self._ready:
                    out, self._ready = self._ready, []
                    return out
                if self._failed:
                    raise self._failed.pop(0)
            if time.monotonic() >= end:
                return []
            time.sleep(0.0005)

    def _collect_locked(self) -> None:
        # Every completed task, whatever its place: a long storage write never delays a load's
        # report. A failed swap is queued and raised once what completed with it was handed out.
        keep = []
        for p in self._pending:
            r = self.session.poll(p.kvtd_id, check=False)
            if r is None:
                keep.append(p)
                continue
            done = self._result_tuple(p, r)
            if done is SwapFailed:
                self.failures.append((p.fd_task, r))
                if self.on_swap_failure == "raise":
                    self._failed.append(SwapFailed(p.fd_task, r))
                continue
            self._ready.append(done)
        self._pending = keep

    def _result_tuple(self, p: _Pending, r: TaskResult):
        if p.kind in ("SWAP2CPU", "SWAP2GPU"):
            return p.fd_task if r.ok else SwapFailed
        event_type, task_id, keys, gpu_ids = p.fd_task
        if p.kind == "STORAGE2GPU":
            loaded = gpu_ids[: r.blocks_done] if r.ok else []
            if not r.ok:
                self.failures.append((p.fd_task, r))
            return (event_type, task_id, keys, loaded)
        if not r.ok:
            self.failures.append((p.fd_task, r))
        return (event_type, task_id, keys, gpu_ids)

    def wait_all(self, timeout: float = 60.0) -> List[tuple]:
        """Every remaining result (a test and shutdown helper)."""
        out = []
        end = time.monotonic() + timeout
        while not self.empty():
            if time.monotonic() >= end:
                raise TimeoutError(f"{len(self._pending)} transfer tasks still pending after {timeout} s")
            out += self.get_transfer_done_signal(timeout=0.05)
        return out
