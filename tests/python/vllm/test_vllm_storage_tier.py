"""kvtd.engines.vllm.storage.StorageTier on its own: the scheduler's bookkeeping of the storage tier's
queries and promotions, answer by answer (the daemons' side runs in test_vllm_engine.py)."""

from __future__ import annotations

import pytest

import vllm_harness

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())


def tier(world=2):
    vllm_harness.import_vllm()
    from kvtd.engines.vllm.storage import StorageTier
    return StorageTier(world)


def results():
    from vllm.v1.kv_offload.base import LookupResult
    return LookupResult


def keys(n):
    return [bytes([i]) * 20 for i in range(n)]


class Blocks:
    """The manager's promote(): hands out host blocks until it has none."""

    def __init__(self, n):
        self.free = list(range(n))
        self.completed = []

    def promote(self, key):
        return self.free.pop(0) if self.free else None

    def complete(self, ks, ok):
        self.completed.append((list(ks), ok))


def test_a_missing_key_is_asked_once_then_answered_by_the_min_of_every_rank():
    t, r, b, ks = tier(), results(), Blocks(8), keys(3)
    assert [t.lookup(k, "a", b.promote) for k in ks] == [r.RETRY] * 3
    assert [t.lookup(k, "a", b.promote) for k in ks] == [r.RETRY] * 3  # asked once, not again
    t.end_step()
    work = t.take_work({})
    assert list(work.queries.values()) == [[k.hex() for k in ks]]
    qid = next(iter(work.queries))
    t.note_answers({qid: (3, 1)}, b.complete)  # one rank of two: undecided
    assert t.lookup(ks[0], "a", b.promote) == r.RETRY
    t.note_answers({qid: (1, 1)}, b.complete)  # the other holds one: MIN 1
    assert t.lookup(ks[0], "a", b.promote) == r.HIT_PENDING
    assert t.lookup(ks[1], "a", b.promote) == r.MISS
    t.end_step()
    (pid, (names, blocks)), = t.take_work({}).prefetches.items()
    assert names == [ks[0].hex()] and blocks == [0]
    assert t.has_pending_work()
    t.note_answers({pid: (1, 2)}, b.complete)
    assert b.completed == [([ks[0]], True), ([], False)]
    assert not t.has_pending_work()


def test_what_a_rank_could_not_prefetch_completes_failed_and_is_not_promoted_again():
    t, r, b, ks = tier(), results(), Blocks(8), keys(2)
    for k in ks:
        t.lookup(k, "a", b.promote)
    t.end_step()
    qid = next(iter(t.take_work({}).queries))
    t.note_answers({qid: (2, 2)}, b.complete)
    assert [t.lookup(k, "a", b.promote) for k in ks] == [r.HIT_PENDING] * 2
    t.end_step()
    pid = next(iter(t.take_work({}).prefetches))
    t.note_answers({pid: (2, 1)}, b.complete)
    t.note_answers({pid: (0, 1)}, b.complete)  # one rank loaded nothing
    assert b.completed == [([], True), (ks, False)]
    assert [t.lookup(k, "a", b.promote) for k in ks] == [r.MISS] * 2


def test_no_host_block_for_a_promotion_is_a_miss():
    t, r, b, ks = tier(world=1), results(), Blocks(0), keys(1)
    t.lookup(ks[0], "a", b.promote)
    t.end_step()
    t.note_answers({next(iter(t.take_work({}).queries)): (1, 1)}, b.complete)
    assert t.lookup(ks[0], "a", b.promote) == r.MISS


def test_a_finished_request_is_forgotten_after_its_last_lookups_went_out():
    t, r, b, ks = tier(world=1), results(), Blocks(4), keys(1)
    t.lookup(ks[0], "a", b.promote)
    t.request_finished("a")
    t.end_step()
    qid = next(iter(t.take_work({}).queries))  # the query still goes out
    t.note_answers({qid: (1, 1)}, b.complete)  # and its late answer changes nothing
    assert t.lookup(ks[0], "b", b.promote) == r.RETRY  # another request asks afresh


def test_store_jobs_take_their_keys_by_host_block_and_reset_forgets_everything():
    from types import SimpleNamespace

    import numpy as np
    t, r, b, ks = tier(world=1), results(), Blocks(4), keys(2)
    t.pending_store_keys.update({7: ks[0], 9: ks[1]})
    job = SimpleNamespace(dst_spec=SimpleNamespace(block_ids=np.array([9, 7])))
    assert t.take_work({3: job}).store_keys == {3: [ks[1].hex(), ks[0].hex()]}
    assert not t.pending_store_keys
    t.lookup(ks[0], "a", b.promote)
    t.end_step()
    t.reset()
    assert not t.has_pending_work() and t.take_work({}).empty()
