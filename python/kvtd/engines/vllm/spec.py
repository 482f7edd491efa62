"""kvtd as vLLM's native KV offloading spec, loaded by vLLM's own factory:

    --kv-transfer-config '{"kv_connector": "KvtdOffloadingConnector", "kv_connector_module_path": "kvtd.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm",
        "kvtd_host_blocks": 65536, "kvtd_session": "vllm"}}'

with one kvtd daemon per rank serving session `<kvtd_session>_r<rank>` (README, "vLLM"); with data
parallelism `<kvtd_session>_dp<index>_r<rank>` (session_suffix).

vLLM constructs the spec in its scheduler process and in every worker process
(OffloadingSpecFactory.create_spec, called by OffloadingConnector's constructor in each; the vLLM
code this module relies on is listed in docs/engines/vllm.md, 'Upstream behaviour relied on').
The scheduler side is vLLM's own CPUOffloadingManager over the daemons' host blocks (its LRU or
ARC policy decides what lives there; kvtd only moves bytes). Each worker (one process per TP rank)
makes a kvtd session serving its rank alone (`<kvtd_session>_r<rank>`, Session(only_rank=rank)),
registers its canonical KV tensors (CUDA IPC handles on a GPU, shared memory on the host backend)
and turns submit_store / submit_load into swaps on its rank's daemon; the host tier is that
daemon's pool, so it outlives the worker. vLLM's connector scheduler waits for every rank's
acknowledgement of a job, which is the cross-rank agreement.

Failures. vLLM's worker asserts every job succeeded ("we currently do not support job
failures"), so a kvtd task that fails is reported finished (success=True) and its failure travels
beside it, in the worker metadata vLLM already carries from every worker to the scheduler
(KvtdWorkerMetadata; the model runner calls get_finished, then get_block_ids_with_load_errors,
then build_connector_worker_meta, in that order, each step, in vLLM's KV connector model-runner
mixin):
- a failed store: its host blocks reach the scheduler's KvtdOffloadingManager, which completes the
  job's keys whose block failed on any rank with success=False (vLLM's own path for a failed
  store: the keys are removed and their blocks freed), so no lookup ever hits a key some rank's
  daemon did not store;
- a failed load: its GPU blocks are returned from get_block_ids_with_load_errors in the pass in
  which get_finished reports the request, so vLLM recomputes them instead of running on bytes that
  did not arrive (with vLLM's default `"kv_load_failure_policy": "fail"` the request fails
  instead); its host blocks reach the manager too, which drops
  those keys once no load holds them (a daemon that lost its pool would otherwise fail every load
  of them again).
A job is reported finished only once every daemon of the rank reported its task final, so no
daemon writes into GPU blocks vLLM was told to recompute. Under vLLM's plain OffloadingConnector
(nothing carries the failures) a failed job is reported failed: vLLM's worker asserts and stops,
the loud outcome instead of a silent wrong byte.

A storage tier behind the host tier: `"kvtd_storage": true` with daemons that have a store and
`--write-policy write_through` (storage.py says how it is driven).

Replicated layouts (MLA): the spec leaves `replicated_layout` False, so every rank stores its own
copy into its own daemon's pool (vLLM's CPU spec lets rank 0 write one copy into a region the
ranks share; kvtd's pools are per rank). The storage tier follows vLLM's
OffloadingConfig.replicated_layout: set (a pure-MLA, TP-only deployment), rank 0's daemon stores
one copy every rank reads; otherwise each rank stores and reads its own (the session and the
daemon declare it: KvIdentity, `--kv-layout`, never inferred from the tensors).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional, Set

from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingManager,
                                     OffloadingSpec, OffloadingWorker, TransferResult)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from ...geometry import Geometry
from ...places import tensor_location
from .layout import block_ids, bytes_per_block, geometry_of
from ..rank import RankTensor, daemon_command, open_rank_session, polled_outcome, task_outcome
from .manager import KvtdOffloadingManager, KvtdWorkerMetadata
from .storage import WorkerStorage

log = logging.getLogger("kvtd.vllm")


def session_suffix(prefix: str, rank: int, dp_index: int = 0, dp_size: int = 1) -> str:
    """`<prefix>[_dp<index>]_r<rank>`: a worker's session, named by every coordinate that tells
    two of them apart on one node: its rank in its engine and, with data parallelism, its
    engine's DP index (each DP engine's workers count their ranks from 0, so one
    `"kvtd_session"` for every engine of a DP deployment made them meet in one name)."""
    return f"{prefix}_dp{dp_index}_r{rank}" if dp_size > 1 else f"{prefix}_r{rank}"


def refused_option(config, extra_config) -> Optional[str]:
    """Why an option of vLLM's offloading config cannot be served by kvtd (None: all can), named as
    the user wrote it, so vLLM stops at start instead of running without what was asked.
    - `canonical_layout` (vLLM's CPU worker then writes topology-free pages): kvtd moves each
      worker's pages as the worker holds them and names its stored objects by the rank's layout
      (KvIdentity per_rank), so its pages are not readable at another TP.
    - `secondary_tiers`: vLLM's SecondaryTierManager reads the primary tier through a memoryview
      of vLLM's CPU region in the scheduler process; with kvtd the host tier is each rank's
      daemon's pool, never in the scheduler. kvtd's own storage tier is "kvtd_storage": true."""
    if bool(getattr(config, "canonical_layout", False)) or bool(extra_config.get("canonical_layout", False)):
        return ('kvtd.vllm does not serve "canonical_layout": it moves each worker\'s pages as the worker holds them '
                "and stores them per rank (not readable at another TP); remove canonical_layout from "
                "kv_connector_extra_config")
    if extra_config.get("secondary_tiers"):
        return ('kvtd.vllm does not take "secondary_tiers": vLLM\'s secondary tiers read its CPU tier in the '
                "scheduler process, and kvtd's host tier is in its daemons; use kvtd's storage tier "
                '("kvtd_storage": true and a store on each daemon) instead')
    return None


class KvtdOffloadingSpec(OffloadingSpec):
    """The spec vLLM loads by `spec_name` / `spec_module_path`."""

    @classmethod
    def build_metric_definitions(cls, extra_config):
        """What the scheduler's manager reports with metrics on: it is vLLM's CPUOffloadingManager
        underneath (manager.py), whose get_stats() sets three gauges and observes one histogram
        (and, with store_threshold >= 2, counts skipped stores); vLLM's Prometheus layer defines
        only these and asserts every key it is handed is defined."""
        from vllm.v1.kv_offload.base import (OffloadingCounterMetadata, OffloadingGaugeMetadata,
                                             OffloadingHistogramMetadata)
        from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as names

        definitions = {
            names.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of kvtd's host blocks held by KV or by transfers in flight (0 to 1)."),
            names.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of kvtd's host blocks being written by stores not yet complete (0 to 1)."),
            names.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of kvtd's host blocks in use other than by pending stores (0 to 1)."),
            names.CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
                documentation="Host blocks asked for by each prepare_store of the scheduler.",
                buckets=tuple(float(4**i) for i in range(10))),
        }
        if int(extra_config.get("store_threshold", 0)) >= 2:  # the manager counts skipped stores then
            definitions[names.STORES_SKIPPED] = OffloadingCounterMetadata(
                documentation="Stores the scheduler skipped: the block was not looked up store_threshold times.")
        return definitions

    def __init__(self, config):
        super().__init__(config)
        x = self.extra_config
        refused = refused_option(config, x)
        if refused:
            raise ValueError(refused)
        if self.blocks_per_chunk != 1:
            raise ValueError(f"kvtd.vllm moves whole GPU blocks: blocks_per_chunk is {self.blocks_per_chunk}, "
                             "set the offloaded block size to the GPU block size")
        self.num_blocks = int(x.get("kvtd_host_blocks", 0))
        if self.num_blocks <= 0:  # vLLM's CPU spec's meaning: the bytes of every worker's copy together
            cpu_bytes = int(x.get("cpu_bytes_to_use", 0))
            per_block = int(config.worker_kv_bytes_per_block) * max(1, int(config.parallel.world_size))
            self.num_blocks = cpu_bytes // per_block if per_block > 0 else 0
        if self.num_blocks <= 0:
            raise ValueError('kvtd.vllm needs the host tier\'s size: "kvtd_host_blocks" (blocks per rank) or '
                             '"cpu_bytes_to_use" in kv_connector_extra_config')
        self.session_prefix = str(x.get("kvtd_session", f"vllm_{config.engine_id}"))
        self.ready_timeout = float(x.get("kvtd_ready_timeout_s", 120.0))
        # A storage tier behind the host tier: the daemons run with a store and --write-policy
        # write_through (storage.py).
        self.storage = bool(x.get("kvtd_storage", False))
        self.weight_version = int(x.get("kvtd_weight_version", 0))
        self._manager: Optional[OffloadingManager] = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            x = self.extra_config
            # vLLM's CPU spec options, passed as its own get_manager passes them:
            # the manager underneath is vLLM's, so each means what it means there.
            self._manager = KvtdOffloadingManager(num_blocks=self.num_blocks,
                                                 cache_policy=x.get("eviction_policy", "lru"),
                                                 cache_policy_module_path=x.get("cache_policy_module_path"),
                                                 enable_events=self.kv_events_config.enable_kv_cache_events,
                                                 store_threshold=int(x.get("store_threshold", 0)),
                                                 max_tracker_size=int(x.get("max_tracker_size", 64_000)),
                                                 storage_ranks=self.config.parallel.world_size if self.storage else 0)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return KvtdOffloadingWorker(self, kv_caches)


@dataclasses.dataclass
class _Job:
    task_id: int
    is_load: bool
    gpu_blocks: List[int]
    host_blocks: List[int]
    nbytes: int
    started: float
    event: object = None  # the engine's ordering event, alive until the swap completed


class KvtdOffloadingWorker(OffloadingWorker):
    """One worker rank's transfers through its daemon. Called from the model runner's thread."""

    def __init__(self, spec: KvtdOffloadingSpec, kv_caches: CanonicalKVCaches):
        p = spec.config.parallel
        self._rank, self._world = int(p.rank), int(p.world_size)
        groups = spec.config.groups
        self._geometry = geometry_of(kv_caches, self._world, spec.num_blocks,
                                     replicated=bool(spec.config.replicated_layout), dtype=spec.config.model.dtype,
                                     block_tokens=int(groups[0].tokens_per_block) if groups else 16)
        grouped = not isinstance(self._geometry, Geometry)
        if grouped and spec.storage:
            raise ValueError('"kvtd_storage" with KV tensors whose pages differ in size: kvtd\'s storage tier stores '
                             "cache groups by their attention kinds, which vLLM's offloading spec does not say; serve "
                             "this model with the host tier alone (remove kvtd_storage)")
        self._bytes_per_block = bytes_per_block(self._geometry)
        self.suffix = session_suffix(spec.session_prefix, self._rank, int(p.data_parallel_index),
                                     int(p.data_parallel_size))
        tensors = []
        for i, t in enumerate(kv_caches.tensors):  # tensor i is layer i of the geometry (slot 0 of its group's)
            handle, offset, nbytes, device = tensor_location(t.tensor)
            tensors.append(RankTensor(i, 0 if grouped else "key", handle, offset, nbytes, device))
        s = open_rank_session(self.suffix, self._geometry, self._rank, tensors, only_rank=self._rank)
        self._device = device if device >= 0 else None  # CUDA ordinal of the KV tensors
        self.daemon_command = daemon_command(self._geometry, self.suffix, self._rank, device)
        log.info("kvtd session %s published; rank %d's daemon: %s", self.suffix, self._rank,
                 " ".join(self.daemon_command))
        self._session = s
        if spec.weight_version:
            s.set_weight_version(spec.weight_version)
        self.storage = WorkerStorage(s, log)
        self._jobs: Dict[int, _Job] = {}
        self._done: List[TransferResult] = []
        self.failed_loads: Set[int] = set()  # GPU blocks whose load failed (to recompute)
        self._failed_host_stores: Set[int] = set()  # host blocks, for the scheduler's manager
        self._failed_host_loads: Set[int] = set()
        # Set by KvtdOffloadingConnector: failures reach vLLM beside the jobs, so a failed job may be
        # reported finished. Under vLLM's plain OffloadingConnector a failed job is reported failed.
        self.failures_reach_vllm = False
        try:
            s.wait_ready(spec.ready_timeout)
        except Exception as e:  # noqa: BLE001 - transfers fail (and are recorded) until it is there
            log.warning("kvtd session %s: rank %d's daemon is not ready (%s); start it as: %s", self.suffix,
                        self._rank, e, " ".join(self.daemon_command))

    def _ordering_event(self):
        """(event, handles) that order this swap after the GPU work queued before it, or (None, None)
        for host tensors. vLLM's own CPU worker makes its copy stream wait on the compute stream
        before every transfer (stores must wait for the model to finish writing the KV they read;
        loads for pending writes to their destination): kvtd's daemon
        waits on the GPU for an interprocess event recorded here on the current stream. The session
        takes one handle per rank of its geometry; this worker's session is served by its own
        rank's daemon only, so the other places hold zeros nobody reads."""
        if self._device is None:
            return None, None
        import torch

        event = torch.cuda.Event(interprocess=True)  # timing off, as interprocess events need
        event.record(torch.cuda.current_stream(self._device))
        handle = bytes(event.ipc_handle())
        return event, [handle if r == self._rank else bytes(len(handle)) for r in range(self._world)]

    def _submit(self, job_id: int, is_load: bool, gpu: List[int], host: List[int]) -> bool:
        nbytes = len(gpu) * self._bytes_per_block
        keys = None if is_load else self.storage.keys_of_store(job_id)
        try:
            event, handles = self._ordering_event()
            g, h = block_ids(self._geometry, gpu, host=False), block_ids(self._geometry, host, host=True)
            tid = (self._session.swap_to_device(h, g, engine_events=handles) if is_load else
                   self._session.swap_to_host(g, h, keys=keys, engine_events=handles))
            if keys is not None:
                self.storage.backup_submitted(tid, job_id)
        except Exception as e:  # noqa: BLE001 - vLLM asserts the submit succeeded
            log.warning("kvtd %s of job %d not submitted: %s", "load" if is_load else "store", job_id, e)
            if keys is not None:
                self.storage.backup_not_submitted(job_id)
            self._record_failure(is_load, gpu, host)
            self._done.append(TransferResult(job_id, False, nbytes, 0.0))
            return True
        self._jobs[job_id] = _Job(tid, is_load, gpu, host, nbytes, time.monotonic(), event)
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, False, [int(b) for b in src_spec.block_ids], [int(b) for b in dst_spec.block_ids])

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, True, [int(b) for b in dst_spec.block_ids], [int(b) for b in src_spec.block_ids])

    def _record_failure(self, is_load: bool, gpu: List[int], host: List[int]) -> None:
        if is_load:
            self.failed_loads.update(gpu)
            self._failed_host_loads.update(host)
        else:
            self._failed_host_stores.update(host)

    def _finish(self, job_id: int, job: _Job, result) -> None:
        if not result.ok:
            log.warning("kvtd %s of job %d failed: %s: %s", "load" if job.is_load else "store", job_id,
                        result.status_name, result.message)
            self._record_failure(job.is_load, job.gpu_blocks, job.host_blocks)
        self._done.append(TransferResult(job_id, bool(result.ok), job.nbytes, time.monotonic() - job.started))

    def get_finished(self) -> List[TransferResult]:
        self.storage.poll()
        for job_id, job in list(self._jobs.items()):
            r = polled_outcome(self._session, job.task_id)
            if r is None:
                continue
            del self._jobs[job_id]
            self._finish(job_id, job, r)
        out, self._done = self._done, []
        if self.failures_reach_vllm:  # carried beside the job by KvtdOffloadingConnector
            return [TransferResult(r.job_id, True, r.transfer_size, r.transfer_time) for r in out]
        for r in out:
            if not r.success:
                log.error('kvtd job %d failed and vLLM was not told which blocks: run kvtd.vllm with "kv_connector": '
                          '"KvtdOffloadingConnector", "kv_connector_module_path": "kvtd.vllm"; reporting the job '
                          'failed (vLLM stops rather than run on KV that did not arrive)', r.job_id)
        return out

    def wait(self, job_ids: Set[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.pop(job_id, None)
            if job is not None:
                self._finish(job_id, job, task_outcome(self._session, job.task_id))

    def wait_ready(self, timeout: float) -> None:
        """Until this rank's daemon is attached (after it was restarted, say)."""
        self._session.wait_ready(timeout)

    def take_failed_loads(self) -> Set[int]:
        """GPU blocks of failed loads since the last call (vLLM recomputes them)."""
        out, self.failed_loads = self.failed_loads, set()
        return out

    def take_failed_host_blocks(self):
        """(store, load) host blocks that failed since the last call, for the scheduler's manager."""
        out = (self._failed_host_stores, self._failed_host_loads)
        self._failed_host_stores, self._failed_host_loads = set(), set()
        return out

    def shutdown(self) -> None:
        self.wait(set(self._jobs))
        self._session.close()


class KvtdOffloadingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector, carrying kvtd's failures (a failed load's GPU blocks to vLLM's
    recompute path, failed stores' and loads' host blocks to the scheduler's manager) and the
    storage tier's work (storage.py) both ways."""

    def _kvtd_worker(self) -> Optional[KvtdOffloadingWorker]:
        w = self.connector_worker
        return w.worker if w is not None and isinstance(w.worker, KvtdOffloadingWorker) else None

    def _kvtd_manager(self) -> Optional[KvtdOffloadingManager]:
        s = self.connector_scheduler
        return s.manager if s is not None and isinstance(s.manager, KvtdOffloadingManager) else None

    # --- worker side ---

    def handle_preemptions(self, kv_connector_metadata) -> None:
        w = self._kvtd_worker()
        if w is not None:  # flushed stores are submitted here, with this step's keys
            w.storage.note_store_keys(getattr(kv_connector_metadata, "kvtd", None))
        super().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        super().start_load_kv(forward_context, **kwargs)
        w = self._kvtd_worker()
        if w is not None:
            w.storage.submit(getattr(self._connector_metadata, "kvtd", None))

    def get_finished(self, finished_req_ids):
        w = self._kvtd_worker()
        if w is not None:
            w.failures_reach_vllm = True  # this connector carries them (below)
            # vLLM queues this step's stores for the next step's start.
            w.storage.note_store_keys(getattr(self._connector_metadata, "kvtd", None))
        return super().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        w = self._kvtd_worker()
        return w.take_failed_loads() if w is not None else set()

    def build_connector_worker_meta(self):
        meta = super().build_connector_worker_meta()
        w = self._kvtd_worker()
        if w is None:
            return meta
        stores, loads = w.take_failed_host_blocks()
        answers, backups = w.storage.take_answers(), w.storage.take_backups()
        if meta is None and not stores and not loads and not answers and not backups:
            return None
        # Every worker hands out KvtdWorkerMetadata, so vLLM's pairwise aggregate keeps the failures.
        base = meta if meta is not None else OffloadingWorkerMetadata()
        return KvtdWorkerMetadata(completed_jobs=base.completed_jobs, transfer_stats=base.transfer_stats,
                                  failed_store_blocks=stores, failed_load_blocks=loads, storage_answers=answers,
                                  storage_backups=backups)

    # --- scheduler side ---

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        m = self._kvtd_manager()
        if m is not None:
            work = m.take_storage_work(meta.store_jobs)
            if work is not None and not work.empty():
                meta.kvtd = work
        return meta

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        m = self._kvtd_manager()
        if isinstance(meta, KvtdWorkerMetadata) and m is not None:
            m.note_failures(meta.failed_store_blocks, meta.failed_load_blocks)
            m.note_storage_answers(meta.storage_answers)
            m.note_storage_backups(meta.storage_backups)
        super().update_connector_output(connector_output)
