"""The scheduler side of kvtd.vllm: vLLM's own CPUOffloadingManager over the daemons' host blocks,
told which of its blocks a daemon failed to store or load.

The manager runs in vLLM's scheduler process; the daemons' results reach it as host block ids in
KvtdWorkerMetadata, summed across workers by vLLM's own aggregation (OffloadingWorkerMetadata)
and handed to the connector's update_connector_output before vLLM completes the jobs (its
update_connector_output calls complete_store / complete_load once every worker acknowledged a
job; see docs/engines/vllm.md, 'Upstream behaviour relied on'). Host block ids identify a job's
blocks: the manager hands a block to one pending store at a time, and every rank's daemon pool
uses the manager's ids.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Dict, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadingEvent, OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from .storage import StorageTier, StorageWork, merge_answers


@dataclasses.dataclass
class KvtdWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus the host blocks whose kvtd store or load failed on this worker
    (on any worker, once aggregated). Plain data: pickled from each worker to the scheduler."""

    failed_store_blocks: Set[int] = dataclasses.field(default_factory=set)
    failed_load_blocks: Set[int] = dataclasses.field(default_factory=set)
    # Storage queries' and prefetches' answers: {id: (MIN blocks_done, workers that answered)}.
    storage_answers: Dict[int, Tuple[int, int]] = dataclasses.field(default_factory=dict)
    # Store jobs' backups that ended: {job id: (MIN backed up, workers that said)}.
    storage_backups: Dict[int, Tuple[int, int]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other):
        merged = super().aggregate(other)
        return KvtdWorkerMetadata(
            completed_jobs=merged.completed_jobs, transfer_stats=merged.transfer_stats,
            failed_store_blocks=self.failed_store_blocks | getattr(other, "failed_store_blocks", set()),
            failed_load_blocks=self.failed_load_blocks | getattr(other, "failed_load_blocks", set()),
            storage_answers=merge_answers(self.storage_answers, getattr(other, "storage_answers", {})),
            storage_backups=merge_answers(self.storage_backups, getattr(other, "storage_backups", {})))


class KvtdOffloadingManager(CPUOffloadingManager):
    """CPUOffloadingManager (its policies, events and accounting unchanged) that refuses to count a
    failed kvtd store as stored and forgets blocks a load could not read. Not thread-safe, like
    its base: vLLM calls it from the scheduler's thread only.

    A failure noted for a job that vLLM has discarded (its connector scheduler's reset_cache) can
    only make a later store of the same block id count as failed once: the safe direction (a
    miss, recomputed), and the note is cleared when the block is handed out again."""

    def __init__(self, *args, storage_ranks: int = 0, **kwargs):
        """storage_ranks: the workers whose daemons hold a storage tier behind this one (0: none)."""
        super().__init__(*args, **kwargs)
        self._failed_store_blocks: Set[int] = set()
        self._failed_load_blocks: Set[int] = set()
        self.storage: Optional[StorageTier] = StorageTier(storage_ranks) if storage_ranks > 0 else None

    def note_failures(self, store_blocks: Collection[int], load_blocks: Collection[int]) -> None:
        """Host blocks whose store / load failed on some rank (before their jobs complete)."""
        self._failed_store_blocks.update(int(b) for b in store_blocks)
        self._failed_load_blocks.update(int(b) for b in load_blocks)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext):
        out = super().prepare_store(keys, req_context)
        if out is not None:
            for key, b in zip(out.keys_to_store, out.store_spec.block_ids.tolist()):
                self._failed_store_blocks.discard(b)
                self._failed_load_blocks.discard(b)
                if self.storage is not None:
                    self.storage.pending_store_keys[b] = key
        return out

    # --- the storage tier behind this one (storage.py) ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = super().lookup(key, req_context)
        if result is not LookupResult.MISS or self.storage is None or req_context is None:
            return result
        return self.storage.lookup(key, req_context.req_id, self._promote)

    def _promote(self, key: OffloadKey) -> Optional[int]:
        """A host block for a key coming back from the store: write-pending, as for a store."""
        out = self.prepare_store([key], None)
        if out is None or not out.keys_to_store:
            return None
        block = int(out.store_spec.block_ids[0])
        self.storage.pending_store_keys.pop(block, None)  # no store job writes it
        return block

    def on_schedule_end(self, context) -> None:
        super().on_schedule_end(context)
        if self.storage is not None:
            self.storage.end_step()

    def on_request_finished(self, req_context: ReqContext) -> None:
        super().on_request_finished(req_context)
        if self.storage is not None:
            self.storage.request_finished(req_context.req_id)

    def has_pending_work(self) -> bool:
        return super().has_pending_work() or (self.storage is not None and self.storage.has_pending_work())

    def take_storage_work(self, store_jobs) -> Optional[StorageWork]:
        """The step's storage work for every worker (None without a storage tier)."""
        return self.storage.take_work(store_jobs) if self.storage is not None else None

    def note_storage_answers(self, answers: Dict[int, Tuple[int, int]]) -> None:
        if self.storage is not None and answers:
            self.storage.note_answers(answers, lambda keys, ok: keys and self.complete_store(keys, None, ok))

    def note_storage_backups(self, backups: Dict[int, Tuple[int, int]]) -> None:
        """Store jobs every rank backed up into the storage tier become STORAGE stored events in
        vLLM's own event path (CPUOffloadingManager's `events`, taken by take_events)."""
        if self.storage is not None and backups:
            self.storage.note_backups(backups, self._storage_stored)

    def _storage_stored(self, keys) -> None:
        if self.events is not None:
            self.events.append(OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=False))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        if success and self._failed_store_blocks:
            failed = []
            for key in keys:
                block = self._policy.get(key)
                if block is not None and not block.is_ready and block.block_id in self._failed_store_blocks:
                    self._failed_store_blocks.discard(block.block_id)
                    failed.append(key)
            if failed:
                super().complete_store(failed, req_context, success=False)  # removed, blocks freed
                gone = set(failed)
                keys = [k for k in keys if k not in gone]
        super().complete_store(keys, req_context, success)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().complete_load(keys, req_context)
        if not self._failed_load_blocks:
            return
        dropped = []
        for key in keys:
            block = self._policy.get(key)
            if block is None or block.block_id not in self._failed_load_blocks or block.ref_cnt != 0:
                continue  # still read by another load: dropped when that one completes
            # What CPUOffloadingManager does to an evicted block (its prepare_store): out of the
            # policy, no longer evictable, back to the free list, a removal event.
            self._failed_load_blocks.discard(block.block_id)
            self._policy.remove(key)
            self._num_evictable_cache_blocks -= 1
            self._free_block(block)
            dropped.append(key)
        if dropped and self.events is not None:
            self.events.append(OffloadingEvent(keys=dropped, medium=self.medium, removed=True))

    def reset_cache(self) -> None:
        super().reset_cache()
        self._failed_store_blocks.clear()
        self._failed_load_blocks.clear()
        if self.storage is not None:
            self.storage.reset()
