"""kvtd's storage tier behind vLLM's CPU tier, routed through the connector.

vLLM's scheduler decides and the workers' daemons move; the scheduler has no session of its own
(each rank's session has one producer, its worker), so the storage work rides the channels vLLM
already has: scheduler -> workers in the connector metadata (StorageWork, as `meta.kvtd`), workers
-> scheduler in the worker metadata (KvtdWorkerMetadata's answers, summed across workers).

- Stores write through: a store job's keys reach its worker, whose swap into the host blocks
  carries them, so its daemon backs the blocks up into the store (`--write-policy
  write_through`) in the order kvtd keeps for tasks on the same blocks (a later swap into a host
  block waits for the backup still reading it).
- Each worker reports its backups' ends beside the answers; once every rank backed a store job
  up, the scheduler's manager emits a STORAGE stored event of its keys into vLLM's own event path
  (offloading/events.py turns it into BlockStored with the block hashes of the CPU tier's event
  of the same keys), so a router joins a block's CPU and STORAGE events.
- A key the CPU tier misses is asked of the store: lookup answers RETRY (vLLM asks again next
  step), a STORAGE_QUERY of the request's missing keys runs on every rank, and the answer is the
  MIN of the ranks' leading hits (each daemon answers for its rank's slice). Keys every rank holds
  are promoted: host blocks are allocated as for a store (write-pending, HIT_PENDING) and a
  PREFETCH loads them on every rank; the keys every rank loaded complete as stored (CPU HIT, then
  vLLM's own load to the GPU), the others as failed.
Objects are named by each daemon's --model-id, the geometry's layout and the weight version
(`"kvtd_weight_version"`): vLLM's block hashes do not cover the weights. The vLLM code this
module relies on is listed in docs/engines/vllm.md, 'Upstream behaviour relied on'.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Set, Tuple

from vllm.v1.kv_offload.base import LookupResult, OffloadKey

from ..rank import polled_outcome


def key_name(key: OffloadKey) -> str:
    """The storage key of a vLLM offload key (block hash + group index): hex, a name every store takes."""
    return bytes(key).hex()


@dataclasses.dataclass
class StorageWork:
    """What the scheduler asks of every worker this step (plain data, pickled to the workers)."""

    store_keys: Dict[int, List[str]] = dataclasses.field(default_factory=dict)  # store job -> key per host block
    queries: Dict[int, List[str]] = dataclasses.field(default_factory=dict)  # query id -> keys, prefix order
    prefetches: Dict[int, Tuple[List[str], List[int]]] = dataclasses.field(default_factory=dict)  # id -> keys, blocks

    def empty(self) -> bool:
        return not (self.store_keys or self.queries or self.prefetches)


def merge_answers(a: Dict[int, Tuple[int, int]], b: Dict[int, Tuple[int, int]]) -> Dict[int, Tuple[int, int]]:
    """{id: (MIN blocks_done, ranks reported)} of two workers' answers."""
    out = dict(a)
    for k, (done, ranks) in b.items():
        mine = out.get(k)
        out[k] = (done, ranks) if mine is None else (min(mine[0], done), mine[1] + ranks)
    return out


@dataclasses.dataclass
class _Request:
    asked: Set[OffloadKey] = dataclasses.field(default_factory=set)
    present: Set[OffloadKey] = dataclasses.field(default_factory=set)
    absent: Set[OffloadKey] = dataclasses.field(default_factory=set)
    to_query: List[OffloadKey] = dataclasses.field(default_factory=list)
    to_promote: List[Tuple[OffloadKey, int]] = dataclasses.field(default_factory=list)
    finished: bool = False


class StorageTier:
    """The scheduler's side: per request, which of its keys the store holds (agreed across ranks),
    and the queries and promotions in flight. Called from vLLM's scheduler thread only."""

    def __init__(self, world_size: int):
        self._world = world_size
        self._ids = itertools.count(1)
        self._requests: Dict[str, _Request] = {}
        self._queries: Dict[int, Tuple[str, List[OffloadKey]]] = {}
        self._prefetches: Dict[int, Tuple[str, List[OffloadKey]]] = {}
        self._answers: Dict[int, Tuple[int, int]] = {}  # queries' and prefetches' ids share one counter
        self._backing: Dict[int, List[OffloadKey]] = {}  # store job -> its keys, until every rank backed it up
        self._backups: Dict[int, Tuple[int, int]] = {}  # store job -> (MIN backed up, ranks that said)
        self._outbox = StorageWork()
        self.pending_store_keys: Dict[int, OffloadKey] = {}  # host block -> key of a store in preparation

    def lookup(self, key: OffloadKey, req_id: str, promote) -> LookupResult:
        """A key the CPU tier does not hold. `promote(key)` allocates its host block (None: no room)."""
        r = self._requests.setdefault(req_id, _Request())
        if key in r.absent:
            return LookupResult.MISS
        if key in r.present:
            r.present.discard(key)
            block = promote(key)
            if block is None:
                r.absent.add(key)
                return LookupResult.MISS
            r.to_promote.append((key, block))
            return LookupResult.HIT_PENDING
        if key not in r.asked:
            r.asked.add(key)
            r.to_query.append(key)
        return LookupResult.RETRY

    def end_step(self) -> None:
        """Turns the step's lookups into queries and promotions (one of each per request)."""
        for req_id, r in self._requests.items():
            if r.to_query:
                qid = next(self._ids)
                self._queries[qid] = (req_id, r.to_query)
                self._outbox.queries[qid] = [key_name(k) for k in r.to_query]
                r.to_query = []
            if r.to_promote:
                pid = next(self._ids)
                self._prefetches[pid] = (req_id, [k for k, _ in r.to_promote])
                self._outbox.prefetches[pid] = ([key_name(k) for k, _ in r.to_promote], [b for _, b in r.to_promote])
                r.to_promote = []
        # A finished request's last lookups went out above (its promotions hold host blocks).
        self._requests = {i: r for i, r in self._requests.items() if not r.finished}

    def take_work(self, store_jobs) -> StorageWork:
        """This step's work for the workers; `store_jobs` are vLLM's ({job id: TransferJob})."""
        work, self._outbox = self._outbox, StorageWork()
        for job_id, job in store_jobs.items():
            keys = [self.pending_store_keys.pop(int(b), None) for b in job.dst_spec.block_ids.tolist()]
            if all(k is not None for k in keys):
                work.store_keys[job_id] = [key_name(k) for k in keys]
                self._backing[job_id] = keys
        return work

    def note_backups(self, backups: Dict[int, Tuple[int, int]], stored) -> None:
        """Workers' backup ends ({store job: (1 backed up or 0, ranks)}). `stored(keys)` is called
        with a job's keys once every rank backed them up; a job a rank did not back up is dropped."""
        self._backups = merge_answers(self._backups, backups)
        for job_id, (ok, ranks) in list(self._backups.items()):
            if ranks < self._world:
                continue
            del self._backups[job_id]
            keys = self._backing.pop(job_id, None)
            if ok and keys:
                stored(keys)

    def note_answers(self, answers: Dict[int, Tuple[int, int]], complete) -> None:
        """Workers' answers; a query or prefetch is decided once every rank answered.
        `complete(keys, success)` completes promoted keys in the manager."""
        self._answers = merge_answers(self._answers, answers)
        for qid, (done, ranks) in list(self._answers.items()):
            if ranks < self._world:
                continue
            del self._answers[qid]
            if qid in self._queries:
                req_id, keys = self._queries.pop(qid)
                r = self._requests.get(req_id)
                if r is not None:
                    r.present.update(keys[:done])
                    r.absent.update(keys[done:])
            elif qid in self._prefetches:
                req_id, keys = self._prefetches.pop(qid)
                complete(keys[:done], True)
                complete(keys[done:], False)
                r = self._requests.get(req_id)
                if r is not None:
                    r.absent.update(keys[done:])  # not promoted again for this request

    def request_finished(self, req_id: str) -> None:
        r = self._requests.get(req_id)
        if r is not None:
            r.finished = True  # forgotten at the end of the step

    def has_pending_work(self) -> bool:
        return bool(self._queries or self._prefetches or not self._outbox.empty())

    def reset(self) -> None:
        """vLLM's reset_cache: every host block is gone, so are the promotions in flight (a late
        prefetch into a block given out again is ordered before the next write into it)."""
        self._requests.clear()
        self._queries.clear()
        self._prefetches.clear()
        self._answers.clear()
        self._backing.clear()
        self._backups.clear()
        self._outbox = StorageWork()
        self.pending_store_keys.clear()


class WorkerStorage:
    """A worker's side: submits the scheduler's queries and prefetches to its rank's session and
    collects their answers; tracks its stores' backups to drain their completions."""

    def __init__(self, session, log):
        self._session, self._log = session, log
        self._store_keys: Dict[int, List[str]] = {}
        self._tasks: Dict[int, Tuple[str, int]] = {}  # kvtd task -> (what, query or prefetch id)
        self._backup_tasks: Dict[int, int] = {}  # backup STORAGE_WRITE task -> its store job
        self.answers: Dict[int, Tuple[int, int]] = {}
        self.backup_ends: Dict[int, Tuple[int, int]] = {}  # store job -> (1 backed up or 0, 1 rank)

    def note_store_keys(self, work: Optional[StorageWork]) -> None:
        if work is not None:
            self._store_keys.update(work.store_keys)

    def keys_of_store(self, job_id: int) -> Optional[List[str]]:
        return self._store_keys.pop(job_id, None)

    def backup_submitted(self, swap_task_id: int, job_id: int) -> None:
        self._backup_tasks[swap_task_id + 1] = job_id  # the backup STORAGE_WRITE's id (storage.md, write policies)

    def backup_not_submitted(self, job_id: int) -> None:
        """The store job's swap (and so its backup) was refused: this rank says so at once, or the
        scheduler would keep the job's keys waiting for this rank's answer forever."""
        self.backup_ends[job_id] = (0, 1)

    def submit(self, work: Optional[StorageWork]) -> None:
        if work is None:
            return
        for qid, keys in work.queries.items():
            self._start("query", qid, lambda: self._session.storage_query(keys))
        for pid, (keys, blocks) in work.prefetches.items():
            self._start("prefetch", pid, lambda: self._session.prefetch(keys, blocks))

    def _start(self, what: str, ident: int, submit) -> None:
        try:
            self._tasks[submit()] = (what, ident)
        except Exception as e:  # noqa: BLE001 - a store that cannot be asked holds nothing
            self._log.warning("kvtd storage %s %d not submitted: %s", what, ident, e)
            self.answers[ident] = (0, 1)

    def poll(self) -> None:
        for tid, (what, ident) in list(self._tasks.items()):
            r = polled_outcome(self._session, tid)
            if r is None:
                continue
            del self._tasks[tid]
            if not r.ok:
                self._log.warning("kvtd storage %s %d failed: %s: %s", what, ident, r.status_name, r.message)
            self.answers[ident] = (int(r.blocks_done) if r.ok else 0, 1)
        for tid, job_id in list(self._backup_tasks.items()):
            r = polled_outcome(self._session, tid)
            if r is not None:
                del self._backup_tasks[tid]
                self.backup_ends[job_id] = (1 if r.ok else 0, 1)
                if not r.ok and r.status_name != "backup_skipped":
                    self._log.warning("kvtd backup %d: %s: %s", tid, r.status_name, r.message)

    def take_answers(self) -> Dict[int, Tuple[int, int]]:
        out, self.answers = self.answers, {}
        return out

    def take_backups(self) -> Dict[int, Tuple[int, int]]:
        out, self.backup_ends = self.backup_ends, {}
        return out

    def busy(self) -> bool:
        return bool(self._tasks or self._backup_tasks)
