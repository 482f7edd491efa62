#!/usr/bin/env python3
"""Task round trip through the Python client (ctypes over libkvtd_client.so): one-block
SWAP_TO_HOST, submit + wait, the same shape as `kvtd-loadgen --mode latency` (1 layer, 2 KiB key
+ 2 KiB value per block), so the two figures side by side are the cost of the Python layer.
Starts its own daemons. Prints figures; asserts nothing."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import kvtd  # noqa: E402
import kvtd.testing  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--samples", type=int, default=20000)
    args = ap.parse_args()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
