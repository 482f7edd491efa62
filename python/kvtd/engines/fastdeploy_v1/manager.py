"""kvtd as FastDeploy cache manager v1's transfer path (ENABLE_V1_KVCACHE_MANAGER=1).

Under v1 FastDeploy starts no transfer process: each GPU worker's CacheController
(fastdeploy/cache_manager/v1/cache_controller.py) swaps its own rank's blocks in-process through
a CacheTransferManager (v1/transfer_manager.py). With KVTD_FASTDEPLOY_V1=1 and this module's
FastDeploy plugin (entry point `kvtd` in group fastdeploy.model_register_plugins, which FastDeploy
loads in every process before it builds a model), each worker's controller gets a
KvtdCacheTransferManager instead, and that worker's swaps are tasks of a one-rank kvtd session
served by that rank's daemon (the FastDeploy code each point below relies on is listed in
docs/engines/fastdeploy_v1.md, 'Upstream behaviour relied on'):

* set_cache_kvs_map(name -> device tensor) registers the tensors by the names the controller
  made (the controller names them with local_rank % tensor_parallel_size while FastDeploy's own
  manager looks them up with the raw local rank, so a local rank >= the TP size finds nothing
  there; here the names are parsed, never rebuilt).
* The host blocks live in the daemon's host pool, not in the worker's private cuda_host_alloc
  memory: a restarted daemon maps the pool again, and a restarted worker's session takes over
  the pool its daemon kept when the dead predecessor's session ended (Session(adopt_host_tier=
  True); $KVTD_FDV1_ADOPT_HOST_TIER=0 turns it off), so the host blocks FastDeploy's CacheManager (in the engine process, alive
  across a worker restart) still names hold what it thinks they hold. The
  controller's host allocations (its cuda_host_alloc calls) get address space reserved with
  no access and no memory behind it, so nothing can read a host block outside kvtd by mistake
  and no host memory is pinned twice.
* evict_to_host_async returns once the bytes are in the host pool (or the copy failed): the
  controller marks an eviction done when the call returns and waits for pending evictions before
  the next submit and, under write_back, before the load, so a load that reuses a host block
  follows the eviction into it.
* load_layers_to_device_async reports a layer (on_layer_complete) only once that layer is in
  device memory on this rank (kvtd's layer progress, stage "done"), and stops reporting at the
  first failure: FastDeploy's own manager calls on_layer_complete for every layer even after a
  failed copy, and its forward pass then reads stale KV. record_input_stream_event returns None,
  so LayerDoneCounter.wait_for_layer relies on the layer being reported (with no event it checks
  the layer's done flag): it is reported only when its bytes are there.
* A failed eviction answers at once: FastDeploy's controller never marks a failed (or empty)
  eviction's counter done, so the next submit_swap_tasks waits 300 s (wait_all's default
  timeout). install() replaces CacheController.evict_device_to_host with one that marks the
  counter finished either way and puts the outcome in the metadata (success, error_message).
  A failed eviction's host blocks cannot be loaded afterwards: the daemon fails any load naming
  a host block whose write failed or never happened (kHostTierLost), so no wrong byte reaches
  the device.

Left out, as FastDeploy v1 at the pinned revision (this package's __init__) does too: MTP layers
(its manager swaps only num_hidden_layers layers) and the storage/transfer connectors
(placeholders there).

Thread-safety: every method may be called from the controller's 4 transfer threads at once.
"""


from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

from ...errors import KvtdError, Timeout
from .support import SWITCH, geometry_of, parse_names, release_host, reserve_host, session_suffix
from ...geometry import KEY, VALUE
from ...places import tensor_location
from ...session import Session
from ..rank import RankTensor, daemon_command, open_rank_session, task_outcome

log = logging.getLogger("kvtd.fastdeploy_v1")

EVICT, LOAD = 0, 1  # FastDeploy's swap modes (0 = device to host, 1 = host to device)
_live_managers: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # A connect thread still waiting for its daemon at exit would be killed by the interpreter's
    # finalisation while it holds torch tensors, which aborts the process (std::terminate): each
    # session is closed first, which ends its wait, and the thread is joined.
    for manager in list(_live_managers):
        manager.close()


class KvtdCacheTransferManager:
    """FastDeploy v1's CacheTransferManager (v1/transfer_manager.py) over kvtd: same constructor,
    same public methods and results. The session is made and published in the background once
    the controller set both maps; its daemon (`kvtd --session <session_suffix()> --rank 0 ...`)
    must join within $KVTD_FDV1_READY_TIMEOUT seconds (default 120) of that; a swap waits for it
    that long, then fails naming why."""

    def __init__(self, config, local_rank: int = 0, device_id: int = 0):
        self.config = config
        self.cache_config = config.cache_config
        self.quant_config = getattr(config, "quant_config", None)
        self._local_rank, self._device_id = local_rank, device_id
        self._num_layers = int(config.model_config.num_hidden_layers)
        self._cache_dtype = self.cache_config.cache_dtype
        self._num_host_blocks = int(self.cache_config.num_cpu_blocks or 0)
        self._suffix = session_suffix(config, local_rank)
        self._ready_timeout = float(os.environ.get("KVTD_FDV1_READY_TIMEOUT", "120"))
        self._task_timeout = float(os.environ.get("KVTD_FDV1_TASK_TIMEOUT", "60"))
        self._adopt = os.environ.get("KVTD_FDV1_ADOPT_HOST_TIER", "1") != "0"
        self._lock = threading.RLock()
        self._cache_kvs_map: Dict[str, Any] = {}
        self._host_cache_kvs_map: Dict[str, Any] = {}
        self._host_ptrs: Dict[tuple, int] = {}  # (layer, kind) -> the controller's host pointer
        self._tensors: Dict[tuple, Any] = {}
        self._session: Optional[Session] = None
        self._unready: Optional[Session] = None  # made, not yet ready: close() must reach it
        self._late: Optional[Session] = None  # published, no daemon within the ready timeout
        self._closed = False
        self._connecting: Optional[threading.Thread] = None
        self._connect_error: Optional[str] = None
        self._in_flight = {EVICT: 0, LOAD: 0}
        self._idle = threading.Condition(self._lock)
        self.failures: collections.deque = collections.deque(maxlen=256)
        self._counts = collections.Counter()
        _live_managers.add(self)

    # -- maps from the controller ---------------------------------------------------------------
    @property
    def cache_kvs_map(self) -> Dict[str, Any]:
        return self._cache_kvs_map

    @property
    def host_cache_kvs_map(self) -> Dict[str, Any]:
        return self._host_cache_kvs_map

    def set_cache_kvs_map(self, cache_kvs_map: Dict[str, Any]) -> None:
        """The device tensors by FastDeploy's names (ValueError naming a name that is not)."""
        tensors = parse_names(cache_kvs_map)
        with self._lock:
            self._cache_kvs_map = cache_kvs_map
            self._tensors = tensors

    def set_host_cache_kvs_map(self, host_cache_kvs_map: Dict[str, Any]) -> None:
        """The controller's host allocations by FastDeploy's names (kvtd's reservations: see
        reserve_host; ValueError naming a name that is not FastDeploy's). With host blocks and
        device tensors known, the session is made and published in the background."""
        host_ptrs = parse_names(host_cache_kvs_map)
        with self._lock:
            self._host_cache_kvs_map = host_cache_kvs_map
            self._host_ptrs = host_ptrs
            if self._num_host_blocks <= 0 or not self._tensors or self._connecting is not None or self._closed:
                return
            self._connecting = threading.Thread(target=self._connect, name=f"kvtd-fdv1-r{self._local_rank}",
                                                daemon=True)
            self._connecting.start()

    def _connect(self) -> None:
        try:
            with self._lock:
                tensors = dict(self._tensors)
            g = geometry_of(tensors, self._num_layers, self._num_host_blocks)
            # MTP layers are not swapped (FastDeploy's manager swaps none either).
            ranked = [RankTensor(layer, kind, *tensor_location(t))
                      for (layer, kind), t in sorted(tensors.items(), key=lambda kv: kv[0]) if layer < self._num_layers]
            # The one-rank session of the wing's rank layer: each FastDeploy worker process is
            # its own session (rank 0 of 1), named by its local rank (support.session_suffix).
            s = open_rank_session(self._suffix, g, 0, ranked, adopt_host_tier=self._adopt)
            # The daemon's line, for whoever starts it (systemd unit, by hand): the worker's geometry.
            command = " ".join(daemon_command(g, self._suffix, 0, ranked[0].device if ranked else -1))
            log.info("kvtd session %s published for rank %d; its daemon: %s", self._suffix, self._local_rank, command)
            with self._lock:
                if self._closed:
                    s.close()
                    return
                self._unready = s
            try:
                s.wait_ready(self._ready_timeout)
            except Timeout as e:
                # No daemon yet: the published session stays, so a daemon started late (systemd
                # restarting it) still serves this worker; each swap looks again.
                with self._lock:
                    self._unready = None
                    self._late = s
                    self._connect_error = f"kvtd session {self._suffix}: {e}; start its daemon as: {command}"
                if self._closed:
                    s.close()
                log.error("%s; the worker waits on for its daemon", self._connect_error)
                return
            except BaseException:
                s.close()
                raise
            finally:
                with self._lock:
                    self._unready = None
            with self._lock:
                if self._closed:
                    s.close()
                    return
                self._session = s
            log.info("kvtd session %s ready for rank %d (%d layers, %d host blocks%s)", self._suffix,
                     self._local_rank, self._num_layers, self._num_host_blocks,
                     "; the host tier its dead predecessor left taken over" if s.host_tier_taken_over(0) else "")
        except Exception as e:  # kept and named by every swap that follows
            if self._closed:
                return  # closed while waiting: nothing will swap
            with self._lock:
                self._connect_error = f"kvtd session {self._suffix}: {e}"
            log.error("%s", self._connect_error)

    def _ready_session(self) -> Session:
        with self._lock:
            t = self._connecting
        if t is None:
            raise KvtdError("no kvtd session: the controller set no device tensors or no host blocks yet")
        t.join(self._ready_timeout + 5)
        with self._lock:
            if self._session is not None:
                return self._session
            late = self._late
        if late is not None:
            try:
                late.wait_ready(1.0)
            except Timeout:
                raise KvtdError(f"{self._connect_error} (and still none)") from None
            with self._lock:
                if self._late is late and not self._closed:
                    self._session, self._late = late, None
                    log.info("kvtd session %s ready for rank %d: its daemon joined late", self._suffix,
                             self._local_rank)
                if self._session is not None:
                    return self._session
        raise KvtdError(self._connect_error or f"kvtd session {self._suffix} is still being made")

    # -- swaps -----------------------------------------------------------------------------------
    def _refuse(self, device_ids, host_ids) -> Optional[str]:
        """Why FastDeploy's own manager would return False for these ids, or None."""
        if self._num_host_blocks <= 0:
            return "no host blocks (num_cpu_blocks is 0)"
        if not device_ids or not host_ids:
            return "empty block ids"
        if len(device_ids) != len(host_ids):
            return f"{len(device_ids)} device block ids for {len(host_ids)} host block ids"
        with self._lock:
            if not self._tensors:
                return "no device cache tensors were set"
        return None

    def _fail(self, what: str, message: str) -> bool:
        text = f"{what} on rank {self._local_rank}: {message}"
        self.failures.append(text)
        self._count(what + " failed")
        log.error("%s", text)
        return False

    def _count(self, what: str) -> None:
        with self._lock:  # four transfer threads: += on a Counter is not atomic
            self._counts[what] += 1

    def _begin(self, mode: int) -> None:
        with self._lock:
            self._in_flight[mode] += 1

    def _end(self, mode: int) -> None:
        with self._lock:
            self._in_flight[mode] -= 1
            self._idle.notify_all()

    def _finish(self, s: Session, tid: int, cancel: bool):
        """The task's final result (a cancel first when the caller gives up waiting)."""
        return task_outcome(s, tid, cancel=cancel, log_every=self._task_timeout)

    def _swap(self, what: str, mode: int, device_ids, host_ids, move: Callable[[Session], Optional[str]]) -> bool:
        """Runs one swap: FastDeploy's refusals first, then `move(session)`, which returns None
        when every byte arrived or what failed. Never raises into FastDeploy's thread."""
        why = self._refuse(device_ids, host_ids)
        if why:
            return self._fail(what, why)
        self._begin(mode)
        try:
            failed = move(self._ready_session())
            if failed:
                return self._fail(what, failed)
            self._count(what)
            return True
        except KvtdError as e:
            return self._fail(what, str(e))
        finally:
            self._end(mode)

    def evict_to_host_async(self, device_block_ids: List[int], host_block_ids: List[int]) -> bool:
        """Copies every layer of the device blocks into the host blocks and returns once they
        are in the host pool: True, or False after a failure (kept in `failures`)."""
        def move(s: Session) -> Optional[str]:
            tid = s.swap_to_host(list(device_block_ids), list(host_block_ids))
            r = self._finish(s, tid, cancel=False)
            return None if r.ok else f"task {tid}: {r.status_name} {r.message}"

        return self._swap("evict", EVICT, device_block_ids, host_block_ids, move)

    def load_layers_to_device_async(self, layer_indices: List[int], host_block_ids: List[int],
                                    device_block_ids: List[int], on_layer_complete: Optional[Callable] = None) -> bool:
        """Loads the host blocks into the device blocks (every layer moves) and calls
        on_layer_complete(layer) for each of `layer_indices`, in order, once that layer is in
        device memory. At the first failure no further layer is reported; returns True only if
        every layer arrived."""
        def move(s: Session) -> Optional[str]:
            tid = s.swap_to_device(list(host_block_ids), list(device_block_ids), layerwise=True)
            for layer in layer_indices:
                try:
                    s.wait_layer(tid, int(layer), self._task_timeout)
                except KvtdError as e:
                    r = self._finish(s, tid, cancel=isinstance(e, Timeout))
                    return f"task {tid}: layer {layer} not loaded ({e}); {r.status_name} {r.message}"
                if on_layer_complete is not None:
                    try:
                        on_layer_complete(layer)
                    except Exception:  # FastDeploy's own manager ignores these too
                        log.exception("on_layer_complete(%s) raised", layer)
            r = self._finish(s, tid, cancel=False)
            return None if r.ok else f"task {tid}: {r.status_name} {r.message}"

        return self._swap("load", LOAD, device_block_ids, host_block_ids, move)

    # -- streams and events ----------------------------------------------------------------------
    def _wait_idle(self, mode: int) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight[mode] == 0)

    def sync_input_stream(self) -> None:
        """Returns once no load is in flight."""
        self._wait_idle(LOAD)

    def sync_output_stream(self) -> None:
        """Returns once no eviction is in flight."""
        self._wait_idle(EVICT)

    def record_input_stream_event(self) -> Any:
        """None: a layer is reported only once its bytes are on the device, so the controller's
        LayerDoneCounter needs no event (it then checks the layer's done flag)."""
        return None

    # -- what FastDeploy's manager also answers ------------------------------------------------
    def _is_fp8_quantization(self) -> bool:
        q = getattr(self.quant_config, "kv_cache_quant_type", None) if self.quant_config else None
        return q == "block_wise_fp8"

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def cache_dtype(self) -> str:
        return self._cache_dtype

    @property
    def has_cache_scale(self) -> bool:
        return self._is_fp8_quantization()

    @property
    def num_host_blocks(self) -> int:
        return self._num_host_blocks

    @property
    def session_suffix(self) -> str:
        return self._suffix

    def _tensor(self, layer_idx: int, kind: int):
        with self._lock:
            return self._tensors.get((layer_idx, kind)) if 0 <= layer_idx < self._num_layers else None

    def get_device_key_cache(self, layer_idx: int):
        return self._tensor(layer_idx, KEY)

    def get_device_value_cache(self, layer_idx: int):
        return self._tensor(layer_idx, VALUE)

    def _host_ptr(self, layer_idx: int, kind: int) -> int:
        """The controller's host allocation for a layer: a reservation (see reserve_host), kept
        only because FastDeploy's manager answers it; kvtd's host blocks are in the daemon."""
        with self._lock:
            if self._num_host_blocks <= 0 or not 0 <= layer_idx < self._num_layers:
                return 0
            return self._host_ptrs.get((layer_idx, kind), 0)

    def get_host_key_ptr(self, layer_idx: int) -> int:
        return self._host_ptr(layer_idx, KEY)

    def get_host_value_ptr(self, layer_idx: int) -> int:
        return self._host_ptr(layer_idx, VALUE)

    def get_stats(self) -> Dict[str, Any]:
        with self._lock:
            return {"num_layers": self._num_layers, "local_rank": self._local_rank, "device_id": self._device_id,
                    "cache_dtype": self._cache_dtype, "num_host_blocks": self._num_host_blocks,
                    "has_device_cache": bool(self._tensors),
                    "has_host_cache": self._num_host_blocks > 0 and bool(self._host_cache_kvs_map),
                    "kvtd_session_ready": self._session is not None,
                    "kvtd_host_tier_taken_over": self._session is not None and self._session.host_tier_taken_over(0),
                    "is_fp8": self._is_fp8_quantization(), "kvtd_session": self._suffix,
                    "kvtd_evictions": self._counts["evict"], "kvtd_loads": self._counts["load"],
                    "kvtd_failures": len(self.failures)}

    def start(self) -> None:
        """CacheController.start() calls this; the session starts with set_host_cache_kvs_map."""

    def stop(self) -> None:
        self.close()

    def close(self) -> None:
        """Removes the session (its daemon detaches and the host pool goes with it); a session
        still waiting for its daemon stops waiting. Idempotent."""
        with self._lock:
            self._closed = True
            sessions = [x for x in (self._session, self._unready, self._late) if x is not None]
            self._session = self._late = None
            t = self._connecting
        for x in sessions:
            x.close()
        if t is not None and t is not threading.current_thread():
            t.join(10)


# -- the hook -------------------------------------------------------------------------------------
def _evict_device_to_host(self, swap_metadata):
    """CacheController.evict_device_to_host with an answer on failure:
    the counter is finished whether the eviction succeeded or not, the outcome is in the
    metadata. FastDeploy's leaves a failed or empty eviction's counter unfinished and the next
    submit waits 300 s for it."""
    from fastdeploy.cache_manager.v1.cache_utils import LayerDoneCounter

    counter = LayerDoneCounter(self._num_layers)
    src, dst = list(swap_metadata.src_block_ids or []), list(swap_metadata.dst_block_ids or [])
    manager = self._transfer_manager

    def run():
        ok, message = False, None
        try:
            ok = bool(src and dst) and manager.evict_to_host_async(src, dst)
            if not ok:
                message = manager.failures[-1] if getattr(manager, "failures", None) else "eviction failed"
        except Exception as e:  # noqa: BLE001 - reported in the metadata, never lost
            message = f"eviction raised {e!r}"
        finally:
            swap_metadata.success = ok
            swap_metadata.error_message = message
            counter.mark_all_done()

    self._executor.submit(run)
    return counter


def install() -> None:
    """Makes every CacheController built from now on in this process use kvtd (see the module
    docstring). Idempotent."""
    import fastdeploy.cache_manager.v1.cache_controller as cc

    cc.CacheTransferManager = KvtdCacheTransferManager
    cc.cuda_host_alloc = reserve_host
    cc.cuda_host_free = release_host
    cc.CacheController.evict_device_to_host = _evict_device_to_host
    log.info("kvtd serves FastDeploy cache manager v1's swaps in this process")


def register() -> None:
    """FastDeploy's plugin entry point (group fastdeploy.model_register_plugins, loaded in every
    FastDeploy process): installs kvtd when KVTD_FASTDEPLOY_V1=1 and v1 is on."""
    if os.environ.get(SWITCH) != "1":
        return
    if os.environ.get("ENABLE_V1_KVCACHE_MANAGER", "0") in ("", "0"):
        log.warning("%s=1 but ENABLE_V1_KVCACHE_MANAGER is off: FastDeploy v0's transfer processes are "
                     "replaced by kvtd.fastdeploy instead (docs/engines/fastdeploy.md)", SWITCH)
        return
    install()
