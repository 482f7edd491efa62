"""kvtd as vLLM's native KV offloading spec (vLLM main 017e9f44), loaded by vLLM's own factory:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm",
        "kvtd_host_blocks": 65536, "kvtd_session": "vllm"}}'

vLLM constructs the spec in its scheduler process and in every worker process
(OffloadingSpecFactory.create_spec, v1/kv_offload/factory.py:52-56; offloading_connector.py:61-82).
The scheduler side is vLLM's own CPUOffloadingManager over the daemons' host blocks (its LRU or
ARC policy decides what lives there; kvtd only moves bytes). Each worker (one process per TP rank)
makes a kvtd session serving its rank alone (`<kvtd_session>_r<rank>`, Session(only_rank=rank)),
registers its canonical KV tensors (CUDA IPC handles on a GPU, shared memory on the host backend)
and turns submit_store / submit_load into swaps on its rank's daemon; the host tier is that
daemon's pool, so it outlives the worker. vLLM waits for every rank's acknowledgement of a job
(scheduler.py:1549-1568), which is the cross-rank agreement.

Failures (vLLM's worker asserts every job succeeded, offloading/worker.py:313-330, 361): a failed
kvtd job is reported finished, and recorded. Use `"kv_connector": "KvtdOffloadingConnector",
"kv_connector_module_path": "kvtd.vllm"` with `"kv_load_failure_policy": "recompute"`: the
connector returns a failed load's GPU blocks from get_block_ids_with_load_errors, in the same pass
in which get_finished reported the request (vLLM calls the two in that order, after each step), so
vLLM recomputes them instead of running on bytes that did not arrive. WORK IN PROGRESS (branch
vllm-wip): failed stores are recorded but the scheduler's manager still counts them stored, and a
store refused before its daemon saw it leaves the host blocks' validity as it was (possibly an
evicted key's older bytes, which a later load would take): not for use until that is closed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional, Set

from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingManager,
                                     OffloadingSpec, OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .fastdeploy_v1_support import tensor_location
from .geometry import Geometry
from .session import Session

log = logging.getLogger("kvtd.vllm")


class KvtdOffloadingSpec(OffloadingSpec):
    """The spec vLLM loads by `spec_name` / `spec_module_path`."""

    def __init__(self, config):
        super().__init__(config)
        x = self.extra_config
        if self.blocks_per_chunk != 1:
            raise ValueError(f"kvtd.vllm moves whole GPU blocks: blocks_per_chunk is {self.blocks_per_chunk}, "
                             "set the offloaded block size to the GPU block size")
        self.num_blocks = int(x.get("kvtd_host_blocks", 0))
        if self.num_blocks <= 0:
            cpu_bytes = int(x.get("cpu_bytes_to_use", 0))
            per_block = int(config.worker_kv_bytes_per_block)
            self.num_blocks = cpu_bytes // per_block if per_block > 0 else 0
        if self.num_blocks <= 0:
            raise ValueError('kvtd.vllm needs the host tier\'s size: "kvtd_host_blocks" (blocks per rank) or '
                             '"cpu_bytes_to_use" in kv_connector_extra_config')
        self.session_prefix = str(x.get("kvtd_session", f"vllm_{config.engine_id}"))
        self.ready_timeout = float(x.get("kvtd_ready_timeout_s", 120.0))
        self._manager: Optional[OffloadingManager] = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(num_blocks=self.num_blocks,
                                                 cache_policy=self.extra_config.get("eviction_policy", "lru"),
                                                 enable_events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return KvtdOffloadingWorker(self, kv_caches)


def geometry_of(kv_caches: CanonicalKVCaches, world_size: int, host_blocks: int) -> Geometry:
    """kvtd's geometry of a worker's canonical tensors: each (num_blocks, page bytes), pairs of
    them as a layer's key and value (a single tensor, e.g. a cross-layer slab, is key only)."""
    tensors = [t.tensor for t in kv_caches.tensors]
    if not tensors:
        raise ValueError("vLLM handed kvtd no KV cache tensors")
    num_blocks = int(tensors[0].shape[0])
    row = [int(t.numel()) * int(t.element_size()) // max(1, int(t.shape[0])) for t in tensors]
    for i, t in enumerate(tensors):
        if int(t.shape[0]) != num_blocks or row[i] != row[0] or not t.is_contiguous():
            raise ValueError(f"canonical KV tensor {i} is {tuple(t.shape)} ({row[i]} bytes per block): kvtd needs "
                             f"every tensor contiguous with {num_blocks} blocks of {row[0]} bytes (not yet: "
                             "groups of different page sizes)")
    shape = (num_blocks, 1, 1, row[0])
    paired = len(tensors) % 2 == 0
    return Geometry(num_ranks=world_size, num_layers=len(tensors) // 2 if paired else len(tensors), key_shape=shape,
                    value_shape=shape if paired else None, dtype="uint8", num_host_blocks=host_blocks)


@dataclasses.dataclass
class _Job:
    task_id: int
    is_load: bool
    gpu_blocks: List[int]
    nbytes: int
    started: float


class KvtdOffloadingWorker(OffloadingWorker):
    """One worker rank's transfers through its daemon. Called from the model runner's thread."""

    def __init__(self, spec: KvtdOffloadingSpec, kv_caches: CanonicalKVCaches):
        p = spec.config.parallel
        self._rank, self._world = int(p.rank), int(p.world_size)
        self._geometry = geometry_of(kv_caches, self._world, spec.num_blocks)
        self._block_bytes = self._geometry.block_bytes("key")
        self._tensors = len(kv_caches.tensors)
        self.suffix = f"{spec.session_prefix}_r{self._rank}"
        s = Session(self.suffix, self._geometry, only_rank=self._rank)
        try:
            paired = self._geometry.value_shape is not None
            for i, t in enumerate(kv_caches.tensors):
                handle, offset, nbytes, device = tensor_location(t.tensor)
                layer, kind = (i // 2, "key" if i % 2 == 0 else "value") if paired else (i, "key")
                s.register_tensor(self._rank, layer, kind, handle, offset, nbytes, device_id=device)
            s.publish()
        except Exception:
            s.close()
            raise
        self._session = s
        self._jobs: Dict[int, _Job] = {}
        self._done: List[TransferResult] = []
        self.failed_loads: Set[int] = set()  # GPU blocks whose load failed (to recompute)
        self.failed_stores: Set[int] = set()  # job ids whose store failed (not stored)
        try:
            s.wait_ready(spec.ready_timeout)
        except Exception as e:  # noqa: BLE001 - transfers fail (and are recorded) until it is there
            log.warning("kvtd session %s: rank %d's daemon is not ready (%s)", self.suffix, self._rank, e)

    def _submit(self, job_id: int, is_load: bool, gpu: List[int], host: List[int]) -> bool:
        nbytes = len(gpu) * self._block_bytes * self._tensors
        try:
            tid = (self._session.swap_to_device(host, gpu) if is_load else self._session.swap_to_host(gpu, host))
        except Exception as e:  # noqa: BLE001 - vLLM asserts the submit succeeded
            log.warning("kvtd %s of job %d not submitted: %s", "load" if is_load else "store", job_id, e)
            self._record_failure(job_id, is_load, gpu)
            self._done.append(TransferResult(job_id, True, nbytes, 0.0))
            return True
        self._jobs[job_id] = _Job(tid, is_load, gpu, nbytes, time.monotonic())
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, False, [int(b) for b in src_spec.block_ids], [int(b) for b in dst_spec.block_ids])

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, True, [int(b) for b in dst_spec.block_ids], [int(b) for b in src_spec.block_ids])

    def _record_failure(self, job_id: int, is_load: bool, gpu: List[int]) -> None:
        if is_load:
            self.failed_loads.update(gpu)
        else:
            self.failed_stores.add(job_id)

    def _finish(self, job_id: int, job: _Job, result) -> None:
        if not result.ok:
            log.warning("kvtd %s of job %d failed: %s: %s", "load" if job.is_load else "store", job_id,
                        result.status_name, result.message)
            self._record_failure(job_id, job.is_load, job.gpu_blocks)
        self._done.append(TransferResult(job_id, True, job.nbytes, time.monotonic() - job.started))

    def get_finished(self) -> List[TransferResult]:
        for job_id, job in list(self._jobs.items()):
            try:
                r = self._session.poll(job.task_id, check=False)
            except Exception as e:  # noqa: BLE001
                log.warning("kvtd job %d: %s", job_id, e)
                r = self._session.final_result(job.task_id, cancel=False)
            if r is None:
                continue
            del self._jobs[job_id]
            self._finish(job_id, job, r)
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: Set[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.pop(job_id, None)
            if job is not None:
                self._finish(job_id, job, self._session.final_result(job.task_id, cancel=False))

    def take_failed_loads(self) -> Set[int]:
        out, self.failed_loads = self.failed_loads, set()
        return out

    def shutdown(self) -> None:
        self.wait(set(self._jobs))
        self._session.close()


class KvtdOffloadingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector, telling vLLM which GPU blocks a kvtd load did not fill."""

    def get_block_ids_with_load_errors(self) -> Set[int]:
        w = self.connector_worker
        if w is None or not isinstance(w.worker, KvtdOffloadingWorker):
            return set()
        return w.worker.take_failed_loads()
