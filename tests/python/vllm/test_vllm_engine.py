"""kvtd as vLLM's native KV offloading spec, loaded and driven by vLLM (main 017e9f44)'s own code.

vLLM's OffloadingSpecFactory loads `kvtd.vllm` from the extra config (factory.py:29-56, asserts
issubclass(OffloadingSpec)); the scheduler side is vLLM's own OffloadingConnectorScheduler over
the spec's manager (vLLM's CPUOffloadingManager, told of kvtd's failures); each rank's worker side
is vLLM's own OffloadingConnectorWorker over the spec's worker; both sit in
kvtd.vllm.KvtdOffloadingConnector. vllm_engine.Engine plays the engine parts that are not vendored
(the engine scheduler, the model runner's connector context, the output aggregator), cited there.
The workers' GPU tensors are shared-memory tensors on the host backend.
"""

from __future__ import annotations

import os
import sys
import time
import types
import uuid

import pytest
import torch

import kvtd.testing

import vllm_engine
import vllm_harness
import vllm_registration
from vllm_engine import Engine, Request, chunk_bytes

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())

LAYERS, GPU_BLOCKS, PAGE = 2, 40, 2048
# A layer's attention shape: PAGE bytes of K (and of V) per block, bfloat16 (16 x 4 x 16 x 2 bytes).
HEADS, HEAD_SIZE = 4, 16


def vllm_modules():
    vllm_harness.import_vllm()
    from vllm.v1.kv_offload import base, config, factory  # noqa: E402
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common, worker  # noqa: E402
    return base, config, factory, common, worker


def offloading_config(rank, world, extra, blocks_per_chunk=1, dp=(0, 1)):
    _, config, _, _, _ = vllm_modules()
    return config.OffloadingConfig(
        groups=(config.OffloadingGroupConfig(tokens_per_block=vllm_engine.TOKENS_PER_BLOCK,
                                             layer_names=tuple(f"l{i}" for i in range(LAYERS))),),
        worker_kv_bytes_per_block=2 * LAYERS * PAGE, enable_kv_cache_events=True, extra_config=extra,
        engine_id="kvtdtest", model=config.OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=vllm_engine.TOKENS_PER_BLOCK,
                                           blocks_per_chunk=blocks_per_chunk),
        parallel=config.OffloadingParallelConfig(rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1,
                                                 dcp_size=1, data_parallel_index=dp[0], data_parallel_size=dp[1],
                                                 data_parallel_rank_local=None, is_parallelism_agnostic=False))


def extra_config(host_blocks=16, **more):
    return {"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm", "kvtd_host_blocks": host_blocks,
            "kvtd_session": f"vl{uuid.uuid4().hex[:6]}", "kvtd_ready_timeout_s": 0.01, **more}


def attention_spec():
    return vllm_registration.attention_spec(HEADS, HEAD_SIZE)


def worker_vllm_config(rank, world):
    return vllm_registration.worker_vllm_config(rank, world, HEADS)


class Rank:
    """One vLLM worker process: its KV cache (shared memory, the host backend's "GPU"), its spec,
    vLLM's OffloadingConnectorWorker over the spec's worker, and its rank's daemon. The KV cache is
    registered by vLLM's own code: cross_layer, one slab of every layer through
    register_cross_layers_kv_cache (vLLM's default: OffloadingConnector.prefer_cross_layer_blocks
    is `not canonical_layout`, offloading_connector.py:51-53); else one FlashAttention tensor per
    layer, (blocks, 2, block_size, heads, head_size) with the blocks outermost, through
    register_kv_caches (worker.py:68-240; what vLLM uses where the cross-layer layout is not
    available), which makes each layer one (blocks, page) tensor of its K and V and derives its
    canonical page mapping."""

    def __init__(self, rank, world, extra, daemon_flags=(), cross_layer=False, start_daemon=True, dp=(0, 1)):
        self.dp = dp
        self.rank, self.block_bytes = rank, 2 * LAYERS * PAGE
        self.path = f"/dev/shm/kvtd_vllm_test_{uuid.uuid4().hex[:8]}"
        self.buffer = torch.from_file(self.path, shared=True, size=2 * LAYERS * GPU_BLOCKS * PAGE, dtype=torch.int8)
        if cross_layer:
            self.tensors = [self.buffer.view(GPU_BLOCKS, 2 * LAYERS * PAGE)]
        else:
            self.tensors = [self.buffer[i * GPU_BLOCKS * 2 * PAGE:(i + 1) * GPU_BLOCKS * 2 * PAGE].view(GPU_BLOCKS, 2 * PAGE)
                            for i in range(LAYERS)]
        try:
            self._start(rank, world, extra, cross_layer)
            self.daemons = None
            if start_daemon:
                self.start_daemon(daemon_flags)
        except BaseException:
            os.unlink(self.path)
            raise

    def _start(self, rank, world, extra, cross_layer):
        _, _, factory, _, worker = vllm_modules()
        self.spec = factory.OffloadingSpecFactory.create_spec(offloading_config(rank, world, extra, dp=self.dp))
        vllm_registration.torch_2_untyped_storage()
        names = [f"l{i}" for i in range(LAYERS)]
        kv_cache_config = vllm_engine.kv_cache_config(names, GPU_BLOCKS, attention_spec())
        self.connector = worker.OffloadingConnectorWorker(self.spec, worker_vllm_config(rank, world), kv_cache_config)
        if cross_layer:
            self.connector.register_cross_layers_kv_cache(self.buffer, vllm_registration.FlashAttentionStandIn)
        else:
            layers = {n: vllm_registration.attention_layer(t, HEADS, HEAD_SIZE) for n, t in zip(names, self.tensors)}
            self.connector.register_kv_caches(layers)
        # the worker's session is published (ready_timeout 0: its daemon joins below)
        self.geometry = self.connector.worker._geometry

    def start_daemon(self, daemon_flags=()):
        """The rank's daemon, started as the worker's logged command line says (its geometry's flags)."""
        w = self.connector.worker
        self.daemons = kvtd.testing.Daemons(None, w.suffix, self.geometry, list(daemon_flags), ranks=[self.rank]).start()
        w._session.wait_ready(30)

    def write_block(self, b, data):
        row = self.tensors[0].shape[1]
        for i, t in enumerate(self.tensors):
            t[b].copy_(data[i * row:(i + 1) * row])

    def block(self, b):
        return torch.cat([t[b].clone() for t in self.tensors])

    def kill_daemon(self):
        self.daemons.kill(self.rank)

    def restart_daemon(self):
        self.daemons.restart(self.rank)

    def close(self):
        self.connector.shutdown()
        if self.daemons is not None:
            self.daemons.stop()
        os.unlink(self.path)


def prompt(seed, chunks):
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 32000, (chunks * vllm_engine.TOKENS_PER_BLOCK,), generator=g)]


def engine_of(world=2, daemon_flags=(), cross_layer=False, **extra):
    config = extra_config(**extra)
    ranks = []
    try:
        for r in range(world):
            ranks.append(Rank(r, world, config, daemon_flags, cross_layer=cross_layer))
        # The scheduler process's spec: one more construction, as vLLM makes in every process.
        _, _, factory, _, _ = vllm_modules()
        spec = factory.OffloadingSpecFactory.create_spec(offloading_config(0, world, config))
        return Engine(spec, ranks, GPU_BLOCKS, [f"l{i}" for i in range(LAYERS)])
    except BaseException:
        for r in ranks:  # their daemons and shared-memory "GPU" files
            r.close()
        raise


def assert_loaded(engine, req, hit):
    """Every GPU block the load filled holds, on every rank, the bytes the model computed."""
    for rank in engine.ranks:
        for i in range(hit // vllm_engine.TOKENS_PER_BLOCK):
            b = engine.last_blocks[i]
            if b not in engine.recomputed_blocks:
                assert torch.equal(rank.block(b), chunk_bytes(rank.rank, req.block_hashes[i], rank.block_bytes)), \
                    f"rank {rank.rank}: chunk {i} of {req.request_id} in GPU block {b}"


def offload_keys(req):
    from vllm.v1.kv_offload.base import make_offload_key
    return [make_offload_key(h, 0) for h in req.block_hashes]


def close(engine):
    for r in engine.ranks:
        r.close()


def test_vllms_own_scheduler_and_workers_store_look_up_load_evict_and_reset_through_two_ranks_daemons():
    engine = engine_of()
    from kvtd.vllm import KvtdOffloadingSpec
    try:
        assert isinstance(engine.ranks[0].spec, KvtdOffloadingSpec)
        a, b, c = prompt(1, 5), prompt(2, 6), prompt(3, 6)
        assert engine.serve(Request("a1", a)) == 0
        hit = engine.serve(Request("a2", a))
        assert hit == 5 * 16, "every chunk of the prompt"
        assert_loaded(engine, Request("a2", a), hit)
        # 16 host blocks: a's 5, b's 6, c's 6 do not fit, and vLLM's LRU policy evicts one of a's
        # chunks. Which one is vLLM's choice: complete_load marks a load's keys evictable in the
        # order of a set (scheduler.py:1568, TransferJobStatus.keys), so any of them may be first.
        assert engine.serve(Request("b1", b)) == 0
        assert engine.serve(Request("c1", c)) == 0
        kept = [engine.manager.lookup(k, None).name for k in offload_keys(Request("a", a))]
        assert kept.count("MISS") == 1, kept
        hit = engine.serve(Request("a3", a))
        assert hit == kept.index("MISS") * 16, "the prefix before the evicted chunk"
        assert_loaded(engine, Request("a3", a), hit)
        hit = engine.serve(Request("c2", c))
        assert hit == 6 * 16
        assert_loaded(engine, Request("c2", c), hit)
        engine.scheduler.connector_scheduler.reset_cache()
        assert engine.serve(Request("c3", c)) == 0, "after reset_cache nothing is offloaded"
        hit = engine.serve(Request("c4", c))
        assert hit == 6 * 16
        assert_loaded(engine, Request("c4", c), hit)
        media = {e.medium for e in engine.events}
        assert media == {"CPU"}, media
        assert any(type(e).__name__ == "BlockRemoved" for e in engine.events)
    finally:
        close(engine)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_workload_hits_as_it_does_with_vllms_own_cpu_manager(policy):
    """The same requests through two engines: one whose scheduler has kvtd.vllm's manager, one whose
    scheduler has vLLM's own CPUOffloadingManager (same size, same policy). With no failure the
    hits are the same, request by request (eviction order included), and every loaded byte is
    right. One process, so vLLM's set-ordered completions (see above) order alike in both."""
    vllm_modules()
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    prompts = [prompt(20 + i, n) for i, n in enumerate([3, 5, 4, 6, 2])]
    order = [0, 0, 1, 2, 0, 3, 1, 4, 2, 0, 3, 3, 4, 1, 0]
    hits = []
    for peer in (False, True):
        engine = engine_of(eviction_policy=policy)
        if peer:
            engine.scheduler.connector_scheduler.manager = CPUOffloadingManager(num_blocks=16, cache_policy=policy)
        try:
            got = []
            for n, i in enumerate(order):
                req = Request(f"w{n}", prompts[i])
                got.append(engine.serve(req))
                assert_loaded(engine, req, got[-1])
            hits.append(got)
        finally:
            close(engine)
    assert hits[0] == hits[1], hits
    assert sum(h > 0 for h in hits[0]) >= 5, hits  # the workload does hit, and evicts (16 host blocks)


def test_a_store_a_killed_daemon_did_not_make_is_never_a_hit():
    """Rank 1's daemon is SIGKILLed: the request's store fails on rank 1 (rank 0's succeeds). vLLM's
    worker code asserts nothing (the job is reported finished); the failure reaches the scheduler's
    manager, which completes those keys with success=False, so the same prompt misses instead of
    loading rank 1's never-written host blocks. With the daemon back, stores and hits resume."""
    engine = engine_of()
    try:
        p = prompt(7, 4)
        engine.ranks[1].kill_daemon()
        assert engine.serve(Request("p1", p)) == 0
        assert engine.serve(Request("p2", p)) == 0, "a store rank 1 never made must not be a hit"
        engine.ranks[1].restart_daemon()
        engine.ranks[1].connector.worker.wait_ready(30)
        assert engine.serve(Request("p3", p)) == 0
        hit = engine.serve(Request("p4", p))
        assert hit == 4 * 16
        assert_loaded(engine, Request("p4", p), hit)
    finally:
        close(engine)


def test_a_store_refused_while_a_daemon_was_down_never_loads_the_blocks_older_bytes():
    """4 host blocks. x is stored on both ranks; rank 1's daemon dies; y evicts x and its store is
    refused on rank 1 (its daemon never sees it), so rank 1's host blocks still hold x's bytes,
    valid. Rank 1's daemon comes back. Were y's keys counted stored, the next y would load x's
    bytes on rank 1 with no error anywhere: the manager must count y's store failed (a miss)."""
    engine = engine_of(host_blocks=4)
    try:
        x, y = prompt(11, 4), prompt(12, 4)
        assert engine.serve(Request("x1", x)) == 0
        engine.ranks[1].kill_daemon()
        assert engine.serve(Request("y1", y)) == 0
        engine.ranks[1].restart_daemon()
        engine.ranks[1].connector.worker.wait_ready(30)
        hit = engine.serve(Request("y2", y))
        assert_loaded(engine, Request("y2", y), hit)
        assert hit == 0, "y was never stored on rank 1"
        assert engine.serve(Request("y3", y)) == 4 * 16
        assert_loaded(engine, Request("y3", y), 4 * 16)
    finally:
        close(engine)


def test_a_load_a_killed_daemon_cannot_serve_is_recomputed_and_forgotten():
    """The prompt is stored on both ranks, then rank 1's daemon is SIGKILLed. The next request hits,
    its load fails on rank 1: vLLM's worker code asserts nothing, get_block_ids_with_load_errors
    names the GPU blocks in the pass that reports the request received, the engine recomputes them
    (every byte right on both ranks), and the manager forgets the keys (the next lookup misses)."""
    engine = engine_of()
    try:
        p = prompt(9, 4)
        assert engine.serve(Request("q1", p)) == 0
        engine.ranks[1].kill_daemon()
        hit = engine.serve(Request("q2", p))
        assert hit == 4 * 16
        assert engine.recomputed_blocks == set(engine.last_blocks[:4])
        for rank in engine.ranks:  # recomputed by the model, or loaded: the same bytes either way
            for i in range(4):
                assert torch.equal(rank.block(engine.last_blocks[i]),
                                   chunk_bytes(rank.rank, Request("q", p).block_hashes[i], rank.block_bytes))
        assert engine.serve(Request("q3", p)) == 0, "keys a load could not read are forgotten"
    finally:
        close(engine)


def test_under_vllms_plain_offloading_connector_a_failed_job_stops_vllm_instead_of_passing():
    """Without KvtdOffloadingConnector nothing carries a failure to vLLM's scheduler, so the worker
    reports the job failed: vLLM's own worker asserts (offloading/worker.py:361) and stops, rather
    than count a store made or run on a load that did not arrive."""
    base, _, _, common, _ = vllm_modules()
    rank = Rank(0, 1, extra_config())
    try:
        rank.kill_daemon()
        job = common.TransferJob("r", base.GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0]),
                                 rank.spec.get_manager().prepare_store(
                                     offload_keys(Request("r", prompt(5, 2))), None).store_spec)
        rank.connector.prepare_store_kv(common.OffloadingConnectorMetadata(load_jobs={}, store_jobs={0: job}))
        rank.connector.start_kv_transfers(common.OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
        with pytest.raises(AssertionError):
            for _ in range(2000):
                rank.connector.get_finished(set())
                time.sleep(0.005)
    finally:
        rank.close()


def store_flags(path):
    """A file store behind every daemon, every swapped-out block backed up into it. A backup may
    wait a minute before its daemon skips it: these tests check what finished backups serve, not
    the backpressure of a loaded machine (under ctest -j 3 a backup was skipped and a lookup hit
    two chunks of four)."""
    return ["--storage-backend", "file", "--storage-path", str(path), "--model-id", "m", "--write-policy",
            "write_through", "--storage-backup-max-age-ms", "60000"]


def wait_stored(path, objects, timeout=60.0):
    """Until the file store holds `objects` objects (<key>.<slice>.kvo; a write in progress is a
    .tmp- file): a store job's backups run after the job completed, so a lookup made at once may
    find only the first of them."""
    deadline = time.monotonic() + timeout
    while len(list(path.rglob("*.kvo"))) < objects:
        assert time.monotonic() < deadline, f"{len(list(path.rglob('*.kvo')))} of {objects} objects stored"
        time.sleep(0.05)


def test_the_storage_tier_serves_what_the_host_tier_forgot_through_vllms_own_scheduler(tmp_path):
    """kvtd_storage: every block stored to the host tier is backed up to the file store by its
    daemon. After vLLM's reset_cache the host tier holds nothing; the next request's lookup asks
    the store (RETRY, vLLM asks again), every rank answers, the blocks are promoted into host blocks
    (PREFETCH on each rank) and loaded to the GPU by vLLM's own load path, every byte right."""
    engine = engine_of(daemon_flags=store_flags(tmp_path), kvtd_storage=True)
    try:
        p = prompt(31, 4)
        assert engine.serve(Request("s1", p)) == 0
        wait_stored(tmp_path, 4 * 2)  # 4 chunks on 2 ranks
        engine.scheduler.connector_scheduler.reset_cache()
        hit = engine.serve(Request("s2", p))
        assert hit == 4 * 16
        assert_loaded(engine, Request("s2", p), hit)
        assert engine.serve(Request("s3", p)) == 4 * 16, "promoted into the host tier: a plain hit now"
    finally:
        close(engine)


def test_vllms_default_cross_layer_slab_loads_each_ranks_own_bytes_from_the_storage_tier(tmp_path):
    """Trust round 4: vLLM's default registration hands each worker one cross-layer slab (no value
    tensor). It was taken for an MLA latent: rank 0 alone stored, every rank read rank 0's objects,
    and after reset_cache rank 1's blocks were loaded with rank 0's bytes, reported loaded. Now the
    geometry declares the slab per rank; each rank stores and loads its own."""
    engine = engine_of(daemon_flags=store_flags(tmp_path), kvtd_storage=True, cross_layer=True)
    try:
        assert all(r.geometry.identity.layout == "per_rank" for r in engine.ranks)
        p = prompt(37, 4)
        assert engine.serve(Request("x1", p)) == 0
        wait_stored(tmp_path, 4 * 2)
        engine.scheduler.connector_scheduler.reset_cache()
        hit = engine.serve(Request("x2", p))
        assert hit == 4 * 16
        assert_loaded(engine, Request("x2", p), hit)
        # <root>/<model>/<fingerprint>/<fan-out>/<key>.w0-0.r<rank>.kvo (storage/object_name.h)
        slices = {f.name[:-len(".kvo")].rsplit(".", 1)[-1] for f in tmp_path.rglob("*.kvo")}
        assert slices == {"r0", "r1"}, f"each rank stores its own objects: {sorted(slices)}"
    finally:
        close(engine)


def test_a_daemon_started_without_the_slabs_layout_is_refused_not_served_rank_0s_bytes(tmp_path):
    """A daemon started by hand without --kv-layout reads a value-less cache as an MLA latent
    (FastDeploy's launch line). The session declares the slab per rank, so that daemon is refused
    at attach, naming the flag, instead of loading rank 0's objects into rank 1's blocks; the
    command line the worker logs (daemon_command) attaches."""
    import subprocess
    rank = Rank(1, 2, extra_config(), store_flags(tmp_path), cross_layer=True, start_daemon=False)
    try:
        w = rank.connector.worker
        cmd = list(w.daemon_command)
        assert cmd[cmd.index("--kv-layout") + 1] == "per_rank" and cmd[cmd.index("--kv-dtype") + 1] == "bfloat16"
        i = cmd.index("--kv-layout")
        by_hand = cmd[1:i] + cmd[i + 2:]
        p = subprocess.run([kvtd.testing.find_binary(), *by_hand, *store_flags(tmp_path), "--attach-timeout", "20"],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert p.returncode != 0, p.stderr[-2000:]
        assert "--kv-layout per_rank" in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
        assert not w._session.rank_alive(1)
        rank.start_daemon(store_flags(tmp_path))
        assert w._session.rank_alive(1)
    finally:
        rank.close()


def test_the_storage_tiers_hits_are_the_ranks_agreed_minimum(tmp_path):
    """Rank 1 backs up only the first two chunks (its daemon was down when the other two were
    stored); rank 0 holds all four. After the host tier is forgotten, the lookup agrees on the
    MIN over the ranks: two chunks are promoted and loaded, the rest computed."""
    engine = engine_of(daemon_flags=store_flags(tmp_path), kvtd_storage=True)
    try:
        p = prompt(41, 4)
        assert engine.serve(Request("m1", p[:32])) == 0
        wait_stored(tmp_path, 2 * 2)
        engine.ranks[1].kill_daemon()
        assert engine.serve(Request("m2", p)) == 2 * 16  # chunks 2, 3: stored on rank 0 only
        wait_stored(tmp_path, 2 * 2 + 2)
        engine.ranks[1].restart_daemon()
        engine.ranks[1].connector.worker.wait_ready(30)
        engine.scheduler.connector_scheduler.reset_cache()
        sent = []
        take = engine.manager.storage.take_work
        engine.manager.storage.take_work = lambda jobs: sent.append(take(jobs)) or sent[-1]
        hit = engine.serve(Request("m3", p))
        assert hit == 2 * 16
        assert_loaded(engine, Request("m3", p), hit)
        prefetched = [keys for w in sent for keys, _ in w.prefetches.values()]
        assert [len(k) for k in prefetched] == [2], "only what every rank holds is promoted"
    finally:
        close(engine)


def test_a_new_weight_version_misses_what_the_old_weights_stored(tmp_path):
    """vLLM's block hashes do not cover the weights; kvtd's object names do (kvtd_weight_version)."""
    for version, expect in ((1, 0), (1, 4 * 16), (2, 0)):
        engine = engine_of(daemon_flags=store_flags(tmp_path), kvtd_storage=True, kvtd_weight_version=version)
        try:
            assert engine.serve(Request("v", prompt(51, 4))) == expect, f"weights {version}"
            wait_stored(tmp_path, 8 * version)  # 4 chunks on 2 ranks per weight version
        finally:
            close(engine)


def test_cpu_bytes_to_use_means_what_it_means_to_vllms_own_cpu_spec():
    """vLLM's CPU spec divides cpu_bytes_to_use by one block of every worker together
    (cpu/spec.py:86-103): 2 workers x 8 KiB a block, 160 KiB -> 10 blocks (on each rank)."""
    _, _, factory, _, _ = vllm_modules()
    extra = {"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm", "cpu_bytes_to_use": 160 * 1024}
    spec = factory.OffloadingSpecFactory.create_spec(offloading_config(1, 2, extra))
    assert spec.num_blocks == 10
    with pytest.raises(ValueError, match="host tier's size"):
        factory.OffloadingSpecFactory.create_spec(offloading_config(0, 2, {**extra, "cpu_bytes_to_use": 0}))
    with pytest.raises(ValueError, match="host tier's size"):
        factory.OffloadingSpecFactory.create_spec(offloading_config(0, 2, {**extra, "kvtd_host_blocks": -5,
                                                                           "cpu_bytes_to_use": 1024}))
    with pytest.raises(ValueError, match="blocks_per_chunk is 2"):
        factory.OffloadingSpecFactory.create_spec(offloading_config(0, 2, extra, blocks_per_chunk=2))


def test_a_stopped_daemon_is_fenced_and_its_store_counts_failed():
    """SIGSTOP, not SIGKILL: rank 1's daemon stops answering mid-service. kvtd fences it (the
    session's liveness, --engine-timeout 2 s here) before the job is reported, vLLM's code keeps
    stepping, the store counts failed (the next lookup misses) and no load runs on it."""
    import signal
    engine = engine_of()
    try:
        p = prompt(61, 3)
        engine.ranks[1].daemons.procs[0].send_signal(signal.SIGSTOP)
        assert engine.serve(Request("t1", p)) == 0
        assert engine.serve(Request("t2", p)) == 0, "a store a stopped daemon never made must not be a hit"
        assert engine.ranks[1].daemons.procs[0].wait(30) is not None, "the stopped daemon was fenced (killed)"
    finally:
        close(engine)


def test_with_metrics_on_vllms_prometheus_layer_takes_the_managers_stats():
    """Metrics on: the scheduler's manager is vLLM's own CPUOffloadingManager underneath, whose
    get_stats() sets vllm:kv_offload_cpu_cache_usage_perc and its read / write siblings and observes
    the allocation sizes (cpu/manager.py:293-318); vLLM's OffloadPromMetrics defines only what the
    spec class's build_metric_definitions returns and asserts each key it is handed is defined
    (offloading/metrics.py:481-490). KvtdOffloadingSpec defined none: the first stats to reach
    Prometheus failed that assertion. vLLM's own classes here, on a registry of the test's."""
    import functools

    import prometheus_client

    vllm_harness.import_vllm()
    # OffloadPromMetrics imports cpu/spec.py only for issubclass(spec, CPUOffloadingSpec)
    # (offloading/metrics.py:332-334), which keeps vLLM's own CPU spec's deprecated metrics; that
    # module does not import on torch 1.13 (PROVENANCE): a stand-in class answers the check.
    from reference_source import stand_in_module

    if "vllm.v1.kv_offload.cpu.spec" not in sys.modules:
        stand_in_module("vllm.v1.kv_offload.cpu.spec", CPUOffloadingSpec=type("CPUOffloadingSpec", (), {}))
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

    from kvtd.engines.vllm.manager import KvtdOffloadingManager

    for store_threshold in (0, 2):  # 2: vLLM's manager also counts the stores it skipped
        registry = prometheus_client.CollectorRegistry()
        metric_types = {cls: functools.partial(cls, registry=registry)
                        for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)}
        extra = {"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm", "kvtd_host_blocks": 8,
                 "store_threshold": store_threshold}
        vllm_config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))
        prom = OffloadPromMetrics(vllm_config, metric_types, ["model_name"], {0: ["m"]})
        manager = KvtdOffloadingManager(num_blocks=8, cache_policy="lru", enable_events=False, storage_ranks=0,
                                        store_threshold=store_threshold)
        for key in (b"k1", b"k2", b"k1", b"k2"):  # seen twice: past any threshold; b"k3" never seen
            manager.lookup(key, None)
        assert manager.prepare_store([b"k1", b"k2", b"k3"], None) is not None
        prom.observe(manager.get_stats().data)
        value = functools.partial(registry.get_sample_value, labels={"model_name": "m"})
        assert value("vllm:kv_offload_cpu_cache_usage_perc") is not None
        assert value("vllm:kv_offload_cpu_allocation_size_count") == 1
        assert value("vllm:kv_offload_stores_skipped_total") == (1 if store_threshold else None)


def test_vllms_cpu_spec_options_reach_vllms_own_manager():
    """store_threshold, max_tracker_size and cache_policy_module_path (cpu/spec.py:123-141) were
    dropped without a word: kvtd's manager is vLLM's CPUOffloadingManager underneath, so each is now
    handed to it as vLLM's own CPU spec hands it. A threshold of 2: a block looked up once is not
    stored (vLLM's own filter), one looked up twice is."""
    base, _, factory, _, _ = vllm_modules()
    extra = extra_config(store_threshold=2, max_tracker_size=123, eviction_policy="lru")
    spec = factory.OffloadingSpecFactory.create_spec(offloading_config(0, 1, extra))
    manager = spec.get_manager()
    assert (manager.store_threshold, manager.max_tracker_size) == (2, 123)
    manager.lookup(b"once", None)
    for _ in range(2):
        manager.lookup(b"twice", None)
    assert manager.prepare_store([b"once", b"twice"], None).keys_to_store == [b"twice"]


def test_two_data_parallel_engines_on_one_node_each_make_their_own_sessions():
    """The documented `"kvtd_session": "vllm"` is one extra config for every engine of a DP
    deployment, and each DP engine's workers count their ranks from 0: both engines' rank 0 made
    `vllm_r0`, and the second failed to start (its session name was taken). The DP index is in the
    name now (`<kvtd_session>_dp<index>_r<rank>`, only with DP > 1). Fails on the old code."""
    extra = extra_config()
    ranks = []
    try:
        for dp_index in (0, 1):
            ranks.append(Rank(0, 1, extra, start_daemon=False, dp=(dp_index, 2)))
        names = [r.connector.worker.suffix for r in ranks]
        assert names == [f"{extra['kvtd_session']}_dp0_r0", f"{extra['kvtd_session']}_dp1_r0"]
    finally:
        for r in ranks:
            r.close()
