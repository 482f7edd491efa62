"""FastDeploy v1 scenarios against real kvtd daemons, one per process run (test_fastdeploy_v1.py
starts this script: FastDeploy's package must not meet the v0 harness's copy of it).

    fastdeploy_v1_scenarios.py <scenario> <tp>

FastDeploy's own CacheManager schedules (prefix match, allocation, write_back eviction to host,
swap back on a re-match); FastDeploy's own CacheController per rank (one per worker in
FastDeploy, each its own one-rank kvtd session and daemon here) runs the swaps through
kvtd.fastdeploy_v1; the "forward pass" writes each block's KV as a pure function of its prefix
hash, rank, layer and kind, and after a load reads it back per layer once
LayerDoneCounter.wait_for_layer says the layer is there. Prints "ok" and exits 0, or fails with
the reason.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
import zlib

import torch

import fastdeploy_v1_harness as fh
from kvtd import Geometry
from kvtd.testing import Daemons

LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM = 3, 2, 4, 8


def kv_of(hash_value: str, rank: int, layer: int, kind: int, nbytes: int) -> torch.Tensor:
    """The model's KV of one block: a pure function of its prefix, so any wrong byte shows."""
    # crc32, not hash(): str hashes differ per process, and a restarted worker checks the first's.
    g = torch.Generator().manual_seed(zlib.crc32(f"{hash_value}/{rank}/{layer}/{kind}".encode()))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def kv_bytes(controller, layer: int, kind: int) -> torch.Tensor:
    """The controller's cache tensor of (layer, kind) as [blocks, bytes of a block]: key, value,
    key scales, value scales by FastDeploy's names."""
    names = controller._get_cache_names(layer)
    t = controller.cache_kvs_map[names[("key", "value", "key_scale", "value_scale")[kind]]]
    return t.view(torch.uint8).view(t.shape[0], -1)


class Deployment:
    def __init__(self, tp: int, gpu_blocks: int, cpu_blocks: int, layers: int = LAYERS, heads: int = HEADS,
                 head_dim: int = HEAD_DIM, first_local_rank: int = 0, install=True, fp8: bool = False,
                 start_daemons: bool = True):
        self.device = fh.make_device()
        self.v1 = fh.load(self.device, install=install)
        os.environ["KVTD_FDV1_SESSION"] = f"fdv1t_{uuid.uuid4().hex[:8]}"
        os.environ.setdefault("KVTD_FDV1_READY_TIMEOUT", "30")
        self.tp, self.layers = tp, layers
        self.kinds = (0, 1, 2, 3) if fp8 else (0, 1)  # key, value, key scales, value scales
        self.cfg = fh.fd_config(self.v1, tp=tp, layers=layers, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                                kv_heads=heads, block_size=BLOCK_SIZE, head_dim=head_dim, fp8=fp8)
        self.controllers = [self.v1.CacheController(self.cfg, local_rank=first_local_rank + r, device_id=first_local_rank + r)
                            for r in range(tp)]
        shape = (gpu_blocks, heads, BLOCK_SIZE, head_dim)
        g = Geometry(num_ranks=1, num_layers=layers, key_shape=shape, value_shape=shape, num_host_blocks=cpu_blocks,
                     dtype="block_wise_fp8" if fp8 else "bfloat16", scale_bytes=4)
        self.daemons = [Daemons(None, c.transfer_manager.session_suffix, g, fh.daemon_flags())
                        for c in self.controllers]
        for d in self.daemons if start_daemons else []:
            d.start()
        for c in self.controllers:
            c.initialize_kv_cache(fh.AttentionBackend(self.cfg), gpu_blocks)
        self.manager = self.v1.CacheManager(self.cfg)
        from fastdeploy.cache_manager.v1.metadata import CacheSwapMetadata

        self.meta = CacheSwapMetadata

    def close(self) -> None:
        for c in self.controllers:
            c.transfer_manager.close()
            c._executor.shutdown(wait=False)
        for d in self.daemons:
            d.stop()
        self.device.close()

    def logs(self) -> str:
        return "\n".join(d.logs() for d in self.daemons)

    # -- the model --------------------------------------------------------------------------------
    def _bytes(self, rank: int, layer: int, kind: int) -> torch.Tensor:
        return kv_bytes(self.controllers[rank], layer, kind)

    def forward(self, req) -> None:
        """Writes the KV of every block the request computed (those past its matched prefix)."""
        for i, block in enumerate(req.block_tables[req.computed_from:], start=req.computed_from):
            for r in range(self.tp):
                for layer in range(self.layers):
                    for kind in self.kinds:
                        view = self._bytes(r, layer, kind)
                        view[block].copy_(kv_of(req.prompt_hashes[i], r, layer, kind, view.shape[1]))

    def check_layer(self, req, layer: int, upto: int) -> None:
        for i in range(upto):
            for r in range(self.tp):
                for kind in self.kinds:
                    view = self._bytes(r, layer, kind)
                    want = kv_of(req.prompt_hashes[i], r, layer, kind, view.shape[1]).to(view.device)
                    if not torch.equal(view[req.block_tables[i]], want):
                        raise AssertionError(f"rank {r} layer {layer} kind {kind}: block {req.block_tables[i]} "
                                             f"(prefix block {i}) does not hold its KV")

    # -- the scheduler (FastDeploy's CacheManager) -------------------------------------------------
    def schedule(self, request_id: str, hashes):
        req = fh.Request(request_id, list(hashes))
        self.manager.match_prefix(req)
        mr = req.match_result
        req.block_tables = list(mr.device_block_ids)
        matched_host = mr.matched_host_nums
        req.computed_from = len(req.block_tables) + matched_host
        allocated = self.manager.allocate_device_blocks(req, len(hashes) - len(req.block_tables))
        if not allocated:
            raise AssertionError(f"{request_id}: FastDeploy's CacheManager allocated nothing")
        req.block_tables += allocated
        req.matched_host = matched_host
        return req

    def batch(self, reqs):
        """BatchRequest.append_*_metadata (request.py:633-661): one eviction and one swap-in."""
        evict = swap = None
        for req in reqs:
            for meta in req.cache_evict_metadata:
                evict = evict or self.meta(src_type=meta.src_type, dst_type=meta.dst_type)
                evict.src_block_ids += meta.src_block_ids
                evict.dst_block_ids += meta.dst_block_ids
            for meta in req.cache_swap_metadata:
                swap = swap or self.meta(src_type=meta.src_type, dst_type=meta.dst_type)
                swap.src_block_ids += meta.src_block_ids
                swap.dst_block_ids += meta.dst_block_ids
        return evict, swap

    def step(self, reqs):
        """The worker side of one step on every rank: submit_swap_tasks, then the forward pass,
        layer by layer after wait_for_layer (attention.py does so per layer)."""
        evict, swap = self.batch(reqs)
        counters = [c.submit_swap_tasks(evict, swap) for c in self.controllers]
        if evict is not None:
            for c in self.controllers:
                c._wait_for_pending_evict_counters()  # the evicted blocks are rewritten below
        for req in reqs:
            if swap is not None:
                for layer in range(self.layers):
                    for counter in counters:
                        counter.wait_for_layer(layer, timeout=30)
                    self.check_layer(req, layer, req.computed_from)
            else:
                for layer in range(self.layers):
                    self.check_layer(req, layer, req.computed_from)
            self.forward(req)
            self.manager.request_finish(req)
        return evict, swap


def finished(meta, timeout: float = 10.0):
    """The metadata once the controller's transfer thread wrote its outcome (it does so after the
    last layer is reported)."""
    deadline = time.monotonic() + timeout
    while not meta.success and meta.error_message is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return meta


def hashes(prefix: str, n: int):
    return [f"{prefix}{i}" for i in range(n)]


def evict_and_swap_back(tp: int, fp8: bool = False) -> None:
    d = Deployment(tp, gpu_blocks=8, cpu_blocks=16, fp8=fp8)
    try:
        a = d.schedule("a", hashes("a", 6))
        d.step([a])
        # 2 free device blocks: all 6 of a's go to the host. (All of them: FastDeploy v1's radix
        # tree evicts the least recently touched device nodes, a prefix's first blocks before
        # its last (radix_tree.py:371-396), and its scheduler puts matched device blocks before
        # the ones swapped back (resource_manager_v1.py:1383, 1431), so after a partial eviction
        # FastDeploy's own block table is out of prefix order, with or without kvtd.)
        b = d.schedule("b", hashes("b", 8))
        evict, swap = d.step([b])
        assert evict is not None and len(evict.src_block_ids) == 6 and swap is None, (evict, swap)
        assert evict.success, evict.error_message
        # a's prefix again: its 6 blocks come back while 7 of b's go out, in one step (write_back:
        # the controller lets the eviction finish before the load, cache_controller.py:155-158).
        a2 = d.schedule("a2", hashes("a", 6) + hashes("c", 1))
        assert a2.matched_host == 6, a2.matched_host
        evict, swap = d.step([a2])
        assert evict is not None and len(evict.src_block_ids) == 7, evict
        assert swap is not None and len(swap.src_block_ids) == 6, swap
        assert finished(swap).success, swap.error_message
        for c in d.controllers:
            stats = c.transfer_manager.get_stats()
            assert stats["kvtd_evictions"] == 2 and stats["kvtd_loads"] == 1 and stats["kvtd_failures"] == 0, stats
    except BaseException:
        print(d.logs(), file=sys.stderr)
        raise
    finally:
        d.close()


def failed_eviction_answers_at_once(tp: int) -> None:
    """A failed eviction is finished at once with success False and a message; the next submit
    does not wait (FastDeploy's controller would wait 300 s in wait_all); a later load naming
    its host blocks fails and reports no layer."""
    d = Deployment(tp, gpu_blocks=8, cpu_blocks=16)
    try:
        bad = d.meta(src_block_ids=[0, 1], dst_block_ids=[3, 99])  # host block 99 of 16
        start = time.monotonic()
        d.controllers[0].submit_swap_tasks(bad, None)
        d.controllers[0].submit_swap_tasks(None, None)  # waits for the pending eviction first
        took = time.monotonic() - start
        assert took < 5, f"the next submit waited {took:.1f} s for a failed eviction"
        assert bad.success is False and bad.error_message and "99" in bad.error_message, bad.error_message
        reported = []
        load = d.meta(src_block_ids=[3], dst_block_ids=[5])  # never written
        counter = d.controllers[0].submit_swap_tasks(None, load)
        assert finished(load).success is False and load.error_message, load
        for layer in range(d.layers):
            reported.append(counter.is_layer_done(layer))
        assert not any(reported), f"layers reported done after a failed load: {reported}"
        failures = list(d.controllers[0].transfer_manager.failures)
        assert any("host block 3" in f for f in failures), failures
    finally:
        d.close()


def daemon_killed_mid_load(tp: int) -> None:
    """Through FastDeploy's controller: the daemon of rank 0 is SIGKILLed once the first layer
    of a large load is reported. FastDeploy sees a failed swap (the metadata's success False, its
    message naming the dead rank), no later layer is ever marked done, and its forward pass's
    wait_for_layer on a later layer times out (LayerSwapTimeoutError) instead of reading stale KV.
    Rank 1's load of the same step (tp 2), on its own daemon, completes."""
    layers = 32
    d = Deployment(tp, gpu_blocks=72, cpu_blocks=72, layers=layers, heads=8, head_dim=1024)  # 128 KiB blocks
    from fastdeploy.cache_manager.v1.cache_utils import LayerSwapTimeoutError

    try:
        ids = list(range(64))
        for c in d.controllers:
            assert c.transfer_manager.evict_to_host_async(ids, ids), list(c.transfer_manager.failures)
        metas = [d.meta(src_block_ids=list(ids), dst_block_ids=list(ids)) for _ in d.controllers]
        counters = [c.submit_swap_tasks(None, m) for c, m in zip(d.controllers, metas)]
        deadline = time.monotonic() + 30
        while not counters[0].is_layer_done(0):
            assert time.monotonic() < deadline, "layer 0 was never reported"
            time.sleep(0.0002)
        d.daemons[0].procs[0].kill()
        assert finished(metas[0], 30).success is False, metas[0]
        # FastDeploy's own words in the metadata (cache_controller.py:770-774); kvtd's, naming
        # the dead rank, in the manager's failures and the worker's log.
        assert metas[0].error_message, metas[0]
        tm = d.controllers[0].transfer_manager
        assert any("rank_dead" in f or "exited" in f for f in tm.failures), list(tm.failures)
        done = [layer for layer in range(layers) if counters[0].is_layer_done(layer)]
        assert done and done == list(range(len(done))) and len(done) < layers, done
        try:
            counters[0].wait_for_layer(layers - 1, timeout=0.5)
            raise AssertionError("FastDeploy's forward pass was told the last layer is there")
        except LayerSwapTimeoutError:
            pass
        for m, counter in zip(metas[1:], counters[1:]):
            assert finished(m, 30).success, m.error_message
            assert all(counter.is_layer_done(layer) for layer in range(layers))
        print(f"reported {len(done)} of {layers} layers before the failure: {list(tm.failures)[-1]}")
    finally:
        d.close()


def local_rank_beyond_tp(tp: int) -> None:
    """A worker whose local rank is at least the TP size (data parallel on one node): the
    controller names its tensors with local_rank % tp (cache_controller.py:231), FastDeploy's own
    manager looks them up with the raw local rank (transfer_manager.py:173-176) and finds none;
    kvtd takes the names the controller registered."""
    d = Deployment(tp, gpu_blocks=8, cpu_blocks=8, first_local_rank=tp)
    try:
        names = sorted(d.controllers[0].cache_kvs_map)
        assert all(f"_rank0.device{tp}" in n for n in names if "_0_" in n), names
        tm = d.controllers[0].transfer_manager
        for layer in range(d.layers):
            for kind in (0, 1):
                d._bytes(0, layer, kind)[2].copy_(kv_of("x", 0, layer, kind, d._bytes(0, layer, kind).shape[1]))
        assert tm.evict_to_host_async([2], [5]), list(tm.failures)
        done = []
        assert tm.load_layers_to_device_async(list(range(d.layers)), [5], [7], done.append), list(tm.failures)
        assert done == list(range(d.layers)), done
        for layer in range(d.layers):
            for kind in (0, 1):
                view = d._bytes(0, layer, kind)
                assert torch.equal(view[7], view[2]), f"layer {layer} kind {kind}: block 7 is not block 2's KV"
    finally:
        d.close()


def plugin_entry_point(tp: int) -> None:
    """FastDeploy's plugin loader (fastdeploy/plugins/utils.py load_plugins_by_group: every entry
    point of the group, loaded and called) finds kvtd's entry point and, with the switch on,
    installs it; with the switch off it leaves FastDeploy alone."""
    from importlib.metadata import entry_points

    import fastdeploy.cache_manager.v1.cache_controller as cc

    original = cc.CacheTransferManager
    found = [ep for ep in entry_points(group="fastdeploy.model_register_plugins") if ep.name == "kvtd"]
    assert len(found) == 1, f"kvtd's FastDeploy plugin entry point is not installed: {found}"
    os.environ.pop("KVTD_FASTDEPLOY_V1", None)
    found[0].load()()
    assert cc.CacheTransferManager is original, "installed without KVTD_FASTDEPLOY_V1=1"
    os.environ["KVTD_FASTDEPLOY_V1"] = "1"
    os.environ["ENABLE_V1_KVCACHE_MANAGER"] = "1"
    found[0].load()()
    from kvtd.fastdeploy_v1 import KvtdCacheTransferManager

    assert cc.CacheTransferManager is KvtdCacheTransferManager, cc.CacheTransferManager


# FastDeploy's own unit tests of its transfer manager (tests/cache_manager/v1/test_transfer_manager.py)
# that test behaviour: construction from the config, the maps and per-layer getters, the
# properties, get_stats, the stream waits and the stream event without cupy. Not run: those that
# read FastDeploy's private lists (_device_key_caches, _host_key_ptrs: test_init_basic,
# *_builds_layer_indices, *_with_scales, *_empty, *_different_rank_device), call its private copy
# paths with its custom ops mocked (_swap_all_layers, _swap_single_layer: TestValidateSwapParams,
# TestSwapAllLayers, TestSwapSingleLayer) or mock its cupy streams (*_with_mock_stream).
FASTDEPLOY_UNIT_TESTS = [
    "TestCacheTransferManagerInit.test_init_metadata_defaults",
    "TestSetDeviceCacheKvsMap.test_set_device_cache_kvs_map_basic",
    "TestSetHostCacheKvsMap.test_set_host_cache_kvs_map_basic",
    *[f"TestMetadataProperties.test_{p}_property" for p in ("num_layers", "local_rank", "device_id", "cache_dtype",
                                                             "num_host_blocks")],
    "TestMetadataProperties.test_has_cache_scale_property_false",
    "TestMetadataProperties.test_has_cache_scale_property_true",
    *[f"TestLayerIndexedAccess.test_get_{t}" for t in ("device_key_cache_valid", "device_key_cache_invalid",
                                                        "device_value_cache_valid", "host_key_ptr_valid",
                                                        "host_key_ptr_invalid", "host_value_ptr_valid")],
    *[f"TestCacheKvsMapGetters.test_{t}" for t in ("device_cache_kvs_map_property", "host_cache_kvs_map_property",
                                                    "device_key_cache_per_layer_accessible",
                                                    "device_value_cache_per_layer_accessible",
                                                    "host_key_ptr_per_layer_accessible",
                                                    "host_value_ptr_per_layer_accessible",
                                                    "get_stats_includes_expected_keys")],
    "TestSyncStreams.test_sync_input_stream_no_stream_does_not_raise",
    "TestSyncStreams.test_sync_output_stream_no_stream_does_not_raise",
    "TestRecordInputStreamEvent.test_returns_none_when_no_cupy",
    "TestRecordInputStreamEvent.test_returns_none_when_input_stream_none",
]


def fastdeploy_unit_tests(tp: int) -> None:
    """Those tests, FastDeploy's file unmodified, with the module's CacheTransferManager being
    kvtd's. Their config helper (tests/utils.py get_default_test_fd_config) builds FastDeploy's
    whole FDConfig, which imports modules the reference does not hold: fh.fd_config stands in
    with its 12 layers (FakeModelConfig) and a 1-head cache. The process must then exit cleanly:
    before kvtd closed its managers at exit, a connect thread still waiting for a daemon (none
    runs here) was killed by the interpreter's finalisation inside torch and the process
    aborted (std::terminate, exit 134; 4 runs in 7 here)."""
    import importlib.util
    import unittest

    import fastdeploy.cache_manager.v1.transfer_manager as tm_module
    import paddle
    from kvtd.fastdeploy_v1 import KvtdCacheTransferManager

    device = fh.ShmDevice()
    paddle.ones = lambda shape, dtype="float32": device.full(shape, 1, dtype)
    tm_module.CacheTransferManager = KvtdCacheTransferManager
    fh._module("utils", get_default_test_fd_config=lambda: fh.fd_config(
        fh.load(device), tp=1, layers=12, gpu_blocks=100, cpu_blocks=0, kv_heads=1, block_size=64, head_dim=1))
    os.environ["KVTD_FDV1_READY_TIMEOUT"] = "1"
    path = fh.source() / "tests" / "cache_manager" / "v1" / "test_transfer_manager.py"
    spec = importlib.util.spec_from_file_location("fastdeploy_test_transfer_manager", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromName(n, module) for n in FASTDEPLOY_UNIT_TESTS)
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=1).run(suite)
    device.close()
    assert result.wasSuccessful() and result.testsRun == len(FASTDEPLOY_UNIT_TESTS), result


def four_callers_at_once(tp: int) -> None:
    """The controller's 4 transfer threads call one manager at once: each thread evicts its own
    device blocks to its own host blocks and loads them back into other device blocks, 20
    rounds; every byte of every round is checked."""
    d = Deployment(tp, gpu_blocks=32, cpu_blocks=16)
    try:
        errors = []

        def caller(t: int) -> None:
            tm = d.controllers[0].transfer_manager
            src, host, dst = [4 * t, 4 * t + 1], [4 * t, 4 * t + 1], [16 + 4 * t, 16 + 4 * t + 1]
            try:
                for round_ in range(20):
                    for layer in range(d.layers):
                        for kind in d.kinds:
                            view = d._bytes(0, layer, kind)
                            for i, b in enumerate(src):
                                view[b].copy_(kv_of(f"t{t}r{round_}b{i}", 0, layer, kind, view.shape[1]))
                    assert tm.evict_to_host_async(src, host), list(tm.failures)
                    done = []
                    assert tm.load_layers_to_device_async(list(range(d.layers)), host, dst, done.append), \
                        list(tm.failures)
                    assert done == list(range(d.layers)), done
                    for layer in range(d.layers):
                        for kind in d.kinds:
                            view = d._bytes(0, layer, kind)
                            for i, b in enumerate(dst):
                                want = kv_of(f"t{t}r{round_}b{i}", 0, layer, kind, view.shape[1]).to(view.device)
                                assert torch.equal(view[b], want), f"thread {t} round {round_} layer {layer} block {b}"
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {t}: {e!r}")

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert d.controllers[0].transfer_manager.get_stats()["kvtd_loads"] == 80
    finally:
        d.close()


def daemon_starts_late(tp: int) -> None:
    """No daemon within the ready timeout: swaps fail naming it (no exception into FastDeploy);
    the daemon started later (systemd bringing it up) serves the same worker without a restart."""
    os.environ["KVTD_FDV1_READY_TIMEOUT"] = "1"
    d = Deployment(tp, gpu_blocks=8, cpu_blocks=8, start_daemons=False)
    os.environ["KVTD_FDV1_READY_TIMEOUT"] = "30"
    try:
        tm = d.controllers[0].transfer_manager
        assert not tm.evict_to_host_async([1], [2]), "an eviction with no daemon succeeded"
        assert "wait_ready" in tm.failures[-1] or "ready" in tm.failures[-1], list(tm.failures)
        # The failure says how to start the missing daemon (the v1 page's operator had no line to copy).
        line = tm.failures[-1].partition("start its daemon as: ")[2].split()
        assert line[:3] == ["kvtd", "--session", d.controllers[0].transfer_manager._suffix], list(tm.failures)
        assert "--num-layers" in line and "--num-host-blocks" in line, line
        d.daemons[0].start()
        deadline = time.monotonic() + 30
        while not tm.evict_to_host_async([1], [2]):
            assert time.monotonic() < deadline, f"the late daemon never served: {list(tm.failures)[-3:]}"
            time.sleep(0.2)
        done = []
        assert tm.load_layers_to_device_async(list(range(d.layers)), [2], [5], done.append), list(tm.failures)
        assert done == list(range(d.layers))
    finally:
        d.close()


def fp8_evict_and_swap_back(tp: int) -> None:
    """The same with block_wise_fp8: uint8 caches and float32 scale tensors per layer, named
    key_cache_scales_<layer>_rank<r>.device<d> (cache_controller.py:281-313); every scale byte too."""
    evict_and_swap_back(tp, fp8=True)


SCENARIOS = {"daemon_starts_late": daemon_starts_late, "four_callers_at_once": four_callers_at_once, "fp8_evict_and_swap_back": fp8_evict_and_swap_back, "fastdeploy_unit_tests": fastdeploy_unit_tests,
             "local_rank_beyond_tp": local_rank_beyond_tp, "plugin_entry_point": plugin_entry_point,
             "evict_and_swap_back": evict_and_swap_back,
             "failed_eviction_answers_at_once": failed_eviction_answers_at_once,
             "daemon_killed_mid_load": daemon_killed_mid_load}

if __name__ == "__main__":
    threading.excepthook = lambda args: print(f"thread {args.thread.name}: {args.exc_value!r}", file=sys.stderr)
    import fastdeploy_v1_bench
    import fastdeploy_v1_restarts

    SCENARIOS.update(fastdeploy_v1_restarts.SCENARIOS)
    SCENARIOS.update(fastdeploy_v1_bench.SCENARIOS)
    # FastDeploy's modules keep the paddle stand-in they imported first, so the tensors FastDeploy's
    # own unit tests make live on this device: close it too (every run left 528 objects in /dev/shm).
    first_device = fh.ShmDevice()
    try:
        if sys.argv[1] in ("plugin_entry_point", "fastdeploy_unit_tests"):
            fh.load(first_device, install=False)
        SCENARIOS[sys.argv[1]](int(sys.argv[2]))
    finally:
        first_device.close()
    print("ok")
