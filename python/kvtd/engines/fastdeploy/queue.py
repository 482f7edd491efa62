"""A drop-in for FastDeploy's cache transfer processes, driven by FastDeploy's own engine code.

FastDeploy's PrefixCacheManager (fastdeploy/cache_manager/prefix_cache_manager.py, "pcm" below)
talks to its per-rank cache_transfer_manager.py processes through an EngineCacheQueue and
shared-memory IPCSignals. A deployment switches to kvtd by changing
launch_cache_manager only (docs/engines/fastdeploy.md has the diff): it builds a
KvtdCacheQueue (KvtdCacheQueue.for_fastdeploy) instead of the EngineCacheQueue client, and starts
`kvtd` with FastDeploy's own launch flags instead of the Python manager. Its worker, scheduler
and signals stay as they are: FastDeploy's worker publishes its KV tensors by name
(set_data_ipc), and the daemons open those names (daemon/process/fastdeploy_ipc.h).

The queue, with FastDeploy's semantics (inter_communicator/engine_cache_queue.py):
  put_transfer_task((SWAP2CPU|SWAP2GPU, transfer_task_id, swap_node_ids, gpu_block_ids, cpu_block_ids))
  put_transfer_task((STORAGE2GPU|GPU2STORAGE, ReadStorageTask|WriteStorageTask))
  put_transfer_task((CTRL, ControlRequest))     # pause, resume, update_weights, sleep, wakeup
  get_transfer_done_signal() -> one result tuple, or None when there is none (never a list)
  result_queue_empty(), empty(), clear_transfer_task()
Results are the tuples FastDeploy's transfer manager puts: a swap's own tuple once, after every
rank finished; a STORAGE2GPU result once per tensor-parallel rank (pcm counts
tensor_parallel_size of them and keeps the shortest: recv_data_transfer_result); one
GPU2STORAGE result.

Failures never raise into FastDeploy's threads (pcm's result thread dies on any exception). A
failed swap is logged with kvtd's status and never reported done, as FastDeploy's own manager
does (its _transfer_data raises in a worker thread and puts no result): the blocks it named hold
no valid KV. A failed STORAGE2GPU reports no blocks loaded, a failed GPU2STORAGE reports no
blocks written (pcm waits for both). Failures are kept in `failures`.

Signals (FastDeploy's IPCSignals, suffix engine_worker_queue_port; see signals.py),
written by a monitor thread from the daemons' state as FastDeploy's manager writes them:
cache_transfer_inited_signal[r] and swap_space_ready_signal[r] once rank r's daemon mapped the
cache and made its host pool; cache_task_inflight[r] (1 while serving, 0 once paused and
drained) and cache_task_is_paused[0]; cache_ready_signal[r] = 0 once rank r released the
worker's tensors for a weight update. kv_cache_status (ints: NORMAL 0, UPDATING 1, CLEARING -1,
CLEARED -2) is polled: CLEARING -> pause, clear_caches() -> CLEARED; UPDATING -> wait for the
worker's cache_ready_signal, restore_caches(), resume -> NORMAL.

Thread-safety: every method may be called from any thread (FastDeploy calls put_transfer_task
from its scheduler threads and get_transfer_done_signal from its result thread).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Sequence

from . import signals as fds
from ...errors import KvtdError
from ..rank import refused_outcome
from .support import FmqControlResponder, geometry_from_fastdeploy, key_prefix_of, weight_version_of
from ...session import Session, TaskResult, now_ns

log = logging.getLogger("kvtd.fastdeploy")

SWAPS = ("SWAP2CPU", "SWAP2GPU")
STORAGE = ("STORAGE2GPU", "GPU2STORAGE")


def session_suffix(engine_worker_queue_port) -> str:
    """The session a daemon launched with FastDeploy's flags attaches to
    (config::fastdeploy_session_suffix)."""
    return f"fastdeploy.{engine_worker_queue_port}"


def _name(event_type) -> str:
    return getattr(event_type, "name", None) or str(event_type)


@dataclasses.dataclass
class _Pending:
    kvtd_id: Optional[int]           # None: refused before it reached the daemons
    kind: str
    fd_task: tuple
    refused: Optional[TaskResult] = None


class KvtdCacheQueue:
    """FastDeploy's cache task queue over a published kvtd Session (daemons started beside it)."""

    def __init__(self, session: Session, *, signal_suffix=None, control_responder: Optional[Callable] = None,
                 drop_host_tier: Optional[bool] = None, monitor: bool = True, poll_s: float = 0.005,
                 drain_timeout: float = 60.0, creates_cache: bool = False, model_path: Optional[str] = None):
        self.session = session
        # FastDeploy's RL key prefix comes from <model_path>/version.yaml and is refreshed at its
        # sync points (a weight update, update_weights, resume); kvtd carries it as the session's
        # weight version, which makes the daemons read the same file again (their stored keys hold
        # the prefix and the version, so KV of other weights is never loaded).
        self.model_path = model_path
        # The daemons make the cache for FastDeploy's worker (--create_cache_tensor, which
        # FastDeploy passes with a storage backend), instead of opening the worker's.
        self.creates_cache = creates_cache
        self.tensor_parallel_size = session.geometry.num_ranks
        self.signal_suffix = signal_suffix
        self.control_responder = control_responder
        if drop_host_tier is None:  # FastDeploy's manager frees its swap space on clear with this set
            drop_host_tier = os.environ.get("FD_ENABLE_SWAP_SPACE_CLEARING", "0") not in ("", "0")
        self.drop_host_tier = drop_host_tier
        self.drain_timeout = drain_timeout
        self.failures: List[tuple] = []       # (fastdeploy task, TaskResult) of every failed task
        self._pending: List[_Pending] = []   # put, not yet complete, in put order
        self._results: Deque[tuple] = collections.deque()  # complete, not yet handed out
        # Threads: FastDeploy's (put, results), one per CTRL task, and the monitor. Each field's lock:
        # _lock: _pending, _results, failures.
        self._lock = threading.Lock()
        # _admit_lock: _paused is written, and a task is admitted (paused read, submitted, queued),
        # under it, so a put that read "not paused" is queued before pause() drains (a put racing a
        # pause was submitted after the drain had looked). Read alone it is a flag for the signals.
        self._admit_lock = threading.Lock()
        self._paused = False
        # _control_lock: one control action at a time (CTRL threads and the monitor's
        # kv_cache_status): _cleared and the clear/restore it guards.
        self._control_lock = threading.RLock()
        self._cleared = False
        # _signals_lock: the opened signals, by name.
        self._signals_lock = threading.Lock()
        self._signals = {}
        self._stop = threading.Event()
        self._refresh_key_prefix()
        self._monitor = None
        if monitor and signal_suffix is not None:
            self._monitor = threading.Thread(target=self._monitor_loop, name="kvtd-fastdeploy", args=(poll_s,),
                                             daemon=True)
            self._monitor.start()

    @classmethod
    def for_fastdeploy(cls, cache_config, tensor_parallel_size: int, key_cache_shape: Sequence[int],
                       val_cache_shape: Sequence[int], engine_worker_queue_port, *, speculative_config=None,
                       default_dtype: str = "bfloat16", local_data_parallel_id: int = 0,
                       engine_queue_address=None, **kw) -> "KvtdCacheQueue":
        """Creates and publishes the session the daemons launched with FastDeploy's flags attach
        to, with no tensors registered (the daemons open the worker's), and the queue over it.
        The arguments are what launch_cache_manager has at hand. With engine_queue_address (the
        EngineCacheQueue FastDeploy's engine serves), CTRL tasks the engine puts there
        (common_engine.py pause/resume/update_weights/sleep/wakeup) reach this queue too."""
        g = geometry_from_fastdeploy(cache_config, tensor_parallel_size, key_cache_shape, val_cache_shape,
                                     speculative_config, default_dtype)
        s = Session(session_suffix(engine_worker_queue_port), g)
        s.publish()
        if "control_responder" not in kw:
            kw["control_responder"] = FmqControlResponder(cache_config.local_cache_queue_port, tensor_parallel_size,
                                                          local_data_parallel_id)
        # launch_cache_manager passes --create_cache_tensor exactly when a storage backend is set.
        kw.setdefault("creates_cache", bool(getattr(cache_config, "kvcache_storage_backend", None)))
        q = cls(s, signal_suffix=engine_worker_queue_port, **kw)
        if engine_queue_address is not None:
            q.bridge_engine_queue(engine_queue_address)
        return q

    def bridge_engine_queue(self, address, authkey: bytes = b"cache_queue_service") -> None:
        """Reads the tasks FastDeploy's engine puts in its own EngineCacheQueue (served at
        `address`) as every rank's transfer manager would, and acts on them here: the engine
        sends CTRL tasks there, not through the prefix cache manager."""
        from fastdeploy.inter_communicator import EngineCacheQueue

        clients = [EngineCacheQueue(address=address, authkey=authkey, is_server=False,
                                    num_client=self.tensor_parallel_size, client_id=r, local_data_parallel_id=0)
                   for r in range(self.tensor_parallel_size)]
        t = threading.Thread(target=self._bridge_loop, args=(clients,), name="kvtd-fastdeploy-bridge", daemon=True)
        t.start()
        self._bridge = t

    def _bridge_loop(self, clients) -> None:
        while not self._stop.is_set():
            try:
                data, _ = clients[0].get_transfer_task()
                if data is None:
                    self._stop.wait(0.005)
                    continue
                # Every client reads it once, so the engine's next put_transfer_task may proceed.
                for c in clients[1:]:
                    while c.get_transfer_task()[0] is None and not self._stop.is_set():
                        time.sleep(0.001)
                self.put_transfer_task(data)
            except (EOFError, ConnectionError, BrokenPipeError) as e:
                log.warning("FastDeploy's engine queue closed: %s", e)
                return
            except Exception as e:  # a malformed task: named, the bridge keeps serving
                log.error("task from FastDeploy's engine queue refused: %s", e)

    def close(self) -> None:
        self._stop.set()
        for t in (self._monitor, getattr(self, "_bridge", None)):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=5)

    # -- engine -> transfer manager ---------------------------------------------------------
    def put_transfer_task(self, item) -> None:
        """Starts a transfer task (FastDeploy's tuples) or acts on a CTRL task. A malformed task
        raises ValueError naming the problem: that is the caller's bug, not a transfer failure."""
        name = _name(item[0])
        if name == "CTRL":
            threading.Thread(target=self._control, args=(item[1],), name="kvtd-fastdeploy-ctrl", daemon=True).start()
            return
        with self._admit_lock:
            if self._paused:
                # FastDeploy's manager skips every non-CTRL task it reads while paused (do_data_transfer).
                log.warning("transfer manager paused: %s task %s dropped, as FastDeploy's manager does", name,
                            _task_id(item))
                return
            pending = self._submit(name, item)
            with self._lock:
                self._pending.append(pending)

    def _submit(self, name: str, item) -> _Pending:
        s = self.session
        if name in SWAPS:
            if len(item) != 5:
                raise ValueError(f"{name} task must be (event_type, transfer_task_id, swap_node_ids, gpu_block_ids, "
                                 f"cpu_block_ids); got {len(item)} fields")
            _, transfer_id, _, gpu_ids, cpu_ids = item
            if len(gpu_ids) != len(cpu_ids):
                raise ValueError(f"{name} {transfer_id}: {len(gpu_ids)} gpu block ids for {len(cpu_ids)} cpu block ids")
            fd_task = tuple(item)
            run = (lambda: s.swap_to_host(gpu_ids, cpu_ids)) if name == "SWAP2CPU" else \
                (lambda: s.swap_to_device(cpu_ids, gpu_ids))
        elif name in STORAGE:
            if len(item) != 2:
                raise ValueError(f"{name} task must be (event_type, storage task); got {len(item)} fields")
            task = item[1]
            keys = [str(k) for k in task.keys]
            gpu_ids = list(task.gpu_block_ids)
            if len(gpu_ids) < len(keys):
                raise ValueError(f"{name} {task.task_id}: {len(keys)} keys for {len(gpu_ids)} gpu block ids")
            gpu_ids = gpu_ids[: len(keys)]
            deadline = now_ns() + int(float(getattr(task, "timeout", 30.0) or 30.0) * 1e9)
            fd_task = (item[0], task.task_id, task.keys, gpu_ids)
            run = (lambda: s.storage_read(keys, gpu_ids, deadline_ns=deadline)) if name == "STORAGE2GPU" else \
                (lambda: s.storage_write(keys, gpu_ids, deadline_ns=deadline))
        else:
            raise ValueError(f"unknown transfer event type {name!r}: expected SWAP2CPU, SWAP2GPU, STORAGE2GPU, "
                             "GPU2STORAGE or CTRL")
        try:
            return _Pending(run(), name, fd_task)
        except KvtdError as e:  # a rank not ready, the cache cleared, ...: a failed task, not a crash
            return _Pending(None, name, fd_task, refused=refused_outcome(e))

    # -- transfer manager -> engine ---------------------------------------------------------
    def get_transfer_done_signal(self):
        """One result tuple, or None (FastDeploy polls this; it never blocks)."""
        if self._stop.is_set():  # closed: FastDeploy's result thread keeps polling until it exits
            return None
        with self._lock:
            self._collect_locked()
            return self._results.popleft() if self._results else None

    def result_queue_empty(self) -> bool:
        """No result waiting to be handed out and no task still running (pcm.reset waits for it)."""
        if self._stop.is_set():
            return True
        with self._lock:
            self._collect_locked()
            return not self._results and not self._pending

    def empty(self) -> bool:
        """No task waiting to start: kvtd starts every task when it is put."""
        return True

    def clear_transfer_task(self) -> None:
        """FastDeploy's engine drops queued tasks (clear_data). Tasks already with the daemons
        cannot be taken back: storage tasks are cancelled, and nothing put before is reported."""
        with self._lock:
            dropped, self._pending = self._pending, []
            self._results.clear()
        for p in dropped:
            if p.kvtd_id is not None and p.kind in STORAGE:
                try:
                    self.session.cancel(p.kvtd_id)
                except KvtdError as e:
                    log.warning("cannot cancel %s %s: %s", p.kind, p.fd_task[1], e)
        if dropped:
            log.info("clear_transfer_task: %d tasks in flight will not be reported", len(dropped))

    def _collect_locked(self) -> None:
        keep = []
        for p in self._pending:
            r = p.refused or self.session.poll(p.kvtd_id, check=False)
            if r is None:
                keep.append(p)
            else:
                self._results.extend(self._result_tuples(p, r))
        self._pending = keep

    def _result_tuples(self, p: _Pending, r: TaskResult) -> List[tuple]:
        if not r.ok:
            self.failures.append((p.fd_task, r))
            log.error("%s %s failed: %s (%s)", p.kind, p.fd_task[1], r.status_name, r.message)
        if p.kind in SWAPS:
            return [p.fd_task] if r.ok else []
        event_type, task_id, keys, gpu_ids = p.fd_task
        if p.kind == "STORAGE2GPU":
            loaded = list(gpu_ids[: r.blocks_done]) if r.ok else []
            return [(event_type, task_id, keys, loaded) for _ in range(self.tensor_parallel_size)]
        return [(event_type, task_id, keys, list(gpu_ids) if r.ok else [])]

    def _in_flight(self) -> int:
        with self._lock:
            self._collect_locked()
            return len(self._pending)

    def _drain(self) -> bool:
        end = time.monotonic() + self.drain_timeout
        while self._in_flight():
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True

    # -- control (CTRL tasks and kv_cache_status) --------------------------------------------
    def _control(self, request) -> None:
        method = request.get_method() if hasattr(request, "get_method") else getattr(request, "method", None)
        handlers = {"pause": self.pause, "resume": self.resume, "update_weights": self._refresh_key_prefix,
                    "sleep": self.sleep, "wakeup": self.wakeup}
        code, message = 200, "Success"
        handler = handlers.get(method)
        if handler is None:
            code, message = 400, f"Unknown control method: {method}"
        else:
            try:
                with self._control_lock:
                    handler()
            except Exception as e:  # answered, never raised into FastDeploy
                code, message = 500, f"Failed to execute {method}: {e}"
        (log.info if code == 200 else log.error)("control %s (%s): %d %s", method,
                                                 getattr(request, "request_id", "?"), code, message)
        if self.control_responder is not None:
            for rank in range(self.tensor_parallel_size):
                self.control_responder(rank, request, code, message)

    def pause(self) -> None:
        """Stops taking transfer tasks and waits for those in flight (FastDeploy's pause)."""
        with self._admit_lock:  # a put past its check is queued by now, and the drain sees it
            self._paused = True
        if not self._drain():
            raise TimeoutError(f"{self._in_flight()} transfer tasks still in flight after {self.drain_timeout} s")

    def resume(self) -> None:
        with self._control_lock:
            self._refresh_key_prefix()
        with self._admit_lock:
            self._paused = False

    def _refresh_key_prefix(self) -> None:
        if not self.model_path:
            return
        prefix = key_prefix_of(self.model_path)
        version = weight_version_of(prefix)
        if version != self.session.weight_version:
            self.session.set_weight_version(version)
            log.info("storage key prefix %r (weight version %d) from %s/version.yaml", prefix, version, self.model_path)

    def sleep(self) -> None:
        """Offload: every rank releases the worker's tensors (FastDeploy's sleep)."""
        with self._control_lock:
            self.pause()
            self._clear()

    def wakeup(self) -> None:
        with self._control_lock:
            self._restore()
            self.resume()

    def _wait_cache_ready(self, want: int, what: str) -> None:
        ready = self._signal("cache_ready_signal")
        end = time.monotonic() + self.drain_timeout
        while ready is not None and int(ready.value.sum()) != want:
            if time.monotonic() >= end:
                raise TimeoutError(f"FastDeploy's worker did not {what} within {self.drain_timeout} s "
                                   f"(cache_ready_signal {list(ready.value)})")
            time.sleep(0.01)

    def _clear(self) -> None:
        """FastDeploy's _clear_gpu_cache. The worker's cache: every daemon closes its mappings, then
        cache_ready_signal = 0 lets the worker free it. The daemons' cache (creates_cache): the
        worker releases its mappings first (cache_ready_signal = 0), then the daemons free it."""
        if self._cleared:
            return
        if self.creates_cache:
            self._wait_cache_ready(0, "release the cache the daemons made")
        self.session.clear_caches(drop_host_tier=self.drop_host_tier, timeout=self.drain_timeout)
        self._cleared = True
        ready = self._signal("cache_ready_signal")
        if ready is not None and not self.creates_cache:
            ready.value[:] = 0

    def _restore(self) -> None:
        """FastDeploy's _init_gpu_cache: the worker's new cache is opened once it says it exists;
        or the daemons make a new one and set cache_ready_signal themselves."""
        if not self._cleared:
            return
        ready = None if self.creates_cache else self._signal("cache_ready_signal")
        end = time.monotonic() + self.drain_timeout
        while ready is not None and int(ready.value.sum()) != self.tensor_parallel_size:
            if time.monotonic() >= end:
                raise TimeoutError(f"FastDeploy's worker did not publish its new KV cache within {self.drain_timeout} s "
                                   f"(cache_ready_signal {list(ready.value)})")
            time.sleep(0.01)
        self.session.restore_caches(timeout=self.drain_timeout)
        self._cleared = False
        self._refresh_key_prefix()

    def check_cache_status(self) -> Optional[int]:
        """One step of FastDeploy's weight-update loop (cache_transfer_manager.py check_cache_status)
        on kv_cache_status: CLEARING -> CLEARED, UPDATING -> NORMAL. The monitor thread calls it;
        a failure is logged and the status left for the next try. Returns the status after."""
        sig = self._signal("kv_cache_status", 1)
        if sig is None:
            return None
        status = int(sig.value[0])
        try:
            if status == fds.CLEARING:
                self.sleep()
                sig.value[0] = fds.CLEARED
            elif status == fds.UPDATING:
                self.wakeup()
                sig.value[0] = fds.NORMAL
        except Exception as e:
            log.error("kv_cache_status %d: %s", status, e)
            time.sleep(1.0)
        return int(sig.value[0])

    # -- signals ------------------------------------------------------------------------------
    def _signal(self, name: str, length: Optional[int] = None):
        if self.signal_suffix is None:
            return None
        with self._signals_lock:
            sig = self._signals.get(name)
            if sig is None:
                sig = fds.Signal.open(name, self.signal_suffix, length or self.tensor_parallel_size)
                if sig is not None:
                    self._signals[name] = sig
            return sig

    def _publish_signals(self) -> None:
        s = self.session
        inited = self._signal("cache_transfer_inited_signal")
        swap = self._signal("swap_space_ready_signal")
        inflight = self._signal("cache_task_inflight")
        paused = self._signal("cache_task_is_paused", 1)
        with self._lock:
            idle = not self._pending
        for r in range(self.tensor_parallel_size):
            bits = s.rank_ready(r)
            if inited is not None and bits & 3 == 3:
                inited.value[r] = 1
            if swap is not None and s.geometry.num_host_blocks > 0:
                swap.value[r] = 1 if bits & 2 else 0
            if inflight is not None:
                inflight.value[r] = 0 if self._paused and idle else 1
        if paused is not None:
            paused.value[0] = 1 if self._paused else 0

    def _monitor_loop(self, poll_s: float) -> None:
        while not self._stop.is_set():
            try:
                self._publish_signals()
                self.check_cache_status()
            except Exception as e:  # the session closed under us, a signal removed: keep serving
                log.warning("fastdeploy signals: %s", e)
            self._stop.wait(poll_s)


def _task_id(item) -> Any:
    return item[1] if _name(item[0]) in SWAPS else getattr(item[1], "task_id", None)
