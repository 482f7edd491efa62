#!/usr/bin/env python3
"""Tasks through the Python client (ctypes over libkvtd_client.so), in the shapes of kvtd-loadgen,
so the figures side by side are the cost of the Python layer. --mode latency: one-block
SWAP_TO_HOST round trips, submit + wait (1 layer, 2 KiB key + 2 KiB value per block, as `--mode
latency`). --mode throughput: tasks of --blocks-per-task random blocks, one in flight,
alternating out and in (32 layers x K/V of 128 KiB block-tensors, 128 device and 96 host blocks,
as bench.sh's `--mode throughput` section), GB/s per rank as the median of 5 rounds.
Starts its own daemons. Prints figures; asserts nothing."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import kvtd  # noqa: E402
import kvtd.testing  # noqa: E402


def latency(args) -> None:
    shape = (16, 1, 16, 64)
    g = kvtd.Geometry(num_ranks=args.ranks, num_layers=1, key_shape=shape, value_shape=shape, num_host_blocks=16,
                      dtype="bfloat16")
    suffix = f"pybench{os.getpid()}"
    with kvtd.testing.Daemons(None, suffix, g, ["--log-level", "warn"]):
        with kvtd.Session(suffix, g) as s:
            s.create_host_device_tensors()
            s.publish()
            s.wait_ready(30)
            for i in range(1000):  # warm up
                s.wait(s.swap_to_host([i % 16], [i % 16]))
            lat = []
            for i in range(args.samples):
                t0 = time.perf_counter_ns()
                s.wait(s.swap_to_host([i % 16], [(i + 3) % 16]))
                lat.append(time.perf_counter_ns() - t0)
            lat.sort()
            pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] / 1000  # noqa: E731
            print(f"python round trip, {args.ranks} rank(s), {args.samples} samples: p50 {pct(0.5):.1f} us, "
                  f"p99 {pct(0.99):.1f} us, p99.9 {pct(0.999):.1f} us")


def throughput(args) -> None:
    shape = (128, 8, 64, 128)  # 128 KiB per block-tensor in bf16: 8 MiB per block over 32 layers x K/V
    g = kvtd.Geometry(num_ranks=args.ranks, num_layers=32, key_shape=shape, value_shape=shape, num_host_blocks=96,
                      dtype="bfloat16")
    n = args.blocks_per_task
    block_bytes = 32 * 2 * 8 * 64 * 128 * 2
    suffix = f"pybench{os.getpid()}"
    rng = random.Random(1)
    with kvtd.testing.Daemons(None, suffix, g, ["--log-level", "warn"]):
        with kvtd.Session(suffix, g) as s:
            s.create_host_device_tensors()
            s.publish()
            s.wait_ready(30)
            for h in range(0, 96, n):  # every host block written once, so any swap-in reads written bytes
                hs = list(range(h, min(96, h + n)))
                s.wait(s.swap_to_host(list(range(len(hs))), hs))
            rates, tasks = [], 0
            for _ in range(5):
                busy, done = 0.0, 0
                end = time.perf_counter() + args.seconds / 5
                while time.perf_counter() < end or done < 2:
                    d, h = rng.sample(range(128), n), rng.sample(range(96), n)
                    t0 = time.perf_counter()
                    if tasks % 2:
                        s.wait(s.swap_to_device(h, d))
                    else:
                        s.wait(s.swap_to_host(d, h))
                    busy += time.perf_counter() - t0
                    done += 1
                    tasks += 1
                rates.append(block_bytes * n * done / busy / 1e9)
            rates.sort()
            print(f"python throughput: {n} random blocks per task ({block_bytes * n / 2**20:.0f} MiB per rank), "
                  f"{args.ranks} rank(s), {tasks} tasks: swap {rates[2]:.2f} GB/s per rank (median of 5 rounds)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("latency", "throughput"), default="latency")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--blocks-per-task", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    (throughput if args.mode == "throughput" else latency)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
