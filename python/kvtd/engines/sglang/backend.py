"""kvtd as sglang's HiCache L3 storage backend, loaded by sglang's own factory:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvtd",
      "module_path": "kvtd.sglang", "class_name": "KvtdHiCacheStorage", "interface_v1": 1,
      "allocator": "shm", "kvtd_session": "sglang"}'

sglang runs one scheduler process per TP rank; each makes one backend (StorageBackendFactory's
`_create_dynamic_backend` calls `cls(storage_config, kwargs)`), which makes a kvtd session
serving that rank alone (`<kvtd_session>_r<tp_rank>`, Session(only_rank=r)) for that rank's
daemon; with DP attention, pipeline or attention context parallelism
`<kvtd_session>_dp<group>_pp<stage>_cp<slice>_r<tp_rank>` (session_suffix), and the stage, the
slice and the pool's dtype are in the stored objects' namespace (kvtd.KvIdentity: the daemon is
started with the same --pp-*, --cp-*, --kv-dtype, as the logged command line shows). With
`"allocator": "shm"` sglang's host pool lives in a memfd (the fd is HostKVCache.fd); the backend
registers that memory with the session by the fd's /proc path, so the daemon maps the very pages
sglang reads and writes, and loads and stores go straight between them and the store: this
process never copies a page.

Every call sglang makes is bounded and never raises into its threads (an exception kills the
storage thread for the life of the process): a daemon that is down or does not answer within
`kvtd_timeout_s` turns into misses and failed sets. A task given up on is cancelled and its final
answer awaited before the call returns, so no daemon writes a page sglang was told failed (a
daemon that dies ends its tasks; one whose copy never finishes exits on its own watchdog).

Keys are sglang's strings, opaque to kvtd; kvtd namespaces them by the daemon's model id, the
layout's fingerprint and the weight version. `clear()` (what sglang's
/clear_hicache_storage_backend calls) moves to the next weight version: everything stored before
misses from then on, and `kvtd ctl storage gc --keep-weight-version` reclaims it.
`"kvtd_weight_version"` in the extra config starts at a given version (a restart after a weight
update).

The extra config's own keys: kvtd_session (session prefix, default "sglang"), kvtd_timeout_s (per
call, default 5), kvtd_weight_version (default 0).

The sglang code this module relies on is listed in docs/engines/sglang.md, 'Upstream behaviour
relied on'.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .layout import PoolPlan, pages_of, plan_pool
from .pools import HybridPlan, plan_group, pool_name
from .pool_calls import PoolGroupCalls
from ...places import memfd_place
from ...session import Session, now_ns
from ..rank import RankTensor, daemon_command, open_rank_session, task_outcome

log = logging.getLogger("kvtd.sglang")


def plan_for(host, tp_size: int, mla: bool, pp: tuple = (0, 1), cp: tuple = (0, 1)) -> PoolPlan:
    """kvtd's geometry and tensors for sglang's HostKVCache `host` (MHA: head_num and head_dim;
    MLA: kv_cache_dim), of pipeline stage `pp` and attention context-parallel slice `cp`, each
    (rank, size). K and V of different head dims (sglang's AsymmetricMHATokenToKVPoolHost)
    are two buffers: `kv_buffer` is (k_buffer, v_buffer) and `v_head_dim` V's head dim."""
    bufs = pool_buffers(host)
    width = int(host.kv_cache_dim) if mla else int(host.head_num) * int(host.head_dim)
    nbytes = [int(b.numel()) * int(b.element_size()) for b in bufs]
    two = len(bufs) == 2
    return plan_pool(layout=host.layout, mla=mla, layer_num=int(host.layer_num), size=int(host.size),
                     page_size=int(host.page_size), token_width=width,
                     dtype_name=str(host.dtype).replace("torch.", ""), itemsize=int(bufs[0].element_size()),
                     tp_size=tp_size, buffer_bytes=nbytes[0], head_dim=0 if mla else int(host.head_dim), pp=pp,
                     cp=cp, value_width=int(host.head_num) * int(host.v_head_dim) if two else 0,
                     value_buffer_bytes=nbytes[1] if two else 0)


def pool_buffers(host) -> tuple:
    """The host pool's buffers: one, or (K, V) for a pool whose K and V are two (a tuple)."""
    buf = host.kv_buffer
    if isinstance(buf, (tuple, list)):
        if len(buf) != 2:
            raise ValueError(f"sglang host pool kv_buffer is a sequence of {len(buf)} buffers; kvtd knows (K, V)")
        return tuple(buf)
    return (buf,)


def buffer_places(host, buffers) -> List[tuple]:
    """(handle, base offset) of each buffer in the memfd sglang's shm allocator made for it: one fd
    per allocation (ShmHostTensorAllocator.fds), matched to a buffer by the mapping's inode, never
    assumed by order."""
    fds = list(getattr(getattr(host, "allocator", None), "fds", None) or [host.fd])
    out = []
    for b in buffers:
        for fd in fds:
            try:
                out.append(memfd_place(int(fd), int(b.data_ptr())))
                break
            except ValueError:
                continue
        else:
            raise ValueError(f"a host pool buffer at {int(b.data_ptr()):#x} is in none of its allocator's memfds {fds}")
    return out


def session_suffix(prefix: str, tp_rank: int, pp: tuple = (0, 1), cp: tuple = (0, 1), dp_group: int = -1) -> str:
    """`<prefix>[_dp<group>][_pp<stage>][_cp<slice>]_r<tp_rank>`: every rank coordinate of a
    scheduler. PP and CP come in HiCacheStorageConfig, as sglang's own HiCacheFile names files by
    them; a coordinate of size 1 is left out, so a deployment without them keeps
    `<prefix>_r<tp_rank>`. With DP attention, tp_rank is the rank inside the attention group (as
    sglang's HiCacheController sets it) and every group counts from 0, so the group is named too
    (`dp_group`, -1 without DP attention: attention_dp_group)."""
    name = prefix
    if dp_group >= 0:
        name += f"_dp{dp_group}"
    if pp[1] > 1:
        name += f"_pp{pp[0]}"
    if cp[1] > 1:
        name += f"_cp{cp[0]}"
    return f"{name}_r{tp_rank}"


def attention_dp_group() -> int:
    """This scheduler's DP-attention group, read as sglang's own HiCacheController reads it
    (from sglang.srt.layers.dp_attention); -1 without DP attention,
    where the group is not part of any name. Pages are the same model's in every group, so the
    group names the session only, never the stored objects (HiCacheFile's names have no DP part
    either)."""
    try:
        from sglang.srt.layers.dp_attention import get_attention_dp_rank, is_dp_attention_enabled
    except ImportError:  # an sglang without DP attention
        return -1
    return int(get_attention_dp_rank()) if is_dp_attention_enabled() else -1


class KvtdHiCacheStorage(PoolGroupCalls, HiCacheStorage):
    """One sglang rank's L3 through its kvtd daemon. Thread-safe: sglang calls it from its
    scheduler, prefetch, prefetch-io and backup threads at once. A hybrid model's pool group is
    one session of cache groups (pools.py; pool_calls.py has sglang's v2 calls)."""

    def __init__(self, storage_config, kwargs: Optional[Dict[str, Any]] = None):
        extra = dict(storage_config.extra_config or {})
        if not int(extra.get("interface_v1", 0)):
            raise ValueError('kvtd.sglang moves pages in place: set "interface_v1": 1 in the extra config '
                             "(sglang's other path copies every page through a tensor)")
        self._rank, self._tp = int(storage_config.tp_rank), int(storage_config.tp_size)
        self._mla = bool(storage_config.is_mla_model)
        # The pipeline stage and attention context-parallel slice (HiCacheStorageConfig): both in
        # the session's name and the stored objects' namespace, or stage 1 loads stage 0's layers.
        self._pp = (int(getattr(storage_config, "pp_rank", 0) or 0), int(getattr(storage_config, "pp_size", 1) or 1))
        self._cp = (int(getattr(storage_config, "attn_cp_rank", 0) or 0),
                    int(getattr(storage_config, "attn_cp_size", 1) or 1))
        self._suffix = session_suffix(str(extra.get("kvtd_session", "sglang")), self._rank, self._pp, self._cp,
                                      attention_dp_group())
        self._timeout = float(extra.get("kvtd_timeout_s", 5.0))
        if self._timeout <= 0:
            raise ValueError(f"kvtd_timeout_s must be positive, got {self._timeout}")
        self._weight_version = int(extra.get("kvtd_weight_version", 0))
        self._asked_for_shm = extra.get("allocator") == "shm"
        self._swa_window = int(extra.get("kvtd_swa_window_tokens", 0))
        self._session: Optional[Session] = None
        self._plan: Optional[PoolPlan] = None  # one pool (v1)
        self._hybrid: Optional[HybridPlan] = None  # a pool group: the KV pool is group 0
        self._kv_page = (0, 0)  # the KV pool's (page size, pages)
        self._page_bytes = 0
        self._lock = threading.Lock()  # _stats; _session is set once at registration, taken once by close
        # _version_lock: _weight_version and the session's copy of it, set together, so two clears
        # at once are two versions and the session is left at the last (an unlocked += lost one,
        # and the older value could be written to the session last).
        self._version_lock = threading.Lock()
        self._stats = {k: 0 for k in ("exists_calls", "pages_hit", "pages_missed", "pages_loaded", "pages_load_failed",
                                      "pages_stored", "pages_store_failed", "calls_failed", "clears")}
        self._last_warning = 0.0
        # --enable-metrics: each load's and store's pages and GB/s, handed to sglang's collector and
        # forgotten at each get_stats() (as sglang's own backends keep them); kept only when sglang
        # will ask, so nothing grows unread. Under _lock.
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._io = {k: [] for k in ("prefetch_pgs", "prefetch_bandwidth", "backup_pgs", "backup_bandwidth")}

    # -- sglang's registration ------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Registers the rank's host pool with a session of its own (sglang's HiCacheController
        calls it once, right after making the backend). A pool not in shared memory is refused by
        name."""
        super().register_mem_pool_host(mem_pool_host)
        entries = getattr(mem_pool_host, "entries", None)
        if entries is not None and hasattr(mem_pool_host, "anchor_entry"):  # memory_pool_host.HostPoolGroup
            self._register_pool_group(mem_pool_host)
            return
        self._check_shm(mem_pool_host)
        plan = plan_for(mem_pool_host, self._tp, self._mla, self._pp, self._cp)
        places = buffer_places(mem_pool_host, pool_buffers(mem_pool_host))
        tensors = [RankTensor(p.layer, p.kind, places[p.buffer][0], places[p.buffer][1] + p.offset, p.nbytes)
                   for p in plan.pieces]
        self._open(plan.geometry, tensors)
        self._plan = plan
        self._kv_page, self._page_bytes = (plan.page_size, plan.pages), plan.buffer_bytes // max(1, plan.pages)
        log.info("kvtd session %s for TP rank %d of %d (%s layout, %d pages of %d tokens); its daemon: %s",
                 self._suffix, self._rank, self._tp, mem_pool_host.layout, plan.pages, plan.page_size,
                 " ".join(daemon_command(plan.geometry, self._suffix, self._rank)))

    def _register_pool_group(self, group) -> None:
        """A hybrid model's HostPoolGroup (HybridCacheController registers it here, then each of
        its pools by register_mem_host_pool_v2): every pool a cache group of one session."""
        entries = sorted(group.entries, key=lambda e: pool_name(e.name) != "kv")  # the KV pool first
        for e in entries:
            self._check_shm(e.host_pool, pool_name(e.name))
        plan = plan_group([(pool_name(e.name), e.host_pool) for e in entries], tp_size=self._tp, mla=self._mla,
                          kv_plan=lambda host, mla: plan_for(host, self._tp, mla, self._pp, self._cp),
                          kv_buffers=pool_buffers, pp=self._pp, cp=self._cp, window_tokens=self._swa_window)
        tensors = []
        for p in plan.pieces:
            handle, base = buffer_places(p.host, [p.buffer])[0]
            tensors.append(RankTensor(p.layer, p.slot, handle, base + p.offset, p.nbytes))
        self._open(plan.groups, tensors)
        self._hybrid = plan
        kv = plan.pools["kv"]
        self._kv_page, self._page_bytes = (kv.index_unit, kv.blocks), plan.page_bytes
        log.info("kvtd session %s for TP rank %d of %d: sglang's pools %s as cache groups (%d-token pages); its "
                 "daemon: %s", self._suffix, self._rank, self._tp, ", ".join(plan.pools), plan.page_size,
                 " ".join(daemon_command(plan.groups, self._suffix, self._rank)))

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Each pool of the group, after register_mem_pool_host registered the group: it is in the
        session already. A pool added later (a sidecar sglang registers at run time) is not: its
        transfers fail, named, and the rest keep working."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name(host_pool_name)
        if self._hybrid is None or name not in self._hybrid.pools:
            log.error("kvtd session %s: sglang pool %r was registered after the session was made from the pool "
                      "group; its pages are never stored or loaded (restart sglang with it in the group)",
                      self._suffix, name)

    def _check_shm(self, mem_pool_host, name: str = "") -> None:
        """Refuses, by name, a pool the daemon cannot map (not in sglang's shm allocator)."""
        what = f"host pool {name!r}" if name else "host pool"
        fd = getattr(mem_pool_host, "fd", None)
        if fd is None and getattr(getattr(mem_pool_host, "allocator", None), "fds", None):
            fd = mem_pool_host.allocator.fds[0]  # a pool without HostKVCache's fd (Mamba's, the indexer's)
        if fd is None and self._asked_for_shm:
            # sglang chose the pool's allocator from the extra config's text, read as inline JSON
            # only (pool_host/common.py get_allocator_type): given as @file, "allocator" is unseen.
            raise ValueError(f'the extra config says "allocator": "shm", but sglang made the {what} in ordinary '
                             "memory: sglang reads \"allocator\" only from an extra config given inline as JSON "
                             "(pool_host/common.py get_allocator_type), not from an @file; give it inline")
        if fd is None:
            raise ValueError(f'kvtd.sglang reads and writes the {what} in place: set "allocator": "shm" in the '
                             "extra config (the pool then lives in a memfd its daemon can map)")

    def _open(self, layout, tensors) -> None:
        with self._version_lock:  # a clear during registration reaches the new session
            self._session = open_rank_session(self._suffix, layout, self._rank, tensors,
                                              weight_version=self._weight_version, only_rank=self._rank)

    def close(self) -> None:
        with self._lock:
            s, self._session = self._session, None
        if s is not None:
            s.close()

    # -- the bounded task -----------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _warn(self, what: str, why) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 5.0:  # a dead daemon would otherwise log every call
            self._last_warning = now
            log.warning("kvtd %s on %s: %s (counted as a miss or failed set)", what, self._suffix, why)

    def _run(self, what: str, submit):
        """`submit(session, deadline_ns)` -> task id; its result when the task succeeded, else
        None (the daemon down or late, the task failed, the call raised). Never raises."""
        s = self._session
        if s is None:
            self._warn(what, "no host pool registered")
            return None
        try:
            if not s.rank_alive(self._rank):
                why = f"rank {self._rank}'s daemon is not attached"
            else:
                tid = submit(s, now_ns() + int(self._timeout * 1e9))
                # past its time cancelled, and its final answer awaited: then sglang may reuse the pages
                r = task_outcome(s, tid, timeout=self._timeout, log_every=self._timeout)
                if r.ok:
                    return r
                why = f"{r.status_name}: {r.message}"
        except Exception as e:  # noqa: BLE001 - sglang's threads must live on
            why = e
        self._count("calls_failed", 1)
        self._warn(what, why)
        return None

    def _pages(self, keys, host_indices, unit: int = 0, count: int = 0) -> Optional[List[int]]:
        """The KV pool's page of each key (or, given `unit` and `count`, another pool's block:
        `unit` indices per key, `count` blocks), None if the indices do not name whole ones."""
        unit, count = (unit, count) if unit else self._kv_page
        pages = None if unit == 0 else pages_of(host_indices, len(keys), unit)
        if pages is None or any(p >= count for p in pages):
            self._warn("page indices", "host indices do not name whole pages of the registered pool (sglang's "
                                       "page-copying calls, as for draft KV, pass page data: those pages miss)")
            return None
        return pages

    def _kv_blocks(self, pages: List[int]):
        """A storage task's blocks for KV pool pages: the pages, or with a pool group the KV
        group's lists, naming no other pool's block."""
        return pages if self._hybrid is None else self._hybrid.blocks("kv", pages)

    # -- sglang's calls ---------------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many leading keys the store holds for this rank (sglang MIN-reduces it across
        ranks itself)."""
        if not keys:
            return 0
        self._count("exists_calls", 1)
        r = self._run("query", lambda s, dl: s.storage_query(list(keys), deadline_ns=dl))
        hits = r.blocks_done if r is not None else 0
        self._count("pages_hit", hits)
        self._count("pages_missed", len(keys) - hits)
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        """Loads each key's page into the host pool page sglang allocated for it, in place; True
        for the leading pages that arrived (sglang stops at the first False)."""
        if not keys:
            return []
        pages = self._pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        start = time.monotonic()
        blocks = self._kv_blocks(pages)
        r = self._run("load", lambda s, dl: s.storage_read(list(keys), blocks, deadline_ns=dl))
        done = min(len(keys), r.blocks_done) if r is not None else 0
        self._record_io("prefetch", done, time.monotonic() - start)
        self._count("pages_loaded", done)
        self._count("pages_load_failed", len(keys) - done)
        return [i < done for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        """Stores each key's page from the host pool, in place."""
        if not keys:
            return []
        pages = self._pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        start = time.monotonic()
        blocks = self._kv_blocks(pages)
        r = self._run("store", lambda s, dl: s.storage_write(list(keys), blocks, deadline_ns=dl))
        ok = r is not None
        self._record_io("backup", len(keys) if ok else 0, time.monotonic() - start)
        self._count("pages_stored" if ok else "pages_store_failed", len(keys))
        return [ok] * len(keys)

    # The page-at-a-time interface: `target_location` is the page's host indices, as for the
    # batch calls (a tensor of the page's bytes would be a copy, which kvtd does not make).
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        if target_location is None or not self.batch_get_v1([key], target_location)[0]:
            return None
        return self.mem_pool_host.get_data_page(int(target_location[0]), flat=True)

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        if target_locations is None:
            return [None] * len(keys)
        return [self.get(k, loc) for k, loc in zip(keys, target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return target_location is not None and self.batch_set_v1([key], target_location)[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        return target_locations is not None and all(self.set(k, None, loc) for k, loc in zip(keys, target_locations))

    def clear(self) -> None:
        """Everything stored so far misses from now on (the next weight version)."""
        self._count("clears", 1)
        with self._version_lock:
            self._weight_version += 1
            s = self._session
            if s is not None:
                try:
                    s.set_weight_version(self._weight_version)
                except Exception as e:  # noqa: BLE001
                    self._warn("clear", e)

    def set_weight_version(self, version: int) -> None:
        """After a weight update: KV stored under other weights never loads."""
        with self._version_lock:
            self._weight_version = int(version)
            s = self._session
            if s is not None:
                s.set_weight_version(self._weight_version)

    # -- metrics ---------------------------------------------------------------------------
    def _record_io(self, what: str, pages: int, seconds: float) -> None:
        """One call's pages moved and GB/s (GiB as sglang's gb_per_page counts them)."""
        if not self._metrics_on or pages <= 0:
            return
        gbps = pages * self._page_bytes / max(seconds, 1e-9) / (1 << 30)
        with self._lock:
            self._io[f"{what}_pgs"].append(pages)
            self._io[f"{what}_bandwidth"].append(gbps)

    def get_stats(self):
        """sglang's StorageMetrics for its collector (--enable-metrics: hiradix_cache.py calls this
        every event round and the collector asserts the type), the calls since the last one;
        None without metrics, as sglang's base backend answers."""
        if not self._metrics_on:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            io, self._io = self._io, {k: [] for k in self._io}
        return StorageMetrics(**io)

    def kvtd_stats(self) -> Dict[str, Any]:
        """kvtd's own counters of this backend (calls, pages hit, loaded, stored, failed, clears)."""
        with self._lock:
            out = dict(self._stats)
        with self._version_lock:
            out["weight_version"] = self._weight_version
        out["session"] = self._suffix
        return out
