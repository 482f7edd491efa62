#!/usr/bin/python3
"""The peer for kvtd's storage of cache groups: sglang v0.5.18's own HiCacheFile (its multi-pool v2
API, batch_set_v2 / batch_get_v2, hicache_storage.py:664-718), loaded unmodified from the reference
tree, moving the same pages kvtd-loadgen's group storage-throughput moves for one rank of a real
model (kvtd.models): every block pool's page of every key, the state (MAMBA pool) only at each
task's last key, and on loads only the pages each pool's rule needs (an SWA pool its window's
trailing pages). One process, as sglang's prefetch and backup threads call it.

    /usr/bin/python3 tools/bench/hicache_v2_peer.py gpt-oss-20b 2 --dir /tmp/x [--keys 256 --per-task 16]

Prints one line: write and read GB/s per rank over the bytes moved.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "tests", "python"), os.path.join(HERE, "..", "..", "tests", "python", "sglang")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sglang_harness  # noqa: E402
from model_groups import MODELS  # noqa: E402


class Pool:
    """What HiCacheFile._batch_io_v2 calls of a host pool (hicache_storage.py:673-696), page size 1:
    `pages` pages of `page_bytes`, as the host pool sglang would register."""

    page_size = 1

    def __init__(self, pages, page_bytes, rng):
        self.data = rng.integers(0, 256, (pages, page_bytes), dtype=np.uint8)
        self.page_bytes = page_bytes

    def get_data_page(self, index, flat=True):
        return torch.from_numpy(self.data[index])

    def get_dummy_flat_data_page(self):
        return torch.empty(self.page_bytes, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, page):
        self.data[index] = page.numpy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("tp", type=int)
    p.add_argument("--dir", required=True)
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--per-task", type=int, default=16)
    a = p.parse_args()
    if sglang_harness.sglang_source() is None:
        raise SystemExit("(skipped: " + sglang_harness.skip_reason() + ")")
    hs = sglang_harness.import_hicache_storage()
    groups = MODELS[a.model](a.tp, 64, 96)
    sizes = groups.sizes()
    names = {"full_attention": hs.PoolName.KV, "mla_latent": hs.PoolName.KV, "sliding_window": hs.PoolName.SWA,
             "state": hs.PoolName.MAMBA, "indexer": hs.PoolName.INDEXER}
    root = os.path.join(a.dir, "v2peer-%d" % os.getpid())
    cfg = hs.HiCacheStorageConfig(tp_rank=0, tp_size=a.tp, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=a.model, extra_config={"enable_metadata_cache": False})
    store = hs.HiCacheFile(cfg, file_path=root)
    rng = np.random.default_rng(1)
    per = a.per_task
    trailing = []
    for g, group in enumerate(groups.groups):
        store.register_mem_host_pool_v2(Pool(per, sizes[g][0], rng), names[group.kind])
        trailing.append(1 if group.kind == "state" else
                        max(1, -(-group.window_tokens // groups.page_tokens)) if group.kind == "sliding_window" else 0)

    def transfers(keys, load):
        out = []
        for g, group in enumerate(groups.groups):
            m = len(keys)
            if group.kind == "state":
                idx = [m - 1]
            elif load and trailing[g]:
                idx = list(range(max(0, m - trailing[g]), m))
            else:
                idx = list(range(m))
            out.append((g, hs.PoolTransfer(name=names[group.kind], keys=[keys[i] for i in idx],
                                           host_indices=torch.tensor(idx, dtype=torch.int64))))
        return out

    def phase(load):
        moved = 0
        os.sync()
        t0 = time.perf_counter()
        for first in range(0, a.keys, per):
            keys = ["k%d" % i for i in range(first, min(a.keys, first + per))]
            ts = transfers(keys, load)
            results = (store.batch_get_v2 if load else store.batch_set_v2)([t for _, t in ts])
            for g, t in ts:
                ok = results[t.name]
                if not all(ok):
                    raise SystemExit("%s failed for pool %s" % ("get" if load else "set", t.name))
                moved += len(t.keys) * sizes[g][0]
        return moved, time.perf_counter() - t0

    wrote, write_s = phase(False)
    read, read_s = phase(True)
    print("peer (sglang v0.5.18 HiCacheFile, v2 multi-pool API, 1 process): %d keys in tasks of %d, %d pools: write "
          "%.2f GB/s (%.1f MiB), read %.2f GB/s (%.1f MiB)"
          % (a.keys, per, len(groups.groups), wrote / write_s / 1e9, wrote / 2**20, read / read_s / 1e9, read / 2**20))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
