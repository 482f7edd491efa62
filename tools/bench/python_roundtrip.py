#!/usr/bin/env python3
"""Tasks through the Python client (ctypes over libkvtd_client.so), in the shapes of kvtd-loadgen,
so the figures side by side are the cost of the Python layer. --mode latency: one-block
SWAP_TO_HOST round trips, submit + wait (1 layer, 2 KiB key + 2 KiB value per block, as `--mode
latency`). --mode throughput: tasks of --blocks-per-task random blocks, one in flight,
alternating out and in (32 layers x K/V of 128 KiB block-tensors, 128 device and 96 host blocks,
as bench.sh's `--mode throughput` section; --device cuda: torch CUDA tensors of the shape given, as
scripts/gpu/through_daemon.sh compares with kvtd-loadgen), GB/s per rank as the median of 5 rounds.
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


def _tensors(s, g, args):
    """The engine's KV tensors: shared-memory stand-ins (host backend) or torch CUDA tensors, one
    allocation for every layer as an engine's (kept alive by the returned reference)."""
    if args.device != "cuda":
        s.create_host_device_tensors()
        return None
    import torch
    shape = g.key_shape
    kv = torch.zeros(g.num_layers, 2, *shape, dtype=torch.bfloat16, device="cuda")
    for layer in range(g.num_layers):
        s.register_torch_tensor(0, layer, "key", kv[layer, 0])
        s.register_torch_tensor(0, layer, "value", kv[layer, 1])
    torch.cuda.synchronize()
    return kv


def throughput(args) -> None:
    # Default: 128 KiB per block-tensor in bf16 (8 MiB per block over 32 layers x K/V); --device cuda
    # (scripts/gpu/through_daemon.sh) passes its own shape so the C++ figure beside it is comparable.
    shape = (args.device_blocks, args.heads, args.block_size, args.head_dim)
    g = kvtd.Geometry(num_ranks=args.ranks, num_layers=args.layers, key_shape=shape, value_shape=shape,
                      num_host_blocks=args.host_blocks, dtype="bfloat16")
    n, ndev, nhost = args.blocks_per_task, args.device_blocks, args.host_blocks
    block_bytes = args.layers * 2 * args.heads * args.block_size * args.head_dim * 2
    suffix = f"pybench{os.getpid()}"
    rng = random.Random(1)
    extra = ["--log-level", "warn"] + (["--device-backend", "cuda", "--numa-node", "auto"] if args.device == "cuda" else [])
    extra += ["--scatter-mode", os.environ["KVTD_SCATTER_MODE"]] if os.environ.get("KVTD_SCATTER_MODE") else []
    with kvtd.testing.Daemons(None, suffix, g, extra):
        with kvtd.Session(suffix, g) as s:
            keep = _tensors(s, g, args)  # noqa: F841 (the tensors live as long as the session)
            s.publish()
            s.wait_ready(60)
            for h in range(0, nhost, n):  # every host block written once, so any swap-in reads written bytes
                hs = list(range(h, min(nhost, h + n)))
                s.wait(s.swap_to_host(list(range(len(hs))), hs))
            rates, tasks = [], 0
            for _ in range(5):
                busy, done = 0.0, 0
                end = time.perf_counter() + args.seconds / 5
                while time.perf_counter() < end or done < 2:
                    d, h = rng.sample(range(ndev), n), rng.sample(range(nhost), n)
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
    ap.add_argument("--device", choices=("host", "cuda"), default="host",
                    help="throughput: the engine's tensors in shared memory (host backend) or torch CUDA tensors")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--device-blocks", type=int, default=128)
    ap.add_argument("--host-blocks", type=int, default=96)
    args = ap.parse_args()
    (throughput if args.mode == "throughput" else latency)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
