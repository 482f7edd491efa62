#!/usr/bin/env python3
"""How long a weight update keeps kvtd away from the engine: clear_caches() (every rank finishes
what is in flight and closes its mappings) and restore_caches() (every rank re-reads the registry
and maps the new tensors), on idle ranks and with a swap of every device block in flight at the
clear, with new host-backend arenas in between. Starts its own daemons. Prints figures; asserts
nothing."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import kvtd  # noqa: E402
import kvtd.testing  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cycles", type=int, default=20)
    args = ap.parse_args()
    shape = (256, 8, 16, 128)  # 256 device blocks of 32 KiB per tensor and layer
    g = kvtd.Geometry(num_ranks=args.ranks, num_layers=args.layers, key_shape=shape, value_shape=shape,
                      num_host_blocks=256, dtype="bfloat16")
    suffix = f"clearbench{os.getpid()}"
    with kvtd.testing.Daemons(None, suffix, g, ["--log-level", "warn"]):
        with kvtd.Session(suffix, g) as s:
            s.create_host_device_tensors()
            s.publish()
            s.wait_ready(60)
            for busy in (False, True):
                clear, restore = [], []
                for _ in range(args.cycles):
                    if busy:  # every device block on its way to the host when the clear is submitted
                        s.swap_to_host(list(range(256)), list(range(256)))
                    t0 = time.perf_counter()
                    s.clear_caches()
                    t1 = time.perf_counter()
                    s.create_host_device_tensors()  # the engine's new tensors
                    t2 = time.perf_counter()
                    s.restore_caches()
                    t3 = time.perf_counter()
                    clear.append((t1 - t0) * 1e3)
                    restore.append((t3 - t2) * 1e3)
                gib = 256 * 2 * 32768 * args.layers * args.ranks / 2**30
                what = f"with a {gib:.1f} GiB swap in flight" if busy else "idle"
                print(f"clear/restore, {args.ranks} ranks x {args.layers} layers, {what}: clear median "
                      f"{statistics.median(clear):.2f} ms (max {max(clear):.2f}), restore median "
                      f"{statistics.median(restore):.2f} ms (max {max(restore):.2f}), {args.cycles} cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
