"""Figures, not tests: the FastDeploy v1 adapter against kvtd's own Session calls. Run by
fastdeploy_v1_scenarios.py (`fastdeploy_v1_scenarios.py bench 1`), whose Deployment it uses.
"""

from __future__ import annotations

import statistics
import time

from fastdeploy_v1_scenarios import Deployment


def bench(tp: int) -> None:
    """Figures, not a test: what the v1 adapter adds over kvtd's own Python session on the same
    daemon. 32 layers x K/V, 16 KiB block-tensors, 16 blocks a task, p50 over 200 rounds, the
    two sides interleaved call by call (which goes first alternates), so that the machine's drift
    falls on both alike: the adapter (evict_to_host_async; load_layers_to_device_async with
    every layer reported) against Session.swap_to_host + wait and swap_to_device(layerwise) with
    wait_layer per layer, the same calls the adapter makes."""
    layers, n = 32, 16
    d = Deployment(1, gpu_blocks=64, cpu_blocks=64, layers=layers, heads=8, head_dim=512)  # 16 KiB: 8x4x512 bf16
    try:
        tm = d.controllers[0].transfer_manager
        s = tm._ready_session()
        dev, host = list(range(n)), list(range(n))
        rows = {}

        def timed_pair(adapter, session, rounds=200):
            took = ([], [])
            for i in range(rounds):
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    (adapter, session)[side]()
                    took[side].append((time.perf_counter() - t0) * 1e6)
            return statistics.median(took[0]), statistics.median(took[1])

        def raw_load():
            tid = s.swap_to_device(host, dev, layerwise=True)
            for layer in range(layers):
                s.wait_layer(tid, layer)
            s.wait(tid)

        for _ in range(20):  # warm
            assert tm.evict_to_host_async(dev, host) and tm.load_layers_to_device_async(range(layers), host, dev)
        rows["evict"] = timed_pair(lambda: tm.evict_to_host_async(dev, host),
                                   lambda: s.wait(s.swap_to_host(dev, host)))
        rows["load, every layer reported"] = timed_pair(
            lambda: tm.load_layers_to_device_async(range(layers), host, dev, None), raw_load)
        nbytes = n * layers * 2 * 16384
        print(f"FIGURE fastdeploy v1 adapter, host backend, {n} blocks x {layers} layers x K/V x 16 KiB "
              f"({nbytes >> 20} MiB a task), p50 of 200")
        for what, (adapter, raw) in rows.items():
            print(f"FIGURE   {what}: adapter {adapter:.0f} us, kvtd Session {raw:.0f} us, "
                  f"adapter/session {adapter / raw:.2f}x ({nbytes / adapter / 1e3:.2f} GB/s)")
    finally:
        d.close()


SCENARIOS = {"bench": bench}
