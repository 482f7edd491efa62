"""kvtd.sglang's v2 (hybrid model) calls against sglang's own HiCacheFile v2, the same pools, the
same calls HybridCacheController makes, in the same run.

    PYTHONPATH=python KVTD_BINARY=build/daemon/kvtd KVTD_CLIENT_LIBRARY=... \\
      /usr/bin/python3 tools/bench/sglang_hybrid.py [--requests 8] [--pages 16] [--rounds 3]

A Qwen3-Next-shaped scheduler (scaled to this machine): a KV pool of 12 full-attention layers x 2
heads x 256 dims bf16, pages of 32 tokens (768 KiB), page-first, and sglang's own MambaPoolHost of
36 linear-attention layers (temporal state 8 x 64 x 64 float32, conv 2048 x 3 bf16 per layer:
4.9 MiB per slot). Each request backs up `--pages` KV pages and the Mamba state at its end, then
loads them back into other pages and another slot: the backup as the controller makes it
(batch_set_v2 of the state, then the KV pages in batches of STORAGE_BATCH_SIZE,
hybrid_cache_controller.py:661-696), the load as it makes it (batch_exists_v2, the KV pages, then
batch_get_v2 of the state, :586-659). kvtd moves pages in place (batch_set_v1 / batch_get_v1 and
its v2 calls) through its daemon's file store; HiCacheFile through its page path for the KV pool
and its v2 calls for the state. Both stores in one folder's file system, page cache warm. Prints
FIGURE lines, kvtd's GB/s next to HiCacheFile's and their ratio, the median of --rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests" / "python"), str(ROOT / "tests" / "python" / "sglang")]

import torch  # noqa: E402

import sglang_harness  # noqa: E402
import sglang_hybrid as sh  # noqa: E402


def pools(a):
    """The KV pool (2x the request pages: loads go to the other half) and the Mamba pool."""
    tokens = a.requests * a.pages * a.page_size
    kv = sglang_harness.mha_host_pool_class()(sglang_harness.DevicePool(torch.bfloat16, tokens, 12, 2, 256), 2.0,
                                              a.page_size, "page_first")
    mamba = sh.mamba_host_pool(sh.MambaDevicePool(layers=36, slots=2 * a.requests, temporal=(8, 64, 64),
                                                  convs=((2048, 3),)))
    for buf in (kv.kv_buffer, mamba.temporal_buffer, *mamba.conv_buffer):
        sh.fill_random(buf, 7)
    return kv, mamba


def timed_round(a, hs, kvtd_backend, oracle, kv, mamba, r):
    P, batch = a.page_size, hs.STORAGE_BATCH_SIZE
    half = a.requests * a.pages

    def kv_idx(pages):
        return torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64)

    def requests():
        for q in range(a.requests):
            keys = [f"r{r}q{q}p{i}" for i in range(a.pages)]
            yield q, keys, list(range(q * a.pages, (q + 1) * a.pages))

    def state(keys, slot):
        return [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=keys[-1:], host_indices=torch.tensor([slot]),
                                hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)]

    def kvtd_set():
        for q, keys, pages in requests():
            assert all(kvtd_backend.batch_set_v2(state(keys, q))[hs.PoolName.MAMBA])
            for i in range(0, len(keys), batch):
                assert all(kvtd_backend.batch_set_v1(keys[i:i + batch], kv_idx(pages[i:i + batch])))

    def file_set():
        for q, keys, pages in requests():
            assert all(oracle.batch_set_v2(state(keys, q))[hs.PoolName.MAMBA])
            for i in range(0, len(keys), batch):
                assert oracle.batch_set(keys[i:i + batch], [kv.get_data_page(p * P) for p in pages[i:i + batch]])

    def kvtd_get():
        for q, keys, pages in requests():
            assert kvtd_backend.batch_exists_v2(keys, state(keys, q)).kv_hit_pages == len(keys)
            dst = [half + p for p in pages]
            for i in range(0, len(keys), batch):
                assert all(kvtd_backend.batch_get_v1(keys[i:i + batch], kv_idx(dst[i:i + batch])))
            assert all(kvtd_backend.batch_get_v2(state(keys, a.requests + q))[hs.PoolName.MAMBA])

    def file_get():
        for q, keys, pages in requests():
            assert oracle.batch_exists_v2(keys, state(keys, q)).kv_hit_pages == len(keys)
            dst = [half + p for p in pages]
            for i in range(0, len(keys), batch):
                got = oracle.batch_get(keys[i:i + batch], [kv.get_dummy_flat_data_page() for _ in keys[i:i + batch]])
                for p, page in zip(dst[i:i + batch], got):
                    kv.set_from_flat_data_page(p * P, page)
            assert all(oracle.batch_get_v2(state(keys, a.requests + q))[hs.PoolName.MAMBA])

    request_bytes = a.pages * 2 * 12 * P * 2 * 256 * 2 + mamba.size_per_token
    out = {}
    for name, fn in (("kvtd set", kvtd_set), ("file set", file_set), ("kvtd get", kvtd_get), ("file get", file_get)):
        t0 = time.perf_counter()
        fn()
        out[name] = a.requests * request_bytes / (time.perf_counter() - t0) / 1e9
    return out, request_bytes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where both stores live (default: a temporary folder)")
    a = ap.parse_args()

    _, _, _, _, hs = sh.import_hybrid()
    work = Path(a.dir or tempfile.mkdtemp(prefix="kvtd_sglang_hybrid_bench_"))
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(work / "hicache")
    kv, mamba = pools(a)
    group = sh.pool_group([(hs.PoolName.KV, kv, None), (hs.PoolName.MAMBA, mamba, None)])
    backend, daemons = sh.kvtd_backend(group, work / "store", model_id="bench", timeout_s=60)
    oracle = hs.HiCacheFile(sglang_harness.storage_config(0, 1, None))
    sh.register_as_controller(oracle, group)
    figures = {k: [] for k in ("kvtd set", "file set", "kvtd get", "file get")}
    try:
        for r in range(a.rounds):
            got, request_bytes = timed_round(a, hs, backend, oracle, kv, mamba, r)
            for name, gbps in got.items():
                figures[name].append(gbps)
        med = {k: statistics.median(v) for k, v in figures.items()}
        shape = (f"{a.requests} requests of {a.pages} KV pages (768 KiB) + 1 Mamba state "
                 f"({mamba.size_per_token / 2**20:.1f} MiB), {request_bytes / 2**20:.1f} MiB each, median of {a.rounds}")
        print(f"FIGURE sglang hybrid backup (v2 state + v1 KV / HiCacheFile v2 + page path): kvtd "
              f"{med['kvtd set']:.2f} GB/s, HiCacheFile {med['file set']:.2f} GB/s = "
              f"{med['kvtd set'] / med['file set']:.2f}x; {shape}")
        print(f"FIGURE sglang hybrid load (exists_v2 + v1 KV + v2 state): kvtd {med['kvtd get']:.2f} GB/s, HiCacheFile "
              f"{med['file get']:.2f} GB/s = {med['kvtd get'] / med['file get']:.2f}x; {shape}")
        return 0
    finally:
        daemons.stop()
        backend.close()
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
