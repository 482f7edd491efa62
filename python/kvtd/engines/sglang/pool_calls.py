"""sglang's multi-pool (v2) storage calls over a session of cache groups (pools.py).

sglang's HybridCacheController (hybrid_cache/hybrid_cache_controller.py) asks, per prefetch,
batch_exists_v2(keys, pool_transfers) for the usable prefix (:586-610); loads the KV pool's pages
by batch_get_v1 and then, only if all of them arrived, each other pool's by batch_get_v2 with the
trailing pools' keys re-aligned to the end of the hit (:640-659, _sync_trailing_keys :764-782);
backs up each other pool by batch_set_v2 and then the KV pool by batch_set_v1 (:661-696). Each
call here is one or more storage tasks that name the blocks of one pool's group and no other
(a load leaves the groups it names no block of out, daemon/storage/group_agreement.cpp).

The hit answer is the daemons': the longest prefix at which every pool's rule holds (every page of
the KV, draft and indexer pools; the window's pages of an SWA pool; the state at the prefix's end
of a Mamba pool; kvtd/proto/group_hits.h), the MIN over ranks. It is never a prefix a pool cannot
load; where sglang's own file backend takes the minimum of each pool's answer, which can name a
point whose state is missing, kvtd's answer is shorter (test_sglang_v2_oracle.py).

Every call is bounded and never raises into sglang's threads (backend.py's _run): a failure is
a miss or a failed set, named in the log.
"""

from __future__ import annotations

from typing import Dict, List

from .pools import pool_name


class PoolGroupCalls:
    """The v2 calls of KvtdHiCacheStorage (its _run, _pages, _warn, _count, _hybrid)."""

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        """The usable prefix of `keys` with every pool's page its rule needs, as sglang's
        PoolTransferResult: that prefix for the KV pool and for each pool transfer asked about."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

        transfers = list(pool_transfers or [])
        plan = self._hybrid
        unknown = [pool_name(t.name) for t in transfers if plan is None or pool_name(t.name) not in plan.pools]
        if unknown:
            self._warn("lookup", f"sglang asked about pool(s) {', '.join(unknown)} that this session does not hold "
                                 f"(pools: {', '.join(plan.pools) if plan else 'kv'})")
            return PoolTransferResult(0, {})
        hits = self.batch_exists(keys, extra_info)
        per_pool = {PoolName.KV: hits} if hits else {}
        for t in transfers:
            if hits:
                per_pool[t.name] = hits
        return PoolTransferResult(hits, per_pool)

    def batch_get_v2(self, transfers, extra_info=None) -> Dict[object, List[bool]]:
        """Loads each transfer's pages (or state slots) into its pool's host indices, in place;
        per transfer, True for each key whose bytes arrived."""
        return {t.name: self._pool_io(t, load=True) for t in transfers}

    def batch_set_v2(self, transfers, extra_info=None) -> Dict[object, List[bool]]:
        """Stores each transfer's pages (or state slots) from its pool, in place."""
        return {t.name: self._pool_io(t, load=False) for t in transfers}

    def _pool_io(self, transfer, *, load: bool) -> List[bool]:
        name, keys = pool_name(transfer.name), list(transfer.keys or [])
        if not keys:
            return []
        plan = self._hybrid
        slot = plan.pools.get(name) if plan is not None else None
        if slot is None:
            self._warn("load" if load else "store", f"sglang pool {name!r} is not in this session "
                                                     f"(pools: {', '.join(plan.pools) if plan else 'kv'})")
            return [False] * len(keys)
        blocks = self._pages(keys, transfer.host_indices, slot.index_unit, slot.blocks)
        if blocks is None:
            return [False] * len(keys)
        if not load:
            r = self._run(f"store of pool {name}", lambda s, dl: s.storage_write(
                keys, plan.blocks(name, blocks), deadline_ns=dl))
            self._count("pages_stored" if r is not None else "pages_store_failed", len(keys))
            return [r is not None] * len(keys)
        arrived: List[bool] = []
        for a, b in plan.read_chunks(name, len(keys)):
            r = self._run(f"load of pool {name}", lambda s, dl: s.storage_read(
                keys[a:b], plan.blocks(name, blocks[a:b]), deadline_ns=dl))
            done = min(b - a, r.blocks_done) if r is not None else 0
            arrived += [True] * done
            if done < b - a:  # sglang counts the leading run only: the rest is not asked for
                break
        self._count("pages_loaded", len(arrived))
        self._count("pages_load_failed", len(keys) - len(arrived))
        return arrived + [False] * (len(keys) - len(arrived))
