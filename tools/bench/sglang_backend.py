"""kvtd.sglang against sglang's own HiCacheFile, the same pages, the same calls the controller makes.

    PYTHONPATH=python KVTD_BINARY=build/daemon/kvtd KVTD_CLIENT_LIBRARY=... \\
      /usr/bin/python3 tools/bench/sglang_backend.py [--pages 128] [--layout page_first] [--rounds 3]

One scheduler's host pool (sglang's HostKVCache base over its ShmHostTensorAllocator, the MHA
stand-in of tests/python/sglang/sglang_harness.py; default 32 layers x 8 heads x 128 dims bf16, pages of
32 tokens = 4 MiB), backed up and loaded in batches of sglang's STORAGE_BATCH_SIZE: kvtd through
batch_set_v1 / batch_get_v1 (zero copy, cache_controller.py:963-978, 1144-1148) with its daemon's
file store, HiCacheFile through batch_set of get_data_page and batch_get then
set_from_flat_data_page (cache_controller.py:980-1000, 1137-1143), both stores in the same folder's
file system, page cache warm. Prints FIGURE lines, kvtd's GB/s next to HiCacheFile's and their
ratio, the median of --rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests" / "python"), str(ROOT / "tests" / "python" / "sglang")]

import torch  # noqa: E402

import kvtd.testing  # noqa: E402
import sglang_harness  # noqa: E402


def timed_round(a, backend, oracle, pool, batch: int, page_bytes: int, r: int) -> dict:
    """GB/s of one round: kvtd's and HiCacheFile's backup of pages [0, pages), then their load of
    the same keys into pages [pages, 2 pages)."""
    src = list(range(a.pages))
    dst = list(range(a.pages, 2 * a.pages))
    keys = [f"r{r}p{p}" for p in src]

    def idx(pages):
        return torch.tensor([p * a.page_size + t for p in pages for t in range(a.page_size)], dtype=torch.int64)

    def batches(pages):
        for i in range(0, len(keys), batch):
            yield keys[i:i + batch], pages[i:i + batch]

    def kvtd_set():
        for k, p in batches(src):
            assert all(backend.batch_set_v1(k, idx(p)))

    def file_set():
        for k, p in batches(src):
            assert oracle.batch_set(k, [pool.get_data_page(x * a.page_size) for x in p])

    def kvtd_get():
        for k, p in batches(dst):
            assert all(backend.batch_get_v1(k, idx(p)))

    def file_get():
        for k, p in batches(dst):
            pages = oracle.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
            for x, page in zip(p, pages):
                pool.set_from_flat_data_page(x * a.page_size, page)

    out = {}
    for name, fn in (("kvtd set", kvtd_set), ("file set", file_set), ("kvtd get", kvtd_get), ("file get", file_get)):
        t0 = time.perf_counter()
        fn()
        out[name] = a.pages * page_bytes / (time.perf_counter() - t0) / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where both stores live (default: a temporary folder)")
    a = ap.parse_args()

    hs = sglang_harness.import_hicache_storage()
    batch = hs.STORAGE_BATCH_SIZE
    work = Path(a.dir or tempfile.mkdtemp(prefix="kvtd_sglang_bench_"))
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(work / "hicache")
    cls = sglang_harness.mha_host_pool_class()
    tokens = a.pages * a.page_size
    dev = sglang_harness.DevicePool(torch.bfloat16, tokens, a.layers, a.heads, a.head_dim)
    pool = cls(dev, 2.0, a.page_size, a.layout)  # 2x the pages: loads go to the other half
    page_bytes = 2 * a.layers * a.page_size * a.heads * a.head_dim * 2
    session = f"sglb{uuid.uuid4().hex[:6]}"
    extra = {"backend_name": "kvtd", "module_path": "kvtd.sglang", "class_name": "KvtdHiCacheStorage",
             "interface_v1": 1, "allocator": "shm", "kvtd_session": session, "kvtd_timeout_s": 60}
    backend = sglang_harness.backend_factory().create_backend(
        "dynamic", sglang_harness.storage_config(0, 1, extra), pool)
    backend.register_mem_pool_host(pool)
    oracle = hs.HiCacheFile(sglang_harness.storage_config(0, 1, None))
    daemons = kvtd.testing.Daemons(None, backend._suffix, backend._plan.geometry, ranks=[0],
                                   extra=["--storage-backend", "file", "--storage-path", str(work / "store"),
                                          "--model-id", "bench"]).start()
    raw = pool.kv_buffer.view(torch.int16)
    raw.copy_(torch.randint(-32768, 32767, raw.shape, dtype=torch.int16))

    figures = {k: [] for k in ("kvtd set", "file set", "kvtd get", "file get")}
    try:
        backend._session.wait_ready(30)
        for r in range(a.rounds):
            for name, gbps in timed_round(a, backend, oracle, pool, batch, page_bytes, r).items():
                figures[name].append(gbps)
        med = {k: statistics.median(v) for k, v in figures.items()}
        shape = (f"{a.pages} pages of {page_bytes / 2**20:.1f} MiB ({a.layout}, {a.layers} layers x {a.heads} heads x "
                 f"{a.head_dim} x {a.page_size} tokens), batches of {batch}, median of {a.rounds}")
        print(f"FIGURE sglang backup (batch_set_v1 / batch_set): kvtd {med['kvtd set']:.2f} GB/s, HiCacheFile "
              f"{med['file set']:.2f} GB/s = {med['kvtd set'] / med['file set']:.2f}x; {shape}")
        print(f"FIGURE sglang load (batch_get_v1 / batch_get): kvtd {med['kvtd get']:.2f} GB/s, HiCacheFile "
              f"{med['file get']:.2f} GB/s = {med['kvtd get'] / med['file get']:.2f}x; {shape}")
        return 0
    finally:
        daemons.stop()
        backend.close()
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
