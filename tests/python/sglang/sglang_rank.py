"""One sglang scheduler process of a TP group (sglang runs one per TP rank), for
test_sglang_engine.py: its kvtd backend from sglang's factory, its own daemon, a backup, a hit
query and a load, every byte checked. Prints one JSON line.

    sglang_rank.py RANK TP SESSION STORE KEYS_STORED
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import test_sglang_engine as t


def main() -> int:
    rank, tp, session, store, stored = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5])
    r = t.Rank(store.parent, "page_first_direct", session, tp_rank=rank, tp_size=tp, store=store)
    try:
        t.fill_random(r.pool, 100 + rank)
        pages = [1, 2, 3, 4][:stored]
        keys = ["p1", "p2", "p3", "p4"]
        original = {p: r.pool.get_data_page(p * t.PAGE).clone() for p in pages}
        set_ok = all(r.backend.batch_set_v1(keys[:stored], t.indices(pages)))
        hits = r.backend.batch_exists(keys)
        # sglang MIN-reduces the hit count across its ranks (cache_controller.py:1100-1106); the
        # parent passes the minimum on stdin once both ranks reported.
        print(json.dumps({"rank": rank, "set_ok": set_ok, "hits": hits}), flush=True)
        agreed = int(sys.stdin.readline())
        r.pool.kv_buffer.zero_()
        targets = [10, 11, 12, 13][:agreed]
        got = r.backend.batch_get_v1(keys[:agreed], t.indices(targets))
        same = all(t.same(r.pool.get_data_page(d * t.PAGE), original[s]) for s, d in zip(pages, targets))
        print(json.dumps({"rank": rank, "loaded": got, "same": same}), flush=True)
        return 0
    finally:
        r.close()


if __name__ == "__main__":
    sys.exit(main())
