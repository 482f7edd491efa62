#!/usr/bin/python3
"""A small reference of the mechanism sglang's HiCacheFile storage backend uses, measured as a peer
for kvtd's file store (scripts/bench.sh). One file per key; put = exists check, ndarray.tofile to
a unique temporary name, os.replace; get = unbuffered open + readinto the caller's buffer; one
thread, no checksum. Written from the description of that mechanism, not from its code.

Prints one line: objects, object size, put and get GB/s.
"""
import argparse
import os
import shutil
import time
import uuid

import numpy as np


def put(root, key, array):
    path = os.path.join(root, key + ".bin")
    if os.path.exists(path):
        return
    tmp = path + "." + uuid.uuid4().hex + ".tmp"
    array.tofile(tmp)
    os.replace(tmp, path)


def get(root, key, out):
    path = os.path.join(root, key + ".bin")
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(memoryview(out).cast("B"))
    return n == out.nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--objects", type=int, default=1024)
    ap.add_argument("--object-mib", type=float, default=1.0)
    ap.add_argument("--slots", type=int, default=1,
                    help="read each object into the next of this many distinct buffers (sglang's HiCacheFile.get "
                         "reads into the key's own host-pool page); 1: one buffer, warm in the CPU cache")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache (/proc/sys/vm/drop_caches, root) before the gets")
    args = ap.parse_args()
    root = os.path.join(args.dir, "peer-%d" % os.getpid())
    os.makedirs(root, exist_ok=True)
    n_bytes = int(args.object_mib * (1 << 20))
    rng = np.random.default_rng(1)
    # A few distinct source buffers, cycled, like KV pages of a pool.
    sources = [rng.integers(0, 255, n_bytes, dtype=np.uint8) for _ in range(8)]
    os.sync()
    t0 = time.perf_counter()
    for i in range(args.objects):
        put(root, "k%d" % i, sources[i % len(sources)])
    put_s = time.perf_counter() - t0
    outs = [np.zeros(n_bytes, dtype=np.uint8) for _ in range(max(1, args.slots))]  # touched: no page faults timed
    if args.cold:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        except OSError as e:
            raise SystemExit("--cold: cannot write /proc/sys/vm/drop_caches (%s); it needs root" % e)
    t0 = time.perf_counter()
    for i in range(args.objects):
        if not get(root, "k%d" % i, outs[i % len(outs)]):
            raise SystemExit("short read of k%d" % i)
    get_s = time.perf_counter() - t0
    total = args.objects * n_bytes
    print("peer (HiCacheFile mechanism, 1 thread, no checksum%s, gets into %d buffer%s): %d objects of %d bytes: "
          "put %.2f GB/s, get %.2f GB/s"
          % (", cold get" if args.cold else "", len(outs), "" if len(outs) == 1 else "s", args.objects, n_bytes, total / put_s / 1e9, total / get_s / 1e9))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
