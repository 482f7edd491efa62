"""kvtd.Session against real kvtd daemons (host backend): every task kind, byte for byte."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest
import torch

import kvtd
from conftest import small_geometry

KINDS = ("key", "value")


def fill_random(s, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for r in range(g.num_ranks):
        for layer in range(g.num_layers):
            for k in ("key", "value", "key_scale", "value_scale"):
                if g.has_tensor(k):
                    t = s.host_tensor(r, layer, k, dtype=torch.uint8)
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def snapshot(s, g, blocks):
    out = {}
    for r in range(g.num_ranks):
        for layer in range(g.num_layers):
            for k in ("key", "value", "key_scale", "value_scale"):
                if g.has_tensor(k):
                    t = s.host_tensor(r, layer, k, dtype=torch.uint8)
                    out[r, layer, k] = t[blocks].clone()
    return out


def test_swap_round_trip_layer_by_layer_is_byte_exact(cluster):
    c = cluster()
    s = c.ready()
    g = c.geometry
    fill_random(s, g)
    src = [3, 7, 8, 9]
    before = snapshot(s, g, src)
    out = s.wait(s.swap_to_host(src, [0, 1, 2, 5]))
    assert out.ok and out.blocks_done == 4 and out.status_name == "ok" and out.failed_rank == -1
    assert out.latency_ns > 0
    fill_random(s, g, seed=1)  # scribble over everything
    dst = [10, 11, 12, 13]
    tid = s.swap_to_device([0, 1, 2, 5], dst, layerwise=True)
    for layer in range(g.num_layers):
        s.wait_layer(tid, layer, timeout=30)
        # Layer `layer` is in place on every rank now, whatever later layers are doing.
        after = snapshot(s, g, dst)
        for r in range(g.num_ranks):
            for k in KINDS:
                assert torch.equal(after[r, layer, k], before[r, layer, k]), (r, layer, k)
    res = s.wait(tid)
    assert res.ok and res.blocks_done == 4
    assert s.layer_event_handle(0, 0) is None  # host backend: no CUDA events


def test_a_host_byte_changed_after_swap_out_fails_the_swap_in_whole_and_layer_by_layer(cluster):
    """--verify-swaps full on the host backend (the checksums taken by the CPU, per layer on a
    layer-by-layer load): a byte of the host pool that changes between swap-out and swap-in fails
    the swap-in with integrity, naming the layer and the blocks; a clean block still loads."""
    g = small_geometry(ranks=1)
    c = cluster(g, extra=["--verify-swaps", "full"])
    s = c.ready()
    fill_random(s, g)
    assert s.wait(s.swap_to_host([3, 7], [0, 1])).ok
    key1 = s.host_array(0, 1, "key")
    block = len(key1) // g.key_shape[0]
    needle = bytes(key1[7 * block:8 * block])  # device block 7's key in layer 1, now host block 1's
    path = f"/dev/shm/kvtd_{os.getuid()}_{s.generation:016x}_host0"
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as pool:
        at = pool.find(needle)
        assert at >= 0, "the block's bytes are not in the host pool"
        pool[at + 5] ^= 0x10
    for layerwise, dst in ((True, [10, 11]), (False, [12, 13])):
        r = s.wait(s.swap_to_device([0, 1], dst, layerwise=layerwise), check=False)
        assert r.status_name == "integrity", (layerwise, r.status_name, r.message)
        assert "layer 1 " in r.message and "host block 1 -> device block" in r.message, r.message
    assert s.wait(s.swap_to_device([0], [14])).ok  # host block 0 is clean


def test_the_completion_forecast_counts_its_waits_and_can_be_turned_off(cluster):
    """Each lone swap after the first is waited for around its forecast end (learned from the
    swap before it), unless the session was made with completion_forecast=False."""
    for on in (True, False):
        c = cluster(completion_forecast=on)
        s = c.ready()
        for i in range(6):
            assert s.wait(s.swap_to_host([i], [i])).ok
        w = s.forecast_waits()
        assert w["waits"] == w["before_window"] + w["in_window"] + w["after_window"]
        assert w["waits"] == (5 if on else 0), (on, w)


def test_failures_are_exceptions_carrying_code_and_status(cluster):
    c = cluster()
    s = c.ready()
    with pytest.raises(kvtd.TaskFailed) as e:
        s.wait(s.swap_to_host([40], [0]))  # 32 device blocks
    assert e.value.code == kvtd._native.E_TASK_FAILED and e.value.code_name == "task_failed"
    assert e.value.result.status_name == "id_out_of_range"
    assert e.value.result.failed_rank == 0
    assert "40" in e.value.result.message
    # check=False hands the failed result back instead.
    r = s.wait(s.swap_to_device([23], [0]), check=False)  # host block 23 never written
    assert not r.ok and r.status_name == "host_tier_lost"
    # A deadline already past when a rank reads it.
    r = s.wait(s.swap_to_host([1], [1], deadline_ns=kvtd.now_ns() - 1), check=False)
    assert r.status_name == "deadline_exceeded"
    with pytest.raises(kvtd.UnknownTask) as u:
        s.wait(123456, timeout=0.01)
    assert u.value.code_name == "unknown_task"
    with pytest.raises(kvtd.InvalidArgument):
        s.storage_query(["bad/key"])
    with pytest.raises(kvtd.InvalidArgument):
        s.submit(42)
    with pytest.raises(ValueError):
        s.wait_layer(1, 0, stage="sometime")
    # The daemons kept serving through all of it.
    assert s.wait(s.swap_to_host([1], [1])).ok


def test_poll_and_after_task_ordering(cluster):
    # `after=` alone orders the two tasks: they share no block (the block tracker would order
    # tasks that do, with or without it), and the first is large (40 MiB per rank) while the
    # second moves one block on the other lane, so without `after=` the second finishes first.
    # poll() alone collects both, within a deadline: no fallback to wait().
    g = small_geometry(layers=8, shape=(64, 8, 64, 128))  # 2 MiB per block per rank
    c = cluster(g)
    s = c.ready()
    fill_random(s, g)
    assert s.wait(s.swap_to_host([30], [22])).ok  # host block 22 holds device block 30's bytes
    before = snapshot(s, g, [30])
    first = s.swap_to_host(list(range(20)), list(range(20)))
    second = s.swap_to_device([22], [40], after=first)
    first_done = second_done = None
    deadline = time.monotonic() + 30
    while second_done is None:
        assert time.monotonic() < deadline, "poll() never answered"
        if first_done is None:
            first_done = s.poll(first)
        second_done = s.poll(second)
        if second_done is not None and first_done is None:
            first_done = s.poll(first)
            assert first_done is not None, "the task after `first` completed before it"
    assert first_done.ok and second_done.ok
    assert s.poll(second) is None  # handed out once
    after = snapshot(s, g, [40])
    assert all(torch.equal(after[r, l, k], before[r, l, k]) for (r, l, k) in before)
    assert s.in_flight == 0


def test_waits_release_the_gil():
    g = small_geometry(ranks=1)
    with kvtd.Session(f"py_gil_{threading.get_ident()}", g) as s:
        s.create_host_device_tensors()
        s.publish()
        count = 0
        stop = threading.Event()

        def spin():
            nonlocal count
            while not stop.is_set():
                count += 1

        t = threading.Thread(target=spin)
        t.start()
        with pytest.raises(kvtd.Timeout):
            s.wait_ready(0.3)  # no daemon: waits the whole 0.3 s in C
        stop.set()
        t.join()
        # Holding the GIL for 0.3 s would leave the counter near zero.
        assert count > 10000, count


def test_storage_write_query_read_and_prefetch(cluster, tmp_path):
    c = cluster(extra=["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--model-id", "t"])
    s = c.ready()
    g = c.geometry
    fill_random(s, g)
    keys = [f"pfx:{i:02d}" for i in range(4)]
    before = snapshot(s, g, [1, 2, 3, 4])
    w = s.wait(s.storage_write(keys, [1, 2, 3, 4]))
    assert w.ok and w.blocks_done == 4 and w.blocks_skipped == 0
    assert s.wait(s.storage_query(keys + ["pfx:missing"])).blocks_done == 4
    r = s.wait(s.storage_read(keys[:3], [20, 21, 22]))
    assert r.blocks_done == 3
    after = snapshot(s, g, [20, 21, 22])
    for (rank, layer, k), t in before.items():
        assert torch.equal(after[rank, layer, k], t[:3]), (rank, layer, k)
    p = s.wait(s.prefetch(keys, [10, 11, 12, 13], min_hits=2))
    assert p.blocks_done == 4
    back = s.wait(s.swap_to_device([10, 11, 12, 13], [24, 25, 26, 27]))
    assert back.ok
    after = snapshot(s, g, [24, 25, 26, 27])
    assert all(torch.equal(after[key], before[key]) for key in before)
    # A bumped weight version misses what older weights stored.
    s.set_weight_version(2)
    assert s.weight_version == 2
    assert s.name.endswith(c.suffix) and s.generation != 0
    assert s.wait(s.storage_query(keys)).blocks_done == 0


def test_fp8_four_byte_scales_extra_layers_and_3d_shape(cluster):
    g = kvtd.Geometry(num_ranks=2, num_layers=4, num_extra_layers=1, extra_device_blocks=16,
                      key_shape=(32, 2, 8), value_shape=(32, 2, 8), dtype="block_wise_fp8", scale_bytes=4,
                      num_host_blocks=24)
    c = cluster(g)
    s = c.ready()
    assert s.host_tensor(0, 0, "key").shape == (32, 2, 8)
    assert s.host_tensor(1, 3, "value_scale").shape == (16, 2, 8)  # extra layer: its own block count
    assert s.host_tensor(1, 3, "value_scale").dtype == torch.float32
    fill_random(s, g)
    before = snapshot(s, g, [2, 9, 15])
    assert s.wait(s.swap_to_host([2, 9, 15], [0, 1, 2])).ok
    fill_random(s, g, seed=5)
    assert s.wait(s.swap_to_device([0, 1, 2], [2, 9, 15], layerwise=True)).ok
    after = snapshot(s, g, [2, 9, 15])
    assert all(torch.equal(after[key], before[key]) for key in before)
    r = s.wait(s.swap_to_host([20], [3]), check=False)  # exists in model layers, not in the extra one
    assert r.status_name == "id_out_of_range" and "[0, 16)" in r.message


def test_closed_session_refuses_calls():
    s = kvtd.Session(f"py_closed_{threading.get_ident()}", small_geometry(ranks=1))
    s.close()
    with pytest.raises(ValueError):
        s.publish()
    s.close()  # twice is fine


def test_device_tensors_register_by_handle_offset_and_pci_address():
    """Registration checks of the library (the driver-side handle logic runs against the CUDA
    stand-in in test_cuda_handles.py)."""
    from kvtd.tensors import cuda_ipc_handle

    g = small_geometry(ranks=1)
    nbytes = g.block_bytes("key") * 32
    with kvtd.Session(f"py_cuda_{threading.get_ident()}", g) as s:
        s.register_tensor(0, 0, "key", bytes(range(64)), 8392, nbytes, device_id=1)
        with pytest.raises(kvtd.InvalidArgument, match="needs"):
            s.register_tensor(0, 1, "key", bytes(64), 0, 16, device_id=1)  # too small for 32 blocks
        with pytest.raises(ValueError, match="64 bytes"):
            s.register_tensor(0, 1, "key", bytes(66), 0, nbytes, device_id=1)  # torch's 66-byte form
        s.register_tensor(0, 1, "key", bytes(64), 0, nbytes, device_id=3, pci_bus_id="0000:3b:00.0")
        with pytest.raises(kvtd.InvalidArgument, match="PCI bus id"):
            s.register_tensor(0, 2, "key", bytes(64), 0, nbytes, device_id=3, pci_bus_id="3b:00")
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ipc_handle(torch.zeros(4))


def test_a_swap_carries_one_engine_event_per_rank(cluster):
    """The host backend has no streams (the engine's writes are done when it submits), so the
    events are carried and the swap runs; the count must be one per rank."""
    c = cluster()
    s = c.ready()
    events = [bytes([r]) * 64 for r in range(2)]
    assert s.wait(s.submit(kvtd.SWAP_TO_HOST, [1, 2], [0, 1], engine_events=events)).ok
    with pytest.raises(kvtd.InvalidArgument, match="1 engine events for 2 ranks"):
        s.submit(kvtd.SWAP_TO_HOST, [1], [0], engine_events=events[:1])
    with pytest.raises(ValueError, match="64 bytes"):
        s.submit(kvtd.SWAP_TO_HOST, [1], [0], engine_events=[b"x", b"y"])


def test_threads_share_a_session_and_each_gets_its_own_errors(cluster):
    c = cluster()
    s = c.ready()
    failures = []

    def worker(n):
        try:
            for i in range(40):
                assert s.wait(s.swap_to_host([n * 4 + i % 4], [n * 4 + i % 4])).ok
                with pytest.raises(kvtd.TaskFailed) as e:
                    s.wait(s.swap_to_host([100 + n], [0]))  # out of range: the message names this id
                assert str(100 + n) in e.value.result.message, e.value.result.message
                with pytest.raises(kvtd.InvalidArgument) as bad:
                    s.submit(SWAP_KIND_BASE + n)
                assert f"task kind {SWAP_KIND_BASE + n}" in str(bad.value), str(bad.value)
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert s.in_flight == 0


SWAP_KIND_BASE = 50


def test_clear_then_new_tensors_then_restore_is_byte_exact(cluster):
    c = cluster()
    s = c.ready()
    g = c.geometry
    fill_random(s, g)
    before = snapshot(s, g, [3, 4])
    s.wait(s.swap_to_host([3, 4], [0, 1]))
    s.clear_caches(weight_version=5)
    assert s.cache_cleared and s.weight_version == 5
    assert all(s.rank_ready(r) == kvtd._native.READY_HOST_POOL for r in range(g.num_ranks))
    with pytest.raises(kvtd.CacheCleared) as e:
        s.swap_to_host([5], [2])
    assert e.value.code_name == "cache_cleared"
    s.free_host_device_tensors()
    s.create_host_device_tensors()  # new arenas, zero-filled
    s.restore_caches()
    assert not s.cache_cleared
    s.wait(s.swap_to_device([0, 1], [10, 11]))  # the host tier kept the old KV
    after = snapshot(s, g, [10, 11])
    for r in range(g.num_ranks):
        for layer in range(g.num_layers):
            for k in KINDS:
                assert torch.equal(after[r, layer, k], before[r, layer, k]), (r, layer, k)
    with pytest.raises(kvtd.InvalidArgument):
        s.restore_caches()  # not cleared


def test_restore_with_a_bad_handle_fails_naming_the_rank(cluster):
    c = cluster()
    s = c.ready()
    g = c.geometry
    s.clear_caches(drop_host_tier=True)
    nbytes = g.block_bytes("key") * g.device_blocks(0)
    s.register_tensor(1, 0, "key", b"kvtd_no_such_arena".ljust(64, b"\0"), 0, nbytes)
    with pytest.raises(kvtd.CacheControlFailed) as e:
        s.restore_caches()
    assert "rank 1" in str(e.value)
    assert s.cache_cleared
    s.clear_caches()
    s.create_host_device_tensors()
    s.restore_caches()
    r = s.wait(s.swap_to_device([0], [1]), check=False)
    assert r.status_name == "host_tier_lost"  # dropped by the first clear


def test_geometry_rules_and_version_come_from_the_library():
    # kvtd.Geometry asks libkvtd_client (kvtd_tensor_shape, kvtd_geometry_check, kvtd_version)
    # instead of re-deriving shapes: the rules live in proto/geometry.h only.
    g = kvtd.Geometry(num_ranks=1, num_layers=3, key_shape=(16, 2, 4, 8), value_shape=(16, 2, 4, 8),
                      dtype="block_wise_fp8", scale_bytes=4, num_host_blocks=4,
                      num_extra_layers=1, extra_device_blocks=8)
    g.check()
    assert g.tensor_shape(0, "key") == (16, 2, 4, 8)
    assert g.tensor_shape(2, "key") == (8, 2, 4, 8)  # the extra (MTP) layer has its own block count
    assert g.tensor_shape(0, "value_scale") == (16, 2, 4)
    assert g.block_bytes("key") == 2 * 4 * 8 and g.block_bytes("key_scale") == 2 * 4 * 4
    assert g.element_bytes("key_scale") == 4
    three_d = kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(16, 2, 4))
    assert three_d.tensor_shape(0, "key") == (16, 2, 4) and not three_d.has_tensor("value")
    bad = kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(16, 2, 4, 8), value_shape=(8, 2, 4, 8))
    with pytest.raises(ValueError, match="same block count"):
        bad.check()
    assert kvtd.__version__.count(".") == 2
