"""The engine side of kvtd in Python: one Session per data-parallel group.

    geo = kvtd.Geometry(num_ranks=2, num_layers=4, dtype="bfloat16", num_host_blocks=256,
                        key_shape=(1024, 8, 64, 128), value_shape=(1024, 8, 64, 128))
    with kvtd.Session("9923", geo) as s:
        s.create_host_device_tensors()          # host backend; CUDA: s.register_torch_tensor(...)
        s.publish()
        s.wait_ready(30)
        tid = s.swap_to_host(device_blocks=[3, 4], host_blocks=[0, 1])
        s.wait(tid)

Thread-safety: every method may be called from any thread (the C library serialises what needs
it); close() must not race other calls. Waits release the GIL.
Lifetime: tensors returned by host_tensor()/host_array() view shared memory owned by the
session; do not use them after close().
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from typing import Iterable, List, Optional, Sequence

from . import _native as n
from .geometry import (DTYPES, KEY, KEY_SCALE, VALUE, VALUE_SCALE, Geometry,  # noqa: F401 (re-exported)
                       kind_code)
from .errors import CacheControlFailed, KvtdError, TaskFailed, Timeout, raise_for
from .places import shm_file_of
from .task_args import TaskResult, block_ids, key_bytes, milliseconds, now_ns, u64  # noqa: F401 (re-exported)

SWAP_TO_HOST = 1
SWAP_TO_DEVICE = 2
STORAGE_QUERY = 3
STORAGE_READ = 4
STORAGE_WRITE = 5
PREFETCH = 6
CANCEL = 7

_ERR_LEN = 1024
_log = logging.getLogger("kvtd.session")


class Session:
    """An engine session (see the module docstring). Creating it makes the shared-memory segment
    "kvtd_<uid>_<suffix>"; close() (or leaving the `with` block) removes it and every object it
    made, and attached daemons detach."""

    def __init__(self, suffix: str, geometry: Optional[Geometry] = None, *, groups=None,
                 adopt_host_tier: bool = False, only_rank: Optional[int] = None,
                 completion_forecast: bool = True):
        """A session over `geometry` (one shape for every layer), or over cache `groups`
        (kvtd.cache_groups.CacheGroups: hybrid models). Exactly one of them. adopt_host_tier
        (geometry only): if this suffix's previous session's engine died (it did not close), each
        rank's daemon takes over the host pool it kept from it when that has the same shape, and
        the blocks written there stay loadable (an engine restarted beside the same daemons);
        `host_tier_taken_over` says which ranks did, once they are ready. only_rank: serve that
        rank of the geometry's (or the cache groups') num_ranks alone, for an engine with one process per TP
        rank, each making a session of its own (a suffix per rank); its daemon runs as that rank
        (--rank r --mp-num num_ranks), so it stores objects as that rank's slice.
        completion_forecast=False: wait() on a swap alone in flight in its direction does not poll
        around the swap's forecast end (by default it does, spending the waiting thread's core for
        an eighth of the swap, 40-400 us, instead of paying a wake-up after the report)."""
        if (geometry is None) == (groups is None):
            raise ValueError("give a geometry or cache groups, not both or neither")
        self.geometry = geometry
        self.groups = groups
        self._tls = threading.local()  # one error buffer per calling thread
        self._h = ctypes.c_void_p()
        self._close_lock = threading.Lock()
        if groups is not None and adopt_host_tier:
            raise ValueError("adopt_host_tier is for a session over one geometry, not cache groups")
        ranks = (geometry if geometry is not None else groups).num_ranks
        if only_rank is not None and not 0 <= only_rank < ranks:
            raise ValueError(f"only_rank {only_rank} is not a rank of the {ranks}-rank "
                             + ("geometry" if geometry is not None else "cache groups"))
        opts = n.SessionOptions()
        if not completion_forecast:
            opts.flags |= n.SESSION_NO_COMPLETION_FORECAST
        identity = (geometry if geometry is not None else groups).identity
        if identity is not None:  # the daemons' flags must say the same (Geometry.daemon_flags does)
            opts.flags |= n.SESSION_KV_IDENTITY
            opts.kv_identity = identity.to_native()
        if only_rank is not None:
            opts.flags |= n.SESSION_ONLY_RANK
            opts.only_rank = only_rank
        if groups is not None:
            native = groups.to_native()
            rc = n.lib.kvtd_session_create_groups_with(suffix.encode(), ctypes.byref(native), ctypes.byref(opts),
                                                       ctypes.byref(self._h), self._errbuf(), _ERR_LEN)
        else:
            native = geometry.to_native()
            if adopt_host_tier:
                opts.flags |= n.SESSION_ADOPT_HOST_TIER
            rc = n.lib.kvtd_session_create_with(suffix.encode(), ctypes.byref(native), ctypes.byref(opts),
                                                ctypes.byref(self._h), self._errbuf(), _ERR_LEN)
        self._check(rc, "create session " + suffix)
        self.suffix = suffix
        self._keepalive = []  # torch tensors registered by handle: kept alive with the session
        self._opened_events = {}  # (rank, layer, device) -> (daemon epoch, torch.cuda.Event)
        self._arena_maps = {}  # host-backend arenas mapped by this object (see _host_buffer)

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Removes the session. Safe from several threads at once and more than once: the handle
        is taken under a lock, so only one caller destroys it; calls on other threads that are
        waiting in it raise Closed, later calls raise ValueError (the library refuses a
        destroyed handle too, never touching freed memory)."""
        with self._close_lock:
            h, self._h = self._h, ctypes.c_void_p()
        if h:
            n.lib.kvtd_session_destroy(h)
            self._keepalive.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _errbuf(self):
        buf = getattr(self._tls, "err", None)
        if buf is None:
            buf = self._tls.err = ctypes.create_string_buffer(_ERR_LEN)
        return buf

    def _check(self, rc: int, what: str) -> None:
        if rc != n.OK:
            raise_for(rc, f"{what}: {self._errbuf().value.decode(errors='replace')}")

    def _handle(self):
        if not self._h:
            raise ValueError("session is closed")
        return self._h

    # -- tensors --------------------------------------------------------------------------
    def register_tensor(self, rank: int, layer: int, kind, handle: bytes, offset: int, nbytes: int,
                        device_id: int = -1, pci_bus_id: Optional[str] = None) -> None:
        """Registers one device tensor: the CUDA IPC handle (64 bytes) of the allocation's base,
        the tensor's byte offset in it, its size, and its GPU (the PCI bus id if known: it means
        the same GPU in every process, an ordinal does not). Only before publish() or after
        clear_caches()."""
        if len(handle) != n.HANDLE_BYTES:
            raise ValueError(f"an IPC handle has {n.HANDLE_BYTES} bytes, got {len(handle)}")
        offset, nbytes = u64(offset, "offset"), u64(nbytes, "nbytes")
        buf = (ctypes.c_uint8 * n.HANDLE_BYTES).from_buffer_copy(handle)
        rc = n.lib.kvtd_register_tensor_on(self._handle(), rank, layer, kind_code(kind), device_id,
                                           pci_bus_id.encode() if pci_bus_id else None, buf, offset, nbytes,
                                           self._errbuf(), _ERR_LEN)
        self._check(rc, f"register rank {rank} layer {layer} {kind}")

    def register_torch_tensor(self, rank: int, layer: int, kind, tensor) -> None:
        """Registers a CUDA torch tensor by its allocation's IPC handle plus offset (what torch's
        own storage sharing uses, so sub-allocations of the caching allocator work)."""
        from .tensors import cuda_ipc_handle, pci_bus_id

        handle, offset, nbytes, device = cuda_ipc_handle(tensor)
        self.register_tensor(rank, layer, kind, handle, offset, nbytes, device, pci_bus_id(device))
        self._keepalive.append(tensor)

    def create_host_device_tensors(self) -> None:
        """Host backend: makes shared-memory "device" tensors for every rank and layer. After
        clear_caches() it frees the old ones and makes new ones (views of the old ones keep the
        old bytes, which nothing reads or writes any more)."""
        self._arena_maps = {}
        self._check(n.lib.kvtd_create_host_device_tensors(self._handle(), self._errbuf(), _ERR_LEN),
                    "create host device tensors")

    def free_host_device_tensors(self) -> None:
        """Host backend: unmaps and unlinks those tensors (before publish, or after clear_caches()).
        Views of them keep the old bytes, which nothing reads or writes any more."""
        self._arena_maps = {}
        self._check(n.lib.kvtd_free_host_device_tensors(self._handle(), self._errbuf(), _ERR_LEN),
                    "free host device tensors")

    # -- weight updates -------------------------------------------------------------------
    def clear_caches(self, *, drop_host_tier: bool = False, weight_version: Optional[int] = None,
                     timeout: Optional[float] = 60.0) -> None:
        """For a weight update: refuses new tasks (CacheCleared), lets every rank finish what was
        submitted before and close every mapping of the KV tensors. On return the tensors may be
        freed; register the new ones, then restore_caches(). drop_host_tier: the host pool's KV is
        the old weights' too. weight_version: set once every rank released. Raises
        CacheControlFailed naming the rank (the cache stays cleared), NotReady when a rank went
        silent and may still map them, Timeout."""
        flags = n.CLEAR_DROP_HOST_TIER if drop_host_tier else 0
        if weight_version is not None:
            flags |= n.CLEAR_SET_WEIGHT_VERSION
        rc = n.lib.kvtd_clear_caches(self._handle(), flags, weight_version or 0, milliseconds(timeout) or 1,
                                     self._errbuf(), _ERR_LEN)
        self._check_cache_control(rc, "clear_caches")

    def restore_caches(self, *, timeout: Optional[float] = 60.0) -> None:
        """Every rank re-reads the tensor registry and maps the (new) tensors; returns once all
        serve again. Raises CacheControlFailed naming a rank that could not (the cache then stays
        cleared: clear_caches(), fix the registration, restore_caches())."""
        rc = n.lib.kvtd_restore_caches(self._handle(), milliseconds(timeout) or 1, self._errbuf(), _ERR_LEN)
        self._check_cache_control(rc, "restore_caches")

    @property
    def cache_cleared(self) -> bool:
        return bool(n.lib.kvtd_cache_cleared(self._handle()))

    def _check_cache_control(self, rc: int, what: str) -> None:
        if rc == n.E_TASK_FAILED:
            raise CacheControlFailed(f"{what}: {self._errbuf().value.decode(errors='replace')}")
        self._check(rc, what)

    def _host_buffer(self, rank: int, layer: int, kind):
        """The tensor's bytes in a mapping of its own: views of it stay valid after close() or a
        clear (the library unmaps its mapping then; the shared object lives on while any of
        ours does). A view of the library's own mapping killed the interpreter when read after
        close()."""
        size = ctypes.c_uint64()
        ptr = n.lib.kvtd_host_device_tensor(self._handle(), rank, layer, kind_code(kind), ctypes.byref(size))
        if not ptr:
            raise ValueError(f"no host device tensor for rank {rank} layer {layer} kind {kind} "
                             "(outside the geometry, or create_host_device_tensors() not called)")
        path, offset = shm_file_of(ptr)
        m = self._arena_maps.get(path)
        if m is None:
            with open(path, "r+b") as f:
                m = mmap.mmap(f.fileno(), 0)
            self._arena_maps[path] = m
        return memoryview(m)[offset: offset + size.value]

    def host_array(self, rank: int, layer: int, kind):
        """The bytes of a host-backend tensor as a writable numpy uint8 array (a view)."""
        import numpy as np

        return np.frombuffer(self._host_buffer(rank, layer, kind), dtype=np.uint8)

    def host_tensor(self, rank: int, layer: int, kind, dtype=None):
        """A host-backend tensor as a torch tensor of its shape (a view of the shared memory).
        dtype defaults to the cache dtype (uint8 for fp8 data; scales: bfloat16 or float32)."""
        import torch

        from .tensors import torch_dtype

        k = kind_code(kind)
        natural = torch_dtype(self.geometry, k)
        if dtype is None:
            dtype = natural
        flat = torch.frombuffer(self._host_buffer(rank, layer, k), dtype=dtype)
        shape = self.geometry.tensor_shape(layer, k)
        if flat.element_size() != torch.empty((), dtype=natural).element_size():
            return flat.view(shape[0], -1)  # another element size: [blocks, elements per block]
        return flat.view(shape)

    def publish(self) -> None:
        self._check(n.lib.kvtd_publish(self._handle(), self._errbuf(), _ERR_LEN), "publish")

    def wait_ready(self, timeout: Optional[float] = 30.0) -> None:
        """Waits until every rank daemon attached and is ready (TimeoutError-derived on timeout)."""
        self._check(n.lib.kvtd_wait_ready(self._handle(), milliseconds(timeout), self._errbuf(), _ERR_LEN), "wait_ready")

    # -- tasks ----------------------------------------------------------------------------
    def submit(self, kind: int, src=None, dst=None, *, keys: Optional[Sequence[str]] = None, blocks=None,
               host_blocks: bool = False, evict_backup: bool = False, layerwise: bool = False,
               min_hits: int = 0, cancel_task_id: int = 0, after: int = 0, deadline_ns: int = 0,
               submit_timeout: float = 1.0, engine_events=None) -> int:
        """Submits a task of any kind to every rank and returns its id. See the shorthands below
        for what each kind uses. `after`: run after that task; `deadline_ns`: absolute
        CLOCK_MONOTONIC (now_ns() + budget), 0 = none. `engine_events` (swaps): one
        interprocess event per rank, in rank order, recorded on the engine's stream after the
        work this copy must follow (`torch.cuda.Event(interprocess=True)`, or its 64-byte
        `ipc_handle()`); the daemons' copies wait for them on the GPU. Without them the engine
        must have synchronised that work before submitting."""
        t = n.Task()
        t.kind = kind
        t.flags = ((n.STORAGE_HOST_BLOCKS if host_blocks else 0) | (n.STORAGE_EVICT_BACKUP if evict_backup else 0)
                   | (n.TASK_LAYERWISE if layerwise else 0))
        src_arr, ns = block_ids(src, "src")
        dst_arr, nd = block_ids(dst, "dst")
        if ns != nd:
            raise ValueError(f"src has {ns} ids, dst {nd}")
        t.src = ctypes.cast(src_arr, ctypes.POINTER(ctypes.c_int32)) if src_arr is not None else None
        t.dst = ctypes.cast(dst_arr, ctypes.POINTER(ctypes.c_int32)) if dst_arr is not None else None
        t.n = ns
        key_arr = None
        if keys is not None:
            encoded = key_bytes(keys)
            key_arr = (ctypes.c_char_p * len(encoded))(*encoded)
            t.keys = ctypes.cast(key_arr, ctypes.POINTER(ctypes.c_char_p))
            t.num_keys = len(encoded)
        per_key = 1
        if blocks is not None and self.groups is not None:
            # A group session names a block per key and group: lists per group (their own ids,
            # None for none), or the flattened group-major list kvtd_task.blocks holds.
            blocks = list(blocks)
            if blocks and isinstance(blocks[0], (list, tuple)):
                blocks = self.groups.storage_blocks(blocks, host=host_blocks)
            per_key = len(self.groups.groups)
        blk_arr, nb = block_ids(blocks, "blocks", allow_none=self.groups is not None)
        if blk_arr is not None:
            if nb != t.num_keys * per_key:
                raise ValueError(f"{t.num_keys} keys for {nb} blocks"
                                 + (f" ({per_key} cache groups: a block per key and group)" if per_key > 1 else ""))
            t.blocks = ctypes.cast(blk_arr, ctypes.POINTER(ctypes.c_int32))
        # ctypes would wrap each of these silently (min_hits 2**32 + 1 is 1).
        t.min_hits = u64(min_hits, "min_hits", 2**32)
        t.cancel_task_id = u64(cancel_task_id, "cancel_task_id", 2**64)
        t.after_task_id = u64(after, "after", 2**64)
        t.deadline_ns = u64(deadline_ns, "deadline_ns", 2**63)
        t.submit_timeout_ms = milliseconds(submit_timeout)
        tid = ctypes.c_uint64()
        if engine_events:
            handles = [bytes(e.ipc_handle()) if hasattr(e, "ipc_handle") else bytes(e) for e in engine_events]
            if any(len(h) != n.HANDLE_BYTES for h in handles):
                raise ValueError(f"an engine event handle has {n.HANDLE_BYTES} bytes")
            rc = n.lib.kvtd_submit_task_after_events(self._handle(), ctypes.byref(t), b"".join(handles), len(handles),
                                                     ctypes.byref(tid), self._errbuf(), _ERR_LEN)
        else:
            rc = n.lib.kvtd_submit_task(self._handle(), ctypes.byref(t), ctypes.byref(tid), self._errbuf(), _ERR_LEN)
        self._check(rc, "submit")
        return tid.value

    def swap_to_host(self, device_blocks, host_blocks, *, keys=None, **kw) -> int:
        """Evicts device blocks into host blocks. With keys (one per host block) it also submits
        the backup STORAGE_WRITE (id + 1) that the daemons' write policy carries out or skips."""
        return self.submit(SWAP_TO_HOST, device_blocks, host_blocks, keys=keys, **kw)

    def swap_to_device(self, host_blocks, device_blocks, *, layerwise: bool = False, **kw) -> int:
        """Loads host blocks into device blocks; layerwise=True reports each layer (wait_layer)."""
        return self.submit(SWAP_TO_DEVICE, host_blocks, device_blocks, layerwise=layerwise, **kw)

    def storage_query(self, keys, **kw) -> int:
        """blocks_done = how many leading keys every rank has stored (a session of cache groups:
        the longest prefix every group's rule allows, kvtd/proto/group_hits.h)."""
        return self.submit(STORAGE_QUERY, keys=keys, **kw)

    def storage_read(self, keys, blocks, *, host_blocks: bool = False, **kw) -> int:
        """Loads the longest prefix of `keys` every rank can load into `blocks` (one per key; a
        session of cache groups: a list per group, None where a group has no block, and only the
        pages each group's rule needs at that point are loaded)."""
        return self.submit(STORAGE_READ, keys=keys, blocks=blocks, host_blocks=host_blocks, **kw)

    def storage_write(self, keys, blocks, *, host_blocks: bool = False, **kw) -> int:
        return self.submit(STORAGE_WRITE, keys=keys, blocks=blocks, host_blocks=host_blocks, **kw)

    def prefetch(self, keys, host_blocks, *, min_hits: int = 0, **kw) -> int:
        return self.submit(PREFETCH, keys=keys, blocks=host_blocks, host_blocks=True, min_hits=min_hits, **kw)

    def cancel(self, task_id: int, **kw) -> int:
        return self.submit(CANCEL, cancel_task_id=task_id, **kw)

    def set_weight_version(self, version: int) -> None:
        """Later storage tasks carry this version: KV stored under other weights is never loaded."""
        n.lib.kvtd_set_weight_version(self._handle(), version)

    @property
    def weight_version(self) -> int:
        return n.lib.kvtd_weight_version(self._handle())

    @property
    def name(self) -> str:
        """The shared-memory segment's name ("kvtd_<uid>_<suffix>")."""
        return n.lib.kvtd_session_name(self._handle()).decode()

    def host_tier_taken_over(self, rank: int) -> bool:
        """Whether the live rank's host pool is the one its daemon kept from this suffix's dead
        previous session (adopt_host_tier): known once the rank is ready, False before."""
        return bool(self.rank_ready(rank) & n.READY_HOST_TIER_TAKEN_OVER)

    @property
    def generation(self) -> int:
        return n.lib.kvtd_session_generation(self._handle())

    def _result(self, rc: int, c: n.Completion, check: bool, what: str) -> TaskResult:
        """The completion of a finished wait/poll: TaskFailed (or the failed result with
        check=False) for a failed task, the code's exception for any other error."""
        if rc == n.E_TASK_FAILED:
            result = TaskResult._from(c, self._errbuf().value.decode(errors="replace"))
            if check:
                raise TaskFailed(result)
            return result
        self._check(rc, what)
        return TaskResult._from(c)

    def wait(self, task_id: int, timeout: Optional[float] = 60.0, *, check: bool = True) -> TaskResult:
        """Waits for the merged result. A failed task raises TaskFailed (carrying the result)
        unless check=False. TimeoutError-derived Timeout if it does not complete in time."""
        c = n.Completion()
        rc = n.lib.kvtd_wait(self._handle(), task_id, milliseconds(timeout), ctypes.byref(c), self._errbuf(), _ERR_LEN)
        return self._result(rc, c, check, f"wait for task {task_id}")

    def final_result(self, task_id: int, *, cancel: bool, timeout_each: float = 60.0) -> TaskResult:
        """The task's final result, cancelling it first if `cancel`: once the daemons report it, no
        copy of it runs, so the engine may reuse its blocks. Waits as long as the daemons live (a
        dead daemon ends its tasks; one whose copy never finishes exits on its watchdog), logging
        every `timeout_each` seconds; never raises TaskFailed (check=False)."""
        if cancel:
            try:
                self.cancel(task_id)
            except KvtdError as e:
                _log.warning("cancel of task %d on %s: %s", task_id, self.suffix, e)
        while True:
            try:
                return self.wait(task_id, timeout_each, check=False)
            except Timeout:
                _log.warning("task %d on %s has not ended after %.0f s; still waiting", task_id, self.suffix,
                             timeout_each)

    def poll(self, task_id: int, *, check: bool = True) -> Optional[TaskResult]:
        """The merged result if every rank reported (handed out once), else None."""
        c = n.Completion()
        rc = n.lib.kvtd_poll(self._handle(), task_id, ctypes.byref(c), self._errbuf(), _ERR_LEN)
        if rc == n.E_PENDING:
            return None
        return self._result(rc, c, check, f"poll task {task_id}")

    def wait_layer(self, task_id: int, layer: int, timeout: Optional[float] = 60.0, *, stage: str = "done") -> None:
        """Layer-by-layer loads: returns once `layer` of the task is in place on every rank
        (stage="done"), or queued with its CUDA event recorded (stage="enqueued")."""
        st = {"done": n.LAYER_DONE, "enqueued": n.LAYER_ENQUEUED}.get(stage)
        if st is None:
            raise ValueError(f"stage {stage!r} is not 'done' or 'enqueued'")
        rc = n.lib.kvtd_wait_layer(self._handle(), task_id, layer, milliseconds(timeout), st, self._errbuf(), _ERR_LEN)
        self._check(rc, f"wait for layer {layer} of task {task_id}")

    def layer_event_handle(self, rank: int, layer: int) -> Optional[bytes]:
        """The cudaIpcEventHandle_t bytes rank `rank` records per layer, or None (host backend)."""
        found = self.layer_event_handle_and_epoch(rank, layer)
        return found[0] if found else None

    def layer_event_handle_and_epoch(self, rank: int, layer: int):
        """(handle bytes, epoch of the daemon that exported it), or None: events opened under one
        epoch are another process's once it changes (a restarted daemon)."""
        buf = (ctypes.c_uint8 * n.HANDLE_BYTES)()
        epoch = ctypes.c_uint32()
        rc = n.lib.kvtd_layer_event(self._handle(), rank, layer, buf, ctypes.byref(epoch))
        return (bytes(buf), epoch.value) if rc == n.OK else None

    def layer_event(self, rank: int, layer: int, device):
        """Rank `rank`'s event for `layer` opened as a torch.cuda.Event on `device`, or None (host
        backend, or no live daemon's events). After wait_layer(tid, layer, stage="enqueued"),
        `torch.cuda.current_stream().wait_event(ev)` makes the compute stream wait on the GPU.
        Opened once per daemon epoch and kept: a restarted daemon's new events are opened when
        its epoch shows. (Written for a GPU; no machine of this project has one, so this has not
        run.)"""
        found = self.layer_event_handle_and_epoch(rank, layer)
        if found is None:
            return None
        handle, epoch = found
        key = (rank, layer, str(device))
        cached = self._opened_events.get(key)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        import torch

        event = torch.cuda.Event.from_ipc_handle(device, handle)
        self._opened_events[key] = (epoch, event)
        return event

    def rank_alive(self, rank: int) -> bool:
        return bool(n.lib.kvtd_rank_alive(self._handle(), rank))

    def rank_ready(self, rank: int) -> int:
        """While the rank is alive, its ready bits: 1 = cache tensors mapped, 2 = host pool made,
        4 = host tier taken over (adopt_host_tier)."""
        return n.lib.kvtd_rank_ready(self._handle(), rank)

    @property
    def in_flight(self) -> int:
        return n.lib.kvtd_in_flight(self._handle())

    def forecast_waits(self) -> dict:
        """Waits that took a swap's result around its completion forecast, by when: before the
        poll window (woken by the report), in it (no wake-up paid), after it (the window missed).
        Keys: waits, before_window, in_window, after_window."""
        out = n.ForecastWaits()
        self._check(n.lib.kvtd_session_forecast_waits(self._handle(), ctypes.byref(out), self._errbuf(), _ERR_LEN),
                    "forecast_waits")
        return {name: getattr(out, name) for name, _ in n.ForecastWaits._fields_}

    def wait_all(self, task_ids: Iterable[int], timeout: Optional[float] = 60.0) -> List[TaskResult]:
        return [self.wait(t, timeout) for t in task_ids]
