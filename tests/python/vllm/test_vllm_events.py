"""One KV-event stream for vLLM's CPU tier and kvtd's storage tier.

The storage tier's events came from each daemon's own publisher, naming a block by the hex text of
its OffloadKey, where vLLM's own events name it by the block hash (offloading/events.py:324-325,
404): a router could not join a block's CPU and STORAGE events. Now every rank's backup end rides
the worker metadata to the scheduler, and once every rank backed a store job up the manager puts a
STORAGE stored event of its keys into vLLM's own event path: vLLM's OffloadingEventsTracker turns
it into vLLM's BlockStored (kv_events.py) with the hashes of the CPU tier's event of the same keys
(events.py:337-380). Fails on the old code: no STORAGE event ever reached vLLM's stream.
"""

from __future__ import annotations

import pytest

import vllm_harness
from test_vllm_engine import close, engine_of, prompt, store_flags
from vllm_engine import Request

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())


def stored_hashes(events, medium):
    from vllm.distributed.kv_events import BlockStored
    return {h for e in events if isinstance(e, BlockStored) and e.medium == medium for h in e.block_hashes}


def test_the_storage_tiers_stored_blocks_reach_vllms_event_stream_by_block_hash(tmp_path):
    engine = engine_of(daemon_flags=store_flags(tmp_path), kvtd_storage=True)
    try:
        tokens = prompt(41, 3)
        assert engine.serve(Request("e1", tokens)) == 0
        cpu = stored_hashes(engine.events, "CPU")
        assert len(cpu) == 3, engine.events
        engine.idle_until(lambda: stored_hashes(engine.events, "STORAGE") == cpu,
                          "every rank's backups reported as STORAGE events")
        assert stored_hashes(engine.events, "STORAGE") == cpu, "each block's CPU and STORAGE events join by hash"
    finally:
        close(engine)


def test_a_store_job_one_rank_did_not_back_up_is_no_storage_event():
    """The manager's part on its own: a job is stored only when every rank backed it up."""
    vllm_harness.import_vllm()
    from kvtd.engines.vllm.storage import StorageTier
    tier = StorageTier(2)
    tier._backing[7] = [b"k7"]
    tier._backing[8] = [b"k8"]
    seen = []
    tier.note_backups({7: (1, 1), 8: (1, 1)}, seen.append)
    assert seen == [], "one rank of two said"
    tier.note_backups({7: (1, 1), 8: (0, 1)}, seen.append)
    assert seen == [[b"k7"]]


def test_a_store_a_rank_refused_leaves_no_job_waiting_for_its_backup(tmp_path):
    """A store job's keys wait in the scheduler until every rank says how its backup ended. A rank
    whose daemon was down refused the store's swap at submit, and so never said: the keys waited
    forever (one entry per such job). It says "not backed up" at once now; no STORAGE event."""
    engine = engine_of(daemon_flags=store_flags(tmp_path), kvtd_storage=True)
    try:
        engine.ranks[1].kill_daemon()
        tokens = prompt(43, 2)
        engine.serve(Request("d1", tokens))
        tier = engine.manager.storage
        engine.idle_until(lambda: not tier._backing and not tier._backups, "every store job's backups answered")
        assert stored_hashes(engine.events, "STORAGE") == set()
    finally:
        close(engine)
