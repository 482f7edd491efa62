"""One sglang scheduler process of a TP 2 group with sglang's own HiCacheController
(sglang_controller.py), its kvtd backend and its daemon; the two processes join one gloo group,
so the controller's own MIN all-reduce of the hit count (cache_controller.py:1100-1106) runs
across them. Prints one JSON line.

    sglang_rank_controller.py RANK SESSION STORE INIT_FILE PAGES_BACKED_UP
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import kvtd.testing
import sglang_controller as sc
import test_sglang_engine as t


def main() -> int:
    rank, session, store, init_file, backed_up = (int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4],
                                                  int(sys.argv[5]))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", world_size=2, rank=rank)
    dev = t.device_pool()
    pool = t.host_pool("page_first", dev)
    cc = sc.controller(pool, dev, tp_rank=rank, tp_size=2, extra=t.extra_config(session),
                       tp_group=torch.distributed.group.WORLD)
    sched = sc.Scheduler(cc)
    b = cc.storage_backend
    daemons = kvtd.testing.Daemons(None, b._suffix, b._plan.geometry, ranks=[rank],
                                   extra=["--storage-backend", "file", "--storage-path", str(store),
                                          "--model-id", "sgl"]).start()
    try:
        b._session.wait_ready(30)
        t.fill_random(pool, 200 + rank)
        tokens = list(range(1000, 1000 + 6 * t.PAGE))
        written = pool.alloc(len(tokens))
        pages = [int(written[i]) for i in range(0, len(tokens), t.PAGE)]
        original = [pool.get_data_page(p).clone() for p in pages]
        backed = sched.backup(written[:backed_up * t.PAGE], tokens[:backed_up * t.PAGE])
        pool.kv_buffer.zero_()
        op = sched.prefetch_hits("req", tokens)
        loaded, done = sched.load(op)
        same = all(t.same(pool.get_data_page(int(loaded[i])), original[i // t.PAGE]) for i in range(0, done, t.PAGE))
        print(json.dumps({"rank": rank, "backed": backed, "hits": op.storage_hit_count, "done": done, "same": same}),
              flush=True)
        return 0
    finally:
        sched.stop()
        daemons.stop()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
