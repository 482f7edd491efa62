"""kvtd as vLLM's native KV offloading spec, loaded and driven by vLLM (main 017e9f44)'s own code.

vLLM's OffloadingSpecFactory loads `kvtd.vllm` from the extra config (factory.py:29-56, asserts
issubclass(OffloadingSpec)); the scheduler side is the spec's manager (vLLM's own
CPUOffloadingManager); each rank's worker side is vLLM's own OffloadingConnectorWorker
(offloading/worker.py) over the spec's worker. The scheduler's part, which needs vLLM's engine,
is done as offloading/scheduler.py does it (cited per step): prepare_store then a store job per
request, completions counted across every worker, complete_store; lookup, prepare_load, a load job,
complete_load. The workers' GPU tensors are shared-memory tensors on the host backend.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import kvtd.testing

import vllm_harness

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())

LAYERS, GPU_BLOCKS, PAGE = 2, 24, 4096


def vllm_modules():
    vllm_harness.import_vllm()
    from vllm.v1.kv_offload import base, config, factory  # noqa: E402
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common, worker  # noqa: E402
    return base, config, factory, common, worker


def offloading_config(rank, world, extra):
    _, config, _, _, _ = vllm_modules()
    return config.OffloadingConfig(
        groups=(config.OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(f"l{i}" for i in range(LAYERS))),),
        worker_kv_bytes_per_block=2 * LAYERS * PAGE, enable_kv_cache_events=False, extra_config=extra,
        engine_id="kvtdtest", model=config.OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=config.OffloadingParallelConfig(rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1,
                                                 dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                                 data_parallel_rank_local=None, is_parallelism_agnostic=False))


class Rank:
    """One vLLM worker process's KV cache (shared memory: the host backend's "GPU"), its spec and
    vLLM's OffloadingConnectorWorker over the spec's worker."""

    def __init__(self, rank, world, extra, tmp_path):
        base, _, factory, _, worker = vllm_modules()
        nbytes = 2 * LAYERS * GPU_BLOCKS * PAGE
        self.path = f"/dev/shm/kvtd_vllm_test_{uuid.uuid4().hex[:8]}"
        self.buffer = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.int8)
        self.tensors = [self.buffer[i * GPU_BLOCKS * PAGE:(i + 1) * GPU_BLOCKS * PAGE].view(GPU_BLOCKS, PAGE)
                        for i in range(2 * LAYERS)]
        self.spec = factory.OffloadingSpecFactory.create_spec(offloading_config(rank, world, extra))
        caches = base.CanonicalKVCaches(tensors=[base.CanonicalKVCacheTensor(t, PAGE) for t in self.tensors],
                                        group_data_refs=[[base.CanonicalKVCacheRef(i, PAGE) for i in range(2 * LAYERS)]])
        from kvtd.vllm import geometry_of
        g = geometry_of(caches, world, self.spec.num_blocks)
        self.daemons = kvtd.testing.Daemons(None, f"{extra['kvtd_session']}_r{rank}", g, ranks=[rank]).start()
        self.connector = worker.OffloadingConnectorWorker(self.spec, None, None)
        self.connector._init_worker(caches)  # what register_kv_caches ends with (worker.py:66-67, 292)

    def block(self, b):
        return torch.cat([t[b].clone() for t in self.tensors])

    def close(self):
        self.connector.shutdown()
        self.daemons.stop()
        os.unlink(self.path)


def run_step(ranks, metadata, job_id, common):
    """One engine step on every rank (worker.py:319-330, 346-389), until each acknowledged
    `job_id`; returns the aggregated worker metadata (summed across workers as vLLM does)."""
    meta = None
    for r in ranks:
        r.connector.start_kv_transfers(metadata)
    pending = set(range(len(ranks)))
    for _ in range(2000):
        for i in list(pending):
            ranks[i].connector.get_finished(set())
            m = ranks[i].connector.build_connector_worker_meta()
            if m is not None:
                meta = m if meta is None else meta.aggregate(m)
                if job_id in m.completed_jobs:
                    pending.discard(i)
        if not pending:
            return meta
        import time
        time.sleep(0.005)
    raise TimeoutError(f"job {job_id} not acknowledged by every rank")


def test_vllms_own_code_stores_looks_up_and_loads_through_two_ranks_daemons(tmp_path):
    base, _, _, common, _ = vllm_modules()
    extra = {"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm", "kvtd_host_blocks": 16,
             "kvtd_session": f"vl{uuid.uuid4().hex[:6]}", "kvtd_ready_timeout_s": 30}
    ranks = [Rank(r, 2, extra, tmp_path) for r in range(2)]
    manager = ranks[0].spec.get_manager()  # the scheduler's: vLLM's own CPUOffloadingManager
    from kvtd.vllm import KvtdOffloadingSpec
    try:
        assert isinstance(ranks[0].spec, KvtdOffloadingSpec)
        for i, r in enumerate(ranks):
            r.buffer.copy_(torch.randint(-128, 127, r.buffer.shape, dtype=torch.int8,
                                         generator=torch.Generator().manual_seed(i)))
        ctx = base.ReqContext("req-1")
        gpu = [3, 5, 7, 11, 12]
        keys = [base.make_offload_key(bytes([k]) * 16, 0) for k in range(len(gpu))]
        originals = [{b: r.block(b) for b in gpu} for r in ranks]
        # Store (scheduler.py:1201-1245): the manager picks host blocks, one job for the request.
        out = manager.prepare_store(keys, ctx)
        job = common.TransferJob("req-1", base.GPULoadStoreSpec(gpu, group_sizes=[len(gpu)], block_indices=[0]),
                                 out.store_spec)
        md = common.OffloadingConnectorMetadata(load_jobs={}, store_jobs={1: job})
        for r in ranks:
            r.connector.prepare_store_kv(md)  # deferred to the next step (worker.py:332-344)
        meta = run_step(ranks, common.OffloadingConnectorMetadata(load_jobs={}, store_jobs={}), 1, common)
        assert meta.completed_jobs[1] == 2  # both workers (scheduler.py:1549-1566)
        manager.complete_store(keys, ctx)
        assert all(manager.lookup(k, ctx) == base.LookupResult.HIT for k in keys)
        # The GPU blocks are reused; the load brings the blocks back elsewhere.
        for r in ranks:
            r.buffer.zero_()
        src = manager.prepare_load(keys, ctx)
        dst = [20, 0, 1, 2, 23]
        load = common.TransferJob("req-2", src, base.GPULoadStoreSpec(dst, group_sizes=[len(dst)], block_indices=[0]))
        meta = run_step(ranks, common.OffloadingConnectorMetadata(load_jobs={2: load}, store_jobs={}), 2, common)
        assert meta.completed_jobs[2] == 2
        manager.complete_load(keys, ctx)
        for i, r in enumerate(ranks):
            for g, d in zip(gpu, dst):
                assert torch.equal(r.block(d), originals[i][g]), f"rank {i}: block {g} loaded into {d}"
        assert not ranks[0].connector.worker.failed_loads and not ranks[0].connector.worker.failed_stores
    finally:
        for r in ranks:
            r.close()


def test_a_killed_daemon_leaves_vllms_worker_code_running_and_records_what_failed(tmp_path):
    """vLLM's worker asserts every transfer succeeded (worker.py:313-330, 361). Rank 1's daemon is
    SIGKILLed; a store and a load through both ranks still complete in vLLM's eyes (no assert
    fires). Rank 1's worker records the store's job as failed, and the connector reports the load's
    GPU blocks through get_block_ids_with_load_errors in the same pass as the request's get_finished
    (vLLM then recomputes them). Failed stores reaching the scheduler's manager: still to do."""
    import signal

    base, _, _, common, _ = vllm_modules()
    extra = {"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm", "kvtd_host_blocks": 16,
             "kvtd_session": f"vl{uuid.uuid4().hex[:6]}", "kvtd_ready_timeout_s": 30}
    ranks = [Rank(r, 2, extra, tmp_path) for r in range(2)]
    manager = ranks[0].spec.get_manager()
    try:
        ctx = base.ReqContext("req-1")
        keys = [base.make_offload_key(bytes([k]) * 16, 0) for k in range(3)]
        ranks[1].daemons.procs[0].send_signal(signal.SIGKILL)
        ranks[1].daemons.procs[0].wait()
        out = manager.prepare_store(keys, ctx)
        job = common.TransferJob("req-1", base.GPULoadStoreSpec([1, 2, 3], group_sizes=[3], block_indices=[0]),
                                 out.store_spec)
        md = common.OffloadingConnectorMetadata(load_jobs={}, store_jobs={1: job})
        for r in ranks:
            r.connector.prepare_store_kv(md)
        assert run_step(ranks, common.OffloadingConnectorMetadata(load_jobs={}, store_jobs={}), 1, common)
        assert ranks[1].connector.worker.failed_stores == {1} and not ranks[0].connector.worker.failed_stores
        manager.complete_store(keys, ctx)
        load = common.TransferJob("req-2", manager.prepare_load(keys, ctx),
                                  base.GPULoadStoreSpec([7, 8, 9], group_sizes=[3], block_indices=[0]))
        md = common.OffloadingConnectorMetadata(load_jobs={2: load}, store_jobs={})
        # Each rank's pass as vLLM's model runner makes it: bind, start_load_kv, then after the
        # step get_finished and get_block_ids_with_load_errors, in that order.
        from kvtd.vllm import KvtdOffloadingConnector
        seen = []
        for r in ranks:
            c = object.__new__(KvtdOffloadingConnector)  # its __init__ needs vLLM's engine config
            c.connector_worker, c.connector_scheduler = r.connector, None
            c.bind_connector_metadata(md)
            c.start_load_kv(None)
            recving, invalid = set(), set()
            for _ in range(2000):
                recving |= c.get_finished(set())[1]
                invalid |= c.get_block_ids_with_load_errors()
                if "req-2" in recving:
                    break
                import time
                time.sleep(0.005)
            c.clear_connector_metadata()
            seen.append((recving, invalid))
        assert seen[0] == ({"req-2"}, set()), "rank 0's load succeeded"
        assert seen[1] == ({"req-2"}, {7, 8, 9}), "rank 1's failed load is reported for recompute with the request"
    finally:
        for r in ranks:
            r.close()
